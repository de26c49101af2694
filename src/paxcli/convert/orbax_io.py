"""paxcli orbax checkpoints: a reader (metadata, then one array at a time) and a streaming writer.

Reading uses orbax's own partial restore of one leaf as a numpy array. Writing streams:
each array goes straight to its own zarr array (orbax's non-OCDBT layout: one directory
per leaf, `_METADATA` describing the tree), written with tensorstore, a stacked array one
layer at a time; the step directory's markers come from orbax itself (a save of `step`
and `meta`), and restore reads the result with orbax like any checkpoint.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from typing import Optional

import numpy as np

from paxcli.convert import formats
from paxcli.convert.formats import ArrayInfo
from paxcli.errors import UserError
from paxcli.jobdir import invocation, layout, storage


# orbax, tensorstore and what reads and writes a job's checkpoints load JAX: only once an orbax checkpoint is read
# or written, not when paxcli.convert.formats loads every reader to find one for a path.

def _orbax():
  import orbax.checkpoint as ocp
  return ocp


def _tensorstore():
  import tensorstore as ts
  return ts


def _checkpointer():
  from paxcli.jobdir import checkpoint
  return checkpoint


def _train_state():
  from paxcli.runtime import train_state
  return train_state


def is_orbax(path: str) -> bool:
  ckpt = _checkpointer()
  job_dir, step = layout.split(path)
  if step is not None:
    return True
  steps = ckpt.step_dirs(layout.checkpoints(job_dir)).values()
  return bool(steps) and not all(storage.isdir(layout.entry(d, 'items')) for d in steps)   # items/: MaxText's


def _sharding_words(meta) -> Optional[str]:
  s = getattr(meta, 'sharding', None)
  if s is None:
    return None
  spec = getattr(s, 'partition_spec', None)
  if spec is not None:
    names = getattr(s, 'axis_names', None)
    shape = getattr(s, 'shape', None)
    mesh = ','.join(f'{n}={k}' for n, k in zip(names or (), shape if shape is not None else ())) 
    return f'P{tuple(spec)} on mesh({mesh})'
  return type(s).__name__.replace('Metadata', '')


class PyTreeDir(formats.SourceBase):
  """The arrays of one orbax PyTree checkpoint directory (`state_dir`), by '/'-joined tree path:
  metadata first, then one array (or one layer of one) at a time. `where` names it in errors."""

  def __init__(self, state_dir: str, where: str):
    self.state_dir, self.where = state_dir, where
    self._arrays = None
    self._tree = None

  def _metadata(self):
    if self._tree is None:
      ocp = _orbax()
      try:
        m = ocp.PyTreeCheckpointer().metadata(self.state_dir)
      except (FileNotFoundError, ValueError, OSError) as e:
        raise UserError(f'{self.where} cannot be read ({type(e).__name__}: {str(e)[:200]}).') from None
      m = getattr(m, 'item_metadata', m)
      self._tree = getattr(m, 'tree', m)
    return self._tree

  def arrays(self) -> list[ArrayInfo]:
    if self._arrays is None:
      import jax
      leaves = jax.tree_util.tree_flatten_with_path(self._metadata(), is_leaf=lambda x: hasattr(x, 'shape'))[0]
      self._arrays = [ArrayInfo(formats.join(p), tuple(m.shape), np.dtype(m.dtype).name, _sharding_words(m))
                      for p, m in leaves if hasattr(m, 'shape')]
    return self._arrays

  _cache: tuple = (None, None)

  def _store(self, name: str):
    """The saved array `name` opened with tensorstore (no data read), or None where it cannot be."""
    ocp = _orbax()
    ts = _tensorstore()
    from etils import epath
    if not hasattr(self, '_layout'):
      try:
        saved = json.loads(storage.read_bytes(layout.entry(self.state_dir, '_METADATA')))
        self._layout = (bool(saved.get('use_ocdbt')), bool(saved.get('use_zarr3')))
      except (OSError, ValueError):
        self._layout = None
      self._ts_context = ocp.type_handlers.get_ts_context()
    if self._layout is None:
      return None
    use_ocdbt, use_zarr3 = self._layout
    info = ocp.type_handlers.ParamInfo(name=name.replace('/', '.'), parent_dir=epath.Path(self.state_dir),
                                       is_ocdbt_checkpoint=use_ocdbt, use_zarr3=use_zarr3,
                                       ts_context=self._ts_context)
    try:
      spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=use_ocdbt)
      return ts.open(ts.Spec(spec), open=True, read=True, context=self._ts_context).result()
    except Exception:   # a leaf orbax keeps another way: read it through orbax
      return None

  def read(self, name: str, index: Optional[int] = None) -> np.ndarray:
    """One array, or one layer (`index`) of a stacked one, as numpy.

    Read with tensorstore: a whole array chunk by chunk into one buffer, a layer from the
    chunks holding it. A checkpoint saved with one chunk spanning all layers (before
    checkpoint.save_args) is read once and its layers served from that copy.
    """
    if index is not None and self._cache[0] == name:
      return np.array(self._cache[1][index])
    self._cache = (None, None)
    store = self._store(name)
    if store is None:
      out = self._read_with_orbax(name)
    elif index is not None and store.chunk_layout.read_chunk.shape[0] == 1:
      return np.asarray(store[index].read().result())
    else:
      out = _read_by_chunks(store)
    if index is None:
      return out
    self._cache = (name, out)
    return np.array(out[index])

  def _read_with_orbax(self, name: str) -> np.ndarray:
    ocp = _orbax()
    keys = name.split('/')
    item, args = {}, {}
    node_i, node_a = item, args
    for k in keys[:-1]:
      node_i = node_i.setdefault(k, {})
      node_a = node_a.setdefault(k, {})
    node_i[keys[-1]] = 0
    node_a[keys[-1]] = ocp.RestoreArgs(restore_type=np.ndarray)
    # sequence nodes (optax's tuples) are addressed by their index as a string key in a dict
    out = ocp.PyTreeCheckpointer().restore(self.state_dir, args=ocp.args.PyTreeRestore(
        item=_as_saved(item, self._metadata()), restore_args=_as_saved(args, self._metadata()),
        partial_restore=True))
    for k in keys:
      out = out[k] if isinstance(out, dict) else out[int(k)]
    return np.asarray(out)


class OrbaxSource(PyTreeDir):
  """A paxcli job directory's checkpoint (the latest step, or --step): its arrays and saved meta."""
  kind = 'orbax'

  def __init__(self, path: str, step: Optional[int] = None, target=None):
    from paxcli.jobdir import restore
    self.path = path
    self.job_dir, step_in_path = layout.split(path)
    if step_in_path is not None and step is not None and step != step_in_path:
      raise UserError(f'{path} is the checkpoint of step {step_in_path}, not --step {step}.')
    self.step = restore.choose_step(self.job_dir, step if step is not None else step_in_path, purpose='convert')
    restore.check_links(self.job_dir, self.step)
    super().__init__(layout.state_dir(layout.step_dir(self.job_dir, self.step)),
                     f'The checkpoint at step {self.step} in {self.job_dir}')
    self.meta = restore.read_meta(self.job_dir, self.step)
    self.config = self.meta.get('config')

  def experiment_name(self) -> Optional[str]:
    """A conversion's output names its experiment in its meta; a trained job in its record of how it was
    made (jobdir.invocation), or, trained by an older paxcli, at the head of its config.txt."""
    if self.meta.get('experiment'):
      return self.meta['experiment']
    made = invocation.read_made(self.job_dir) or invocation.made_by_config(self.job_dir)
    return made.experiment if made else None

  def extra_files(self) -> dict:
    from paxcli.jobdir import tokenizer
    path = tokenizer.local_file(self.job_dir)
    return {'tokenizer': path} if path else {}


def _read_by_chunks(store) -> np.ndarray:
  """The whole array, read one row of chunks at a time into one buffer (transient: one chunk row)."""
  if not store.ndim:
    return np.asarray(store.read().result())
  rows = max(1, int(store.chunk_layout.read_chunk.shape[0] or store.shape[0]))
  out = np.empty(store.shape, store.dtype.numpy_dtype)
  for start in range(0, store.shape[0], rows):
    end = min(start + rows, store.shape[0])   # tensorstore refuses a slice past the end (numpy would cut it)
    out[start:end] = store[start:end].read().result()
  return out


def _as_saved(tree, like):
  """Nested dicts shaped like the saved tree: sequences become lists with None elsewhere."""
  if not isinstance(tree, dict):
    return tree
  if isinstance(like, (list, tuple)):
    out = [None] * len(like)
    for k, v in tree.items():
      out[int(k)] = _as_saved(v, like[int(k)])
    return type(like)(out) if isinstance(like, list) else out
  return {k: _as_saved(v, like[k]) for k, v in tree.items()}


formats.register_reader('orbax', lambda path, step=None, target=None: OrbaxSource(path, step, target),
                        detect=is_orbax)


# ---------------------------------------------------------------------------------------------
# Writer


CHUNK_BYTES = 32 << 20   # the chunks written (and the blocks cast) at most


def _zarr_dtype(dtype: np.dtype) -> str:
  return 'bfloat16' if dtype.name == 'bfloat16' else dtype.str


class StateWriter:
  """Writes a train state (names 'step', 'params/...', 'opt_state/...') array by array.

      w = StateWriter(state_dir)
      w.write('params/embedding/embedding', x)              # a whole array
      w.create('params/layers/mlp/wo/kernel', shape, dtype)  # then one layer at a time
      w.write_slice('params/layers/mlp/wo/kernel', i, x_i)
      w.placeholder('opt_state/0')                           # optax's empty states
      w.finish()                                             # _METADATA and the rest
  """

  def __init__(self, state_dir: str):
    ts = _tensorstore()
    self._ts = ts
    self.dir = state_dir
    os.makedirs(state_dir, exist_ok=True)
    self._tree: dict = {}
    self._array_meta: list = []
    self._open: dict = {}
    self._sums: dict = {}   # name -> checksum lanes, accumulated as the pieces are written

  def _sum(self, name: str, x: np.ndarray, offset: int) -> None:
    train_state = _train_state()
    total = self._sums.get(name, np.zeros(2, np.uint32))
    start = offset
    for block in formats.blocks(x, 2 << 20):   # the checksum needs ~20 bytes per element: small blocks
      total = total + train_state.checksum_part(block, start)
      start += block.size
    self._sums[name] = total

  def checksums(self) -> dict[str, str]:
    """'name' -> checksum of every array written (train_state.checksums' format)."""
    train_state = _train_state()
    return {name: train_state.checksum_hex(lanes) for name, lanes in self._sums.items()}

  @staticmethod
  def _param_name(name: str) -> str:
    return name.replace('/', '.')

  def _entry(self, name: str, value_metadata: dict, key_types=None) -> None:
    keys = name.split('/')
    key_types = key_types or [1 if k.isdigit() else 2 for k in keys]
    self._tree[str(tuple(keys))] = {
        'key_metadata': [{'key': k, 'key_type': t} for k, t in zip(keys, key_types)],
        'value_metadata': value_metadata}

  def create(self, name: str, shape, dtype, layered: bool = False):
    dtype = np.dtype(dtype)
    shape = [int(s) for s in shape]
    chunks = list(shape)
    if shape:   # chunks of at most CHUNK_BYTES along the leading axis (one layer for stacked arrays)
      row = max(1, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)
      chunks[0] = 1 if layered else max(1, min(shape[0], CHUNK_BYTES // row))
    spec = {'driver': 'zarr', 'kvstore': {'driver': 'file', 'path': os.path.join(self.dir, self._param_name(name))},
            'metadata': {'shape': shape, 'chunks': chunks, 'dtype': _zarr_dtype(dtype),
                         'compressor': None, 'dimension_separator': '.'}}   # weights barely compress
    arr = self._ts.open(spec, create=True, open=False).result()
    self._open[name] = arr
    self._entry(name, {'value_type': 'jax.Array', 'skip_deserialize': False, 'write_shape': shape})
    self._array_meta.append({'array_metadata': {'param_name': self._param_name(name), 'write_shape': shape,
                                                'chunk_shape': chunks, 'ext_metadata': None}})
    return arr

  def write(self, name: str, x: np.ndarray, dtype=None) -> None:
    """A whole array, cast to `dtype` (default: its own) and written a block of rows at a time."""
    x = np.asarray(x)
    dtype = np.dtype(dtype or x.dtype)
    arr = self.create(name, x.shape, dtype)
    if not x.ndim:
      x = x.astype(dtype)
      arr.write(x).result()
      self._sum(name, x, 0)
    else:   # whole chunks at a time: tensorstore buffers no partial chunk
      rows = arr.chunk_layout.write_chunk.shape[0]
      for start in range(0, x.shape[0], rows):
        block = x[start:start + rows].astype(dtype, copy=False)
        arr[start:start + block.shape[0]].write(block).result()
        self._sum(name, block, start * block[0].size)
    del self._open[name]

  def write_slice(self, name: str, index: int, x: np.ndarray) -> None:
    arr = self._open[name]
    x = np.asarray(x).astype(arr.dtype.numpy_dtype, copy=False)
    arr[index].write(x).result()
    self._sum(name, x, index * x.size)

  def placeholder(self, name: str) -> None:
    self._entry(name, {'value_type': 'None', 'skip_deserialize': True})

  def finish(self) -> None:
    self._open.clear()
    with open(os.path.join(self.dir, '_METADATA'), 'w', encoding='utf-8') as f:
      json.dump({'tree_metadata': self._tree, 'use_ocdbt': False, 'use_zarr3': False,
                 'store_array_data_equal_to_fill_value': True, 'custom_metadata': None}, f)
    os.makedirs(os.path.join(self.dir, 'array_metadatas'), exist_ok=True)
    with open(os.path.join(self.dir, 'array_metadatas', 'process_0'), 'w', encoding='utf-8') as f:
      json.dump({'array_metadatas': self._array_meta}, f)
    with open(os.path.join(self.dir, '_sharding'), 'w', encoding='utf-8') as f:
      single = json.dumps({'sharding_type': 'SingleDeviceSharding', 'device_str': 'cpu:0'})
      json.dump({base64.b64encode(m['array_metadata']['param_name'].encode()).decode(): single
                 for m in self._array_meta}, f)
    with open(os.path.join(self.dir, 'commit_success.txt'), 'w', encoding='utf-8') as f:
      f.write('Checkpoint successfully committed.')


def placeholder_names(source: OrbaxSource) -> list[str]:
  """Names of the saved tree's empty leaves (optax's EmptyState), from _METADATA."""
  path = layout.entry(source.state_dir, '_METADATA')
  try:
    with open(path, encoding='utf-8') as f:
      tree = json.load(f)['tree_metadata']
  except (OSError, ValueError, KeyError):
    return []
  return ['/'.join(k['key'] for k in v['key_metadata']) for v in tree.values()
          if v['value_metadata'].get('value_type') == 'None']


def write_step(job_dir: str, step: int, meta: dict, fill_state) -> str:
  """Makes job_dir/checkpoints/<step> with orbax's markers; fill_state(state_dir) writes the state.

  fill_state may return the checksums of what it wrote; they go into the step's meta, so
  that every later restore verifies the converted arrays as it does a trained checkpoint's.
  """
  ckpt = _checkpointer()
  checkpointer = ckpt.Checkpointer(layout.checkpoints(job_dir), max_to_keep=0, async_save=False)
  checkpointer.save(step, {'step': np.int32(step)}, meta)
  checkpointer.close()
  state_dir = layout.state_dir(layout.step_dir(job_dir, step))
  shutil.rmtree(state_dir)
  sums = fill_state(state_dir)
  if sums:
    meta_file = layout.meta_file(layout.step_dir(job_dir, step))
    with open(meta_file, encoding='utf-8') as f:
      saved = json.load(f)
    saved['checksums'] = sums
    with open(meta_file, 'w', encoding='utf-8') as f:
      json.dump(saved, f)
  return state_dir
