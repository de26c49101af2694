"""MaxText -> Pax translation: the seed table, the four scaling eras, defaults, presets, mesh."""

import math

import pytest

from paxcli.errors import UserError
from paxcli.maxtext import defaults as mt
from paxcli.maxtext.shell import read_script
from paxcli.maxtext.translate import Options, parse_value, translate

from maxtext_common import FIXTURES, SEED_2XV4_128


def run(name, args=(), **options):
  return translate(read_script(str(FIXTURES / name), list(args)), Options(**options))


@pytest.mark.parametrize('fixture', ['2xv4-128.sh', '2xv4-128-scale.sh'])
def test_seed_table_for_2xv4_128(fixture):
  t = run(fixture)
  assert {k: t.knobs[k] for k in SEED_2XV4_128} == SEED_2XV4_128
  assert t.era == 'scale'
  assert t.knobs['NUM_KV_HEADS'] is None if 'NUM_KV_HEADS' in t.knobs else True
  assert t.knobs['PLATFORM_ENV']['tpu']['LIBTPU_INIT_ARGS'].endswith('TPU_MEGACORE=MEGACORE_DENSE')
  assert set(t.knobs['PLATFORM_ENV']) == {'tpu'}  # TPU flags never reach a CPU/GPU run


def test_seed_table_scale_column():
  t = run('2xv4-128-scale.sh')
  rows = {r.knob: r for r in t.rows}
  # scale 3 applies to base_num_decoder_layers 16, base_emb_dim 2048, base_mlp_dim 8192,
  # base_num_heads 8 (the 2023 base.yml), as in the seed table.
  for knob, key, base in (('NUM_LAYERS', 'base_num_decoder_layers', 16), ('MODEL_DIMS', 'base_emb_dim', 2048),
                          ('HIDDEN_DIMS', 'base_mlp_dim', 8192), ('NUM_HEADS', 'base_num_heads', 8)):
    assert rows[knob].key == f'{key}, scale'
    assert rows[knob].raw.startswith(str(base))
    assert rows[knob].after.startswith(f'{3 * base} (= scale 3 x {base})')
  assert 'the script sets `scale`' in t.era_reason


def _expected_multipliers(era, scale):
  """The issue's four rules, written independently of the code under test."""
  if era == 'scale':
    return {'emb': scale, 'heads': scale, 'mlp': scale, 'layers': scale}
  b, r = divmod(int(math.log2(scale)), 3)
  if era == 'jul2023':  # plain multipliers
    return {'emb': b + 1 + (r > 0), 'heads': b + 1 + (r > 1), 'mlp': b + 1 + (r > 1), 'layers': b + 1}
  if era == 'aug2023':  # exponents of two, embedding first
    e = {'emb': b + (r > 0), 'heads': b + (r > 1), 'mlp': b + (r > 1), 'layers': b}
  else:  # current: heads and mlp first
    e = {'heads': b + (r > 0), 'mlp': b + (r > 0), 'emb': b + (r > 1), 'layers': b}
  return {k: 2 ** v for k, v in e.items()}


@pytest.mark.parametrize('era', ['scale', 'jul2023', 'aug2023', 'current'])
@pytest.mark.parametrize('scale', [1, 2, 4, 8, 16])
def test_scaling_rules_over_explicit_dims(era, scale):
  key = 'scale' if era == 'scale' else 'global_parameter_scale'
  t = run('gps-explicit.sh', [f'SCALE={scale}', f'SCALE_KEY={key}'], era=era)
  m = _expected_multipliers(era, scale)
  # gps-explicit.sh: base_emb_dim=1024 base_num_heads=8 base_mlp_dim=4096 layers=6
  assert t.knobs['MODEL_DIMS'] == 1024 * m['emb']
  assert t.knobs['NUM_HEADS'] == 8 * m['heads']
  assert t.knobs['HIDDEN_DIMS'] == 4096 * m['mlp']
  assert t.knobs['NUM_LAYERS'] == 6 * m['layers']
  assert t.knobs['DIMS_PER_HEAD'] == 128  # head_dim is never scaled


@pytest.mark.parametrize('era, snapshot', [('jul2023', 'jul-2023'), ('aug2023', 'aug-2023'),
                                           ('current', '2024')])
@pytest.mark.parametrize('scale', [1, 2, 4, 8, 16])
def test_scaling_rules_over_dated_defaults(era, snapshot, scale):
  t = run('gps-aug2023.sh', [f'SCALE={scale}'], era=era)
  assert t.defaults.startswith(snapshot)
  base = mt.SNAPSHOT_BY_NAME[snapshot].values
  heads_key = 'base_num_heads' if 'base_num_heads' in base else 'base_num_query_heads'
  m = _expected_multipliers(era, scale)
  assert t.knobs['MODEL_DIMS'] == base['base_emb_dim'] * m['emb']
  assert t.knobs['NUM_HEADS'] == base[heads_key] * m['heads']
  assert t.knobs['HIDDEN_DIMS'] == base['base_mlp_dim'] * m['mlp']
  assert t.knobs['NUM_LAYERS'] == base['base_num_decoder_layers'] * m['layers']
  if heads_key == 'base_num_query_heads':  # query and kv heads scale together
    assert t.knobs['NUM_KV_HEADS'] == base['base_num_kv_heads'] * m['heads']


def test_scaling_spot_checks_by_hand():
  # scale 16: log2 = 4, b = 1, r = 1.
  cur = run('gps-explicit.sh', ['SCALE=16'], era='current').knobs
  # heads, mlp 2**(1+1) = 4x; emb 2**1 = 2x; layers 2**1 = 2x.
  assert (cur['MODEL_DIMS'], cur['NUM_HEADS'], cur['HIDDEN_DIMS'], cur['NUM_LAYERS']) == (2048, 32, 16384, 12)
  aug = run('gps-explicit.sh', ['SCALE=16'], era='aug2023').knobs
  # emb 2**(1+1) = 4x; heads, mlp 2**1 = 2x; layers 2x.
  assert (aug['MODEL_DIMS'], aug['NUM_HEADS'], aug['HIDDEN_DIMS'], aug['NUM_LAYERS']) == (4096, 16, 8192, 12)
  jul = run('gps-explicit.sh', ['SCALE=16'], era='jul2023').knobs
  # multipliers: emb 1+1+1 = 3; heads, mlp 1+1 = 2; layers 1+1 = 2.
  assert (jul['MODEL_DIMS'], jul['NUM_HEADS'], jul['HIDDEN_DIMS'], jul['NUM_LAYERS']) == (3072, 16, 8192, 12)


@pytest.mark.parametrize('scale', ['3', '6', '0', '-2', 'big'])
def test_global_parameter_scale_must_be_a_power_of_two(scale):
  with pytest.raises(UserError, match='not a power of two'):
    run('gps-explicit.sh', [f'SCALE={scale}'])


def test_era_detection_and_overrides():
  assert run('2xv4-128.sh').era == 'scale'                       # base_num_heads, no scale key
  assert run('gqa-current.sh').era == 'current'                  # global_parameter_scale
  t = run('llama2-7b-v5p.sh')
  assert t.era == 'current' and 'model_name' in t.era_reason
  t = run('gps-aug2023.sh', ['SCALE=2'])
  assert t.era == 'current' and '--maxtext-era jul2023 or aug2023' in t.era_reason
  t = run('gps-aug2023.sh', ['SCALE=2'], date='2023-08-15')
  assert t.era == 'aug2023' and t.defaults.startswith('aug-2023')
  t = run('gps-aug2023.sh', ['SCALE=2'], date='2023-07-25')
  assert t.era == 'jul2023' and t.defaults.startswith('jul-2023')
  assert run('2xv4-128.sh', era='current').era == 'current'
  with pytest.raises(UserError, match='not a date'):
    run('2xv4-128.sh', date='August')


def test_snapshots_hold_the_documented_defaults():
  early = mt.SNAPSHOT_BY_NAME['early-2023'].values
  assert {k: early[k] for k in ('base_emb_dim', 'base_num_heads', 'base_mlp_dim', 'base_num_decoder_layers',
                                'head_dim', 'vocab_size', 'per_device_batch_size', 'max_target_length',
                                'dtype', 'mlp_activations', 'remat_policy', 'scan_layers',
                                'ici_fsdp_parallelism')} == {
      'base_emb_dim': 2048, 'base_num_heads': 8, 'base_mlp_dim': 8192, 'base_num_decoder_layers': 16,
      'head_dim': 256, 'vocab_size': 32768, 'per_device_batch_size': 32, 'max_target_length': 1024,
      'dtype': 'bfloat16', 'mlp_activations': ['relu'], 'remat_policy': 'minimal', 'scan_layers': True,
      'ici_fsdp_parallelism': 4}
  today = mt.SNAPSHOT_BY_NAME['2024'].values
  assert {k: today[k] for k in ('base_emb_dim', 'base_num_query_heads', 'base_num_kv_heads', 'base_mlp_dim',
                                'base_num_decoder_layers', 'head_dim', 'vocab_size', 'per_device_batch_size',
                                'max_target_length', 'dtype', 'weight_dtype', 'mlp_activations',
                                'remat_policy', 'scan_layers', 'ici_fsdp_parallelism',
                                'dcn_data_parallelism')} == {
      'base_emb_dim': 2048, 'base_num_query_heads': 16, 'base_num_kv_heads': 16, 'base_mlp_dim': 7168,
      'base_num_decoder_layers': 16, 'head_dim': 128, 'vocab_size': 32000, 'per_device_batch_size': 12.0,
      'max_target_length': 2048, 'dtype': 'bfloat16', 'weight_dtype': 'float32',
      'mlp_activations': ['silu', 'linear'], 'remat_policy': 'full', 'scan_layers': True,
      'ici_fsdp_parallelism': -1, 'dcn_data_parallelism': -1}
  # The dated steps between: ici_fsdp 4 -> -1 in mid 2023; emb 2560 and batch 12 by autumn;
  # 8 query/kv heads at the end of 2023.
  assert mt.SNAPSHOT_BY_NAME['mid-2023'].values['ici_fsdp_parallelism'] == -1
  autumn = mt.SNAPSHOT_BY_NAME['autumn-2023'].values
  assert (autumn['base_emb_dim'], autumn['per_device_batch_size']) == (2560, 12.0)
  end = mt.SNAPSHOT_BY_NAME['end-2023'].values
  assert (end['base_num_query_heads'], end['base_num_kv_heads']) == (8, 8) and 'base_num_heads' not in end
  assert [s.start for s in mt.SNAPSHOTS] == sorted(s.start for s in mt.SNAPSHOTS)


def test_snapshot_follows_the_script_keys():
  # global_parameter_scale with the 2023 head key: the autumn-2023 defaults, which had both.
  t = run('gps-explicit.sh', ['SCALE=1'])
  assert t.era == 'current' and t.defaults.startswith('autumn-2023')
  assert t.knobs['VOCAB_SIZE'] == 32768 and t.knobs['MAX_SEQ_LEN'] == 2048


def test_current_script_with_query_and_kv_heads():
  t = run('gqa-current.sh')
  k = t.knobs
  # global_parameter_scale=2: b=0, r=1 -> heads and mlp x2, emb and layers x1.
  assert (k['MODEL_DIMS'], k['NUM_HEADS'], k['NUM_KV_HEADS'], k['HIDDEN_DIMS'], k['NUM_LAYERS']) == \
      (3072, 48, 16, 16384, 28)
  assert (k['ACTIVATION'], k['USE_GATED_ACTIVATION']) == ('silu', True)
  assert (k['NORM_TYPE'], k['USE_BIAS'], k['POSITION_EMBEDDING']) == ('rmsnorm', False, 'rotary')
  assert k['MAX_SEQ_LEN'] == 8192 and k['PERCORE_BATCH_SIZE'] == 12
  assert k['CHECKPOINT_POLICY'] == 'save_qkv_out_proj'
  # steps 100, warmup_steps_fraction 0.05 -> 5 warm-up steps, cosine to 0.1 at step 100.
  assert (k['LR_SCHEDULE'], k['LR_WARMUP_STEPS'], k['LR_DECAY_START'], k['LR_DECAY_END'], k['LR_MIN_RATIO']) == \
      ('linear_rampup_cosine_decay', 5, 5, 100, 0.1)
  assert (k['LEARNING_RATE'], k['OPTIMIZER'], k['WEIGHT_DECAY'], k['NUM_TRAIN_STEPS'], k['SAVE_INTERVAL_STEPS']) == \
      (3e-4, 'adamw', 0.1, 100, 50)
  assert k['UNSUPPORTED_FEATURES'] == {}
  assert not t.warnings


def test_mesh_fill_resolution():
  assert run('gqa-current.sh').knobs['ICI_MESH_SHAPE'] == [1, -1, 4]  # left as fill
  # v5p-128 counts 128 TensorCores = 64 devices; ici_tensor 4 -> fsdp fills 16.
  for options in ({'topology': 'v5p-128'}, {'num_devices': 64}, {'topology': 'v5p-128', 'num_slices': 1}):
    k = run('gqa-current.sh', **options).knobs
    assert (k['ICI_MESH_SHAPE'], k['DCN_MESH_SHAPE']) == ([1, 16, 4], [1, 1, 1])
  k = run('gqa-current.sh', topology='v5p-128', num_slices=4).knobs  # dcn_data=-1 fills 4 slices
  assert (k['ICI_MESH_SHAPE'], k['DCN_MESH_SHAPE']) == ([1, 16, 4], [4, 1, 1])
  k = run('2xv4-128.sh', topology='v4-128', num_slices=2).knobs
  assert (k['ICI_MESH_SHAPE'], k['DCN_MESH_SHAPE']) == ([1, 64, 1], [2, 1, 1])


@pytest.mark.parametrize('options, message', [
    ({'num_devices': 100}, 'Cannot build the MaxText mesh'),     # 100 / 2 slices = 50 != 64
    ({'topology': 'v4-64', 'num_slices': 2}, 'Cannot build the MaxText mesh'),
    ({'topology': 'v9-8'}, 'not a TPU type'),
    ({'topology': 'v4-128', 'num_devices': 100}, 'does not match'),
])
def test_mesh_that_cannot_be_built(options, message):
  with pytest.raises(UserError, match=message):
    run('2xv4-128.sh', **options)


def test_compile_topology_of_an_aot_script(tmp_path):
  path = tmp_path / 'aot.sh'
  path.write_text('python3 MaxText/train_compile.py MaxText/configs/base.yml compile_topology=v5e-256 '
                  'compile_topology_num_slices=2 ici_fsdp_parallelism=-1 ici_tensor_parallelism=8 '
                  'global_parameter_scale=8\n')
  k = translate(read_script(str(path)), Options()).knobs
  # v5e counts chips: 256 devices per slice / tensor 8 = 32; dcn_data -1 fills 2 slices.
  assert (k['ICI_MESH_SHAPE'], k['DCN_MESH_SHAPE']) == ([1, 32, 8], [2, 1, 1])


@pytest.mark.parametrize('setting', ['steps=many', 'per_device_batch_size=[1]', 'head_dim=12.5'])
def test_values_that_are_not_numbers(tmp_path, setting):
  path = tmp_path / 'bad.sh'
  path.write_text(f'python3 MaxText/train.py base.yml {setting}\n')
  with pytest.raises(UserError, match='must be a'):
    translate(read_script(str(path)), Options())


def test_two_fill_axes_are_an_error(tmp_path):
  path = tmp_path / 'two.sh'
  path.write_text('python3 MaxText/train.py base.yml ici_fsdp_parallelism=-1 ici_data_parallelism=-1\n')
  with pytest.raises(UserError, match='both -1'):
    translate(read_script(str(path)), Options())


def test_topology_table():
  assert {n: mt.topology_devices(n) for n in ('v2-8', 'v3-32', 'v4-8', 'v4-128', 'v4-384', 'v5p-256',
                                               'v5litepod-16', 'v5e-256', 'v6e-64')} == {
      'v2-8': 8, 'v3-32': 32, 'v4-8': 4, 'v4-128': 64, 'v4-384': 192, 'v5p-256': 128,
      'v5litepod-16': 16, 'v5e-256': 256, 'v6e-64': 64}
  assert mt.topology_devices('v5e-3') is None and mt.topology_devices('v4-12') is None


def test_unsupported_axes_fold_with_warnings():
  t = run('unsupported-axes.sh')
  assert t.knobs['ICI_MESH_SHAPE'] == [1, -1, 2]
  # 64 devices: fsdp = 64 / (sequence 4 x fsdp_transpose 2 x tensor 2) = 4; Pax data = 4 x 4 x 2.
  assert run('unsupported-axes.sh', num_devices=64).knobs['ICI_MESH_SHAPE'] == [1, 32, 2]
  assert any('ici_sequence_parallelism=4' in w for w in t.strict_warnings)
  assert any('ici_fsdp_transpose_parallelism=2' in w for w in t.strict_warnings)
  assert set(t.unsupported) == {'sequence_parallelism'}   # mixtral-8x7b's experts are the Mixtral family's
  unknown = [u for u in t.untranslated if u.kind == 'unknown']
  assert [u.key for u in unknown] == ['stepz'] and "Did you mean 'steps'" in unknown[0].reason


def test_model_presets():
  k = run('llama2-7b-v5p.sh').knobs
  assert (k['NUM_LAYERS'], k['MODEL_DIMS'], k['HIDDEN_DIMS'], k['NUM_HEADS'], k['NUM_KV_HEADS'],
          k['DIMS_PER_HEAD'], k['VOCAB_SIZE']) == (32, 4096, 11008, 32, 32, 128, 32000)
  assert k['PERCORE_BATCH_SIZE'] == 0.25 and k['MAX_SEQ_LEN'] == 4096  # the script's keys win
  assert (k['ICI_MESH_SHAPE'], k['CHECKPOINT_POLICY']) == ([1, 16, 4], 'save_dot_with_no_batch_dim')
  assert k['DROPOUT_PROB'] == 0.0 and k['SEPARATE_EMBEDDING'] is True
  assert k['PLATFORM_ENV'] == {'tpu': {'XLA_FLAGS': '--xla_dump_to=/tmp/xla_dump '
                                                    '--xla_tpu_enable_windowed_einsum_for_all_gather=true'}}


@pytest.mark.parametrize('name, dims', [
    ('llama2-70b', (80, 8192, 28672, 64, 8)), ('llama3-8b', (32, 4096, 14336, 32, 8)),
    ('llama3.1-405b', (126, 16384, 53248, 128, 8)), ('gpt3-175b', (96, 12288, 49152, 96, 96)),
    ('gemma2-9b', (42, 3584, 14336, 16, 8)), ('mistral-7b', (32, 4096, 14336, 32, 8))])
def test_more_presets(tmp_path, name, dims):
  path = tmp_path / 'preset.sh'
  path.write_text(f'python3 -m maxtext.trainers.pre_train.train base.yml model_name={name}\n')
  k = translate(read_script(str(path)), Options()).knobs
  assert (k['NUM_LAYERS'], k['MODEL_DIMS'], k['HIDDEN_DIMS'], k['NUM_HEADS'], k['NUM_KV_HEADS']) == dims
  if name == 'gpt3-175b':
    assert (k['ACTIVATION'], k['USE_GATED_ACTIVATION'], k['NORM_TYPE'], k['USE_BIAS'],
            k['POSITION_EMBEDDING'], k['SEPARATE_EMBEDDING']) == ('gelu', False, 'layernorm', True, 'learned', False)
  if name == 'llama3-8b':
    assert k['ROTARY_MAX_TIMESCALE'] == 500000.0 and k['VOCAB_SIZE'] == 128256
  if name == 'gemma2-9b':  # 21 MaxText layers, each a local+global pair: the Gemma 2 family's (test_maxtext_gemma)
    assert k['UNSUPPORTED_FEATURES'] == {} and tuple(k['LAYER_PATTERN']) == ('local', 'global')
  # the recipe records the family whose decoder block the model is (MODEL_FAMILY); gpt3's is none of them
  assert k.get('MODEL_FAMILY') == {'gemma2-9b': 'gemma2', 'gpt3-175b': None}.get(name, 'llama')


def test_unknown_model_and_model_config(tmp_path):
  path = tmp_path / 'm.sh'
  path.write_text('python3 MaxText/train.py base.yml model_name=llama9-1b steps=3\n')
  with pytest.raises(UserError, match=r"Unknown MaxText model_name 'llama9-1b'.*llama2-7b"):
    translate(read_script(str(path)), Options())
  config = tmp_path / 'llama9-1b.yml'
  config.write_text('base_emb_dim: 512\nbase_num_query_heads: 8\nbase_num_kv_heads: 2\n'
                    'base_mlp_dim: 1536\nbase_num_decoder_layers: 4\nhead_dim: 64\nvocab_size: 1000\n'
                    'mlp_activations: ["silu", "linear"]\nnormalization_layer_epsilon: 1e-5\n')
  k = translate(read_script(str(path)), Options(model_config=str(config))).knobs
  assert (k['NUM_LAYERS'], k['MODEL_DIMS'], k['NUM_HEADS'], k['NUM_KV_HEADS'], k['DIMS_PER_HEAD'],
          k['VOCAB_SIZE'], k['NUM_TRAIN_STEPS']) == (4, 512, 8, 2, 64, 1000, 3)


def test_users_base_config(tmp_path):
  base = tmp_path / 'base.yml'
  base.write_text('scale: 1\nbase_emb_dim: 512\nbase_num_heads: 4\nbase_mlp_dim: 2048\n'
                  'base_num_decoder_layers: 4\nhead_dim: 64\nvocab_size: 1000\nmax_target_length: 128\n'
                  'per_device_batch_size: 2\nmy_fork_key: 3\n')
  path = tmp_path / 'run.sh'
  path.write_text('python3 MaxText/train.py base.yml scale=2 my_fork_key=4\n')
  t = translate(read_script(str(path)), Options(base_config=str(base)))
  assert t.era == 'scale' and t.defaults.startswith(str(base))
  k = t.knobs
  assert (k['MODEL_DIMS'], k['NUM_HEADS'], k['HIDDEN_DIMS'], k['NUM_LAYERS'], k['DIMS_PER_HEAD'],
          k['VOCAB_SIZE'], k['MAX_SEQ_LEN'], k['PERCORE_BATCH_SIZE']) == (1024, 8, 4096, 8, 64, 1000, 128, 2)
  # A key the user's base.yml defines is known, though MaxText never had it.
  assert [u.kind for u in t.untranslated if u.key == 'my_fork_key'] == ['no_equivalent']
  with pytest.raises(UserError, match='Cannot read base config'):
    translate(read_script(str(path)), Options(base_config=str(tmp_path / 'nope.yml')))


def test_platform_env_for_gpu_scripts():
  t = run('gpu-a3.sh')
  env = t.knobs['PLATFORM_ENV']
  assert set(env) == {'gpu'}
  assert env['gpu']['XLA_FLAGS'].split() == [
      '--xla_gpu_enable_latency_hiding_scheduler=true', '--xla_gpu_enable_triton_gemm=false',
      '--xla_gpu_all_reduce_combine_threshold_bytes=134217728']
  assert env['gpu']['NCCL_DEBUG'] == 'WARN' and env['gpu']['XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.85'
  k = t.knobs
  assert (k['ICI_MESH_SHAPE'], k['DCN_MESH_SHAPE'], k['USE_REPEATED_LAYER']) == ([1, 8, 1], [2, 1, 1], False)
  assert any('weight_dtype=bfloat16' in w for w in t.warnings)
  reasons = {u.key: u.kind for u in t.untranslated}
  assert reasons['attention'] == 'ignored' and reasons['use_iota_embed'] == 'ignored'


@pytest.mark.parametrize('hardware, flags, expected', [
    ('tpu', '--xla_dump_to=/d --xla_tpu_x=1 --xla_gpu_y=2',
     {'tpu': '--xla_dump_to=/d --xla_tpu_x=1', 'gpu': '--xla_gpu_y=2'}),
    ('gpu', '--xla_dump_to=/d --xla_gpu_y=2', {'gpu': '--xla_dump_to=/d --xla_gpu_y=2'}),
    ('tpu', '--xla_dump_to=/d', {'tpu': '--xla_dump_to=/d'}),
])
def test_xla_flags_go_to_their_platform(tmp_path, hardware, flags, expected):
  path = tmp_path / 'flags.sh'
  path.write_text(f'export XLA_FLAGS="{flags}"\npython3 MaxText/train.py base.yml hardware={hardware}\n')
  env = translate(read_script(str(path)), Options()).knobs['PLATFORM_ENV']
  assert {p: d['XLA_FLAGS'] for p, d in env.items()} == expected


# MaxText mesh axes Pax has as its own: <net>_<axis>_parallelism -> index in <NET>_MESH_SHAPE
# (replica, data, mdl). The other axes are folded into one of these with a warning naming the key.
MESH_INDEX = {'data': 0, 'fsdp': 1, 'tensor': 2}


def test_nothing_the_script_sets_goes_missing():
  """Every key a script sets becomes a knob (its row names it), is listed as untranslated, or is a
  mesh axis found in the mesh it built: a Pax axis with its value in place (or -1, filled), or
  another axis folded in with a warning naming `key=value`. No key is exempt by its name."""
  for name in ('2xv4-128.sh', 'gqa-current.sh', 'gpu-a3.sh', 'unsupported-axes.sh', 'llama2-7b-v5p.sh'):
    t = run(name)
    used = {key.strip() for r in t.rows for key in r.key.split(',')}
    listed = {u.key for u in t.untranslated}
    for o in t.script.overrides:
      preset = o.key == 'model_name' and t.preset == o.value
      if o.key in listed or preset or o.key in used:
        continue
      net, _, rest = o.key.partition('_')
      axis = rest.removesuffix('_parallelism')
      assert net in ('ici', 'dcn') and rest.endswith('_parallelism'), (name, o.key)
      shape = t.knobs[f'{net.upper()}_MESH_SHAPE']
      if axis in MESH_INDEX:
        assert f'{net}_{axis}' in used, (name, o.key)  # the mesh row names it
        value = int(o.value)
        assert shape[MESH_INDEX[axis]] == value or value == -1, (name, o.key, shape)
      else:
        assert any(w.startswith(f'{o.key}={o.value}: ') and 'folded into' in w for w in t.warnings), (name, o.key)


@pytest.mark.parametrize('raw, like, value', [
    ('16', None, 16), ('12.0', None, 12.0), ('0.25', 1.0, 0.25), ('16', 1.0, 16.0), ('10_000', None, 10000),
    ('3e-4', None, 3e-4), ('1.e-5', None, 1e-5), ('true', None, True), ('False', None, False),
    ('["silu","linear"]', None, ['silu', 'linear']), ('[silu,linear]', None, ['silu', 'linear']),
    ("'relu'", ['relu'], ['relu']), ('c4', None, 'c4')])
def test_parse_value(raw, like, value):
  assert parse_value(raw, like) == value


@pytest.mark.parametrize('keys,parallel,unsupported', [
    ('decoder_block=default', True, set()),                               # 2024 defaults: exact
    ('decoder_block=llama2', None, set()),
    ('decoder_block=default logits_via_embedding=true', True, {'normalize_embedding_logits'}),
    ('decoder_block=default logits_via_embedding=true normalize_embedding_logits=false', True, set()),
])
def test_decoder_block_default_is_the_parallel_block(keys, parallel, unsupported, tmp_path):
  """MaxText's default decoder layer (attention + MLP from one norm) is PARALLEL_BLOCK since 2024;
  tied logits divided by sqrt(emb_dim) are a feature paxcli lacks."""
  script = tmp_path / 'run.sh'
  script.write_text(f'python3 -m maxtext.trainers.pre_train.train src/maxtext/configs/base.yml {keys}\n')
  k = translate(read_script(str(script), []), Options()).knobs
  assert k.get('PARALLEL_BLOCK') == parallel
  assert set(k['UNSUPPORTED_FEATURES']) == unsupported
  assert 'decoder_block_default' in run('2xv4-128.sh').knobs['UNSUPPORTED_FEATURES']   # the 2023 layer
