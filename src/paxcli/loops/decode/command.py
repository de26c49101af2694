"""`pax decode` as a function: a resolved config, a job directory and options in; records out.

    decoded = decode(resolved, job_dir, DecodeOptions(...), prompt_ids=['1,2,3'])
    decoded.records        # one dict per prompt and sample (beam), as written to decoded.path

Every check that needs no decoding (the model, the checkpoint, the prompts, the options
against the vocabulary, the output file) runs before the weights are read. Process 0
writes the JSONL; every process returns the records. Printing is the caller's (`pax decode`
prints a table, or the JSON lines); `log` gets the restore's warnings.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, ContextManager, Optional, Sequence

import jax

from paxcli.errors import UserError
from paxcli.jobdir import restore
from paxcli.jobdir import tokenizer as tok_lib
from paxcli.loops.decode.decoder import Decoder
from paxcli.loops.decode.options import DecodeOptions
from paxcli.loops.decode.output import check_output, cli_output_path, write_jsonl
from paxcli.loops.decode.prompts import Prompt, check_lengths, prompts_from_args, prompts_from_dataset
from paxcli.runtime import engine

# Given the number of prompts, a context whose value is called with each decoded batch's count.
Progress = Callable[[int], ContextManager[Callable[[int], None]]]


class Decoded(list):
  """The records, one dict per prompt and sample (beam), as written to `path`; a list, so that
  `paxcli.decode(...)` returns records, with what `pax decode` prints besides them."""

  def __init__(self, records: list[dict], stats: dict, step: int, path: Optional[str], has_text: bool):
    super().__init__(records)
    self.stats = stats        # prefill/decode tokens and seconds, compile_s (see Decoder.run)
    self.step = step          # the checkpoint step decoded; 0 for fresh weights
    self.path = path          # the JSONL written; None on processes other than 0
    self.has_text = has_text  # a tokenizer gave the prompts and continuations as text

  @property
  def records(self) -> list[dict]:
    return list(self)


def decode(resolved, job_dir: str, opts: DecodeOptions, texts: Sequence[str] = (), prompts_file: Optional[str] = None,
           prompt_ids: Sequence[str] = (), dataset: Optional[str] = None, num_prompts: int = 8,
           step: Optional[int] = None, use_checkpoint: bool = True, dtype: Optional[str] = None,
           output: Optional[str] = None, log: Callable[[str], None] = print,
           progress: Optional[Progress] = None, force: bool = False) -> Decoded:
  """Decodes the prompts (texts, a file, id lists, or `num_prompts` rows of the input `dataset`)
  with the weights of checkpoint `step` (default the latest; fresh ones without `use_checkpoint`)."""
  setup = engine.build(resolved)
  decoder = Decoder(setup, None, dtype=dtype)  # a model that cannot decode fails before any reading
  chosen = restore.choose_step(job_dir, step, purpose='decode') if use_checkpoint else None  # None: fresh weights
  tokenizer = tok_lib.load(job_dir, resolved.train_dataset())
  if dataset:
    room = max(1, decoder.max_seq_len - opts.max_decode_steps)
    prompts = prompts_from_dataset(resolved, dataset, tokenizer, num_prompts, room)
  else:
    prompts = prompts_from_args(texts, prompts_file, prompt_ids, tokenizer, decoder.vocab_size)
  check_lengths(prompts, decoder.max_seq_len)
  opts = _checked(opts, tokenizer, decoder.vocab_size)
  lead = jax.process_index() == 0
  if lead:  # an unwritable output is found before the decoding, not after it
    check_output(output or cli_output_path(job_dir, dataset, chosen or 0), force,
                 inputs=[prompts_file] if prompts_file else [])
  decoder.params, ckpt_step = restore.weights(setup, resolved, job_dir, chosen, 'decode', fallback=step is None,
                                              log=log)
  records, stats = _run(decoder, prompts, opts, tokenizer, progress if lead else None)
  path = None
  if lead:
    path = output or cli_output_path(job_dir, dataset, ckpt_step)
    write_jsonl(path, records)
  return Decoded(records, stats, ckpt_step, path, tokenizer is not None)


def _checked(opts: DecodeOptions, tokenizer, vocab: int) -> DecodeOptions:
  """The options checked against the vocabulary and the tokenizer, with its EOS id by default."""
  opts.check(vocab)  # --top-k, --beam-size against the vocabulary
  if opts.stop and tokenizer is None:
    raise UserError('--stop needs a tokenizer to turn tokens into text; this model has none (use --eos-id).')
  if not opts.eos_ids and tokenizer is not None and tokenizer.eos_id is not None:
    opts = dataclasses.replace(opts, eos_ids=(tokenizer.eos_id,))
  for e in opts.eos_ids:
    if not 0 <= e < vocab:
      raise UserError(f'--eos-id {e} is outside the vocabulary (0 to {vocab - 1}).')
  return opts


def _run(decoder: Decoder, prompts: list[Prompt], opts: DecodeOptions, tokenizer, progress: Optional[Progress]):
  with progress(len(prompts)) if progress else contextlib.nullcontext() as advance:
    return decoder.run(prompts, opts, tokenizer, progress=advance)
