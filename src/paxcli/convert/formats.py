"""Checkpoint sources: a small registry of readers, one per on-disk format.

A reader opens a checkpoint and answers from metadata alone; arrays are read one at a
time, on request, so that conversion never holds a whole model in host memory.

    src = formats.open_source('runs/X')                    # format detected, latest step
    src = formats.open_source('model.safetensors', fmt='safetensors')
    src.step, src.config, src.kind
    for a in src.arrays():                                  # ArrayInfo, no data read
      a.name, a.shape, a.dtype, a.sharding
    x = src.read('params/layer_0/attention/query/kernel')  # one np.ndarray
    x0 = src.read('params/layers/mlp/wi_0/kernel', index=0)  # one layer of a stacked array

The `Source` protocol (duck-typed; subclass `SourceBase` for the defaults):
  kind: str                 the format name ('orbax', 'safetensors', 'hf', 'paxml', ...)
  path: str                 what was opened
  step: int                 the training step the arrays belong to (0 when unknown)
  config: dict | None       paxcli's flat saved config (`knobs.NUM_LAYERS` -> '2', the repr
                            strings a paxcli run keeps in its checkpoint meta), or None
  native: dict | None       the format's own config when it has one (HF config.json), else None
  paxcli_names: bool        True when array names are paxcli state paths joined with '/'
                            ('step', 'params/layer_0/mlp/wi_0/kernel', 'opt_state/...'),
                            shapes as the paxcli model has them
  arrays() -> list[ArrayInfo]           metadata only
  read(name, index=None) -> np.ndarray  one array; index: one slice of the leading axis
  knobs() -> dict | None                knob values (parsed, e.g. {'NUM_LAYERS': 2}) that the
                            arrays need in a paxcli experiment, when the format knows them
                            (HF Llama derives them from config.json), else None
  extra_files() -> dict[str, str]       files to carry along, by role ({'tokenizer': path})
  close()

A reader is a function `reader(path, step=None, target=None) -> Source`. `target` is the
resolved paxcli experiment the user converts to (`config.Resolved`, or None for inspect):
a reader whose names are not paxcli's (a paxml checkpoint) may use it to yield arrays
already under paxcli names and shapes for that experiment, with `paxcli_names = True`.
`detect(path) -> bool` (optional) lets `open_source` find the format without --from.

    formats.register_reader('paxml', open_paxml, detect=is_paxml_checkpoint)

Readers of other modules register on import; `MODULES` lists the modules imported on the
first lookup (a missing optional module is skipped).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Iterable, Optional

import ml_dtypes
import numpy as np

from paxcli.errors import UserError, did_you_mean
from paxcli.jobdir import storage


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  name: str
  shape: tuple
  dtype: str                     # numpy dtype name: 'float32', 'bfloat16', 'int32', ...
  sharding: Optional[str] = None  # as saved, in words ('PartitionSpec(None, 'model') on mesh ...')

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

  @property
  def nbytes(self) -> int:
    return self.size * np_dtype(self.dtype).itemsize


def np_dtype(name: str) -> np.dtype:
  """numpy dtype of a name, bfloat16 included (ml_dtypes, which JAX brings)."""
  if name in ('bfloat16', 'bf16'):
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


class SourceBase:
  """Defaults for the Source protocol."""
  kind = 'unknown'
  path = ''
  step = 0
  config: Optional[dict] = None
  native: Optional[dict] = None
  paxcli_names = True

  def arrays(self) -> list[ArrayInfo]:
    raise NotImplementedError

  def read(self, name: str, index: Optional[int] = None) -> np.ndarray:
    raise NotImplementedError

  def info(self, name: str) -> ArrayInfo:
    for a in self.arrays():
      if a.name == name:
        return a
    raise KeyError(name)

  def knobs(self) -> Optional[dict]:
    return None

  def extra_files(self) -> dict:
    return {}

  def close(self) -> None:
    pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


Reader = Callable[..., Any]


@dataclasses.dataclass
class _Entry:
  reader: Reader
  detect: Optional[Callable[[str], bool]]


READERS: dict[str, _Entry] = {}
MODULES = ('paxcli.convert.orbax_io', 'paxcli.convert.safetensors_io', 'paxcli.convert.hf',
           'paxcli.convert.paxml', 'paxcli.convert.maxtext')
_loaded = False


def register_reader(name: str, reader: Reader, detect: Optional[Callable[[str], bool]] = None) -> None:
  READERS[name] = _Entry(reader, detect)


def _load() -> None:
  global _loaded
  if _loaded:
    return
  _loaded = True
  for module in MODULES:
    try:
      importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name != module:
        raise


def reader_names() -> list[str]:
  _load()
  return sorted(READERS)


def detect_format(path: str) -> str:
  """The registered format whose detect() accepts path, or a UserError."""
  _load()
  if not storage.exists(path):
    raise UserError(f'No such checkpoint: {path} does not exist.')
  for name, entry in READERS.items():
    if entry.detect is not None and entry.detect(path):
      return name
  raise UserError(f'{path} is not a checkpoint paxcli can read: not a paxcli job directory or step '
                  f'(checkpoints/<step>/state), a .safetensors file or directory, a Hugging Face '
                  f'directory (config.json + weights) or a paxml checkpoint. Formats: '
                  f'{", ".join(reader_names())}; name one with --from.')


def open_source(path: str, fmt: Optional[str] = None, step: Optional[int] = None, target=None):
  """Opens path with the reader of `fmt` (detected when None)."""
  _load()
  fmt = fmt or detect_format(path)
  if fmt not in READERS:
    raise UserError(f'Unknown checkpoint format {fmt!r}; formats: {", ".join(reader_names())}.'
                    f'{did_you_mean(fmt, READERS)}')
  return READERS[fmt].reader(path, step=step, target=target)


BLOCK_BYTES = 64 << 20


def pick_step(steps: dict, step: Optional[int], where: str, kind: str = '') -> tuple[Any, int]:
  """(steps[step], step) of a foreign run's checkpoints: the latest when `step` is None; a missing
  one is refused naming the steps there. `kind` names the program ('MaxText ')."""
  if step is None:
    step = max(steps)
  elif step not in steps:
    raise UserError(f'No {kind}checkpoint of step {step} in {where}; steps there: {", ".join(map(str, sorted(steps)))}.')
  return steps[step], step


def blocks(x: np.ndarray, max_bytes: int = BLOCK_BYTES):
  """Consecutive leading-axis slices of x of at most about max_bytes each (views, not copies)."""
  if x.ndim == 0 or x.nbytes <= max_bytes:
    yield x
    return
  rows = max(1, max_bytes // max(1, x[0].nbytes))
  for start in range(0, x.shape[0], rows):
    yield x[start:start + rows]


def join(path: Iterable) -> str:
  """'/'-joined name of a pytree key path (dict keys, sequence indices, attributes)."""
  parts = []
  for k in path:
    for attr in ('key', 'idx', 'name'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '/'.join(parts)
