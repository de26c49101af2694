"""Decoding with a KV cache: greedy, sampling (temperature, top-k, top-p) and beam search.

    decoder = Decoder(setup, params)                       # jitted prefill/step on setup's mesh
    records, stats = decoder.run(prompts, DecodeOptions(...))   # one dict per prompt and sample

The decoder knows the model only through paxcli.models.DecodingModel: `init_cache` and
`extend` (jitted here), `vocab_size` and `max_seq_len`.

How a batch is decoded: prompts are LEFT-PADDED to the longest prompt of the batch and
each row carries its own positions (0..p-1 for a prompt of length p, whatever the padding),
so that every row's last prompt token sits in the same cache slot and one cache index
serves the batch. Padding slots are marked invalid in the cache and never attended to:
a prompt gets the same tokens in any batch as alone. One forward pass over the padded
prompts fills the cache (prefill); each step then feeds one token per row at slot
P + t (P the padded prompt length) and position p + t.

The cache is the model's: its leaves name their logical axes, which map onto the mesh
by the activation table (the LM's [B, S, K, E] keys and values: batch over (replica,
data), kv heads over mdl); it is created on that sharding, and beam search moves rows
along each leaf's 'batch' axis.

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

import time
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.errors import UserError
from paxcli.layers.activation_sharding import ACTIVATION_RULES, spec_for
from paxcli.loops.decode.options import DecodeOptions
from paxcli.loops.decode.output import finite_or_none
from paxcli.loops.decode.prompts import Prompt, check_lengths
from paxcli.models.base import DecodingModel
from paxcli.runtime import sharding


def cache_layout(boxed, mesh):
  """(abstract cache, its shardings, each leaf's row axis or None) from `init_cache`'s boxed shapes.

  Logical axes map onto the mesh by the activation table (paxcli.layers.activation_sharding):
  the cache is what a forward pass holds, sharded as its activations are. A leaf without
  axis names is replicated and shared by all rows.
  """
  is_box = lambda x: isinstance(x, nn.LogicallyPartitioned)
  leaves, treedef = jax.tree.flatten(boxed, is_leaf=is_box)
  abstract, shardings, row_axes = [], [], []
  for leaf in leaves:
    value = leaf.value if is_box(leaf) else leaf
    names = tuple(leaf.names) if is_box(leaf) else (None,) * len(value.shape)
    abstract.append(value)
    shardings.append(NamedSharding(mesh, spec_for(names, value.shape, dict(mesh.shape), ACTIVATION_RULES)))
    row_axes.append(names.index('batch') if 'batch' in names else None)
  return treedef.unflatten(abstract), treedef.unflatten(shardings), row_axes


def rows_reorder(row_axes: Sequence[Optional[int]]) -> Callable:
  """(cache, rows_B) -> the cache whose row b is row rows_B[b] (beam search: each beam takes its
  parent's cache); `row_axes` as `cache_layout` gives them."""

  def reorder(cache, rows_B):
    leaves, treedef = jax.tree.flatten(cache)
    return treedef.unflatten([x if axis is None else x.take(rows_B, axis=axis) for x, axis in zip(leaves, row_axes)])

  return reorder


def select_tokens(logits_BxV, keys_Bx2, t, temperature, top_k: int, top_p, sampling: bool):
  """Next token per row and its model logprob. top_k is static (0: off); top_p, temperature traced."""
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


class Decoder:
  """Jitted prefill and step functions of a model on its mesh; `run` decodes prompts."""

  def __init__(self, setup, params, dtype: Optional[str] = None):
    self.setup = setup
    self.mesh = setup.mesh
    model = setup.model
    if not isinstance(model, DecodingModel):
      raise UserError(f"This experiment's model, a {type(model).__name__}, does not generate tokens: decoding "
                      'needs a paxcli.models.DecodingModel (init_cache and extend), such as the LanguageModel.')
    self.model = model.with_fprop_dtype(dtype) if dtype else model
    self.params = params
    self.max_seq_len = model.max_seq_len
    self.vocab_size = model.vocab_size
    self.replicated = NamedSharding(self.mesh, PartitionSpec())
    self._fns = {}
    self.compile_seconds = 0.0  # all compilations so far (each shape and strategy compiles once)

  # -- jitted pieces, one compile per (rows, cache length, strategy) --
  def _compiled(self, rows: int, prompt_len: int, length: int, opts: DecodeOptions):
    key = (rows, prompt_len, length, opts.sampling, opts.top_k or 0, bool(opts.beam_size))
    if key in self._fns:
      return self._fns[key]
    sds = jax.ShapeDtypeStruct
    params_abs = jax.tree.map(lambda x: sds(x.shape, x.dtype), self.params)
    model, rep = self.model, self.replicated
    abstract, cache_sh, row_axes = cache_layout(
        jax.eval_shape(lambda p: model.init_cache(p, rows, length), params_abs), self.mesh)
    batch_sh = sharding.batch_sharding(self.mesh)
    params_sh = self.setup.state_shardings['params']
    top_k, sampling, beam = opts.top_k or 0, opts.sampling, opts.beam_size

    def zeros(params):
      return nn.meta.unbox(model.init_cache(params, rows, length))

    def finish(logits_BxV, keys, t, temperature, top_p):
      if beam:
        logp = jax.nn.log_softmax(logits_BxV, axis=-1)
        return jax.lax.top_k(logp, beam)
      return select_tokens(logits_BxV, keys, t, temperature, top_k, top_p, sampling)

    def prefill(params, cache, ids_BxP, pos_BxP, keys, temperature, top_p):
      logits_BxPxV, cache = model.extend(params, cache, ids_BxP, pos_BxP)  # position -1: left padding
      return finish(logits_BxPxV[:, -1], keys, 0, temperature, top_p), cache

    def step(params, cache, tok_B, pos_B, keys, t, temperature, top_p):
      logits_Bx1xV, cache = model.extend(params, cache, tok_B[:, None], pos_B[:, None])
      return finish(logits_Bx1xV[:, 0], keys, t, temperature, top_p), cache

    # Compiled ahead of time, so that compilation is timed apart from decoding (compile_s).
    start = time.perf_counter()
    ids_abs = sds((rows, prompt_len), jnp.int32)
    row_ints, keys_abs = sds((rows,), jnp.int32), sds((rows, 2), jnp.uint32)
    f32, i32 = sds((), jnp.float32), sds((), jnp.int32)
    fns = {
        'zeros': jax.jit(zeros, in_shardings=(params_sh,), out_shardings=cache_sh).lower(params_abs).compile(),
        'prefill': jax.jit(prefill, in_shardings=(params_sh, cache_sh, batch_sh, batch_sh, rep, rep, rep),
                           out_shardings=(rep, cache_sh), donate_argnums=(1,)).lower(
                               params_abs, abstract, ids_abs, ids_abs, keys_abs, f32, f32).compile(),
        'step': jax.jit(step, in_shardings=(params_sh, cache_sh, rep, rep, rep, rep, rep, rep),
                        out_shardings=(rep, cache_sh), donate_argnums=(1,)).lower(
                            params_abs, abstract, row_ints, row_ints, keys_abs, i32, f32, f32).compile(),
    }
    if beam:
      fns['reorder'] = jax.jit(rows_reorder(row_axes), in_shardings=(cache_sh, rep), out_shardings=cache_sh,
                               donate_argnums=(0,)).lower(abstract, row_ints).compile()
    self.compile_seconds += time.perf_counter() - start
    self._fns[key] = fns
    return fns

  # -- the loops --
  def run(self, prompts: Sequence[Prompt], opts: DecodeOptions, tokenizer=None, progress: Optional[Callable] = None,
          prompt_offset: int = 0) -> tuple[list[dict], dict]:
    """Decodes every prompt; returns (records in prompt then sample order, timing stats)."""
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
    batch_sh = sharding.batch_sharding(self.mesh)
    t0 = time.perf_counter()
    cache = fns['zeros'](self.params)
    (tok, lp), cache = fns['prefill'](self.params, cache, sharding.from_host(ids, batch_sh),
                                      sharding.from_host(pos, batch_sh), keys, temperature, top_p)
    tok, lp = sharding.to_host(tok), sharding.to_host(lp)
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
      tok, lp = sharding.to_host(tok), sharding.to_host(lp)
      stats.setdefault('step_s', []).append(time.perf_counter() - ts)
    stats['decode_tokens'] += sum(len(x) for x in out_ids)
    stats['decode_s'] += time.perf_counter() - t1
    return [_record(prompts[row_prompt[r]], indices[row_prompt[r]], row_sample[r], out_ids[r], out_lp[r], reason[r],
                    tokenizer, opts) for r in range(n)]

  def _beam_batch(self, prompts, indices, rows, opts, tokenizer, stats):
    k = opts.beam_size
    row_prompt = [p for p in range(len(prompts)) for _ in range(k)]
    ids, pos, budget, plen = self._prepare(prompts, row_prompt, rows, opts)
    steps = int(budget[:len(row_prompt)].max())
    fns = self._compiled(rows, plen, plen + steps, opts)
    batch_sh = sharding.batch_sharding(self.mesh)
    dummy = (np.zeros((rows, 2), np.uint32), np.float32(1), np.float32(1))
    t0 = time.perf_counter()
    cache = fns['zeros'](self.params)
    (vals, toks), cache = fns['prefill'](self.params, cache, sharding.from_host(ids, batch_sh),
                                         sharding.from_host(pos, batch_sh), *dummy)
    vals, toks = sharding.to_host(vals), sharding.to_host(toks)
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
      vals, toks = sharding.to_host(vals), sharding.to_host(toks)
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
          'decoded': text, 'decoded_ids': ids, 'logprob': finite_or_none(float(sum(lps))),
          'token_logprobs': [finite_or_none(x) for x in lps], 'num_decoded_tokens': len(ids), 'stop_reason': reason}
