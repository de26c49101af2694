"""The tokenizer a run was trained with, kept in its job directory.

`pax train` copies the train input's tokenizer to `<job dir>/tokenizer/spm.model` (a
sentencepiece model) or `<job dir>/tokenizer/tokenizer.json` (a Hugging Face tokenizer), with
the tokenizer_config.json shipped beside it (its special tokens, and every chat template it ships,
chat_template.jinja's too, folded in: keep_config), process 0,
before the first step, so that `pax decode`, `pax inspect-input` and `pax
checkpoint` turn text into ids and back exactly as training did, without rebuilding the
input or its cache. Models trained on inputs without a vocabulary (the synthetic input) have
no tokenizer: they are decoded from ids. Readers go through paxcli.inputs.tokenizers.load.

Once the job directory holds a checkpoint, its tokenizer is the one the weights were trained with
and is never replaced: own-data inputs that would train one (no TOKENIZER) read it instead
(`keep_trained`), since a data file changed since would train another and change every id; a
run whose input names another tokenizer is refused in one line (`check_kept`).

A run that starts from INIT_FROM's weights reads with the tokenizer that checkpoint's job directory
carries (an imported model's, as shipped): its embeddings learned those ids. Own-data inputs without
TOKENIZER read with it (`adopt_base`) instead of training a new one on the data; an input that names
another is refused in one line (`check_base`).
"""

from __future__ import annotations

import copy
import os
from typing import Optional

import fiddle as fdl

from paxcli import files
from paxcli.errors import UserError
from paxcli.inputs import tokenizers
from paxcli.inputs.file_input import FileLmInput
from paxcli.inputs.tokenizers import Tokenizer
from paxcli.jobdir import checkpoint, layout, storage


def save_to_job_dir(train_input, job_dir: str) -> Optional[str]:
  """Copies the train input's tokenizer into the job directory; returns its path."""
  source = train_input.tokenizer_file() if hasattr(train_input, 'tokenizer_file') else None
  if not source:
    return None
  if not os.path.isfile(source):
    raise UserError(f'The train input names the tokenizer {source}, which is not a file.')
  kind = tokenizers.kind_of(source)
  target = layout.tokenizer(job_dir, kind)
  for other in layout.TOKENIZER_FILES:  # one tokenizer per job directory: the other kind's file would shadow it
    if other != kind and storage.isfile(layout.tokenizer(job_dir, other)):
      storage.remove(layout.tokenizer(job_dir, other))
  _copy(source, target)
  keep_config(source, layout.tokenizer_config(job_dir))
  return target


def keep_config(source: str, target: str) -> None:
  """Writes the tokenizer_config.json of the tokenizer at `source`, its chat templates folded in
  (tokenizers.folded_config: chat_template.jinja and friends travel in it), to `target`; removes
  another tokenizer's there when this one ships none."""
  data = tokenizers.folded_config_bytes(source)
  if data is None:
    if storage.isfile(target):
      storage.remove(target)   # another tokenizer's
  elif not (storage.isfile(target) and storage.read_bytes(target) == data):
    if storage.is_local(target):
      files.atomic_write(target, data, 0o644)
    else:
      storage.write_bytes(target, data)


def _copy(source: str, target: str) -> None:
  if storage.isfile(target) and _same_bytes(source, target):
    return
  if storage.is_local(target):
    os.makedirs(os.path.dirname(target), exist_ok=True)
    files.copy_member(source, target)  # atomic: a reader never sees half a model
  else:
    storage.write_bytes(target, storage.read_bytes(source))  # one object upload: all or nothing


def _trained_with(job_dir: Optional[str]) -> Optional[str]:
  """The job directory's tokenizer when it also holds a complete checkpoint, else None."""
  if not job_dir or not storage.isfile(layout.tokenizer(job_dir)):
    return None
  if not checkpoint.complete_steps(layout.checkpoints(job_dir)):
    return None
  return storage.local_copy(layout.tokenizer(job_dir))   # readers of a tokenizer take a local file


def local_file(job_dir: str) -> Optional[str]:
  """The job directory's tokenizer as a local file (resolved inside a local job directory; a bucket's
  downloaded), or None when it has none."""
  name = os.path.relpath(layout.tokenizer(job_dir), job_dir)
  if storage.is_local(job_dir):
    path = files.member(job_dir, name, 'tokenizer')
    return path if os.path.isfile(path) else None
  return storage.local_copy(layout.tokenizer(job_dir)) if storage.isfile(layout.tokenizer(job_dir)) else None


def kept(job_dir: Optional[str]) -> Optional[str]:
  """The tokenizer file own-data inputs of job_dir read (keep_trained), None before its first checkpoint."""
  return _trained_with(job_dir)


def keep_trained(datasets: dict, job_dir: Optional[str]) -> None:
  """Own-data inputs (fiddle configs, edited in place) without a tokenizer of their own read the
  job directory's when it has a checkpoint, rather than training one on the data as it is now."""
  kept = _trained_with(job_dir)
  for cfg in datasets.values() if kept else ():
    if fdl.get_callable(cfg) is FileLmInput and not cfg.tokenizer:
      cfg.tokenizer = kept


def check_kept(train_input, job_dir: str) -> None:
  """UserError when the job directory has a checkpoint and a tokenizer and the train input
  names another one: its ids would not be the ones the weights learned."""
  check_named(_input_tokenizer(train_input), job_dir)


def check_named(source: Optional[str], job_dir: str) -> None:
  """check_kept for a tokenizer file a command names (source; None names none)."""
  kept = _trained_with(job_dir)
  if kept and source and not _same_tokenizer(source, kept):
    shown = layout.tokenizer(job_dir)
    raise UserError(f'{job_dir} was trained with the tokenizer {shown}; this run\'s input uses {source}, which '
                    f'differs, and would change every id: resume with --set TOKENIZER={kept}, or give a new '
                    '--job-log-dir.')


def base_tokenizer(init_from: Optional[str]) -> Optional[str]:
  """The tokenizer file the job directory INIT_FROM names (or holds the step of) carries, else None."""
  return local_file(layout.split(init_from)[0]) if init_from else None


def adopt_base(datasets: dict, train_cfg) -> None:
  """Own-data inputs (fiddle configs, edited in place) without a tokenizer of their own read with the
  one INIT_FROM's job carries, rather than training one on the data whose ids the base never saw."""
  base = base_tokenizer(getattr(train_cfg, 'init_from', None))
  for cfg in datasets.values() if base else ():
    if fdl.get_callable(cfg) is FileLmInput and not cfg.tokenizer:
      cfg.tokenizer = base


def check_base(train_input, init_from: Optional[str]) -> None:
  """UserError when INIT_FROM's job carries a tokenizer and the train input reads with another one."""
  base, source = base_tokenizer(init_from), _input_tokenizer(train_input)
  if base and source and not _same_tokenizer(source, base):
    raise UserError(f'INIT_FROM={init_from} carries the tokenizer {base}, the ids its embeddings learned; this '
                    f'run\'s input reads with {source}, which differs and would give every id another meaning: '
                    f'leave TOKENIZER unset (your TRAIN_DATA then reads with the base\'s) or set TOKENIZER={base}.')


def _input_tokenizer(train_input) -> Optional[str]:
  return train_input.tokenizer_file() if hasattr(train_input, 'tokenizer_file') else None


def _same_tokenizer(a: str, b: str) -> bool:
  return tokenizers.kind_of(a) == tokenizers.kind_of(b) and _same_bytes(a, b)


def _same_bytes(a: str, b: str) -> bool:
  return storage.read_bytes(a) == storage.read_bytes(b)


def load(job_dir: Optional[str], train_input_cfg=None) -> Optional[Tokenizer]:
  """The job directory's tokenizer; else the one the experiment's train input names; else None.

  `train_input_cfg` (a fiddle config) is built only when the job directory has none, e.g. for
  `--no-checkpoint` runs that never trained.
  """
  if job_dir and storage.isfile(layout.tokenizer(job_dir)):
    return tokenizers.load(storage.local_copy(layout.tokenizer(job_dir)))
  if train_input_cfg is None:
    return None
  cfg = copy.deepcopy(train_input_cfg)
  for field, value in (('batch_size', 1), ('num_infeed_hosts', 1), ('infeed_host_index', 0)):
    if getattr(cfg, field, None) is None:
      setattr(cfg, field, value)
  inp = fdl.build(cfg)
  path = inp.tokenizer_file() if hasattr(inp, 'tokenizer_file') else None
  return tokenizers.load(path) if path else None
