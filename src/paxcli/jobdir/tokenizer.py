"""The tokenizer a run was trained with, kept in its job directory.

`pax train` copies the train input's sentencepiece model to `<job dir>/tokenizer/spm.model`
(process 0, before the first step), so that `pax decode` and `pax checkpoint` turn text into
ids and back exactly as training did, without rebuilding the input or its cache. Models
trained on inputs without a vocabulary (the synthetic input) have no tokenizer: they are
decoded from ids.
"""

from __future__ import annotations

import copy
import os
import shutil
from typing import Optional

import fiddle as fdl
import sentencepiece as spm

from paxcli.errors import UserError
from paxcli.jobdir import layout


def save_to_job_dir(train_input, job_dir: str) -> Optional[str]:
  """Copies the train input's sentencepiece model into the job directory; returns its path."""
  source = train_input.tokenizer_file() if hasattr(train_input, 'tokenizer_file') else None
  if not source:
    return None
  if not os.path.isfile(source):
    raise UserError(f'The train input names the sentencepiece model {source}, which is not a file.')
  target = layout.tokenizer(job_dir)
  if os.path.isfile(target) and _same_bytes(source, target):
    return target
  os.makedirs(os.path.dirname(target), exist_ok=True)
  tmp = target + '.tmp'
  shutil.copyfile(source, tmp)
  os.replace(tmp, target)  # atomic: a reader never sees half a model
  return target


def _same_bytes(a: str, b: str) -> bool:
  with open(a, 'rb') as fa, open(b, 'rb') as fb:
    return fa.read() == fb.read()


class Tokenizer:
  """A sentencepiece model: text <-> ids, and its special ids."""

  def __init__(self, path: str):
    self.path = path
    try:
      self._sp = spm.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as e:
      raise UserError(f'{path} is not a sentencepiece model: {e}') from None

  @property
  def vocab_size(self) -> int:
    return int(self._sp.get_piece_size())

  @property
  def eos_id(self) -> Optional[int]:
    eos = int(self._sp.eos_id())
    return eos if eos >= 0 else None

  @property
  def bos_id(self) -> Optional[int]:
    bos = int(self._sp.bos_id())
    return bos if bos >= 0 else None

  @property
  def pad_id(self) -> Optional[int]:
    pad = int(self._sp.pad_id())
    return pad if pad >= 0 else None

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text))

  def decode(self, ids) -> str:
    return self._sp.decode([int(i) for i in ids])


def load(job_dir: Optional[str], train_input_cfg=None) -> Optional[Tokenizer]:
  """The job directory's tokenizer; else the one the experiment's train input names; else None.

  `train_input_cfg` (a fiddle config) is built only when the job directory has none, e.g. for
  `--no-checkpoint` runs that never trained.
  """
  if job_dir and os.path.isfile(layout.tokenizer(job_dir)):
    return Tokenizer(layout.tokenizer(job_dir))
  if train_input_cfg is None:
    return None
  cfg = copy.deepcopy(train_input_cfg)
  for field, value in (('batch_size', 1), ('num_infeed_hosts', 1), ('infeed_host_index', 0)):
    if getattr(cfg, field, None) is None:
      setattr(cfg, field, value)
  inp = fdl.build(cfg)
  path = inp.tokenizer_file() if hasattr(inp, 'tokenizer_file') else None
  return Tokenizer(path) if path else None
