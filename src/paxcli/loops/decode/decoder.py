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
P + t (P the padded prompt length, a power of two: see `padded_length`) and position p + t.
Greedy and sampled batches run those steps in one compiled `jax.lax.while_loop` that records
each row's tokens, logprobs and stop (EOS, budget) on the device; the host comes in only every
STOP_CHECK_EVERY tokens when stop strings need the text, and when the cache must grow: a step
attends over the whole cache, so a batch starts with the power of two of slots its first steps
need (at least FIRST_CACHE) and the cache doubles between runs of the loop, each length compiled
once (`cache_length`, `grown`). Beam search steps from the host over a cache allocated whole.

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
import warnings
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


def select_tokens(logits_BxV, keys_Bx2, t, temperature, top_k, top_p, sampling: bool):
  """Next token per row and its model logprob. top_k is static (0: off) or one per row (`pax serve`: 0 off);
  top_p, temperature and t traced, one for all rows or one per row."""
  logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  if not sampling:
    tok_B = first_argmax(logits_BxV)
  else:
    rows = logits_BxV.shape[0]
    per_row = lambda v: jnp.broadcast_to(jnp.asarray(v), (rows,))
    x = logits_BxV / jnp.maximum(per_row(temperature), 1e-6)[:, None]
    neg = jnp.finfo(jnp.float32).min
    if isinstance(top_k, int):
      if top_k:
        kth_B = jax.lax.top_k(x, top_k)[0][:, -1]
        x = jnp.where(x >= kth_B[:, None], x, neg)
      sorted_BxV = jnp.sort(x, axis=-1)[:, ::-1]
    else:   # the k-th largest from the sort itself (the same cut as top_k's)
      sorted_BxV = jnp.sort(x, axis=-1)[:, ::-1]
      k_B = per_row(top_k)
      kth_B = jnp.take_along_axis(sorted_BxV, jnp.clip(k_B - 1, 0, x.shape[-1] - 1)[:, None], axis=-1)[:, 0]
      kth_B = jnp.where(k_B > 0, kth_B, -jnp.inf)
      x = jnp.where(x >= kth_B[:, None], x, neg)
      sorted_BxV = jnp.where(sorted_BxV >= kth_B[:, None], sorted_BxV, neg)
    probs = jax.nn.softmax(sorted_BxV, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs     # mass of the tokens ranked above each token
    keep = before < per_row(top_p)[:, None]
    cutoff_B = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1)
    x = jnp.where(x >= cutoff_B[:, None], x, neg)

    def draw(key, row, t_row):
      return jax.random.categorical(jax.random.fold_in(key, t_row), row)

    tok_B = jax.vmap(draw)(keys_Bx2, x, per_row(t))
  tok_B = tok_B.astype(jnp.int32)
  return tok_B, jnp.take_along_axis(logp_BxV, tok_B[:, None], axis=-1)[:, 0]


@jax.jit
def _row_keys(base, prompts_R, samples_R):
  """fold_in(fold_in(base, prompt), sample) of every row at once: the keys one fold at a time took half of a
  GRPO rollout of one-token completions (two eager dispatches a row)."""
  return jax.vmap(lambda p, s: jax.random.fold_in(jax.random.fold_in(base, p), s))(prompts_R, samples_R)


def first_argmax(x_BxV):
  """jnp.argmax over the last axis (the first index of the largest value; of the first NaN if any) as two
  plain reductions: XLA's CPU argmax, one reduction over (value, index) pairs, took a tenth of a decoding
  step at batch 16 with a 32k vocabulary."""
  hit = (x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)) | jnp.isnan(x_BxV)
  return jnp.min(jnp.where(hit, jnp.arange(x_BxV.shape[-1], dtype=jnp.int32), x_BxV.shape[-1]), axis=-1)


FIRST_CACHE = 128   # the shortest KV cache greedy and sampled batches decode with (cache_length)


def cache_length(slots: int, length: int, first: int = 0) -> int:
  """The KV cache a batch decodes with while its steps fill `slots` slots: the next power of two, at least
  `first` (the decoder's, FIRST_CACHE by default), at most the whole `length`. Every step attends over the
  whole cache, so early steps should not read slots no token has reached: the device loop is compiled for
  each length a batch reaches, and the cache grows between its runs (`grown`)."""
  return min(length, max(first, 1 << (slots - 1).bit_length()))


def grown(cache, abstract):
  """`cache` with its leaves zero-padded at the end to the shapes of `abstract`, the same model's cache for more
  slots (DecodingModel.init_cache): the axes that grow with the length gain empty slots, the rest stay."""
  def pad(x, target):
    return x if x.shape == target.shape else jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, target.shape)])

  return jax.tree.map(pad, cache, abstract)


def _quietly_donating(lower: Callable, *args):
  """lower(*args) without JAX's warning that some donated buffers were not reused: a cache's growth reuses those
  of the leaves that keep their shape (the others cannot be)."""
  with warnings.catch_warnings():
    warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
    return lower(*args)


def padded_length(longest: int, room: int) -> int:
  """The prompt length a batch is left-padded to: a power of two (at least 16), so that prompts of many
  lengths share a few compiled shapes, but no longer than `room` (what MAX_SEQ_LEN leaves beside the
  new tokens) unless the longest prompt is. Padding is never attended to: it changes no token."""
  return max(longest, min(max(16, 1 << (longest - 1).bit_length()), room))


class Decoder:
  """Jitted prefill and step functions of a model on its mesh; `run` decodes prompts."""

  def __init__(self, setup, params, dtype: Optional[str] = None, first_cache: int = FIRST_CACHE):
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
    self.first_cache = first_cache   # the shortest cache greedy and sampled batches start with (cache_length)

  @property
  def params(self):
    """The params as given (a checkpoint's layout). The decoder runs `_run_params`: these prepared once by
    the model's `decoding_params` (the LM's joined products on a CPU), so that references computed from
    `params` check the prepared products."""
    return self._params

  @params.setter
  def params(self, params):
    self._params, self._run_params, self._params_sh = params, None, self.setup.state_shardings['params']
    if params is not None:
      self._run_params, self._params_sh = self.model.decoding_params(params, self._params_sh)

  def _lazy(self, fns, what: str, *args):
    """fns[what][args]: a piece compiled on first use (the device loop for a cache length, a cache's growth),
    its compile timed apart."""
    if args not in fns[what]:
      begin = time.perf_counter()
      fns[what][args] = fns['lower_' + what](*args).compile()
      self.compile_seconds += time.perf_counter() - begin
    return fns[what][args]

  # -- jitted pieces, one compile per (rows, padded prompt length, cache length, strategy) --
  def _compiled(self, rows: int, prompt_len: int, length: int, opts: DecodeOptions):
    key = (rows, prompt_len, length, opts.sampling, opts.top_k or 0, bool(opts.beam_size), len(_eos(opts)))
    if key in self._fns:
      return self._fns[key]
    sds = jax.ShapeDtypeStruct
    params_abs = jax.tree.map(lambda x: sds(x.shape, x.dtype), self._run_params)
    model, rep = self.model, self.replicated
    layouts = {}

    def layout(slots: int):
      """(abstract cache, its shardings, row axes) of a cache of `slots` slots."""
      if slots not in layouts:
        layouts[slots] = cache_layout(jax.eval_shape(lambda p: model.init_cache(p, rows, slots), params_abs), self.mesh)
      return layouts[slots]

    batch_sh = sharding.batch_sharding(self.mesh)
    params_sh = self._params_sh
    top_k, sampling, beam = opts.top_k or 0, opts.sampling, opts.beam_size
    steps = length - prompt_len
    # Greedy and sampled rows start with the cache their first steps need and grow it (cache_length); beam
    # search, stepping from the host, allocates it whole.
    first = length if beam else cache_length(prompt_len + 1, length, self.first_cache)
    abstract, cache_sh, row_axes = layout(first)

    def zeros(params):
      return nn.meta.unbox(model.init_cache(params, rows, first))

    def finish(logits_BxV, keys, t, temperature, top_p):
      if beam:
        logp = jax.nn.log_softmax(logits_BxV, axis=-1)
        return jax.lax.top_k(logp, beam)
      return select_tokens(logits_BxV, keys, t, temperature, top_k, top_p, sampling)

    def prefill(params, cache, ids_BxP, pos_BxP, keys, temperature, top_p):
      logits_Bx1xV, cache = model.extend(params, cache, ids_BxP, pos_BxP, last_only=True)  # position -1: padding
      return finish(logits_Bx1xV[:, -1], keys, 0, temperature, top_p), cache

    def step(params, cache, tok_B, pos_B, keys, t, temperature, top_p):
      logits_Bx1xV, cache = model.extend(params, cache, tok_B[:, None], pos_B[:, None])
      return finish(logits_Bx1xV[:, 0], keys, t, temperature, top_p), cache

    def start(params, cache, ids_BxP, pos_BxP, keys, temperature, top_p, stops):
      """Prefill, then the first new token recorded (`Progress`)."""
      (tok_B, lp_B), cache = prefill(params, cache, ids_BxP, pos_BxP, keys, temperature, top_p)
      return _record(_progress(rows, steps), tok_B, lp_B, 0, stops), cache

    def run_on(params, cache, state, keys, temperature, top_p, stops, until):
      """Steps on device until every row has stopped or token `until` is recorded: no host in between."""
      def go(carry):
        state, _ = carry
        return (state['t'] < until) & jnp.any(state['reason'] == LIVE)

      def one(carry):
        state, cache = carry
        t = state['t'] + 1
        (tok_B, lp_B), cache = step(params, cache, state['tok'], stops['lengths'] + t - 1, keys, t, temperature,
                                    top_p)
        return _record(state, tok_B, lp_B, t, stops), cache

      return jax.lax.while_loop(go, one, (state, cache))

    # Compiled ahead of time, so that compilation is timed apart from decoding (compile_s).
    begin = time.perf_counter()
    ids_abs = sds((rows, prompt_len), jnp.int32)
    row_ints, keys_abs = sds((rows,), jnp.int32), sds((rows, 2), jnp.uint32)
    f32, i32 = sds((), jnp.float32), sds((), jnp.int32)
    fns = {'zeros': jax.jit(zeros, in_shardings=(params_sh,), out_shardings=cache_sh).lower(params_abs).compile()}
    if beam:
      fns['prefill'] = jax.jit(prefill, in_shardings=(params_sh, cache_sh, batch_sh, batch_sh, rep, rep, rep),
                               out_shardings=(rep, cache_sh), donate_argnums=(1,)).lower(
                                   params_abs, abstract, ids_abs, ids_abs, keys_abs, f32, f32).compile()
      fns['step'] = jax.jit(step, in_shardings=(params_sh, cache_sh, rep, rep, rep, rep, rep, rep),
                            out_shardings=(rep, cache_sh), donate_argnums=(1,)).lower(
                                params_abs, abstract, row_ints, row_ints, keys_abs, i32, f32, f32).compile()
      fns['reorder'] = jax.jit(rows_reorder(row_axes), in_shardings=(cache_sh, rep), out_shardings=cache_sh,
                               donate_argnums=(0,)).lower(abstract, row_ints).compile()
    else:
      stops_abs = {'lengths': row_ints, 'budget': row_ints, 'min_length': i32,
                   'eos': sds((len(_eos(opts)),), jnp.int32)}
      state_abs = jax.eval_shape(lambda: _progress(rows, steps))
      fns['start'] = jax.jit(start, in_shardings=(params_sh, cache_sh, batch_sh, batch_sh, rep, rep, rep, rep),
                             out_shardings=(rep, cache_sh), donate_argnums=(1,)).lower(
                                 params_abs, abstract, ids_abs, ids_abs, keys_abs, f32, f32, stops_abs).compile()
      # Per cache length, compiled as a batch reaches it (`_lazy`): the device loop, and the growth to it.
      fns['run_on'], fns['grow'] = {}, {}
      fns['lower_run_on'] = lambda slots: jax.jit(
          run_on, in_shardings=(params_sh, layout(slots)[1], rep, rep, rep, rep, rep, rep),
          out_shardings=(rep, layout(slots)[1]), donate_argnums=(1, 2)).lower(
              params_abs, layout(slots)[0], state_abs, keys_abs, f32, f32, stops_abs, i32)
      fns['lower_grow'] = lambda slots, more: _quietly_donating(jax.jit(
          lambda cache: grown(cache, layout(more)[0]), in_shardings=(layout(slots)[1],),
          out_shardings=layout(more)[1], donate_argnums=(0,)).lower, layout(slots)[0])
    self.compile_seconds += time.perf_counter() - begin
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
    plen = padded_length(max(lengths), self.max_seq_len - min(opts.max_decode_steps, self.max_seq_len - min(lengths)))
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
    """Greedy or sampled rows, decoded on device: after the prefill one compiled loop runs the steps
    and records each row's tokens and stop (EOS, budget) without the host; stop strings need the
    text, so with them the loop returns every STOP_CHECK_EVERY tokens for the host to look."""
    ns = opts.num_samples
    row_prompt = [p for p in range(len(prompts)) for _ in range(ns)]
    row_sample = [s for _ in range(len(prompts)) for s in range(ns)]
    n = len(row_prompt)
    ids, pos, budget, plen = self._prepare(prompts, row_prompt, rows, opts)
    budget[n:] = 0   # rows past the prompts (the data-parallel round-up) stop at once
    steps = int(budget[:n].max())
    fns = self._compiled(rows, plen, plen + steps, opts)
    keys = np.zeros((rows, 2), np.uint32)
    keys[:n] = _row_keys(jax.random.PRNGKey(opts.seed), np.array([indices[p] for p in row_prompt], np.uint32),
                         np.array(row_sample, np.uint32))
    temperature = np.float32(opts.temperature if opts.temperature is not None else 1.0)
    top_p = np.float32(opts.top_p if opts.top_p is not None else 1.0)
    lengths = np.array([len(prompts[p].ids) for p in row_prompt] + [0] * (rows - n), np.int32)
    stops = {'lengths': lengths, 'budget': budget.astype(np.int32), 'min_length': np.int32(opts.min_length),
             'eos': np.asarray(_eos(opts), np.int32)}
    batch_sh = sharding.batch_sharding(self.mesh)
    t0 = time.perf_counter()
    cache = fns['zeros'](self._run_params)
    state, cache = fns['start'](self._run_params, cache, sharding.from_host(ids, batch_sh),
                                sharding.from_host(pos, batch_sh), keys, temperature, top_p, stops)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    stats['prefill_tokens'] += int(sum(len(prompts[p].ids) for p in row_prompt))
    stats['prefill_s'] += t1 - t0
    check_text = bool(opts.stop) and tokenizer is not None
    every = STOP_CHECK_EVERY if check_text else steps
    checked = np.zeros(rows, np.int64)   # tokens of each row the host has read for stop strings
    compiled_before, t, slots = self.compile_seconds, 0, cache_length(plen + 1, plen + steps, self.first_cache)
    while True:
      if plen + t + 1 > slots:   # the next step's slot is past the cache: grow it
        more = cache_length(plen + t + 1, plen + steps, self.first_cache)
        cache, slots = self._lazy(fns, 'grow', slots, more)(cache), more
      until = min(steps - 1, t + every, slots - plen)   # step t fills slot plen + t - 1
      state, cache = self._lazy(fns, 'run_on', slots)(self._run_params, cache, state, keys, temperature, top_p,
                                                      stops, np.int32(until))
      host = {k: np.array(sharding.to_host(v)) for k, v in state.items()}   # writable: stop strings
      t = int(host['t'])
      if check_text and self._stop_strings(host, checked, n, prompts, row_prompt, tokenizer, opts):
        state = {**state, 'reason': host['reason'], 'count': host['count']}
      if not (host['reason'][:n] == LIVE).any():
        break
    stats['decode_tokens'] += int(host['count'][:n].sum())
    stats['decode_s'] += time.perf_counter() - t1 - (self.compile_seconds - compiled_before)
    return [_row_record(prompts[row_prompt[r]], indices[row_prompt[r]], row_sample[r], host, r, tokenizer, opts)
            for r in range(n)]

  def _stop_strings(self, host, checked, n, prompts, row_prompt, tokenizer, opts) -> bool:
    """Ends rows whose text reached a stop string among the tokens recorded since the last look (in
    `host`, in place); True when one did. EOS on the same token wins, as in `_stop`."""
    changed = False
    for r in range(n):
      end = int(host['count'][r])
      for i in range(int(checked[r]), end):
        if i + 1 < opts.min_length or (i + 1 == end and host['reason'][r] == EOS):
          continue
        text = continuation_text(tokenizer, prompts[row_prompt[r]].ids, host['ids'][r, :i + 1].tolist())
        if any(s in text for s in opts.stop):
          host['reason'][r], host['count'][r] = STOP_STRING, i + 1
          changed = True
          break
      checked[r] = host['count'][r]
    return changed

  def _beam_batch(self, prompts, indices, rows, opts, tokenizer, stats):
    k = opts.beam_size
    row_prompt = [p for p in range(len(prompts)) for _ in range(k)]
    ids, pos, budget, plen = self._prepare(prompts, row_prompt, rows, opts)
    steps = int(budget[:len(row_prompt)].max())
    fns = self._compiled(rows, plen, plen + steps, opts)
    batch_sh = sharding.batch_sharding(self.mesh)
    dummy = (np.zeros((rows, 2), np.uint32), np.float32(1), np.float32(1))
    t0 = time.perf_counter()
    cache = fns['zeros'](self._run_params)
    (vals, toks), cache = fns['prefill'](self._run_params, cache, sharding.from_host(ids, batch_sh),
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
      (vals, toks), cache = fns['step'](self._run_params, cache, np.asarray(new_tok),
                                        np.asarray(lengths + t - 1, np.int32), *dummy[:1], np.int32(t), *dummy[1:])
      vals, toks = sharding.to_host(vals), sharding.to_host(toks)
    stats['decode_tokens'] += decoded
    stats['decode_s'] += time.perf_counter() - t1
    records = []
    for p in range(P):
      ranked = sorted(done[p], key=lambda h: -h[0])[:k]
      for rank, (norm, s, ids_, lps, why) in enumerate(ranked):
        rec = _record_of(prompts[p], indices[p], 0, ids_, lps, why, tokenizer, opts)
        rec['beam_rank'] = rank
        rec['score'] = norm
        records.append(rec)
    return records


# Why a row stopped, as the device loop records it (0: still decoding).
LIVE, EOS, MAX_STEPS, STOP_STRING = 0, 1, 2, 3
REASONS = {EOS: 'eos', MAX_STEPS: 'max_steps', STOP_STRING: 'stop_string'}
STOP_CHECK_EVERY = 16   # tokens the device loop decodes between the host's looks for stop strings


def _eos(opts: DecodeOptions) -> tuple:
  """The ids that end a row (none with ignore_eos)."""
  return () if opts.ignore_eos else tuple(opts.eos_ids)


def _progress(rows: int, steps: int) -> dict:
  """The device loop's record of a batch: the last token `t` recorded, each row's tokens, model
  logprobs, count and stop reason; `tok` the tokens to feed next."""
  return {'t': jnp.int32(-1), 'tok': jnp.zeros((rows,), jnp.int32), 'ids': jnp.zeros((rows, steps), jnp.int32),
          'lps': jnp.zeros((rows, steps), jnp.float32), 'count': jnp.zeros((rows,), jnp.int32),
          'reason': jnp.full((rows,), LIVE, jnp.int32)}


def _record(state: dict, tok_B, lp_B, t, stops: dict) -> dict:
  """`state` with new token t of every row still decoding, and the rows it stops: EOS (from
  min_length on), else the row's budget spent. Stopped rows keep what they had."""
  live = state['reason'] == LIVE
  n = t + 1
  eos = jnp.any(tok_B[:, None] == stops['eos'][None, :], axis=-1) & (n >= stops['min_length'])
  reason = jnp.where(eos, EOS, jnp.where(n >= stops['budget'], MAX_STEPS, LIVE))
  return {'t': jnp.asarray(t, jnp.int32), 'tok': tok_B,
          'ids': jax.lax.dynamic_update_index_in_dim(state['ids'], tok_B, t, axis=1),
          'lps': jax.lax.dynamic_update_index_in_dim(state['lps'], lp_B, t, axis=1),
          'count': jnp.where(live, n, state['count']), 'reason': jnp.where(live, reason, state['reason'])}


def _row_record(prompt: Prompt, index: int, sample: int, host: dict, r: int, tokenizer, opts) -> dict:
  count = int(host['count'][r])
  return _record_of(prompt, index, sample, host['ids'][r, :count].tolist(), host['lps'][r, :count].tolist(),
                    REASONS[int(host['reason'][r])], tokenizer, opts)


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


def _record_of(prompt: Prompt, index: int, sample: int, ids: list, lps: list, reason: str, tokenizer, opts) -> dict:
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
