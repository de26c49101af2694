"""Context parallelism (paxcli.layers.context_parallel): each sequence split over the mesh's `context` axis.

The real train step (loops.train.step_gradients) on 8 fake CPU devices gives the loss and gradients of the same
step without context parallelism ([1, 8, 1]: every device on `data`), with the same weights: float32, 1e-6
relative over the whole gradient and 1e-5 for each array alone. Both strategies (ring, all-gather), with and
without load balancing, beside FSDP (data), tensor parallelism (mdl), pipeline stages, an expert axis and LoRA,
with windows, soft caps, packed documents and latent attention; each compiled step holds its strategy's
collectives. A job trained this way decodes and scores as one trained without; bad layouts are one line before
anything compiles. The default suite runs each strategy once; the grid, unpacked rows and the jobs are slow.
"""

import json
import re

import jax
import numpy as np
import pytest

from conftest import pax_main
from paxcli import api, config
from paxcli.errors import UserError
from paxcli.layers import context_parallel
from paxcli.loops.train import step_gradients
from paxcli.models import losses
from paxcli.runtime import engine, sharding

EXP = 'paxcli.models.LmExperiment'
B, L = 8, 32   # PERCORE_BATCH_SIZE 1 on 8 devices; 32 tokens: 16 chunks of 2 over a context axis of 8
TINY = ['NUM_LAYERS=2', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'DIMS_PER_HEAD=8',
        'VOCAB_SIZE=32', f'MAX_SEQ_LEN={L}', 'USE_REPEATED_LAYER=True', 'PERCORE_BATCH_SIZE=1']
# Models, each with its reference on [1, 8, 1]; a case adds its mesh and layout knobs.
MODELS = {
    'dense': [],
    'deep': ['NUM_LAYERS=4'],   # a circular pipeline: 2 stages x 2 repeats of a layer
    # windows shorter than a chunk of 4 and longer, both with soft-capped logits (the cap small enough to bend)
    'window': ['SLIDING_WINDOW=5', 'ATTEN_LOGIT_CAP=1.0'],
    'pattern': ["LAYER_PATTERN=('local', 'global')", "LAYER_KINDS={'local': {'SLIDING_WINDOW': 3}}",
                'ATTEN_LOGIT_CAP=2.0'],
    'moe': ["LAYER_PATTERN=('dense', 'moe')", "LAYER_KINDS={'moe': {'NUM_EXPERTS': 4, 'EXPERTS_PER_TOKEN': 2}}"],
    'lora': ['LORA_RANK=2', "LORA_TARGETS=('query', 'value', 'output')"],
    'latent': ['KV_LORA_RANK=8', 'Q_LORA_RANK=6', 'QK_NOPE_HEAD_DIMS=4', 'QK_ROPE_HEAD_DIMS=4', 'V_HEAD_DIMS=6',
               'NUM_KV_HEADS=4', "POSITION_EMBEDDING='rotary'", 'USE_ATTENTION_BIAS=False'],
}
MESHES = {'context 8': '[1,1,1,1,8,1]', 'fsdp': '[1,1,2,1,4,1]', 'tp': '[1,1,2,1,2,2]', 'expert': '[1,1,1,2,4,1]',
          'pipeline': '[2,1,1,1,4,1]'}
PIPELINE = ['NUM_STAGES=2', 'NUM_MICROBATCHES=2']
# The default suite runs the two strategies once each (with their collectives asserted); the slow one the grid.
SLOW_CASES = [  # (model, mesh, strategy, load balance, more knobs)
    ('dense', 'context 8', 'all_gather', True, []),
    ('dense', 'context 8', 'ring', False, []),
    ('dense', 'tp', 'ring', True, []),
    ('dense', 'pipeline', 'ring', True, PIPELINE),
    ('dense', 'pipeline', 'ring', False, PIPELINE),
    ('deep', 'pipeline', 'ring', True, PIPELINE + ['PIPELINE_CIRCULAR_REPEAT=2']),
    ('window', 'context 8', 'ring', True, []),
    ('window', 'context 8', 'all_gather', False, []),
    ('window', 'fsdp', 'ring', False, []),
    ('window', 'tp', 'ring', True, []),
    ('pattern', 'fsdp', 'ring', True, []),
    ('pattern', 'tp', 'all_gather', True, []),
    ('moe', 'expert', 'ring', True, []),
    ('moe', 'expert', 'all_gather', True, []),
    ('lora', 'pipeline', 'all_gather', True, PIPELINE),
    ('lora', 'fsdp', 'ring', True, []),
    ('latent', 'fsdp', 'ring', True, []),
    ('latent', 'tp', 'all_gather', True, []),
]


def _relative(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _batch(packed: bool = True):
  """B x L tokens; packed: two documents a row, the break inside a chunk, with their own positions."""
  rng = np.random.default_rng(0)
  batch = {'ids': rng.integers(0, 32, (B, L)).astype(np.int32),
           'labels': rng.integers(0, 32, (B, L)).astype(np.int32),
           'weights': (rng.random((B, L)) > 0.1).astype(np.float32)}
  if packed:
    cut = 13
    batch['segment_ids'] = np.repeat([[1] * cut + [2] * (L - cut)], B, 0).astype(np.int32)
    batch['positions'] = np.repeat([list(range(cut)) + list(range(L - cut))], B, 0).astype(np.int32)
  return batch


def _step(setup, state, batch):
  """(loss, grads, the compiled program's HLO text) of the real train step's forward and backward pass
  (loops.train.step_gradients)."""
  state = jax.device_put(state, setup.state_shardings)
  batch = sharding.to_global(batch, sharding.batch_sharding(setup.mesh), setup.global_batch)
  compiled = jax.jit(step_gradients(setup, 0)).lower(state, batch).compile()
  done = jax.device_get(compiled(state, batch))
  return done.loss, done.grads, compiled.as_text()


_REFERENCES: dict = {}


def _reference(model: str, packed: bool = True):
  """(state, (loss, grads)) of a model on [1, 8, 1]: no context axis; built once per module and model."""
  if (model, packed) not in _REFERENCES:
    setup = engine.build(config.resolve(EXP, TINY + MODELS[model] + ['ICI_MESH_SHAPE=[1,8,1]']))
    state = jax.device_get(engine.init_state(setup, 0))
    _REFERENCES[model, packed] = state, _step(setup, state, _batch(packed))[:2]
  return _REFERENCES[model, packed]


def _knobs(model, mesh, strategy, balance, more):
  return TINY + MODELS[model] + [f'ICI_MESH_SHAPE={MESHES[mesh]}', f'CONTEXT_PARALLEL_STRATEGY={strategy!r}',
                                 f'CONTEXT_LOAD_BALANCE={balance}'] + more


def _check_case(model, mesh, strategy, balance, more, packed=True):
  state, (ref_loss, ref_grads) = _reference(model, packed)
  setup = engine.build(config.resolve(EXP, _knobs(model, mesh, strategy, balance, more)))
  assert sharding.context_size(setup.mesh) == int(MESHES[mesh].strip('[]').split(',')[4])
  loss, grads, hlo = _step(setup, state, _batch(packed))
  assert _relative(loss, ref_loss) <= 1e-6, (loss, ref_loss)
  flat = dict(jax.tree_util.tree_flatten_with_path(ref_grads)[0])
  mine = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
  assert flat.keys() == mine.keys()
  whole = lambda tree: np.concatenate([np.ravel(tree[k]) for k in sorted(tree, key=jax.tree_util.keystr)])
  assert _relative(whole(mine), whole(flat)) <= 1e-6
  # each array on its own too, so that one wrong array cannot hide behind large others; 1e-5, as a key bias's
  # gradient is a sum that cancels nearly to 0 (exactly 0 without a soft cap) and keeps float32's rounding
  for path, g in mine.items():
    if np.linalg.norm(flat[path]) > 1e-6:
      assert _relative(g, flat[path]) <= 1e-5, (jax.tree_util.keystr(path), _relative(g, flat[path]))
  return hlo


def test_the_ring_step_equals_the_step_without_context_parallelism_and_passes_keys_round():
  """Context 8, load-balanced, packed documents; the compiled step passes keys and values round the axis
  (collective-permute) and never gathers a whole sequence of them."""
  hlo = _check_case('dense', 'context 8', 'ring', True, [])
  assert 'collective-permute' in hlo and not _kv_gathers(hlo, 8)


def test_the_all_gather_step_equals_the_step_without_context_parallelism_and_gathers_keys():
  """Data 2 x context 4 (FSDP over both), the loss in chunks of each device's share; the compiled step gathers
  whole sequences of keys and values (all-gather of [B/2, L, K, E]) and permutes nothing."""
  hlo = _check_case('dense', 'fsdp', 'all_gather', True, ['LOSS_CHUNK_TOKENS=4'])
  assert _kv_gathers(hlo, 4) and 'collective-permute' not in hlo


@pytest.mark.slow
@pytest.mark.parametrize('model,mesh,strategy,balance,more', SLOW_CASES)
def test_the_step_equals_the_step_without_context_parallelism_full_grid(model, mesh, strategy, balance, more):
  hlo = _check_case(model, mesh, strategy, balance, more)
  # (beside tensor parallelism or pipeline stages XLA also permutes and gathers for its own reshardings)
  assert 'collective-permute' in hlo if strategy == 'ring' else _kv_gathers(hlo)


@pytest.mark.slow
def test_unpacked_rows_get_their_positions_before_the_reordering():
  """No segment ids or positions in the batch: the load-balanced order makes positions 0 .. L-1 first."""
  _check_case('dense', 'context 8', 'ring', True, [], packed=False)


def _kv_gathers(hlo: str, rows: int = 0) -> list[str]:
  """The all-gathers whose result is a whole sequence of keys or values: [rows, L, 2 kv heads, 8 head dims], or
  with rows 0 any [rows, L, heads, dims]; under pipeline stages with a leading [stages on the device] too."""
  shape = rf'\[([0-9]+,)?{rows},{L},2,8\]' if rows else rf'\[([0-9]+,)?[0-9]+,{L},[0-9]+,[0-9]+\]'
  return [line for line in hlo.splitlines()
          if ' all-gather' in line and re.search(r' all-gather(-start)?\(', line)
          and re.search(shape, line.split('=', 1)[1].split('all-gather')[0])]


@pytest.mark.parametrize('window,cap,block,value_dims', [(5, 0.0, 4, 8), (9, 1.5, 16, 6)])
def test_the_flash_kernel_equals_the_einsum_reference(window, cap, block, value_dims):
  """Values and gradients of attention_ops.flash_attention (blocks of `block`, skipped where no query sees a key)
  against the einsum reference: GQA 4/2 heads, two packed documents, windows, soft caps, and value heads of
  another size than the queries' (latent attention's)."""
  import jax.numpy as jnp
  from paxcli.layers import attention_ops
  keys = jax.random.split(jax.random.key(0), 4)
  q, k = (jax.random.normal(key, (2, 48, n, 8)) for key, n in zip(keys, (4, 2)))
  v = jax.random.normal(keys[2], (2, 48, 2, value_dims))
  segments = jnp.asarray(np.repeat([[1] * 20 + [2] * 28], 2, 0))
  cotangent = jax.random.normal(keys[3], (2, 48, 4, value_dims))

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * cotangent)

  flash = lambda q, k, v: attention_ops.flash_attention(q, k, v, segments, window, cap, block=block)
  reference = lambda q, k, v: attention_ops.einsum_attention(q, k, v, segments, cap, window)
  np.testing.assert_allclose(jax.jit(flash)(q, k, v), reference(q, k, v), rtol=1e-5, atol=1e-6)
  got = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
  want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    assert _relative(a, b) <= 1e-6


def test_the_loss_is_chunked_by_default_where_a_device_s_logits_would_pass_2_gib():
  # Llama 3's vocabulary: 8,192 tokens a device are 4 GiB of float32 logits; 2,048 x 32k / 128k -> 512 a chunk
  assert losses.chunk_length(1, 8192, 0, 128256) == 512
  assert losses.chunk_length(1, 8192, -1, 128256) == 8192 and losses.chunk_length(1, 1024, 0, 128256) == 1024
  with pytest.raises(UserError, match='LOSS_CHUNK_TOKENS must be'):
    engine.validate(config.resolve(EXP, TINY + ['LOSS_CHUNK_TOKENS=-2']))


def test_the_layout_holds_an_early_and_a_late_chunk_per_device():
  layout = context_parallel.Layout(devices=4, length=16, balanced=True)
  assert [layout.device_chunks(d) for d in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
  assert layout.order().tolist() == [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]
  assert np.asarray(layout.indices(1)).tolist() == [2, 3, 12, 13]
  assert layout.ring_offsets(0) == (0, 1, 2, 3)
  # a window of 2 within chunks of 2: each query sees its own chunk and the one before, which device d - 1
  # or d + 1 holds (the late chunks run backwards)
  assert layout.ring_offsets(2) == (0, 1, 3)
  contiguous = context_parallel.Layout(devices=4, length=16, balanced=False)
  assert contiguous.order().tolist() == list(range(16)) and contiguous.ring_offsets(2) == (0, 1)


@pytest.mark.parametrize('knobs,message', [
    (['MAX_SEQ_LEN=36', 'ICI_MESH_SHAPE=[1,1,1,1,8,1]'],
     'The context axis of 8 devices does not divide the 36 tokens of a sequence of the train input'),
    (['MAX_SEQ_LEN=28', 'ICI_MESH_SHAPE=[1,1,2,1,4,1]'], 'the length must be a multiple of 8'),
    (['MAX_SEQ_LEN=22', 'ICI_MESH_SHAPE=[1,1,2,1,4,1]', 'CONTEXT_LOAD_BALANCE=False', 'NUM_LAYERS=1'],
     'each device holds 1 of 4 equal shares'),
    (['MAX_SEQ_LEN=4168', 'ICI_MESH_SHAPE=[1,1,1,1,4,1]'],   # 521 is prime, above the kernel's 512
     'make 8 chunks of 521 over the context axis, which the attention kernel cuts only into blocks of 1'),
    (["LAYER_PATTERN=('dense', 'moe')", "LAYER_KINDS={'moe': {'NUM_EXPERTS': 4}}", "MOE_DISPATCH='capacity'",
      'ICI_MESH_SHAPE=[1,1,2,1,4,1]'], "The 'moe' layers' mixture of experts has MOE_DISPATCH='capacity'"),
    (['ICI_MESH_SHAPE=[1,1,2,1,4,1]', "CONTEXT_PARALLEL_STRATEGY='rings'"], "CONTEXT_PARALLEL_STRATEGY must be"),
])
def test_bad_layouts_are_one_line_before_anything_compiles(knobs, message, capsys):
  code, out, err = pax_main(['describe', '--exp', EXP, *[a for k in TINY + knobs for a in ('--set', k)]], capsys)
  assert code != 0 and message in ' '.join(err.split()), err
  assert 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  with pytest.raises((UserError, ValueError)):
    engine.validate(config.resolve(EXP, TINY + knobs))


def test_describe_says_how_sequences_are_split(capsys):
  sets = [a for k in TINY + ['ICI_MESH_SHAPE=[1,1,2,1,4,1]', "CONTEXT_PARALLEL_STRATEGY='ring'"] for a in ('--set', k)]
  code, out, err = pax_main(['describe', '--exp', EXP, *sets], capsys)
  assert code == 0, err
  assert ('# context parallelism: each sequence over 4 devices (context), attention by ring; load-balanced: 2 chunks '
          'of 4 tokens a device') in out


@pytest.mark.slow
def test_a_job_trained_with_context_parallelism_decodes_and_scores_as_one_trained_without(tmp_path, capsys):
  """Two steps trained on [1, 8, 1] and on context 4 x data 2 (ring): the same losses, and the same decoded
  tokens and scores from each job's checkpoint (decode and score lay out their own mesh)."""
  requests = tmp_path / 'r.jsonl'
  requests.write_text('{"context_ids": [5, 6, 7], "continuation_ids": [8, 9, 10]}\n'
                      '{"context_ids": [3], "continuation_ids": [4, 5, 6, 7, 8]}\n')
  runs = {}
  for name, layout in (('plain', ['ICI_MESH_SHAPE=[1,8,1]']),
                       ('context', ['ICI_MESH_SHAPE=[1,1,2,1,4,1]', "CONTEXT_PARALLEL_STRATEGY='ring'"])):
    job = str(tmp_path / name)
    sets = TINY + layout + ['NUM_TRAIN_STEPS=2', 'SAVE_INTERVAL_STEPS=2', 'SUMMARY_INTERVAL_STEPS=1',
                            'LEARNING_RATE=0.01']
    code, out, err = pax_main(['train', '--exp', EXP, *[a for k in sets for a in ('--set', k)], '--job-log-dir',
                               job], capsys)
    assert code == 0, err
    losses = [json.loads(line)['loss'] for line in open(f'{job}/train_metrics.jsonl')]
    model = TINY + ['NUM_TRAIN_STEPS=2']
    decoded = api.decode(EXP, overrides=model, job_dir=job, prompt_ids=['5,6,7', '3'], max_decode_steps=5,
                         ignore_eos=True, output=str(tmp_path / f'{name}.jsonl'), console=_quiet())
    scored = api.score(str(requests), EXP, overrides=model, job_dir=job, console=_quiet())
    runs[name] = losses, decoded, list(scored)
  (plain_losses, plain_decoded, plain_scored), (losses, decoded, scored) = runs['plain'], runs['context']
  assert len(losses) == 2
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
  assert [d['decoded_ids'] for d in decoded] == [d['decoded_ids'] for d in plain_decoded]
  for a, b in zip(scored, plain_scored):
    np.testing.assert_allclose(a['token_logprobs'], b['token_logprobs'], atol=1e-5)


def _quiet():
  from rich.console import Console
  return Console(quiet=True)


def test_a_batch_of_another_form_is_refused_where_the_step_would_split_its_sequences():
  """A model reading its own batch (preference pairs, GRPO rollouts: no `ids`) under a context axis over 1 is
  refused in one line, naming what it reads; unsplit, its batch passes as it is."""
  from paxcli.layers import activation_sharding
  import jax.numpy as jnp
  batch = {'chosen_ids': jnp.zeros((2, 16), jnp.int32), 'rejected_ids': jnp.zeros((2, 16), jnp.int32)}
  assert context_parallel.to_device_order(batch) is batch
  split = sharding.make_mesh([1, 1, 1, 1, 2, 1], devices=jax.devices()[:2])
  with activation_sharding.rules(split):
    with pytest.raises(UserError, match='this model reads chosen_ids, rejected_ids: set the context axis to 1'):
      context_parallel.to_device_order(batch)
  with activation_sharding.rules(sharding.make_mesh([1, 1, 1], devices=jax.devices()[:1])):
    assert context_parallel.to_device_order(batch) is batch
