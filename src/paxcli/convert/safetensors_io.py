"""The safetensors format, read and written with numpy (no torch, no safetensors package).

A file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape,
data_offsets}}, plus `__metadata__`: str -> str) and the raw little-endian bytes. paxcli
writes parameter names joined with '/', the step and the saved config in `__metadata__`,
and above `max_shard_bytes` several files `model-0000i-of-0000n.safetensors` with an
index `model.safetensors.index.json` (the Hugging Face convention). Arrays are written
one at a time (a stacked array layer by layer) and read one at a time through a memory map.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Optional

import numpy as np

from paxcli import files
from paxcli.convert import formats, hf_tokenizer
from paxcli.convert.formats import ArrayInfo
from paxcli.errors import UserError
from paxcli.values import parse_size  # noqa: F401  (its old home)

DTYPES = {'F64': 'float64', 'F32': 'float32', 'F16': 'float16', 'BF16': 'bfloat16', 'I64': 'int64',
          'I32': 'int32', 'I16': 'int16', 'I8': 'int8', 'U8': 'uint8', 'BOOL': 'bool'}
CODES = {v: k for k, v in DTYPES.items()}
INDEX = 'model.safetensors.index.json'


MAX_HEADER = 100 * 2**20


def _bad(path: str, why: str) -> UserError:
  return UserError(f'{path} is not a valid safetensors file: {why}.')


def read_header(path: str) -> tuple[dict, int]:
  """(header, offset of the data) of one file, checked: every entry's dtype, shape and
  data_offsets consistent, inside the file and not overlapping another's; else a UserError."""
  files.check_regular_file(path, 'safetensors file')
  try:
    with open(path, 'rb') as f:
      size = os.fstat(f.fileno()).st_size
      head = f.read(8)
      if len(head) < 8:
        raise _bad(path, f'{size} bytes, shorter than the 8-byte header length')
      n = struct.unpack('<Q', head)[0]
      if n > min(MAX_HEADER, size - 8):
        raise _bad(path, f'the header length {n:,} is beyond the file ({size:,} bytes)' if n <= MAX_HEADER
                   else f'the header length {n:,} is over {MAX_HEADER:,} bytes')
      raw = f.read(n)
  except OSError as e:
    raise UserError(f'Cannot read {path}: {e.strerror}.') from None
  try:
    header = json.loads(raw)
  except (ValueError, RecursionError) as e:
    raise _bad(path, f'the header is not JSON ({str(e)[:100]})') from None
  if not isinstance(header, dict):
    raise _bad(path, f'the header is a JSON {type(header).__name__}, not an object')
  meta = header.get('__metadata__')
  if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
    raise _bad(path, '__metadata__ is not an object of strings')
  spans = []
  for name, e in header.items():
    if name == '__metadata__':
      continue
    shown = repr(name)[:100]
    if not (isinstance(e, dict) and isinstance(e.get('dtype'), str) and isinstance(e.get('shape'), list)
            and isinstance(e.get('data_offsets'), list) and len(e['data_offsets']) == 2):
      raise _bad(path, f'the entry of {shown} is not {{dtype, shape, data_offsets: [begin, end]}}')
    ints = e['shape'] + e['data_offsets']
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
      raise _bad(path, f'{shown} has a shape or data_offsets that are not non-negative integers')
    begin, end = e['data_offsets']
    if end < begin:
      raise _bad(path, f'{shown} has data_offsets [{begin}, {end}] that end before they begin')
    if end > size - 8 - n:
      raise _bad(path, f'{shown} has data_offsets [{begin}, {end}] beyond its {size - 8 - n:,} bytes of data'
                 + ' (the file is truncated?)')
    if e['dtype'] in DTYPES:
      want = int(np.prod(e['shape'], dtype=object)) * formats.np_dtype(DTYPES[e['dtype']]).itemsize
      if end - begin != want:
        raise _bad(path, f'{shown} is {e["dtype"]} {e["shape"]} ({want:,} bytes) but its data_offsets span '
                   f'{end - begin:,} bytes')
    spans.append((begin, end, name))
  spans.sort()
  for (b0, e0, a), (b1, e1, b) in zip(spans, spans[1:]):
    if b1 < e0:
      raise _bad(path, f'the data of {repr(a)[:100]} [{b0}, {e0}] and {repr(b)[:100]} [{b1}, {e1}] overlap')
  return header, 8 + n


def _index(path: str) -> list[str]:
  """The shard files an index names, each inside the directory (files.member)."""
  index = files.member(path, INDEX, 'index')
  text = files.read_text(index, 'safetensors index', 64 << 20)
  try:
    data = json.loads(text)
  except (ValueError, RecursionError) as e:
    raise UserError(f'{index} is not valid JSON ({str(e)[:100]}).') from None
  weight_map = data.get('weight_map') if isinstance(data, dict) else None
  if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
    raise UserError(f'{index}: no "weight_map" object of tensor name -> file name.')
  out = []
  for name in sorted(set(weight_map.values())):
    shard = files.member(path, name, f'shard (named in {INDEX})')
    if not os.path.isfile(shard):
      raise UserError(f'{index} names the shard {name!r}, which is not a file in {path}.')
    out.append(shard)
  return out


def files_of(path: str) -> list[str]:
  if os.path.isfile(path):
    return [path]
  if os.path.lexists(os.path.join(path, INDEX)):
    return _index(path)
  found = sorted(glob.glob(os.path.join(glob.escape(path), '*.safetensors')))
  return [files.member(path, os.path.basename(f), 'safetensors file') for f in found]


def is_safetensors(path: str) -> bool:
  if os.path.isfile(path):
    return path.endswith('.safetensors')
  return bool(files_of(path)) and not os.path.exists(os.path.join(path, 'config.json'))


class SafetensorsSource(formats.SourceBase):
  kind = 'safetensors'

  def __init__(self, path: str, step: Optional[int] = None, target=None):
    self.path = path
    self.files = files_of(path)
    if not self.files:
      raise UserError(f'No .safetensors files in {path}.')
    self._where: dict[str, tuple[str, int, dict]] = {}
    metadata: dict = {}
    for file in self.files:
      header, offset = read_header(file)
      metadata.update(header.pop('__metadata__', None) or {})
      for name, entry in header.items():
        if name in self._where:
          raise UserError(f'{file} and {self._where[name][0]} both hold {name!r}.')
        self._where[name] = (file, offset, entry)
    self.metadata = metadata
    try:
      self.config = json.loads(metadata['paxcli_config']) if 'paxcli_config' in metadata else None
    except (ValueError, RecursionError):
      raise UserError(f'{path}: the paxcli_config in its metadata is not JSON.') from None
    if self.config is not None and not isinstance(self.config, dict):
      raise UserError(f'{path}: the paxcli_config in its metadata is not a JSON object.')
    try:
      self.step = int(metadata.get('step', 0))
    except ValueError:
      raise UserError(f'{path}: the step in its metadata, {metadata["step"][:50]!r}, is not a number.') from None
    if step is not None and step != self.step:
      raise UserError(f'{path} holds step {self.step}, not --step {step}.')
    self.paxcli_names = metadata.get('format') == 'paxcli'

  def experiment_name(self) -> Optional[str]:
    return self.metadata.get('experiment')

  def arrays(self) -> list[ArrayInfo]:
    out = []
    for name, (_, _, e) in self._where.items():
      if e['dtype'] not in DTYPES:
        raise UserError(f'{self.path}: {name} has dtype {e["dtype"]}, which paxcli does not read.')
      out.append(ArrayInfo(name, tuple(e['shape']), DTYPES[e['dtype']]))
    return out

  def read(self, name: str, index: Optional[int] = None) -> np.ndarray:
    if name not in self._where:
      raise KeyError(name)
    file, offset, e = self._where[name]
    dtype = formats.np_dtype(DTYPES[e['dtype']]).newbyteorder('<')
    shape = tuple(e['shape'])
    begin, end = e['data_offsets']
    mm = np.memmap(file, dtype=np.uint8, mode='r', offset=offset + begin, shape=(end - begin,))
    x = mm.view(dtype).reshape(shape)
    out = np.array(x[index] if index is not None else x)
    del mm, x
    return out

  def extra_files(self) -> dict:
    directory = self.path if os.path.isdir(self.path) else os.path.dirname(os.path.abspath(self.path))
    return hf_tokenizer.find_in(directory)


formats.register_reader('safetensors', lambda path, step=None, target=None: SafetensorsSource(path, step),
                        detect=is_safetensors)


def write(directory: str, arrays: list[tuple[str, tuple, str]], fill, metadata: dict,
          max_shard_bytes: int, on_bytes=lambda n: None) -> list[str]:
  """Writes arrays [(name, shape, dtype)] into directory; fill(name, write) calls write(np_array)
  once or more (consecutive leading-axis slices) per name. Returns the files written."""
  sizes = [int(np.prod(s, dtype=np.int64)) * formats.np_dtype(d).itemsize for _, s, d in arrays]
  shards, current, size = [], [], 0
  for entry, nbytes in zip(arrays, sizes):
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append((entry, nbytes))
    size += nbytes
  shards.append(current)
  single = len(shards) == 1
  names = ['model.safetensors'] if single else [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
                                                  for i in range(len(shards))]
  weight_map = {}
  for file_name, shard in zip(names, shards):
    header: dict = {'__metadata__': {k: str(v) for k, v in metadata.items()}}
    offset = 0
    for (name, shape, dtype), nbytes in shard:
      header[name] = {'dtype': CODES[formats.np_dtype(dtype).name], 'shape': list(shape),
                      'data_offsets': [offset, offset + nbytes]}
      offset += nbytes
      weight_map[name] = file_name
    raw = json.dumps(header, separators=(',', ':')).encode()
    raw += b' ' * (-len(raw) % 8)
    with open(os.path.join(directory, file_name), 'wb') as f:
      f.write(struct.pack('<Q', len(raw)))
      f.write(raw)
      for (name, shape, dtype), nbytes in shard:
        written = [0]
        want = formats.np_dtype(dtype).newbyteorder('<')

        def put(x, f=f, want=want, written=written):
          for block in formats.blocks(np.asarray(x)):   # cast and made contiguous a block at a time
            block = np.ascontiguousarray(block.astype(want, copy=False))
            f.write(memoryview(block.reshape(-1).view(np.uint8)))
            written[0] += block.nbytes
            on_bytes(block.nbytes)
        fill(name, put)
        if written[0] != nbytes:
          raise RuntimeError(f'{name}: wrote {written[0]} bytes, expected {nbytes}')
  if not single:
    with open(os.path.join(directory, INDEX), 'w', encoding='utf-8') as f:
      json.dump({'metadata': {'total_size': sum(sizes)}, 'weight_map': weight_map}, f, indent=1)
  return names


