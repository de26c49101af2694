"""The device side of `pax serve`: a KV cache of rows that requests join and leave, and its compiled pieces.

    slots = Slots(setup, params, max_rows=16)
    slots.prefill(rows_state, ids, positions, targets, adapter)   # a prompt into the staging row
    slots.insert(row)                                              # the staging row becomes row `row`
    out = slots.decode(state, steps)                               # every row steps on device, `steps` at most
    slots.move(src, dst); slots.resize(rows, length)

It knows the model only through paxcli.models.DecodingModel, as `pax decode`'s Decoder does, and
reuses that decoder's pieces: the cache's layout and shardings (`cache_layout`), its growth with
empty slots (`grown`, `cache_length`) and the choice of a token (`select_tokens`).

The cache. Its leaves with a 'batch' axis hold one entry per row (keys, values, which slots are
real tokens, each row's own write index); the others (the LM's transposed logits table on a CPU)
are shared. A row of zeros is an empty row, as `init_cache` makes it. Each row writes at its own
index (the model's attention keeps one per row), so rows of different lengths and ages share
one batch. The cache holds `rows` rows of `length` slots, both powers of two (rows times the
data-parallel size): at most `max_rows` rows of the model's MAX_SEQ_LEN (rounded up to a power of
two), a bound fixed when the server starts; within it the cache is only as large as the rows in
use and their longest text need, since a step reads the whole cache (`resize` copies it into a
larger or smaller one, between steps). A model whose cache changes form with its length (a
sliding window shorter than the text: a ring) keeps the whole length throughout.

Prefill. A prompt is fed, a chunk at a time, into a one-row staging cache beside the rows (so
that decoding never touches it), then copied into a free row whole (`insert`). The first chunk
is left-padded to a power of two (a few compiled shapes), later ones are `chunk` tokens; the
prompt's last token is held back and fed by the first decoding step, which also chooses the
first new token (with the row's sampling settings and key, as every other token).

Decoding. `decode` runs up to `steps` steps of every row in one compiled loop on the device
(`jax.lax.while_loop`), each row feeding its last token at its own position and choosing the next
with its own settings (greedy or temperature, top-p, top-k; the key of token t of a row is
fold_in(row key, t), as `pax decode`'s); a row stops on device at an end-of-sequence id or when
its budget is spent. Rows not decoding (free, or finished) feed padding, which is never attended.

Adapters. With several LoRA adapters of one base, `adapters` holds each adapter weight stacked
([adapter, ...], adapter 0 all zeros: the base alone) and each row names its own; the step gathers
every row's A and B, which paxcli.layers.lora applies per row.

Compilation. Each piece compiles once per shape it meets (rows, length, prefill chunk), ahead of
time, timed apart (`compile_seconds`).
"""

from __future__ import annotations

import time
import warnings
from typing import Optional

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from paxcli.loops.decode.decoder import cache_layout, first_argmax, grown, select_tokens
from paxcli.runtime import sharding

FIRST_LENGTH = 128    # the shortest cache (slots per row)
MIN_CHUNK = 16        # the shortest first prefill chunk; chunks are powers of two up to `chunk`
TOP_LOGPROBS = 20     # alternatives a token's logprobs may list (OpenAI's bound for chat)


def pow2(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


class Slots:
  """The KV cache's rows and the model's compiled prefill and decode on them."""

  def __init__(self, setup, params, max_rows: int, chunk: int = 256, max_steps: int = 8,
               adapters: Optional[dict] = None, adapter_leads: Optional[dict] = None):
    self.mesh, self.model = setup.mesh, setup.model
    self.params, self.adapters, self.adapter_leads = params, adapters or {}, adapter_leads or {}
    self.params_sh = setup.state_shardings['params']
    self.dp = sharding.data_parallel_size(self.mesh)
    self.max_rows = -(-max_rows // self.dp) * self.dp
    self.max_seq_len = self.model.max_seq_len
    # Slots a row may fill: its prompt's padding (engine.chunk_sizes: at most a quarter chunk), prompt, new tokens.
    self.capacity = self.max_seq_len + max(MIN_CHUNK, chunk // 4)
    self.chunk, self.max_steps = chunk, max_steps
    self.rep = NamedSharding(self.mesh, PartitionSpec())
    self.vocab_size = self.model.vocab_size
    self.compile_seconds = 0.0
    self._layouts, self._fns = {}, {}
    self.fixed_length = self._form_changes()
    self.axes = self.layout(1, FIRST_LENGTH)[2]   # each cache leaf's row axis, None for the shared ones
    self.rows, self.length = self._bucket_rows(1), self._bucket_length(1)
    self.cache = self._compiled('zeros', self.rows, self.length)(self.params)
    self.staging, self.staging_length = None, 0

  # ---- shapes ---------------------------------------------------------------------------------------

  def _bucket_rows(self, n: int) -> int:
    return min(self.max_rows, self.dp * pow2(-(-max(n, 1) // self.dp)))

  def _bucket_length(self, n: int) -> int:
    if self.fixed_length:
      return self.capacity
    return min(self.capacity, max(FIRST_LENGTH, pow2(n)))

  def _form_changes(self) -> bool:
    """Whether the model's cache has another form at full length than at the shortest (a ring for a window
    shorter than the text): then it keeps the whole length, since `grown` only appends empty slots."""
    short, long = (jax.tree.structure(self._abstract(1, n)) for n in (FIRST_LENGTH, self.capacity))
    return short != long

  def _abstract(self, rows: int, length: int):
    sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)
    return jax.eval_shape(lambda p: self.model.init_cache(p, rows, length), sds)

  def layout(self, rows: int, length: int):
    """(abstract cache, its shardings, each leaf's row axis or None) for `rows` rows of `length` slots."""
    if (rows, length) not in self._layouts:
      self._layouts[rows, length] = cache_layout(self._abstract(rows, length), self.mesh)
    return self._layouts[rows, length]

  # ---- what the server calls ------------------------------------------------------------------------

  def resize(self, rows: int, length: int) -> None:
    """The cache with `rows` rows of `length` slots (powers of two within the bounds): rows and slots kept
    where both have them, empty ones appended."""
    rows, length = self._bucket_rows(rows), self._bucket_length(length)
    if (rows, length) != (self.rows, self.length):
      self.cache = self._compiled('resize', self.rows, self.length, rows, length)(self.cache)
      self.rows, self.length = rows, length

  def row_need(self, need_rows: int, need_length: int) -> tuple[int, int]:
    """The (rows, length) buckets that hold `need_rows` rows of `need_length` slots."""
    return self._bucket_rows(need_rows), self._bucket_length(need_length)

  def start_staging(self, prompt_slots: int) -> None:
    """A fresh staging row with room for `prompt_slots` slots."""
    length = self._bucket_length(prompt_slots)
    self.staging = self._compiled('staging_zeros', length)(self.params)
    self.staging_length = length

  def prefill(self, ids: np.ndarray, positions: np.ndarray, targets: np.ndarray, adapter: int,
              scores: bool) -> Optional[dict]:
    """Feeds one chunk ([1, C] ids at positions, -1 for padding) into the staging row. With `scores`, returns
    the log-probability of each of `targets` (the prompt's next tokens) and the TOP_LOGPROBS best, on the host."""
    c = ids.shape[1]
    fn = self._compiled('prefill', self.staging_length, c, scores)
    shared = self._shared(self.cache)
    out, self.staging = fn(self.params, self.adapters, np.asarray([adapter], np.int32), shared, self.staging,
                           ids, positions, targets)
    return jax.tree.map(np.asarray, out) if scores else None

  def insert(self, row: int) -> None:
    """Copies the staging row into row `row` (which must exist; the cache grows first if it is shorter)."""
    if self.staging_length > self.length:
      self.resize(self.rows, self.staging_length)
    fn = self._compiled('insert', self.rows, self.length, self.staging_length)
    self.cache = fn(self.cache, self.staging, np.int32(row))

  def move(self, src: int, dst: int) -> None:
    """Row `dst` becomes a copy of row `src` (compaction: the rows in use stay the first ones)."""
    self.cache = self._compiled('move', self.rows, self.length)(self.cache, np.int32(src), np.int32(dst))

  def decode(self, state: dict, steps: int, top: bool) -> dict:
    """Up to `steps` (at most max_steps) steps of every row on device; `state` (host arrays, one entry per row):
    tok, pos, live, count, budget, min_tokens, key, temperature, top_p, top_k, adapter, and `eos` ids
    (-1 padded). Returns the host's copy of the tokens chosen (ids, lps [rows, max_steps]; with `top`,
    top_ids, top_lps [rows, max_steps, TOP_LOGPROBS]), each row's count and why it stopped (`stopped`:
    0 going on, 1 an end-of-sequence id, 2 its budget), and `steps` run."""
    fn = self._compiled('decode', self.rows, self.length, top)
    out, self.cache = fn(self.params, self.adapters, self.cache, state, np.int32(min(steps, self.max_steps)))
    return jax.tree.map(np.asarray, out)

  # ---- compiled pieces ------------------------------------------------------------------------------

  def _compiled(self, what: str, *shape):
    key = (what,) + shape
    if key not in self._fns:
      begin = time.perf_counter()
      with warnings.catch_warnings():   # a resize reuses the buffers of the leaves that keep their shape
        warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
        self._fns[key] = getattr(self, '_lower_' + what)(*shape).compile()
      self.compile_seconds += time.perf_counter() - begin
    return self._fns[key]

  def _params_abs(self):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params)

  def _adapters_abs(self):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.adapters)

  def _adapters_sh(self):
    return jax.tree.map(lambda _: self.rep, self.adapters)

  def _shared(self, tree) -> list:
    """The leaves of a cache (or its layout) every row shares (no 'batch' axis), in tree order."""
    return [x for x, axis in zip(jax.tree.leaves(tree), self.axes) if axis is None]

  def _own(self, tree) -> list:
    """The leaves of a cache (or its layout) with one entry per row, in tree order."""
    return [x for x, axis in zip(jax.tree.leaves(tree), self.axes) if axis is not None]

  def _lower_zeros(self, rows: int, length: int):
    abstract, cache_sh, _ = self.layout(rows, length)
    zeros = lambda p: nn.meta.unbox(self.model.init_cache(p, rows, length))
    return jax.jit(zeros, in_shardings=(self.params_sh,), out_shardings=cache_sh).lower(self._params_abs())

  def _lower_staging_zeros(self, length: int):
    """The staging row: zeros for its own leaves (the shared ones come from the rows' cache)."""
    abstract, cache_sh, _ = self.layout(1, length)
    zeros = lambda p: [jnp.zeros(a.shape, a.dtype) for a in self._own(abstract)]
    return jax.jit(zeros, in_shardings=(self.params_sh,), out_shardings=self._own(cache_sh)).lower(self._params_abs())

  def _lower_resize(self, rows: int, length: int, new_rows: int, new_length: int):
    (abstract, cache_sh, _), (target, target_sh, _) = self.layout(rows, length), self.layout(new_rows, new_length)

    def resize(cache):   # rows past the new count are free, slots past it hold no text
      return grown(jax.tree.map(lambda x, t: x[tuple(slice(0, n) for n in t.shape)], cache, target), target)

    return jax.jit(resize, in_shardings=(cache_sh,), out_shardings=target_sh, donate_argnums=(0,)).lower(abstract)

  def _lower_insert(self, rows: int, length: int, staging_length: int):
    abstract, cache_sh, axes = self.layout(rows, length)
    small, small_sh, _ = self.layout(1, staging_length)
    own_abs, own_sh = self._own(small), self._own(small_sh)
    full = self.layout(1, length)[0]

    def insert(cache, staging, row):
      leaves, treedef = jax.tree.flatten(cache)
      own, out = iter(staging), []
      for x, axis, want in zip(leaves, axes, jax.tree.leaves(full)):
        if axis is None:
          out.append(x)
          continue
        one = grown(next(own), want)   # the staging row's empty slots, up to the rows' length
        out.append(jax.lax.dynamic_update_index_in_dim(x, jnp.squeeze(one, axis), row, axis))
      return treedef.unflatten(out)

    return jax.jit(insert, in_shardings=(cache_sh, own_sh, self.rep), out_shardings=cache_sh,
                   donate_argnums=(0,)).lower(abstract, own_abs, jax.ShapeDtypeStruct((), jnp.int32))

  def _lower_move(self, rows: int, length: int):
    abstract, cache_sh, axes = self.layout(rows, length)

    def move(cache, src, dst):
      leaves, treedef = jax.tree.flatten(cache)
      return treedef.unflatten([x if axis is None else jax.lax.dynamic_update_index_in_dim(
          x, jax.lax.dynamic_index_in_dim(x, src, axis, keepdims=False), dst, axis) for x, axis in zip(leaves, axes)])

    i32 = jax.ShapeDtypeStruct((), jnp.int32)
    return jax.jit(move, in_shardings=(cache_sh, self.rep, self.rep), out_shardings=cache_sh,
                   donate_argnums=(0,)).lower(abstract, i32, i32)

  def _with_rows(self, params, adapters, adapter_R):
    """The params with every row's own adapter (paxcli.layers.lora's per-row form), or as they are."""
    return adapter_rows(params, adapters, self.adapter_leads, adapter_R) if adapters else params

  def _lower_prefill(self, staging_length: int, c: int, scores: bool):
    small, small_sh, _ = self.layout(1, staging_length)
    shared_abs, shared_sh = self._shared(small), self._shared(small_sh)
    own_abs, own_sh = self._own(small), self._own(small_sh)
    treedef = jax.tree.structure(small)
    model, k = self.model, TOP_LOGPROBS

    def prefill(params, adapters, adapter_1, shared, own, ids_1xC, pos_1xC, targets_1xC):
      shared_it, own_it = iter(shared), iter(own)
      cache = treedef.unflatten([next(own_it) if axis is not None else next(shared_it) for axis in self.axes])
      logits_1xCxV, cache = model.extend(self._with_rows(params, adapters, adapter_1), cache, ids_1xC, pos_1xC)
      own = self._own(cache)
      if not scores:
        return {}, own
      logp = jax.nn.log_softmax(logits_1xCxV.astype(jnp.float32), axis=-1)
      top_lps, top_ids = jax.lax.top_k(logp, k)
      target_lp = jnp.take_along_axis(logp, targets_1xC[..., None], axis=-1)[..., 0]
      return {'lp': target_lp, 'top_lps': top_lps, 'top_ids': top_ids.astype(jnp.int32)}, own

    ints = jax.ShapeDtypeStruct((1, c), jnp.int32)
    return jax.jit(prefill, in_shardings=(self.params_sh, self._adapters_sh(), self.rep, shared_sh, own_sh, self.rep,
                                          self.rep, self.rep),
                   out_shardings=(self.rep, own_sh), donate_argnums=(4,)).lower(
                       self._params_abs(), self._adapters_abs(), jax.ShapeDtypeStruct((1,), jnp.int32), shared_abs,
                       own_abs, ints, ints, ints)

  def _lower_decode(self, rows: int, length: int, top: bool):
    abstract, cache_sh, _ = self.layout(rows, length)
    model, steps_max, k = self.model, self.max_steps, TOP_LOGPROBS

    def decode(params, adapters, cache, state, steps):
      params = self._with_rows(params, adapters, state['adapter'])
      out = {'ids': jnp.zeros((rows, steps_max), jnp.int32), 'lps': jnp.zeros((rows, steps_max), jnp.float32),
             'count': state['count'], 'stopped': jnp.where(state['live'], 0, 2).astype(jnp.int32)}
      if top:
        out['top_ids'] = jnp.zeros((rows, steps_max, k), jnp.int32)
        out['top_lps'] = jnp.zeros((rows, steps_max, k), jnp.float32)

      def go(carry):
        s, _, out, _ = carry
        return (s < steps) & jnp.any(out['stopped'] == 0)

      def one(carry):
        s, tok, out, cache = carry
        live = out['stopped'] == 0
        pos = jnp.where(live, state['pos'] + s, -1)
        logits_RxV, cache = model.extend(params, cache, tok[:, None], pos[:, None])
        logits_RxV = logits_RxV[:, 0].astype(jnp.float32)
        new, lp, logp = choose(logits_RxV, state, out['count'])
        out = dict(out, ids=out['ids'].at[:, s].set(new), lps=out['lps'].at[:, s].set(lp))
        if top:
          top_lps, top_ids = jax.lax.top_k(logp, k)
          out['top_ids'] = out['top_ids'].at[:, s].set(top_ids.astype(jnp.int32))
          out['top_lps'] = out['top_lps'].at[:, s].set(top_lps)
        count = out['count'] + live
        eos = jnp.any(new[:, None] == state['eos'], axis=-1) & (count >= state['min_tokens'])
        stopped = jnp.where(~live, out['stopped'], jnp.where(eos, 1, jnp.where(count >= state['budget'], 2, 0)))
        return s + 1, jnp.where(live, new, tok), dict(out, count=count, stopped=stopped), cache

      s, _, out, cache = jax.lax.while_loop(go, one, (jnp.int32(0), state['tok'], out, cache))
      return dict(out, steps=s), cache

    sds = jax.ShapeDtypeStruct
    row = lambda dtype, *more: sds((rows,) + more, dtype)
    state_abs = {'tok': row(jnp.int32), 'pos': row(jnp.int32), 'live': row(jnp.bool_), 'count': row(jnp.int32),
                 'budget': row(jnp.int32), 'min_tokens': row(jnp.int32), 'key': row(jnp.uint32, 2),
                 'temperature': row(jnp.float32), 'top_p': row(jnp.float32), 'top_k': row(jnp.int32),
                 'adapter': row(jnp.int32), 'eos': row(jnp.int32, EOS_IDS)}
    state_sh = jax.tree.map(lambda _: self.rep, state_abs)
    return jax.jit(decode, in_shardings=(self.params_sh, self._adapters_sh(), cache_sh, state_sh, self.rep),
                   out_shardings=(self.rep, cache_sh), donate_argnums=(2,)).lower(
                       self._params_abs(), self._adapters_abs(), abstract, state_abs, sds((), jnp.int32))


EOS_IDS = 4   # end-of-sequence ids a row may stop at (-1 pads the list)


def adapter_rows(params, adapters: dict, leads: dict, adapter_R):
  """`params` with each adapter weight replaced by every row's own: adapters['a/b/query_lora_a'] holds them all
  stacked on axis leads[name] (after the stacked layers' axes), adapter_R names each row's."""
  flat = traverse_util.flatten_dict(params, sep='/')
  for name, stack in adapters.items():
    flat[name] = jnp.take(stack, adapter_R, axis=leads[name])
  return traverse_util.unflatten_dict(flat, sep='/')


def choose(logits_RxV, state: dict, t_R):
  """Each row's next token, its model log-probability (temperature 1, no truncation, as `pax decode`
  reports) and the log-probabilities of all tokens: greedy where temperature is 0, else sampled with the
  row's temperature, top-k and top-p (decoder.select_tokens, key fold_in(row key, t))."""
  logp_RxV = jax.nn.log_softmax(logits_RxV, axis=-1)
  greedy = first_argmax(logits_RxV)
  sampling = state['temperature'] > 0
  sample = lambda: select_tokens(logits_RxV, state['key'], t_R, state['temperature'], state['top_k'],
                                 state['top_p'], True)[0]
  tok = jnp.where(sampling, jax.lax.cond(jnp.any(sampling), sample, lambda: greedy), greedy)
  return tok, jnp.take_along_axis(logp_RxV, tok[:, None], axis=-1)[:, 0], logp_RxV
