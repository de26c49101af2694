"""Decoding while training (DECODE_INTERVAL_STEPS): greedy continuations of DECODE_PROMPTS."""

from __future__ import annotations

import jax

from paxcli.jobdir import tokenizer as tok_lib
from paxcli.jobdir.summaries import SummaryWriter
from paxcli.loops.decode.decoder import Decoder
from paxcli.loops.decode.options import DecodeOptions
from paxcli.loops.decode.output import output_path, summaries_dir, write_jsonl
from paxcli.loops.decode.prompts import configured_prompts


class TrainDecoder:
  """task.train.decode_interval_steps: greedy continuations of decode_prompts at those steps,
  into TensorBoard text summaries (summaries/decode) and decoder_out/prompts/decode_step<k>.jsonl."""

  def __init__(self, resolved, setup, job_dir: str, train_cfg):
    self.setup, self.job_dir = setup, job_dir
    self.tokenizer = tok_lib.load(job_dir, resolved.train_dataset())
    self.decoder = Decoder(setup, None)
    self.prompts = configured_prompts(train_cfg.decode_prompts, self.tokenizer, self.decoder.vocab_size,
                                      self.decoder.max_seq_len)
    eos = (self.tokenizer.eos_id,) if self.tokenizer is not None and self.tokenizer.eos_id is not None else ()
    self.opts = DecodeOptions(max_decode_steps=train_cfg.decode_max_steps, eos_ids=eos)
    self.writer = None
    self.lead = jax.process_index() == 0

  def run(self, step: int, params) -> list[str]:
    self.decoder.params = params
    records, _ = self.decoder.run(self.prompts, self.opts, self.tokenizer)
    if not self.lead:
      return []
    write_jsonl(output_path(self.job_dir, None, step), records)
    if self.writer is None:
      self.writer = SummaryWriter(summaries_dir(self.job_dir))
    lines = []
    for r in records:
      prompt = r['prompt'] if r['prompt'] is not None else ' '.join(map(str, r['prompt_ids']))
      # `decoded` carries its own leading space where the model began a new word
      cont = r['decoded'] if r['decoded'] is not None else ' ' + ' '.join(map(str, r['decoded_ids']))
      self.writer.text(step, f"decode/prompt_{r['prompt_index']}", f'**{prompt}**{cont}')
      lines.append(f'decode step {step}: {prompt!r} -> {cont!r}')
    self.writer.flush()
    return lines

  def close(self) -> None:
    if self.writer:
      self.writer.close()
