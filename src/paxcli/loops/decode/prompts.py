"""Prompts: token ids (and their text) from --prompt, --prompt-ids, a prompts file, an input, or
the experiment's DECODE_PROMPTS; each checked against the vocabulary and the room left to decode."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Optional, Sequence

import numpy as np

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.inputs.base import EndOfInput
from paxcli.runtime import infeed

MAX_PROMPTS_FILE_BYTES = 256 << 20  # prompts are decoded in memory; a bigger file is a mistake


@dataclasses.dataclass
class Prompt:
  ids: list
  text: Optional[str] = None


def prompts_from_args(texts: Sequence[str], file: Optional[str], ids: Sequence[str], tokenizer,
                      vocab_size: int) -> list[Prompt]:
  """--prompt (repeatable), --prompts-file (text or JSONL), --prompt-ids (repeatable) -> Prompts."""
  prompts = [text_prompt(t, tokenizer, '--prompt') for t in texts]
  if file:
    prompts += read_prompts_file(file, tokenizer)
  if isinstance(ids, str):  # one --prompt-ids value, as callers before it was repeatable gave it
    ids = [ids]
  for one in ids or ():
    prompts.append(Prompt(parse_ids(one)))
  for n, p in enumerate(prompts):
    if not p.ids:
      raise UserError(f'Prompt {n} ({p.text!r}) is empty: it has no tokens.')
    bad = [i for i in p.ids if not 0 <= i < vocab_size]
    if bad:
      raise UserError(f'Prompt {n} has id {bad[0]} outside the vocabulary (0 to {vocab_size - 1}).')
  return prompts


def parse_ids(text: str) -> list[int]:
  """'12,15,18' (or spaces) -> [12, 15, 18]; UserError otherwise."""
  try:
    return [int(x) for x in text.replace(' ', ',').split(',') if x]
  except ValueError:
    raise UserError(f'--prompt-ids takes integers separated by commas, got {shorten(repr(text), 80)}.') from None


def text_prompt(text: str, tokenizer, where: str) -> Prompt:
  if tokenizer is None:
    raise UserError(f'This model has no tokenizer (it was trained on ids, e.g. the synthetic input), so '
                    f'{where} cannot take text; give token ids with --prompt-ids 12,15,18 or a JSONL '
                    'prompts file with "prompt_ids".')
  files.check_unicode(text, where)   # sentencepiece fails on a lone surrogate with a C++ error
  bos = [tokenizer.bos_id] if tokenizer.bos_first else []   # as the model was trained (inputs.packing)
  return Prompt(bos + tokenizer.encode(text), text)


def read_prompts_file(path: str, tokenizer) -> list[Prompt]:
  """One prompt per line, or JSONL objects with "prompt" (text) or "prompt_ids" (ints)."""
  lines = files.read_text(path, 'the prompts file', MAX_PROMPTS_FILE_BYTES).splitlines()
  numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
  if not numbered:
    raise UserError(f'The prompts file {path} is empty: write one prompt per line, or JSONL objects with '
                    '"prompt" or "prompt_ids".')
  is_jsonl = path.endswith('.jsonl') or numbered[0][1].lstrip().startswith('{')
  prompts = []
  for n, line in numbered:
    if not is_jsonl:
      prompts.append(text_prompt(line, tokenizer, f'{path} line {n}'))
      continue
    obj = files.parse_json(line, f'{path} line {n}')   # bounded: depth, digits; NaN is not JSON
    if not isinstance(obj, dict) or not ('prompt' in obj or 'prompt_ids' in obj):
      raise UserError(f'{path} line {n}: expected an object with "prompt" or "prompt_ids", got {line[:80]!r}')
    if 'prompt_ids' in obj:
      ids = obj['prompt_ids']
      if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f'{path} line {n}: "prompt_ids" must be a list of integers.')
      prompts.append(Prompt(ids, obj.get('prompt') if isinstance(obj.get('prompt'), str) else None))
    elif not isinstance(obj['prompt'], str):
      raise UserError(f'{path} line {n}: "prompt" must be a string.')
    else:
      prompts.append(text_prompt(obj['prompt'], tokenizer, f'{path} line {n}'))
  return prompts


def prompts_from_dataset(resolved, name: str, tokenizer, max_prompts: int, max_len: int) -> list[Prompt]:
  """Rows of the experiment's input `name` as prompts: its `prefix`, else `ids` without padding,
  cut to their first `max_len` tokens (full-length LM rows would leave no room to decode)."""
  cfgs = dict(resolved.datasets)
  if name not in cfgs:
    close = difflib.get_close_matches(name, list(cfgs), n=1)
    hint = f' Did you mean {close[0]!r}?' if close else ''
    raise UserError(f'The experiment has no input named {name!r} (inputs: {", ".join(cfgs) or "none"}).{hint}')
  inp = infeed.build_input(cfgs[name], process_batch=max(1, min(max_prompts, 64)), num_hosts=1, host_index=0)
  prompts = []
  while len(prompts) < max_prompts:
    try:
      batch = inp.get_next()
    except EndOfInput:
      break
    rows = batch.get('prefix', batch['ids'])
    if 'prefix' in batch:
      keep = batch.get('prefix_paddings')
      keep = (1 - keep) if keep is not None else (rows != 0)
    elif 'paddings' in batch:
      keep = 1 - batch['paddings']
    else:
      keep = batch.get('weights', np.ones_like(rows)) > 0
    for row, k in zip(np.asarray(rows), np.asarray(keep) > 0):
      ids = [int(t) for t in row[k]][:max_len]
      if ids and len(prompts) < max_prompts:
        prompts.append(Prompt(ids, tokenizer.decode(ids) if tokenizer else None))
  if not prompts:
    raise UserError(f'The input {name!r} gave no prompts.')
  return prompts


def configured_prompts(decode_prompts: Sequence, tokenizer, vocab_size: int, max_seq_len: int) -> list[Prompt]:
  """The experiment's DECODE_PROMPTS (texts or lists of ids), decoded while training."""
  prompts = []
  for n, p in enumerate(decode_prompts):
    if isinstance(p, str):
      prompts.append(text_prompt(p, tokenizer, f'DECODE_PROMPTS[{n}]'))
    else:
      prompts.append(Prompt([int(i) for i in p]))
  check_lengths(prompts, max_seq_len)
  for n, p in enumerate(prompts):
    if not p.ids or not all(0 <= i < vocab_size for i in p.ids):
      raise UserError(f'DECODE_PROMPTS[{n}] is empty or has ids outside the vocabulary.')
  return prompts


def check_lengths(prompts: Sequence[Prompt], max_seq_len: int, offset: int = 0) -> None:
  for n, p in enumerate(prompts):
    if len(p.ids) >= max_seq_len:
      raise UserError(f'Prompt {n + offset} has {len(p.ids)} tokens, which leaves no room to decode below '
                      f'MAX_SEQ_LEN {max_seq_len}; shorten it or raise MAX_SEQ_LEN.')
