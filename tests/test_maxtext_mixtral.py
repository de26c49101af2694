"""`pax import-maxtext` of MaxText's Mixtral runs: recipes on the Mixtral family, with expert parallelism.

MaxText's mixtral decoder block (MaxText models/mixtral.py, layers/moe.py RoutedMoE; configs/models/mixtral-*.yml)
is the Mixtral family's layer: num_experts and num_experts_per_tok, the softmax over the chosen k, dropless grouped
matmuls (sparse_matmul, or capacity_factor < 0) or its dense path's capacity per sequence, the load-balancing
weight, and ici/dcn_expert_parallelism as the `expert` mesh axis. The fixture is a MaxText launch script
(tests/fixtures/maxtext/mixtral-8x7b.sh).
"""

import ast
import json
import math
import re
import types

import pytest

from conftest import pax_main
from maxtext_common import FIXTURES
from paxcli.layers.moe import expert_capacity
from paxcli.models.knobs import LM_KNOBS, effective
from paxcli.models.mixtral import MIXTRAL

SCRIPT = FIXTURES / 'mixtral-8x7b.sh'
EXP = 'maxtext_mixtral_8x7b.py:MaxTextMixtral8x7b'
# The tiny size the trained checks use: 8 experts of 32 units, top-2, 2 layers of 32.
TINY = ['NUM_LAYERS=2', 'MODEL_DIMS=32', 'HIDDEN_DIMS=32', 'NUM_HEADS=4', 'NUM_KV_HEADS=2', 'DIMS_PER_HEAD=8',
        'VOCAB_SIZE=128', 'MAX_SEQ_LEN=16', 'PERCORE_BATCH_SIZE=1', 'NUM_TRAIN_STEPS=2', 'DCN_MESH_SHAPE=None',
        'FPROP_DTYPE=float32']


def _knobs(script, capsys, *args):
  code, out, err = pax_main(['import-maxtext', str(script), '--dry-run', '--json', *args], capsys)
  assert code == 0, err
  return json.loads(out)['knobs']


def _script(tmp_path, *keys, name='mx.sh'):
  """A MaxText launch of model_name=mixtral-8x7b with the given key=value overrides."""
  script = tmp_path / name
  script.write_text('python3 -m maxtext.trainers.pre_train.train src/maxtext/configs/base.yml model_name=mixtral-8x7b '
                    'run_name=x steps=5 ' + ' '.join(keys) + '\n')
  return script


def _flat(knob_values):
  values = {k: v for k, v in knob_values.items() if k in {n.name for n in LM_KNOBS}}
  return types.SimpleNamespace(**effective(values, LM_KNOBS))


def test_mixtral_script_imports_to_the_mixtral_family(capsys):
  knobs = _knobs(SCRIPT, capsys, '--topology', 'v5p-128')
  assert knobs['UNSUPPORTED_FEATURES'] == {}
  assert (knobs['NUM_LAYERS'], knobs['MODEL_DIMS'], knobs['HIDDEN_DIMS'], knobs['NUM_HEADS'], knobs['NUM_KV_HEADS'],
          knobs['VOCAB_SIZE']) == (32, 4096, 14336, 32, 8, 32000)
  assert (knobs['NUM_EXPERTS'], knobs['EXPERTS_PER_TOKEN'], knobs['ROUTER_SOFTMAX']) == (8, 2, 'after_topk')
  assert knobs['MOE_DISPATCH'] == 'dropless' and 'EXPERT_CAPACITY_FACTOR' not in knobs
  # MaxText: the mean over 32 layers of a loss that is k = 2 when balanced; paxcli: the sum of one that is 1
  assert knobs['LOAD_BALANCE_LOSS_WEIGHT'] == pytest.approx(0.01 * 2 / 32)
  # 64 devices of a v5p-128: expert 8, fsdp fills the other 8 -> [stage, replica, data, expert, mdl]
  assert knobs['ICI_MESH_SHAPE'] == [1, 1, 8, 8, 1] and knobs['DCN_MESH_SHAPE'] == [1, 1, 1, 1, 1]
  assert MIXTRAL.misfit(_flat(knobs)) == []
  # without a device count the data axis fills when pax trains
  assert _knobs(SCRIPT, capsys)['ICI_MESH_SHAPE'] == [1, 1, -1, 8, 1]


def test_the_recipe_holds_the_knobs_as_literals_and_describes_mixtral(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  code, out, err = pax_main(['import-maxtext', str(SCRIPT), 'RUN_NAME=x"""; import os', '--topology', 'v5p-128'],
                            capsys)
  assert code == 0, err
  source = (tmp_path / 'maxtext_mixtral_8x7b.py').read_text()
  tree = ast.parse(source)
  imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
  assert imports == ['from paxcli.models import LmExperiment']   # the script's text stays text
  body = next(n for n in tree.body if isinstance(n, ast.ClassDef)).body
  values = {n.targets[0].id: ast.literal_eval(n.value) for n in body if isinstance(n, ast.Assign)}
  assert {k: values[k] for k in ('NUM_EXPERTS', 'EXPERTS_PER_TOKEN', 'MOE_DISPATCH', 'ICI_MESH_SHAPE')} == {
      'NUM_EXPERTS': 8, 'EXPERTS_PER_TOKEN': 2, 'MOE_DISPATCH': 'dropless', 'ICI_MESH_SHAPE': [1, 1, 8, 8, 1]}
  assert 'NUM_EXPERTS = 8  # num_experts=8' in source
  code, out, err = pax_main(['describe', '--exp', EXP], capsys)
  assert code == 0, err
  # Mixtral 8x7B's published figures (as recipes/mixtral.py): 46.7B parameters, 12.9B active
  assert '# parameters: 46.7 G (46,702,792,704); active per token: 12.9 G (12,879,925,248' in out


@pytest.mark.parametrize('keys, args, dispatch', [
    (('sparse_matmul=true', 'capacity_factor=1.25'), (), 'dropless'),    # the sparse path never drops
    (('sparse_matmul=false', 'capacity_factor=-1'), (), 'dropless'),     # the dense path without a capacity
    (('sparse_matmul=false', 'megablox=false'), (), 'dropless'),         # base.yml's capacity_factor -1
    (('sparse_matmul=false', 'capacity_factor=1.25'), (), 'capacity'),
    # before sparse_matmul (2025-01-15) megablox chose the sparse path; since, sparse_matmul (true by default)
    (('megablox=false', 'capacity_factor=1.25'), ('--maxtext-date', '2024-12-01'), 'capacity'),
    (('megablox=false', 'capacity_factor=1.25'), (), 'dropless'),
])
def test_dispatch(keys, args, dispatch, tmp_path, capsys):
  assert _knobs(_script(tmp_path, *keys), capsys, *args)['MOE_DISPATCH'] == dispatch


@pytest.mark.parametrize('length, factor', [(4096, 1.25), (4096, 1.1), (100, 1.1), (36, 2.0), (4096, 0.3)])
def test_capacity_is_maxtexts_per_sequence(length, factor, tmp_path, capsys):
  """MaxText's capacity per sequence is int(max(ceil(L k / E) x factor, factor)); paxcli's ceil(factor x L k / E):
  the imported factor gives paxcli's layer (paxcli.layers.moe.expert_capacity) MaxText's number of slots."""
  knobs = _knobs(_script(tmp_path, 'sparse_matmul=false', f'capacity_factor={factor}', f'max_target_length={length}'),
                 capsys)
  assert knobs['MOE_DISPATCH'] == 'capacity'
  maxtext = int(max(math.ceil(length * 2 / 8) * factor, factor))
  assert expert_capacity(length, 8, 2, knobs['EXPERT_CAPACITY_FACTOR']) == min(maxtext, length)
  if factor * length * 2 / 8 == int(factor * length * 2 / 8):
    assert knobs['EXPERT_CAPACITY_FACTOR'] == factor   # the same number where both round alike


def test_load_balance_weight_defaults_by_date(tmp_path, capsys):
  """MaxText's default weight: 0.01 from 2024-08-31, 0.0 since 2025-12-26 (today's, without --maxtext-date)."""
  script = _script(tmp_path)
  assert _knobs(script, capsys)['LOAD_BALANCE_LOSS_WEIGHT'] == 0.0
  assert _knobs(script, capsys, '--maxtext-date', '2025-06-01')['LOAD_BALANCE_LOSS_WEIGHT'] == pytest.approx(
      0.01 * 2 / 32)


def test_explicit_experts_and_the_8x22b_preset(tmp_path, capsys):
  knobs = _knobs(_script(tmp_path, 'num_experts=4', 'num_experts_per_tok=1', 'dcn_expert_parallelism=2',
                         'ici_expert_parallelism=2', 'ici_fsdp_parallelism=-1'), capsys,
                 '--num-devices', '16', '--num-slices', '2')
  assert (knobs['NUM_EXPERTS'], knobs['EXPERTS_PER_TOKEN']) == (4, 1)
  assert knobs['ICI_MESH_SHAPE'] == [1, 1, 4, 2, 1] and knobs['DCN_MESH_SHAPE'] == [1, 1, 1, 2, 1]
  script = tmp_path / 'x22.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml model_name=mixtral-8x22b run_name=x steps=5\n')
  knobs = _knobs(script, capsys)
  # MaxText's configs/models/mixtral-8x22b.yml
  assert (knobs['NUM_LAYERS'], knobs['MODEL_DIMS'], knobs['HIDDEN_DIMS'], knobs['NUM_HEADS'], knobs['NUM_KV_HEADS'],
          knobs['VOCAB_SIZE'], knobs['NUM_EXPERTS'], knobs['EXPERTS_PER_TOKEN']) == (56, 6144, 16384, 48, 8, 32768, 8, 2)
  assert knobs['ICI_MESH_SHAPE'] == [1, -1, 1]   # no expert parallelism: Pax's three axes


def test_experts_on_a_block_without_them_stay_unsupported(tmp_path, capsys):
  """num_experts on MaxText's llama2 block: paxcli builds that block with a dense MLP, and says so."""
  script = tmp_path / 'l.sh'
  script.write_text('python3 MaxText/train.py MaxText/configs/base.yml model_name=llama2-7b num_experts=8 run_name=x\n')
  knobs = _knobs(script, capsys)
  assert 'decoder_block=mixtral' in knobs['UNSUPPORTED_FEATURES']['mixture_of_experts'] and 'NUM_EXPERTS' not in knobs


@pytest.mark.parametrize('keys, message', [
    (('num_experts_per_tok=9',), 'num_experts_per_tok=9 is more than num_experts=8'),
    (('ici_expert_parallelism=3', 'ici_fsdp_parallelism=1'), 'does not divide num_experts=8'),
    (('ici_expert_parallelism=2', 'dcn_expert_parallelism=3'), 'does not divide num_experts=8'),
    (('capacity_factor=0', 'sparse_matmul=false'), 'capacity_factor=0 with sparse_matmul=false'),
    (('capacity_factor=0.1', 'sparse_matmul=false', 'max_target_length=8'), 'every token would be dropped'),
    (('num_experts=two',), 'num_experts='),
    (('base_moe_mlp_dim=4096',), 'base_moe_mlp_dim=4096 differs from base_mlp_dim=14336'),
])
def test_bad_values_are_one_line(keys, message, tmp_path, capsys):
  code, out, err = pax_main(['import-maxtext', str(_script(tmp_path, *keys)), '--dry-run'], capsys)
  assert code == 2 and message in err, (out, err)
  assert 'Traceback' not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow   # two 2-step trainings on 8 fake devices (~40 s on the loaded 2-core machine)
@pytest.mark.parametrize('keys', [(), ('sparse_matmul=false', 'capacity_factor=1.25')])
def test_the_recipe_trains_with_experts_sharded_four_ways(keys, tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  script = tmp_path / 'mixtral-8x7b.sh'
  script.write_text(SCRIPT.read_text().replace('capacity_factor=-1 ', ' '.join(keys) + ' ') if keys
                    else SCRIPT.read_text())
  code, _, err = pax_main(['import-maxtext', str(script)], capsys)
  assert code == 0, err
  sets = [a for s in TINY + ['ICI_MESH_SHAPE=[1,1,2,4,1]', 'SUMMARY_INTERVAL_STEPS=1'] for a in ('--set', s)]
  code, out, err = pax_main(['train', '--exp', EXP, *sets, '--job-log-dir', 'runs/tiny'], capsys)
  assert code == 0, err
  assert 'Done: step 2' in out and 'mesh stage=1 x replica=1 x data=2 x expert=4 x mdl=1' in out
  metrics = [json.loads(line) for line in (tmp_path / 'runs/tiny/train_metrics.jsonl').read_text().splitlines()]
  assert metrics and all(math.isfinite(m['loss']) for m in metrics if 'loss' in m)
  assert any(re.search('expert_load_max', k) for m in metrics for k in m), metrics[-1].keys()


@pytest.mark.slow   # compiles the real-size step for 64 devices (~25 s on the 2-core machine)
def test_the_real_size_recipe_plans_on_64_devices(tmp_path, capsys, monkeypatch):
  from conftest import run_pax
  monkeypatch.chdir(tmp_path)
  code, _, err = pax_main(['import-maxtext', str(SCRIPT), '--topology', 'v5p-128'], capsys)
  assert code == 0, err
  done = run_pax('bench', 'mfu', '--exp', EXP, '--compile-only', '--num-devices', '64', '--device-memory', '80GiB',
                 '--json', cwd=str(tmp_path), timeout=900)
  assert done.returncode == 0, done.stderr[-2000:]
  row = json.loads(done.stdout)[0]
  # per_device_batch_size 2 of 4096 tokens: 54 GB a device (float32 weights and Adam, bf16 activations)
  assert row['status'] == 'compiled' and row['devices'] == 64 and row['fits'] is True, row
  assert row['memory_total_bytes'] < 80 * 2**30
  assert row['mesh'] == 'stage=1 x replica=1 x data=8 x expert=8 x mdl=1'


def test_from_maxtext_refuses_a_mixtral_recipe_in_one_line(tmp_path, capsys):
  """--from maxtext reads no MaxText MoE checkpoints: a Mixtral recipe (here the llama2 fixture's script with
  decoder_block=mixtral and 4 experts) is refused before anything is read or written."""
  from test_convert_maxtext import _convert_into_edited_recipe
  code, err = _convert_into_edited_recipe('llama2_scanned', 'decoder_block=llama2',
                                          'decoder_block=mixtral num_experts=4 num_experts_per_tok=2', tmp_path, capsys)
  assert code == 2 and 'reads no MaxText MoE (mixtral) checkpoints' in err and len(err.strip().splitlines()) == 1, err
