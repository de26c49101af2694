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
from typing import Iterable, Optional

import numpy as np

from paxcli.convert import formats
from paxcli.convert.formats import ArrayInfo
from paxcli.errors import UserError

DTYPES = {'F64': 'float64', 'F32': 'float32', 'F16': 'float16', 'BF16': 'bfloat16', 'I64': 'int64',
          'I32': 'int32', 'I16': 'int16', 'I8': 'int8', 'U8': 'uint8', 'BOOL': 'bool'}
CODES = {v: k for k, v in DTYPES.items()}
INDEX = 'model.safetensors.index.json'


def read_header(path: str) -> tuple[dict, int]:
  """(header, offset of the data) of one file."""
  try:
    with open(path, 'rb') as f:
      n = struct.unpack('<Q', f.read(8))[0]
      if n > 100 * 2**20:
        raise ValueError('header too large')
      header = json.loads(f.read(n))
  except (OSError, ValueError, struct.error) as e:
    raise UserError(f'{path} is not a safetensors file ({e}).') from None
  return header, 8 + n


def files_of(path: str) -> list[str]:
  if os.path.isfile(path):
    return [path]
  index = os.path.join(path, INDEX)
  if os.path.exists(index):
    with open(index, encoding='utf-8') as f:
      names = sorted(set(json.load(f)['weight_map'].values()))
    return [os.path.join(path, n) for n in names]
  return sorted(glob.glob(os.path.join(path, '*.safetensors')))


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
        self._where[name] = (file, offset, entry)
    self.metadata = metadata
    self.config = json.loads(metadata['paxcli_config']) if 'paxcli_config' in metadata else None
    self.step = int(metadata.get('step', 0))
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
    directory = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
    path = os.path.join(directory, 'tokenizer.model')
    return {'tokenizer': path} if os.path.exists(path) else {}


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


def parse_size(text: str, option: str = '--max-shard-size') -> int:
  """'5GB', '500MiB', '1024' -> bytes (at least 1); UserError for anything else (0, negative, inf, nan)."""
  given, text = text, text.strip().upper().replace('IB', 'B')
  number, mult = text, 1
  for unit, size in (('TB', 1 << 40), ('GB', 1 << 30), ('MB', 1 << 20), ('KB', 1 << 10), ('B', 1)):
    if text.endswith(unit):
      number, mult = text[:-len(unit)], size
      break
  try:
    value = float(number) * mult
  except ValueError:
    value = float('nan')
  if not (value >= 1 and value < 1 << 60):  # NaN fails both
    raise UserError(f'{option} {given!r}: give a positive size such as 5GB, 500MB or a number of bytes.')
  return int(value)
