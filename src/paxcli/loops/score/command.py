"""`pax score` as a function: a resolved config, a job directory and a requests file in; records out.

    scored = score(resolved, job_dir, read_requests('requests.jsonl'), 'requests.jsonl')
    scored.records      # one dict per request, in file order, as written to scored.path

A record is the request's own fields with `logprob` (the sum of the scored tokens'
log-probabilities), `is_greedy` (every scored token is the model's argmax), `num_tokens` (tokens
scored), `token_logprobs`, `line` (its line in the file) and `truncated` (context tokens dropped to
fit the window; for a text, the number of windows it took is `num_windows`). Every check that needs no
model (the file, the tokens, the output path) runs before the weights are read. Process 0
writes the JSONL; every process returns the records.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional

import jax

from paxcli.jobdir import layout, restore, storage
from paxcli.jobdir import tokenizer as tok_lib
from paxcli.loops.decode.output import check_output, finite_or_none, write_jsonl
from paxcli.loops.score.requests import Pair, Request, to_pairs
from paxcli.loops.score.scorer import Scorer
from paxcli.runtime import engine

# Given the number of pairs, a context whose value is called with each scored batch's count.
Progress = Callable[[int], ContextManager[Callable[[int], None]]]


class Scored(list):
  """The records, one dict per request in file order, as written to `path`; a list, with what `pax
  score` prints besides them."""

  def __init__(self, records: list[dict], stats: dict, step: int, path: Optional[str]):
    super().__init__(records)
    self.stats = stats  # tokens, scored_tokens, seconds, compile_s, requests, windows
    self.step = step    # the checkpoint step scored; 0 for fresh weights
    self.path = path    # the JSONL written; None on processes other than 0

  @property
  def records(self) -> list[dict]:
    return list(self)


def score(resolved, job_dir: str, requests: list[Request], requests_file: str, step: Optional[int] = None,
          use_checkpoint: bool = True, dtype: Optional[str] = None, batch_size: int = 0, output: Optional[str] = None,
          log: Callable[[str], None] = print, progress: Optional[Progress] = None, force: bool = False) -> Scored:
  """Scores `requests` (read from `requests_file`, which messages name) with checkpoint `step`'s
  weights (default the latest; fresh ones without `use_checkpoint`). An existing `output` is replaced
  only with `force`."""
  setup = engine.build(resolved)
  scorer = Scorer(setup, None, dtype=dtype)  # a model that cannot score fails before any reading
  chosen = restore.choose_step(job_dir, step, purpose='score') if use_checkpoint else None
  tokenizer = tok_lib.load(job_dir, resolved.train_dataset())
  pairs = to_pairs(requests, tokenizer, scorer.vocab_size, scorer.max_seq_len, requests_file)
  cut = sum(1 for p in pairs if p.dropped)
  if cut:
    log(f'{cut} request(s) longer than MAX_SEQ_LEN {scorer.max_seq_len} + 1 tokens: their contexts lose their first '
        'tokens (each record\'s "truncated" says how many).')
  lead = jax.process_index() == 0
  if lead:  # an unwritable output is found before the scoring, not after it
    check_output(output or default_output(job_dir, chosen or 0), force, inputs=[requests_file])
  scorer.params, ckpt_step = restore.weights(setup, resolved, job_dir, chosen, 'score', fallback=step is None, log=log)
  with progress(len(pairs)) if progress and lead else contextlib.nullcontext() as advance:
    results, stats = scorer.run(pairs, batch_size, progress=advance)
  records = _records(requests, pairs, results)
  stats.update(requests=len(requests), windows=len(pairs))
  path = None
  if lead:
    path = output or default_output(job_dir, ckpt_step)
    write_jsonl(path, records)
  return Scored(records, stats, ckpt_step, path)


def default_output(job_dir: str, step: int) -> str:
  """<job dir>/scores/pax_score_step<k>_<n>.jsonl with the first unused n: never an earlier score."""
  return layout.first_unused(lambda n: layout.scores(job_dir, step, n))


def _records(requests: list[Request], pairs: list[Pair], results: list) -> list[dict]:
  """One record per request: its fields, then its pairs' scores summed (a text's windows add up)."""
  per_request = [[] for _ in requests]
  for pair, result in zip(pairs, results):
    per_request[pair.request].append((pair, result))
  records = []
  for req, scored in zip(requests, per_request):
    token_logprobs = [x for _, (lps, _) in scored for x in lps]
    record = dict(req.fields)
    record.update(line=req.line, logprob=finite_or_none(math.fsum(token_logprobs)),
                  is_greedy=all(greedy for _, (_, greedy) in scored), num_tokens=len(token_logprobs),
                  token_logprobs=[finite_or_none(x) for x in token_logprobs],
                  truncated=sum(p.dropped for p, _ in scored))
    if req.kind == 'rolling':
      record['num_windows'] = len(scored)
    records.append(record)
  return records
