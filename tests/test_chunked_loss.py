"""The loss whose logits never exist whole (#34 item 3): head_lm_loss makes the logits a chunk of
positions at a time (LOSS_CHUNK_TOKENS) with a custom backward that remakes each chunk. Same loss,
metrics and gradients as the whole-logits fused loss (1e-6 relative), the final soft cap inside it, its
compiled memory free of a [B, L, V] array, and the train step, eval and score using it on 8 fake devices."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import pax_main
from paxcli import config
from paxcli.loops.train import step_gradients
from paxcli.models.losses import Head, chunk_length, fused_lm_loss, head_lm_loss, soft_cap, token_scores
from paxcli.runtime import engine, sharding


def _relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _case(tied: bool, cap: float, b=4, l=16, d=8, vocab=96):
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (b, l, d))
  w = jax.random.normal(keys[1], (vocab, d) if tied else (d, vocab))
  bias = 0.1 * jax.random.normal(keys[2], (vocab,))
  head = Head(w, bias, tied=tied, dtype=jnp.float32, table_dtype=jnp.float32, cap=cap)
  labels = jax.random.randint(keys[3], (b, l), 0, vocab)
  weights = (jax.random.uniform(keys[4], (b, l)) > 0.2).astype(jnp.float32)
  return x, head, labels, weights


@pytest.mark.parametrize('tied,cap', [(True, 0.0), (False, 0.0), (True, 5.0)])
def test_chunked_loss_equals_the_whole_loss_value_metrics_and_gradients(tied, cap):
  x, head, labels, weights = _case(tied, cap)
  assert chunk_length(4, 16, 16) == 4   # 4 rows x 4 positions a chunk: 4 chunks

  def whole(x, head):
    return fused_lm_loss(head.logits(x), labels, weights)

  def chunked(x, head):
    return head_lm_loss(x, head, labels, weights, chunk_tokens=16)

  (ref, ref_sums), ref_grads = jax.jit(jax.value_and_grad(whole, argnums=(0, 1), has_aux=True))(x, head)
  (new, new_sums), new_grads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(x, head)
  assert _relative(new, ref) <= 1e-6
  for key in ref_sums:
    assert _relative(new_sums[key], ref_sums[key]) <= 1e-6, key
  for a, b in zip(jax.tree.leaves(new_grads), jax.tree.leaves(ref_grads)):
    assert _relative(a, b) <= 1e-6
  # the soft cap is inside: the capped logits' loss, not the raw ones'
  if cap:
    raw = Head(head.w, head.bias, tied=tied, dtype=jnp.float32, table_dtype=jnp.float32)
    assert not np.isclose(float(new), float(fused_lm_loss(raw.logits(x), labels, weights)[0]))
    np.testing.assert_allclose(head.logits(x), soft_cap(raw.logits(x), cap), rtol=1e-6)
    assert float(jnp.abs(head.logits(x)).max()) < cap


def test_token_scores_equal_the_whole_log_softmax():
  x, head, labels, _ = _case(False, 3.0)
  logp, greedy = jax.jit(lambda x, h: token_scores(x, h, labels, chunk_tokens=8))(x, head)
  full = jax.nn.log_softmax(head.logits(x), axis=-1)
  np.testing.assert_allclose(logp, jnp.take_along_axis(full, labels[..., None], -1)[..., 0], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(greedy, jnp.argmax(full, -1) == labels)


def test_the_chunked_loss_memory_does_not_grow_with_the_length():
  """XLA's plan for value and gradients at a fixed LOSS_CHUNK_TOKENS: the whole loss's temporaries are at
  least one float32 [B, L, V] array and grow with L; the chunked one's are a few chunks' worth, the same
  at 4 times the length."""
  b, d, vocab, chunk = 4, 32, 4096, 128

  def temp(fn, l):
    x, head, labels, weights = _case(True, 0.0, b, l, d, vocab)
    step = jax.jit(jax.value_and_grad(lambda x, h: fn(x, h, labels, weights)[0], argnums=(0, 1)))
    return step.lower(x, head).compile().memory_analysis().temp_size_in_bytes

  whole = lambda x, h, y, w: fused_lm_loss(h.logits(x), y, w)
  chunked = lambda x, h, y, w: head_lm_loss(x, h, y, w, chunk_tokens=chunk)
  short, long = temp(chunked, 128), temp(chunked, 512)
  assert temp(whole, 512) >= b * 512 * vocab * 4
  assert long < 1.1 * short, (short, long)
  assert long < 8 * chunk * vocab * 4   # a few [chunk, V] float32 arrays (logits, probabilities, their gradient)


# ---- in the model, on 8 fake devices ---------------------------------------------------------------

EXP = 'lm_cloud.LmCloudSpmdTest'
TINY = ['NUM_LAYERS=2', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=64',
        'MAX_SEQ_LEN=16', 'USE_REPEATED_LAYER=True', 'PERCORE_BATCH_SIZE=2', 'ICI_MESH_SHAPE=[1,4,2]',
        'SOFTMAX_CAP_LOGITS=4.0']


def _batch(rows=16, length=16):
  rng = np.random.default_rng(0)
  return {'ids': rng.integers(0, 64, (rows, length)).astype(np.int32),
          'labels': rng.integers(0, 64, (rows, length)).astype(np.int32),
          'weights': (rng.random((rows, length)) > 0.2).astype(np.float32),
          'segment_ids': np.ones((rows, length), np.int32),
          'positions': np.tile(np.arange(length, dtype=np.int32), (rows, 1))}


def test_the_train_step_gives_the_same_loss_and_gradients_chunked_and_whole():
  """2 rows per data shard x 16 positions: LOSS_CHUNK_TOKENS=8 makes 4 chunks of 4 positions, under the
  activation sharding (vocab over `mdl`) in the forward and in the custom backward."""
  done = {}
  for chunk in (0, 8):
    setup = engine.build(config.resolve(EXP, TINY + [f'LOSS_CHUNK_TOKENS={chunk}']))
    state = engine.init_state(setup, 0)
    batch = sharding.to_global(_batch(), sharding.batch_sharding(setup.mesh), setup.global_batch)
    done[chunk] = jax.device_get(jax.jit(step_gradients(setup, 0))(state, batch))
  whole, chunked = done[0], done[8]
  assert _relative(chunked.loss, whole.loss) <= 1e-6
  assert _relative(chunked.metrics['accuracy'][0], whole.metrics['accuracy'][0]) <= 1e-6
  flat = dict(jax.tree_util.tree_flatten_with_path(whole.grads)[0])
  for path, g in jax.tree_util.tree_flatten_with_path(chunked.grads)[0]:
    if np.linalg.norm(flat[path]) > 1e-6:   # the key bias's is zero but for rounding
      assert _relative(g, flat[path]) <= 1e-6, jax.tree_util.keystr(path)


def test_eval_and_score_use_it_and_give_the_same_numbers(tmp_path, capsys):
  requests = tmp_path / 'r.jsonl'
  requests.write_text('{"context_ids": [5, 6, 7], "continuation_ids": [8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}\n'
                      '{"context_ids": [3], "continuation_ids": [4, 5]}\n')
  evals, scores = {}, {}
  for chunk in (0, 4):
    sets = [a for k in TINY + [f'LOSS_CHUNK_TOKENS={chunk}'] for a in ('--set', k)]
    job = ['--exp', EXP, *sets, '--job-log-dir', str(tmp_path / 'job'), '--no-checkpoint']
    code, out, err = pax_main(['eval', *job, '--json'], capsys)
    assert code == 0, err
    evals[chunk] = json.loads(out)['results']
    code, out, err = pax_main(['score', str(requests), *job, '--json', '-o', str(tmp_path / f's{chunk}.jsonl')],
                              capsys)
    assert code == 0, err
    scores[chunk] = [json.loads(line) for line in out.splitlines()]
  for name, metrics in evals[0].items():
    for key in ('loss', 'accuracy'):
      if key in metrics:
        assert evals[4][name][key] == pytest.approx(metrics[key], rel=1e-6), (name, key)
  for a, b in zip(scores[4], scores[0]):
    np.testing.assert_allclose(a['token_logprobs'], b['token_logprobs'], rtol=1e-6, atol=1e-6)
    assert a['is_greedy'] == b['is_greedy']


def test_the_soft_cap_is_importable_from_the_losses_module():
  """The Gemma families reuse it: paxcli.models.losses.soft_cap and Head(cap=...)."""
  from paxcli.models import losses
  np.testing.assert_allclose(losses.soft_cap(jnp.array([0.0, 100.0, -100.0]), 30.0), [0.0, 29.9, -29.9], atol=0.1)
  assert losses.soft_cap(jnp.array(7.0), 0.0) == 7.0
