"""Decoding with a KV cache: greedy, sampling (temperature, top-k, top-p) and beam search.

    decoder = Decoder(setup, params)                       # jitted prefill/step on setup's mesh
    results = decoder.run(prompts, DecodeOptions(...))     # one dict per prompt and sample

How a batch is decoded: prompts are LEFT-PADDED to the longest prompt of the batch and
each row carries its own positions (0..p-1 for a prompt of length p, whatever the padding),
so that every row's last prompt token sits in the same cache slot and one cache index
serves the batch. Padding slots are marked invalid in the cache and never attended to:
a prompt gets the same tokens in any batch as alone. One forward pass over the padded
prompts fills the cache (prefill); each step then feeds one token per row at slot
P + t (P the padded prompt length) and position p + t.

The cache (flax collection 'cache', see layers/transformer.py) is [B, S, K, E] per layer
(with a leading layer axis for scanned layers), sharded batch over (replica, data) and
kv heads over mdl, created zeroed on that sharding; remat is not used when decoding.

Sampling order: logits / temperature, then top-k (keep the k largest), then top-p (keep
the smallest set of the remaining tokens whose probability, renormalised after top-k,
reaches p), then one draw. The key of sample s of prompt i at new token t is
fold_in(fold_in(fold_in(key(seed), i), s), t): it does not depend on the batch, its size
or the number of processes. Reported log-probabilities are the model's own (temperature
1, no truncation): `logprob` is the teacher-forced log-likelihood of `decoded_ids`.

Beam search (Pax's): each step the k best continuations of a prompt's live beams are kept;
a continuation that ends (EOS, a stop string) leaves the beam as a finished hypothesis and
its slot dies; a prompt ends when it has k finished hypotheses or its step budget is spent
(live beams then finish with `max_steps`). Hypotheses are ranked by
logprob / ((5 + length) / 6) ** length_penalty (Pax's length_norm_alpha).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from paxcli.errors import UserError, shorten


@dataclasses.dataclass
class DecodeOptions:
  max_decode_steps: int = 64
  temperature: Optional[float] = None   # None or 0 with no top-k/top-p: greedy
  top_k: Optional[int] = None
  top_p: Optional[float] = None
  num_samples: int = 1
  seed: int = 0
  beam_size: int = 0                     # >0: beam search
  length_penalty: float = 0.0
  eos_ids: tuple = ()
  stop: tuple = ()
  batch_size: int = 0                    # rows per batch; 0: up to 64
  ignore_eos: bool = False               # EOS ids do not stop a row (they are kept in decoded_ids)
  min_length: int = 0                    # no row stops (EOS, stop string) before this many new tokens

  @property
  def sampling(self) -> bool:
    if self.temperature == 0:
      return False
    return self.temperature is not None or self.top_k is not None or self.top_p is not None

  def check(self, vocab_size: Optional[int] = None) -> None:
    """UserError for options that cannot decode; with `vocab_size`, also those above the vocabulary."""
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise UserError(f'--top-p must be in (0, 1], got {self.top_p}.')
    if self.top_k is not None and self.top_k < 0:
      raise UserError(f'--top-k must be at least 0 (0: no top-k), got {self.top_k}.')
    if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise UserError(f'--temperature must be a finite number at least 0 (0: greedy), got {self.temperature}.')
    if not math.isfinite(self.length_penalty):
      raise UserError(f'--length-penalty must be a finite number, got {self.length_penalty}.')
    if not 0 <= self.seed < 2 ** 32:
      # JAX (without x64) keeps a seed's low 32 bits: a larger or negative seed would repeat another one.
      raise UserError(f'--seed must be between 0 and {2 ** 32 - 1} (32 bits; JAX keeps only those, so a larger '
                      f'seed would give the samples of a smaller one), got {shorten(self.seed, 60)}.')
    if '' in self.stop:
      raise UserError("--stop '' is empty: every text contains it, so it would stop every row at its first "
                      'token. Give a non-empty string.')
    if self.min_length < 0:
      raise UserError(f'--min-length must be at least 0, got {self.min_length}.')
    if self.max_decode_steps < 1:
      raise UserError(f'--max-decode-steps must be at least 1, got {self.max_decode_steps}.')
    if self.num_samples < 1:
      raise UserError(f'--num-samples must be at least 1, got {self.num_samples}.')
    if self.beam_size < 0:
      raise UserError(f'--beam-size must be at least 1, got {self.beam_size}.')
    if self.beam_size:
      used = [n for n, v in (('--temperature', self.temperature), ('--top-k', self.top_k),
                             ('--top-p', self.top_p)) if v is not None]
      if self.num_samples != 1:
        used.append('--num-samples')
      if used:
        raise UserError(f'Beam search (--beam-size) is deterministic; it cannot be combined with sampling '
                        f'options ({", ".join(used)}).')
    elif self.length_penalty:
      raise UserError('--length-penalty applies to beam search only; add --beam-size.')
    if vocab_size is not None:
      if self.top_k and self.top_k > vocab_size:
        raise UserError(f'--top-k {self.top_k} is above the vocabulary size {vocab_size}; use at most '
                        f'{vocab_size} (or 0: no top-k).')
      if self.beam_size > vocab_size:
        raise UserError(f'--beam-size {self.beam_size} is above the vocabulary size {vocab_size}; a step '
                        f'cannot keep more beams than there are tokens.')


MAX_PROMPTS_FILE_BYTES = 256 << 20  # prompts are decoded in memory; a bigger file is a mistake


@dataclasses.dataclass
class Prompt:
  ids: list
  text: Optional[str] = None


# ---- prompts ---------------------------------------------------------------------------------------


def prompts_from_args(texts: Sequence[str], file: Optional[str], ids: Sequence[str], tokenizer,
                      vocab_size: int) -> list[Prompt]:
  """--prompt (repeatable), --prompts-file (text or JSONL), --prompt-ids (repeatable) -> Prompts."""
  prompts = [_text_prompt(t, tokenizer, '--prompt') for t in texts]
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


def check_text(text: str, option: str) -> None:
  """A command-line string the OS gave us with undecodable bytes (Python keeps them as surrogates)."""
  try:
    text.encode('utf-8')
  except UnicodeEncodeError as e:
    bad = text[e.start].encode('utf-8', 'surrogateescape')
    raise UserError(f'{option} {shorten(ascii(text), 80)} is not UTF-8 text (byte 0x{bad.hex()} at character '
                    f'{e.start}); give UTF-8 text, or token ids with --prompt-ids.') from None


def _text_prompt(text: str, tokenizer, where: str) -> Prompt:
  if tokenizer is None:
    raise UserError(f'This model has no tokenizer (it was trained on ids, e.g. the synthetic input), so '
                    f'{where} cannot take text; give token ids with --prompt-ids 12,15,18 or a JSONL '
                    'prompts file with "prompt_ids".')
  return Prompt(tokenizer.encode(text), text)


def read_prompts_file(path: str, tokenizer) -> list[Prompt]:
  """One prompt per line, or JSONL objects with "prompt" (text) or "prompt_ids" (ints)."""
  import json

  from paxcli import files
  lines = files.read_text(path, 'the prompts file', MAX_PROMPTS_FILE_BYTES).splitlines()
  numbered = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
  if not numbered:
    raise UserError(f'The prompts file {path} is empty: write one prompt per line, or JSONL objects with '
                    '"prompt" or "prompt_ids".')
  is_jsonl = path.endswith('.jsonl') or numbered[0][1].lstrip().startswith('{')
  prompts = []
  for n, line in numbered:
    if not is_jsonl:
      prompts.append(_text_prompt(line, tokenizer, f'{path} line {n}'))
      continue
    try:
      obj = json.loads(line)
    except ValueError as e:
      raise UserError(f'{path} line {n} is not valid JSON ({e.msg}): {line[:80]!r}') from None
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
      prompts.append(_text_prompt(obj['prompt'], tokenizer, f'{path} line {n}'))
  return prompts


def prompts_from_dataset(resolved, setup, name: str, tokenizer, max_prompts: int, max_len: int) -> list[Prompt]:
  """Rows of the experiment's input `name` as prompts: its `prefix`, else `ids` without padding,
  cut to their first `max_len` tokens (full-length LM rows would leave no room to decode)."""
  from paxcli.runtime import infeed
  from paxcli.inputs.base import EndOfInput
  cfgs = dict(resolved.datasets)
  if name not in cfgs:
    from difflib import get_close_matches
    close = get_close_matches(name, list(cfgs), n=1)
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


# ---- the model side ---------------------------------------------------------------------------------


def _cache_shardings(cache_abstract, mesh):
  """Batch over (replica, data), kv heads over mdl (where they divide), the rest replicated."""
  import jax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from paxcli.runtime import sharding
  dp = sharding.data_parallel_size(mesh)

  def one(path, leaf):
    name = str(getattr(path[-1], 'key', path[-1]))
    spec = [None] * leaf.ndim
    if name in ('cached_key', 'cached_value', 'cached_valid'):
      b_axis = leaf.ndim - (4 if name != 'cached_valid' else 2)
      if leaf.shape[b_axis] % dp == 0:
        spec[b_axis] = sharding.BATCH_AXES
      if name != 'cached_valid' and leaf.shape[-2] % mesh.shape['mdl'] == 0:
        spec[-2] = 'mdl'
    return NamedSharding(mesh, P(*spec))

  return jax.tree_util.tree_map_with_path(one, cache_abstract)


def _reorder(cache, rows_B):
  """Cache rows gathered by `rows_B` (beam search: each beam takes its parent's cache)."""
  import jax

  def one(path, x):
    name = str(getattr(path[-1], 'key', path[-1]))
    if name == 'cache_index':
      return x
    axis = x.ndim - (4 if name != 'cached_valid' else 2)
    return x.take(rows_B, axis=axis)

  return jax.tree_util.tree_map_with_path(one, cache)


def select_tokens(logits_BxV, keys_Bx2, t, temperature, top_k: int, top_p, sampling: bool):
  """Next token per row and its model logprob. top_k is static (0: off); top_p, temperature traced."""
  import jax
  import jax.numpy as jnp
  logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  if not sampling:
    tok_B = jnp.argmax(logits_BxV, axis=-1)
  else:
    x = logits_BxV / jnp.maximum(temperature, 1e-6)
    neg = jnp.finfo(jnp.float32).min
    if top_k:
      kth_B = jax.lax.top_k(x, top_k)[0][:, -1]
      x = jnp.where(x >= kth_B[:, None], x, neg)
    sorted_BxV = jnp.sort(x, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BxV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs     # mass of the tokens ranked above each token
    keep = before < top_p
    cutoff_B = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1)
    x = jnp.where(x >= cutoff_B[:, None], x, neg)

    def draw(key, row):
      return jax.random.categorical(jax.random.fold_in(key, t), row)

    tok_B = jax.vmap(draw)(keys_Bx2, x)
  tok_B = tok_B.astype(jnp.int32)
  return tok_B, jnp.take_along_axis(logp_BxV, tok_B[:, None], axis=-1)[:, 0]


def check_lengths(prompts: Sequence[Prompt], max_seq_len: int, offset: int = 0) -> None:
  for n, p in enumerate(prompts):
    if len(p.ids) >= max_seq_len:
      raise UserError(f'Prompt {n + offset} has {len(p.ids)} tokens, which leaves no room to decode below '
                      f'MAX_SEQ_LEN {max_seq_len}; shorten it or raise MAX_SEQ_LEN.')


class Decoder:
  """Jitted prefill and step functions of a model on its mesh; `run` decodes prompts."""

  def __init__(self, setup, params, dtype: Optional[str] = None):
    import jax
    self.setup = setup
    self.mesh = setup.mesh
    model = setup.model
    lm = getattr(model, 'lm_tpl', None)
    if lm is None or not hasattr(lm, 'vocab_size'):
      raise UserError(f'pax decode generates text from language models; this experiment\'s model is a '
                      f'{type(model).__name__}.')
    if dtype and dtype != lm.fprop_dtype:
      import copy
      lm = copy.deepcopy(lm)
      lm.fprop_dtype = dtype
      model = model.clone(lm_tpl=lm)
    self.model = model
    self.params = params
    self.max_seq_len = lm.max_seq_len
    self.vocab_size = lm.vocab_size
    self.replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self._fns = {}
    self.compile_seconds = 0.0  # all compilations so far (each shape and strategy compiles once)

  # -- jitted pieces, one compile per (rows, cache length, strategy) --
  def _cache_layout(self, rows: int, length: int):
    import jax
    import jax.numpy as jnp
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    abstract = jax.eval_shape(
        lambda p, x: self.model.apply({'params': p}, x, mutable=['cache'])[1]['cache'], self.params, ids)
    return abstract, _cache_shardings(abstract, self.mesh)

  def _compiled(self, rows: int, prompt_len: int, length: int, opts: DecodeOptions):
    import jax
    import jax.numpy as jnp

    from paxcli.runtime import sharding
    key = (rows, prompt_len, length, opts.sampling, opts.top_k or 0, bool(opts.beam_size))
    if key in self._fns:
      return self._fns[key]
    abstract, cache_sh = self._cache_layout(rows, length)
    model, rep = self.model, self.replicated
    batch_sh = sharding.batch_sharding(self.mesh)
    params_sh = self.setup.state_shardings['params']
    top_k, sampling, beam = opts.top_k or 0, opts.sampling, opts.beam_size

    def zeros():
      return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)

    def finish(logits_BxV, keys, t, temperature, top_p):
      if beam:
        logp = jax.nn.log_softmax(logits_BxV, axis=-1)
        return jax.lax.top_k(logp, beam)
      return select_tokens(logits_BxV, keys, t, temperature, top_k, top_p, sampling)

    def prefill(params, cache, ids_BxP, pos_BxP, keys, temperature, top_p):
      segment_ids = (pos_BxP >= 0).astype(jnp.int32)  # 0: left padding, never attended to
      logits, mut = model.apply({'params': params, 'cache': cache}, ids_BxP, segment_ids, jnp.maximum(pos_BxP, 0),
                                mutable=['cache'])
      return finish(logits[:, -1], keys, 0, temperature, top_p), mut['cache']

    def step(params, cache, tok_B, pos_B, keys, t, temperature, top_p):
      logits, mut = model.apply({'params': params, 'cache': cache}, tok_B[:, None], jnp.ones_like(tok_B)[:, None],
                                pos_B[:, None], mutable=['cache'])
      return finish(logits[:, 0], keys, t, temperature, top_p), mut['cache']

    # Compiled ahead of time, so that compilation is timed apart from decoding (compile_s).
    start = time.perf_counter()
    sds = jax.ShapeDtypeStruct
    params_abs = jax.tree.map(lambda x: sds(x.shape, x.dtype), self.params)
    ids_abs = sds((rows, prompt_len), jnp.int32)
    row_ints, keys_abs = sds((rows,), jnp.int32), sds((rows, 2), jnp.uint32)
    f32, i32 = sds((), jnp.float32), sds((), jnp.int32)
    fns = {
        'zeros': jax.jit(zeros, out_shardings=cache_sh).lower().compile(),
        'prefill': jax.jit(prefill, in_shardings=(params_sh, cache_sh, batch_sh, batch_sh, rep, rep, rep),
                           out_shardings=(rep, cache_sh), donate_argnums=(1,)).lower(
                               params_abs, abstract, ids_abs, ids_abs, keys_abs, f32, f32).compile(),
        'step': jax.jit(step, in_shardings=(params_sh, cache_sh, rep, rep, rep, rep, rep, rep),
                        out_shardings=(rep, cache_sh), donate_argnums=(1,)).lower(
                            params_abs, abstract, row_ints, row_ints, keys_abs, i32, f32, f32).compile(),
    }
    if beam:
      fns['reorder'] = jax.jit(_reorder, in_shardings=(cache_sh, rep), out_shardings=cache_sh,
                               donate_argnums=(0,)).lower(abstract, row_ints).compile()
    self.compile_seconds += time.perf_counter() - start
    self._fns[key] = fns
    return fns

  def _global(self, x: np.ndarray, sharding):
    import jax
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  # -- the loops --
  def run(self, prompts: Sequence[Prompt], opts: DecodeOptions, tokenizer=None, progress: Optional[Callable] = None,
          prompt_offset: int = 0) -> tuple[list[dict], dict]:
    """Decodes every prompt; returns (records in prompt then sample order, timing stats)."""
    from paxcli.runtime import sharding
    opts.check(self.vocab_size)
    check_lengths(prompts, self.max_seq_len, prompt_offset)
    per_prompt = opts.beam_size or opts.num_samples
    dp = sharding.data_parallel_size(self.mesh)
    want = opts.batch_size or 64
    prompts_per_batch = max(1, want // per_prompt)
    stats = {'prefill_tokens': 0, 'prefill_s': 0.0, 'decode_tokens': 0, 'decode_s': 0.0}
    compiled_before = self.compile_seconds
    records = []
    for start in range(0, len(prompts), prompts_per_batch):
      chunk = list(range(start, min(start + prompts_per_batch, len(prompts))))
      rows = len(chunk) * per_prompt
      rows = -(-rows // dp) * dp
      fn = self._beam_batch if opts.beam_size else self._sample_batch
      records += fn([prompts[i] for i in chunk], [i + prompt_offset for i in chunk], rows, opts, tokenizer, stats)
      if progress:
        progress(len(chunk))
    stats['compile_s'] = self.compile_seconds - compiled_before
    return records, stats

  def _prepare(self, prompts, rows_prompt, rows, opts):
    """Left-padded ids, positions (-1 at padding) and step budgets for `rows` rows."""
    lengths = [len(prompts[i].ids) for i in rows_prompt]
    plen = max(lengths)
    ids = np.zeros((rows, plen), np.int32)
    pos = np.full((rows, plen), -1, np.int32)
    budget = np.zeros((rows,), np.int64)
    for r in range(rows):
      p = prompts[rows_prompt[r % len(rows_prompt)]].ids if r < len(rows_prompt) else prompts[rows_prompt[0]].ids
      ids[r, plen - len(p):] = p
      pos[r, plen - len(p):] = np.arange(len(p))
      budget[r] = min(opts.max_decode_steps, self.max_seq_len - len(p))
    return ids, pos, budget, plen

  def _stop(self, tok: int, ids: list, tokenizer, opts, prompt_ids=()) -> Optional[str]:
    if len(ids) < opts.min_length:
      return None
    if tok in opts.eos_ids and not opts.ignore_eos:
      return 'eos'
    if opts.stop and tokenizer is not None:
      text = continuation_text(tokenizer, prompt_ids, ids)
      if any(s in text for s in opts.stop):
        return 'stop_string'
    return None

  def _sample_batch(self, prompts, indices, rows, opts, tokenizer, stats):
    import jax
    ns = opts.num_samples
    row_prompt = [p for p in range(len(prompts)) for _ in range(ns)]
    row_sample = [s for _ in range(len(prompts)) for s in range(ns)]
    ids, pos, budget, plen = self._prepare(prompts, row_prompt, rows, opts)
    steps = int(budget[:len(row_prompt)].max())
    fns = self._compiled(rows, plen, plen + steps, opts)
    base = jax.random.PRNGKey(opts.seed)
    keys = np.stack([np.asarray(jax.random.fold_in(jax.random.fold_in(base, indices[row_prompt[r]]),
                                                   row_sample[r])) if r < len(row_prompt) else np.zeros(2, np.uint32)
                     for r in range(rows)]).astype(np.uint32)
    temperature = np.float32(opts.temperature if opts.temperature is not None else 1.0)
    top_p = np.float32(opts.top_p if opts.top_p is not None else 1.0)
    from paxcli.runtime import sharding
    batch_sh = sharding.batch_sharding(self.mesh)
    t0 = time.perf_counter()
    cache = fns['zeros']()
    (tok, lp), cache = fns['prefill'](self.params, cache, self._global(ids, batch_sh), self._global(pos, batch_sh),
                                      keys, temperature, top_p)
    tok, lp = _host(tok), _host(lp)
    t1 = time.perf_counter()
    stats['prefill_tokens'] += int(sum(len(prompts[p].ids) for p in row_prompt))
    stats['prefill_s'] += t1 - t0
    n = len(row_prompt)
    out_ids = [[] for _ in range(n)]
    out_lp = [[] for _ in range(n)]
    reason: list = [None] * n
    lengths = np.array([len(prompts[p].ids) for p in row_prompt] + [0] * (rows - n))
    t = 0
    while True:
      for r in range(n):
        if reason[r] is None:
          out_ids[r].append(int(tok[r]))
          out_lp[r].append(float(lp[r]))
          reason[r] = self._stop(int(tok[r]), out_ids[r], tokenizer, opts, prompts[row_prompt[r]].ids)
          if reason[r] is None and len(out_ids[r]) >= budget[r]:
            reason[r] = 'max_steps'
      if all(reason):
        break
      t += 1
      ts = time.perf_counter()
      (tok, lp), cache = fns['step'](self.params, cache, np.asarray(tok), np.asarray(lengths + t - 1, np.int32),
                                     keys, np.int32(t), temperature, top_p)
      tok, lp = _host(tok), _host(lp)
      stats.setdefault('step_s', []).append(time.perf_counter() - ts)
    stats['decode_tokens'] += sum(len(x) for x in out_ids)
    stats['decode_s'] += time.perf_counter() - t1
    return [_record(prompts[row_prompt[r]], indices[row_prompt[r]], row_sample[r], out_ids[r], out_lp[r], reason[r],
                    tokenizer, opts) for r in range(n)]

  def _beam_batch(self, prompts, indices, rows, opts, tokenizer, stats):
    from paxcli.runtime import sharding
    k = opts.beam_size
    row_prompt = [p for p in range(len(prompts)) for _ in range(k)]
    ids, pos, budget, plen = self._prepare(prompts, row_prompt, rows, opts)
    steps = int(budget[:len(row_prompt)].max())
    fns = self._compiled(rows, plen, plen + steps, opts)
    batch_sh = sharding.batch_sharding(self.mesh)
    dummy = (np.zeros((rows, 2), np.uint32), np.float32(1), np.float32(1))
    t0 = time.perf_counter()
    cache = fns['zeros']()
    (vals, toks), cache = fns['prefill'](self.params, cache, self._global(ids, batch_sh),
                                         self._global(pos, batch_sh), *dummy)
    vals, toks = _host(vals), _host(toks)
    t1 = time.perf_counter()
    stats['prefill_tokens'] += int(sum(len(prompts[p].ids) for p in range(len(prompts))))
    stats['prefill_s'] += t1 - t0
    P = len(prompts)
    score = np.full((rows,), -np.inf)
    score[0:P * k:k] = 0.0                      # only beam 0 of each prompt is live at the start
    hist = [[] for _ in range(rows)]            # tokens of each live beam
    hist_lp = [[] for _ in range(rows)]
    done: list[list] = [[] for _ in range(P)]   # (norm score, score, ids, lps, reason)
    finished = [False] * P
    lengths = np.array([len(prompts[p].ids) for p in row_prompt] + [0] * (rows - P * k))
    decoded = 0
    t = 0
    while True:
      parents = np.arange(rows)
      new_tok = np.zeros((rows,), np.int32)
      for p in range(P):
        if finished[p]:
          continue
        base = p * k
        cand = [(score[base + b] + vals[base + b, j], base + b, int(toks[base + b, j]), float(vals[base + b, j]))
                for b in range(k) if np.isfinite(score[base + b]) for j in range(k)]
        cand.sort(key=lambda c: -c[0])
        chosen = cand[:k]
        new_hist, new_lp = [], []
        for slot, (s, parent, tok, lp) in enumerate(chosen):
          ids_ = hist[parent] + [tok]
          lps = hist_lp[parent] + [lp]
          why = self._stop(tok, ids_, tokenizer, opts, prompts[p].ids)
          if why is None and len(ids_) >= budget[base]:
            why = 'max_steps'
          if why:
            done[p].append((_length_norm(s, len(ids_), opts.length_penalty), s, ids_, lps, why))
            s = -np.inf
          new_hist.append(ids_)
          new_lp.append(lps)
          score[base + slot] = s
          parents[base + slot] = parent
          new_tok[base + slot] = tok
        for slot in range(len(chosen), k):
          score[base + slot] = -np.inf
          new_hist.append([])
          new_lp.append([])
        hist[base:base + k] = new_hist
        hist_lp[base:base + k] = new_lp
        decoded += len(chosen)
        if len(done[p]) >= k or not np.isfinite(score[base:base + k]).any():
          finished[p] = True
      if all(finished):
        break
      t += 1
      cache = fns['reorder'](cache, np.asarray(parents, np.int32))
      (vals, toks), cache = fns['step'](self.params, cache, np.asarray(new_tok), np.asarray(lengths + t - 1, np.int32),
                                        *dummy[:1], np.int32(t), *dummy[1:])
      vals, toks = _host(vals), _host(toks)
    stats['decode_tokens'] += decoded
    stats['decode_s'] += time.perf_counter() - t1
    records = []
    for p in range(P):
      ranked = sorted(done[p], key=lambda h: -h[0])[:k]
      for rank, (norm, s, ids_, lps, why) in enumerate(ranked):
        rec = _record(prompts[p], indices[p], 0, ids_, lps, why, tokenizer, opts)
        rec['beam_rank'] = rank
        rec['score'] = norm
        records.append(rec)
    return records


def _length_norm(score: float, length: int, alpha: float) -> float:
  return score / (((5.0 + length) / 6.0) ** alpha) if alpha else score


def _host(x) -> np.ndarray:
  """A replicated global array as numpy (works with several processes)."""
  return np.asarray(x.addressable_data(0))


def continuation_text(tokenizer, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
  """The text `ids` add after the prompt, so that prompt + continuation reads as the model wrote it.

  Sentencepiece drops the word-boundary space of a text's first piece ('▁the' alone decodes to
  'the'), so the continuation is decoded together with the prompt and the prompt's text cut off.
  """
  if not prompt_ids:
    return tokenizer.decode(ids)
  head = tokenizer.decode(list(prompt_ids))
  whole = tokenizer.decode(list(prompt_ids) + list(ids))
  return whole[len(head):] if whole.startswith(head) else tokenizer.decode(ids)


def _record(prompt: Prompt, index: int, sample: int, ids: list, lps: list, reason: str, tokenizer, opts) -> dict:
  text = None
  if tokenizer is not None:
    shown = ids[:-1] if reason == 'eos' else ids
    text = continuation_text(tokenizer, prompt.ids, shown)
    if reason == 'stop_string':
      cut = min((text.find(s) for s in opts.stop if s in text), default=-1)
      text = text[:cut] if cut >= 0 else text
  return {'prompt_index': index, 'sample_index': sample, 'prompt': prompt.text, 'prompt_ids': list(prompt.ids),
          'decoded': text, 'decoded_ids': ids, 'logprob': _finite(float(sum(lps))),
          'token_logprobs': [_finite(x) for x in lps], 'num_decoded_tokens': len(ids), 'stop_reason': reason}


def _finite(x: float) -> Optional[float]:
  """JSON has no NaN or Infinity: a non-finite figure is written as null."""
  return x if math.isfinite(x) else None


def full_recompute_greedy(model, params, prompt_ids: Sequence[int], steps: int) -> list[int]:
  """Reference: greedy tokens by re-running the model on the whole prefix for every token.

  The prefix is right-padded to MAX_SEQ_LEN (one compile); attention is causal, so the
  logits at its last token are those of the prefix alone.
  """
  import jax
  import jax.numpy as jnp
  length = model.max_seq_len
  fwd = jax.jit(lambda p, x, n: jnp.argmax(model.apply({'params': p}, x)[0, n - 1]))
  ids = list(prompt_ids)
  out = []
  for _ in range(steps):
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(ids)] = ids
    tok = int(fwd(params, padded, len(ids)))
    out.append(tok)
    ids.append(tok)
  return out


def teacher_forced_logprob(model, params, prompt_ids: Sequence[int], decoded_ids: Sequence[int]) -> float:
  import jax
  import jax.numpy as jnp
  ids = list(prompt_ids) + list(decoded_ids)
  logits = model.apply({'params': params}, jnp.asarray([ids[:-1]], jnp.int32))[0]
  logp = jax.nn.log_softmax(logits, axis=-1)
  p = len(prompt_ids)
  return float(sum(logp[p - 1 + i, t] for i, t in enumerate(decoded_ids)))


# ---- `pax decode` ------------------------------------------------------------------------------------


def output_path(job_dir: str, dataset: Optional[str], step: int) -> str:
  """Where the trainer writes its decodes at `step` (decode_interval_steps)."""
  import os
  return os.path.join(job_dir, 'decoder_out', dataset or 'prompts', f'decode_step{step}.jsonl')


def cli_output_path(job_dir: str, dataset: Optional[str], step: int) -> str:
  """`pax decode`'s default output: pax_decode_step<k>_<n>.jsonl with the first unused n, beside the
  trainer's decode_step<k>.jsonl and never replacing it or an earlier `pax decode`."""
  import os
  directory = os.path.dirname(output_path(job_dir, dataset, step))
  n = 1
  while os.path.lexists(os.path.join(directory, f'pax_decode_step{step}_{n}.jsonl')):
    n += 1
  return os.path.join(directory, f'pax_decode_step{step}_{n}.jsonl')


def check_output(path: str) -> None:
  """UserError now, before any decoding, if `path` cannot be written (its directory may be made later)."""
  import os
  import tempfile
  shown = shorten(path, 200)
  full = os.path.abspath(path)
  if os.path.isdir(full):
    raise UserError(f'--output {shown} is a directory; give a file name.')
  probe = os.path.dirname(full)
  while not os.path.lexists(probe):  # the nearest existing ancestor: its directories are made at the end
    probe = os.path.dirname(probe)
  if not os.path.isdir(probe):
    raise UserError(f'Cannot write {shown}: {probe} is not a directory.')
  try:
    with tempfile.TemporaryFile(dir=probe):
      pass
  except OSError as e:
    raise UserError(f'Cannot write {shown}: {probe} is not writable ({e.strerror}).') from None


def write_jsonl(path: str, records: Sequence[dict]) -> None:
  """Process 0 writes the whole file atomically (a reader never sees half of it)."""
  import json
  import os
  try:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      for r in records:
        f.write(json.dumps(r, allow_nan=False) + '\n')
    os.replace(tmp, path)
  except OSError as e:
    raise UserError(f'Cannot write {shorten(path, 200)}: {e.strerror}.') from None


def eos_ids_for(opts: DecodeOptions, tokenizer) -> DecodeOptions:
  if not opts.eos_ids and tokenizer is not None and tokenizer.eos_id is not None:
    return dataclasses.replace(opts, eos_ids=(tokenizer.eos_id,))
  return opts


def decode_command(resolved, job_dir: str, opts: DecodeOptions, texts=(), prompts_file=None, prompt_ids=None,
                   dataset=None, num_prompts: int = 8, step=None, use_checkpoint: bool = True, dtype=None,
                   output=None, json_out: bool = False) -> list[dict]:
  import json
  import sys

  import jax

  from paxcli.runtime import engine

  from paxcli.jobdir import restore

  from paxcli.jobdir import tokenizer as tok_lib
  from paxcli.cli import common
  setup = engine.build(resolved)
  decoder_check = Decoder(setup, None)  # a model that cannot decode fails before any reading
  if use_checkpoint:
    ckpt_step = restore.choose_step(job_dir, step, purpose='decode')
  tokenizer = tok_lib.load(job_dir, resolved.train_dataset())
  vocab = decoder_check.vocab_size
  if dataset:
    room = max(1, decoder_check.max_seq_len - opts.max_decode_steps)
    prompts = prompts_from_dataset(resolved, setup, dataset, tokenizer, num_prompts, room)
  else:
    prompts = prompts_from_args(texts, prompts_file, prompt_ids, tokenizer, vocab)
  check_lengths(prompts, decoder_check.max_seq_len)
  opts.check(vocab)  # --top-k, --beam-size against the vocabulary
  lead = jax.process_index() == 0
  if lead:  # an unwritable output is found before the decoding, not after it
    check_output(output or cli_output_path(job_dir, dataset, ckpt_step if use_checkpoint else 0))
  if opts.stop and tokenizer is None:
    raise UserError('--stop needs a tokenizer to turn tokens into text; this model has none (use --eos-id).')
  opts = eos_ids_for(opts, tokenizer)
  for e in opts.eos_ids:
    if not 0 <= e < vocab:
      raise UserError(f'--eos-id {e} is outside the vocabulary (0 to {vocab - 1}).')
  if use_checkpoint:
    flat = {k: repr(v) for k, v in resolved.flat().items()}
    # The latest checkpoint, if damaged, falls back to the newest intact one (named in a WARNING
    # line, nothing moved); a --step that is damaged is refused, naming it.
    restored = restore.restore(setup, job_dir, ckpt_step, params_only=True, flat_now=flat, action='decode',
                               fallback=step is None,
                               log=lambda m: common.console(stderr=True).print(m, highlight=False, markup=False,
                                                                                    soft_wrap=True))
    params, ckpt_step = restored.state['params'], restored.step
  else:
    ckpt_step = 0
    params = engine.init_state(setup, resolved.experiment.RANDOM_SEED)['params']
  decoder = Decoder(setup, params, dtype=dtype)
  err = common.console(stderr=True)
  show = lead and not json_out and sys.stderr.isatty()
  if show:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    with Progress(TextColumn('decoding'), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
      task = bar.add_task('decode', total=len(prompts))
      records, stats = decoder.run(prompts, opts, tokenizer, progress=lambda n: bar.advance(task, n))
  else:
    records, stats = decoder.run(prompts, opts, tokenizer)
  if not lead:
    return records
  path = output or cli_output_path(job_dir, dataset, ckpt_step)
  write_jsonl(path, records)
  if json_out:
    for r in records:
      sys.stdout.write(json.dumps(r) + '\n')
    sys.stdout.flush()
    return records
  common.console().print(results_table(records, ckpt_step, tokenizer is not None))
  err.print(speed_line(stats) + f'\nWrote {len(records)} results to {path}', highlight=False)
  return records


def speed_line(stats: dict) -> str:
  """Steady-state rates (compilation is timed apart: the decoder compiles ahead of time)."""
  pre = stats['prefill_tokens'] / max(stats['prefill_s'], 1e-9)
  dec = stats['decode_tokens'] / max(stats['decode_s'], 1e-9)
  return (f'prefill {stats["prefill_tokens"]} tokens at {pre:,.0f} tokens/s; decode {stats["decode_tokens"]} '
          f'tokens at {dec:,.0f} tokens/s; compilation {stats.get("compile_s", 0.0):.1f} s, not in the rates')


def results_table(records: Sequence[dict], step: int, has_text: bool):
  from rich.table import Table
  from rich.text import Text
  table = Table(title=f'Decoded at step {step}', show_lines=True)
  table.add_column('#', justify='right')
  table.add_column('prompt', overflow='fold', ratio=1)
  table.add_column('continuation', overflow='fold', ratio=2)
  table.add_column('logprob', justify='right')
  table.add_column('stop')
  for r in records:
    tag = f"{r['prompt_index']}" + (f".{r['beam_rank']}" if 'beam_rank' in r else
                                    f".{r['sample_index']}" if r['sample_index'] else '')
    prompt = r['prompt'] if has_text and r['prompt'] is not None else ' '.join(map(str, r['prompt_ids']))
    cont = r['decoded'] if has_text else ' '.join(map(str, r['decoded_ids']))
    table.add_row(tag, Text(prompt), Text(cont, style='bold'), f"{r['logprob']:.2f}", r['stop_reason'])
  return table


# ---- decoding while training --------------------------------------------------------------------------


class TrainDecoder:
  """task.train.decode_interval_steps: greedy continuations of decode_prompts at those steps,
  into TensorBoard text summaries (summaries/decode) and decoder_out/prompts/decode_step<k>.jsonl."""

  def __init__(self, resolved, setup, job_dir: str, train_cfg):
    import jax

    from paxcli.jobdir import tokenizer as tok_lib
    self.setup, self.job_dir = setup, job_dir
    self.tokenizer = tok_lib.load(job_dir, resolved.train_dataset())
    self.decoder = Decoder(setup, None)
    prompts = []
    for n, p in enumerate(train_cfg.decode_prompts):
      if isinstance(p, str):
        prompts.append(_text_prompt(p, self.tokenizer, f'DECODE_PROMPTS[{n}]'))
      else:
        prompts.append(Prompt([int(i) for i in p]))
    check_lengths(prompts, self.decoder.max_seq_len)
    for n, p in enumerate(prompts):
      if not p.ids or not all(0 <= i < self.decoder.vocab_size for i in p.ids):
        raise UserError(f'DECODE_PROMPTS[{n}] is empty or has ids outside the vocabulary.')
    self.prompts = prompts
    eos = (self.tokenizer.eos_id,) if self.tokenizer is not None and self.tokenizer.eos_id is not None else ()
    self.opts = DecodeOptions(max_decode_steps=train_cfg.decode_max_steps, eos_ids=eos)
    self.writer = None
    self.lead = jax.process_index() == 0

  def run(self, step: int, params) -> list[str]:
    import os
    self.decoder.params = params
    records, _ = self.decoder.run(self.prompts, self.opts, self.tokenizer)
    if not self.lead:
      return []
    write_jsonl(output_path(self.job_dir, None, step), records)
    if self.writer is None:
      from paxcli.jobdir.summaries import SummaryWriter
      self.writer = SummaryWriter(os.path.join(self.job_dir, 'summaries', 'decode'))
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
