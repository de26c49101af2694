"""PaxLM: lm-evaluation-harness' model interface over a paxcli checkpoint.

    lm = PaxLM(resolved, job_dir)                 # the latest checkpoint; weights read at the first request
    lm_eval.simple_evaluate(model=lm, tasks=['hellaswag'])

The harness asks three things of a model, each a list of requests answered in order:
  loglikelihood          (context, continuation) -> (log-probability, greedy?)
  loglikelihood_rolling  (text,) -> log-probability of the whole text, in rolling windows
  generate_until         (context, generation kwargs) -> the generated text, cut at the first stop sequence
The first two are `pax score`'s requests (paxcli.loops.score: the harness' tokenization of a pair,
its rolling windows, the Scorer's batches on the mesh); the third is `pax decode`'s Decoder (greedy
unless the task samples; stop sequences; at most max_gen_toks new tokens, the context cut from the
left to leave room for them, as the harness' Hugging Face backend does, whose convention for the
text returned, the new tokens decoded on their own, is kept too).

Registered with the harness as `paxcli`: after `import paxcli.loops.harness.model`,
`simple_evaluate(model='paxcli', model_args='job_dir=runs/x,exp=default.StdlibDocsLm')` builds one.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import simple_parse_args_string

from paxcli import config
from paxcli.errors import UserError
from paxcli.jobdir import layout, restore
from paxcli.jobdir import tokenizer as tok_lib
from paxcli.loops.decode.decoder import Decoder
from paxcli.loops.decode.options import DecodeOptions
from paxcli.loops.decode.prompts import Prompt
from paxcli.loops.score.requests import Request, to_pairs
from paxcli.loops.score.scorer import Scorer
from paxcli.runtime import engine

# Given a label and a count, a context whose value is called with each batch's count (a progress bar).
Progress = Callable[[str, int], ContextManager[Callable[[int], None]]]
WHERE = 'lm-eval request'  # how errors name a request: 'lm-eval request 12: ...'


@register_model('paxcli')
class PaxLM(LM):
  """The harness' model for a paxcli job: its checkpoint `step` (default the latest), on its mesh."""

  def __init__(self, resolved, job_dir: str, step: Optional[int] = None, batch_size: int = 0,
               dtype: Optional[str] = None, log: Callable[[str], None] = print, progress: Optional[Progress] = None):
    super().__init__()
    self.resolved, self.job_dir, self.batch_size, self.log, self._progress = resolved, job_dir, batch_size, log, progress
    self.setup = engine.build(resolved)
    self.scorer = Scorer(self.setup, None, dtype=dtype)      # a model that cannot score fails here, before any reading
    self.decoder = Decoder(self.setup, None, dtype=dtype)
    self.wanted = restore.choose_step(job_dir, step, purpose='evaluate')
    self.fallback = step is None  # the latest, if damaged, gives way to the newest intact one
    self.tokenizer = tok_lib.load(job_dir, resolved.train_dataset())
    if self.tokenizer is None:
      raise UserError(f'{job_dir} has no tokenizer (the model was trained on ids, e.g. the synthetic input): '
                      'lm-evaluation-harness gives text, so it needs the tokenizer the model was trained with.')
    self.step = None       # the checkpoint read: set at the first request
    self._ignored = []
    self.counts = {'loglikelihood': 0, 'loglikelihood_rolling': 0, 'generate_until': 0}

  @classmethod
  def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> PaxLM:
    """`model_args='job_dir=runs/x,exp=NAME,step=200,batch_size=16'` (the harness' own `--model paxcli`)."""
    return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

  @classmethod
  def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> PaxLM:
    args = dict(arg_dict)
    if 'job_dir' not in args:
      raise UserError("The paxcli model needs model_args with job_dir=<the job directory> (and exp=<experiment>).")
    overrides = [s for s in str(args.pop('set', '')).split(';') if s]
    batch = (additional_config or {}).get('batch_size')
    return cls(config.resolve(args.pop('exp', None), overrides), layout.absolute(str(args.pop('job_dir'))),
               step=args.pop('step', None), batch_size=int(args.pop('batch_size', 0) or batch or 0),
               dtype=args.pop('dtype', None))

  def compile_seconds(self) -> float:
    """Seconds spent compiling the forward pass and the decoder (each shape once), so far."""
    return self.scorer.compile_seconds + self.decoder.compile_seconds

  # ---- the weights, read once ---------------------------------------------------------------------

  def _ready(self) -> None:
    if self.step is None:
      params, self.step = restore.weights(self.setup, self.resolved, self.job_dir, self.wanted, 'evaluate with lm-eval',
                                          fallback=self.fallback, log=self.log)
      self.scorer.params = self.decoder.params = params

  def _bar(self, label: str, total: int):
    return self._progress(label, total) if self._progress else contextlib.nullcontext(None)

  # ---- the harness' three requests ----------------------------------------------------------------

  def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
    reqs = [Request(n, {'context': c, 'continuation': x}, 'pair', False)
            for n, (c, x) in enumerate((r.args for r in requests), 1)]
    return self._score(reqs, 'loglikelihood')

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    reqs = [Request(n, {'text': r.args[0]}, 'rolling', False) for n, r in enumerate(requests, 1)]
    return [logprob for logprob, _ in self._score(reqs, 'loglikelihood_rolling')]

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    self._ready()
    out: list = [None] * len(requests)
    groups: dict = {}  # requests with the same generation kwargs decode together
    for n, r in enumerate(requests):
      context, kwargs = r.args
      groups.setdefault(repr(sorted(kwargs.items())), (kwargs, []))[1].append((n, context))
    with self._bar('lm-eval generate_until', len(requests)) as advance:
      for kwargs, members in groups.values():
        opts, until = self._options(kwargs)
        prompts = [self._prompt(context, opts.max_decode_steps) for _, context in members]
        records, _ = self.decoder.run(prompts, opts, self.tokenizer, progress=advance)
        for (n, _), record in zip(members, records):
          out[n] = self._text(record, until)
    self.counts['generate_until'] += len(requests)
    return out

  # ---- how ----------------------------------------------------------------------------------------

  def _score(self, reqs: list[Request], kind: str) -> list[tuple[float, bool]]:
    """(sum of the scored tokens' log-probabilities, all greedy) per request, through `pax score`'s
    pairs (a rolling text is several) and Scorer."""
    self._ready()
    pairs = to_pairs(reqs, self.tokenizer, self.scorer.vocab_size, self.scorer.max_seq_len, WHERE)
    with self._bar(f'lm-eval {kind}', len(pairs)) as advance:
      results, _ = self.scorer.run(pairs, self.batch_size, progress=advance)
    totals = [([], True) for _ in reqs]
    for pair, (logprobs, greedy) in zip(pairs, results):
      lps, all_greedy = totals[pair.request]
      lps.extend(logprobs)
      totals[pair.request] = (lps, all_greedy and greedy)
    self.counts[kind] += len(reqs)
    return [(math.fsum(lps), greedy) for lps, greedy in totals]

  def _options(self, kwargs: dict) -> tuple[DecodeOptions, list[str]]:
    """DecodeOptions for a task's generation kwargs (the harness' own reading of them), and its stop sequences."""
    kwargs = normalize_gen_kwargs(dict(kwargs), 256)  # the harness' default max_gen_toks
    until = handle_stop_sequences(kwargs.pop('until', None), eos=None)
    steps = int(kwargs.pop('max_gen_toks'))
    if steps >= self.decoder.max_seq_len:
      raise UserError(f'The task asks for up to {steps} new tokens (max_gen_toks), which leaves no room for a context '
                      f'below MAX_SEQ_LEN {self.decoder.max_seq_len}; set a smaller max_gen_toks (--gen-kwargs).')
    sampling = bool(kwargs.get('do_sample')) and float(kwargs.get('temperature') or 0) > 0
    ignored = sorted(set(kwargs) - {'do_sample', 'temperature', 'top_k', 'top_p'})
    if ignored and ignored != self._ignored:
      self._ignored = ignored
      self.log(f'lm-eval: generation kwargs {", ".join(ignored)} are not options of paxcli\'s decoder; ignored.')
    eos = self.tokenizer.eos_id
    opts = DecodeOptions(
        max_decode_steps=steps, stop=tuple(s for s in until if s), eos_ids=(eos,) if eos is not None else (),
        batch_size=self.batch_size, temperature=float(kwargs['temperature']) if sampling else None,
        top_k=int(kwargs['top_k']) if sampling and kwargs.get('top_k') else None,
        top_p=float(kwargs['top_p']) if sampling and kwargs.get('top_p') is not None else None)
    opts.check(self.decoder.vocab_size)
    return opts, until

  def _prompt(self, context: str, new_tokens: int) -> Prompt:
    """The context's ids (after BOS where the model was trained so), the oldest cut to leave room for
    `new_tokens` (the harness' left truncation); an empty context is the BOS (else EOS) token."""
    tok = self.tokenizer
    ids = tok.encode(context) if context else []
    if tok.bos_first or not ids:
      start = tok.bos_id if tok.bos_id is not None else tok.eos_id
      ids = ([start] if start is not None else []) + ids
    if not ids:
      raise UserError(f'An {WHERE} has an empty context and the tokenizer has no BOS or EOS token to start from.')
    return Prompt(ids[-(self.decoder.max_seq_len - new_tokens):], context)

  def _text(self, record: dict, until: list[str]) -> str:
    """The new tokens decoded on their own (EOS dropped), cut at the first stop sequence: what the
    harness' Hugging Face backend returns for the same tokens."""
    ids = record['decoded_ids'][:-1] if record['stop_reason'] == 'eos' else record['decoded_ids']
    return postprocess_generated_text(self.tokenizer.decode(ids), until, None)
