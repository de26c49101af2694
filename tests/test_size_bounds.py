"""Settings and received configs are bounded before anything is built (issue 33): `pax describe`
refuses what `pax train` refuses, in the same one line; sizes that cannot be traced or held on this
machine are one line naming the numbers (a 70B model is still described); a paxml model_params.txt,
an HF config.json and a MaxText script each name the file and the line or field."""

import os
import shutil

import pytest

from conftest import REPO, pax_main
from test_untrusted_files import CONFIG, make_hf

# Llama-2-70B's shape (80 layers of 8192, GQA 64/8 heads, FFN 28672, vocab 32000).
LLAMA_70B = ['NUM_LAYERS=80', 'MODEL_DIMS=8192', 'HIDDEN_DIMS=28672', 'NUM_HEADS=64', 'NUM_KV_HEADS=8',
             'DIMS_PER_HEAD=128', 'VOCAB_SIZE=32000', 'MAX_SEQ_LEN=4096', 'SEPARATE_EMBEDDING=True',
             'USE_REPEATED_LAYER=True']


def _sets(overrides):
  return [a for o in overrides for a in ('--set', o)]


def _one_line(code, err, *phrases) -> str:
  text = ' '.join(err.split())
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err[-3000:]
  for phrase in phrases:
    assert phrase in text, (phrase, err)
  return text


@pytest.mark.parametrize('sets,phrase', [
    (['NUM_HEADS=3', 'MODEL_DIMS=64'], 'DIMS_PER_HEAD'),
    (['VOCAB_SIZE=-1'], 'vocab_size must be at least 1, got -1'),
    (['ICI_MESH_SHAPE=[0,1,1]'], 'ICI_MESH_SHAPE [0, 1, 1]: entries must be positive'),
    (['NUM_LAYERS=1000000000'], 'NUM_LAYERS is 1,000,000,000; paxcli builds models with NUM_LAYERS of at most 65,536'),
    (['NUM_LAYERS=50000'], 'num_layers (NUM_LAYERS) is 50,000 unrolled layers'),
    (['MAX_SEQ_LEN=10000000000'], 'MAX_SEQ_LEN is 10,000,000,000; paxcli builds models with MAX_SEQ_LEN of at most'),
    (['MAX_SEQ_LEN=2000000000'], 'The sequence length 2,000,000,000'),
])
def test_describe_refuses_what_train_refuses_in_the_same_line(sets, phrase, tmp_path, capsys):
  code, _, err = pax_main(['describe', *_sets(sets)], capsys)
  described = _one_line(code, err, phrase)
  code, _, err = pax_main(['train', *_sets(sets), '--job-log-dir', str(tmp_path / 'job')], capsys)
  assert _one_line(code, err, phrase) == described
  assert not (tmp_path / 'job').exists()   # refused before the job directory is made


def test_a_scanned_65536_layers_is_described_and_refused_before_allocating(tmp_path, capsys):
  sets = ['--exp', 'lm_cloud.LmCloudSpmdTest', *_sets(['NUM_LAYERS=65536', 'USE_REPEATED_LAYER=True'])]
  code, out, err = pax_main(['describe', *sets], capsys)
  assert code == 0, err[-3000:]
  count = next(line for line in out.splitlines() if line.startswith('# parameters')).split('(')[1].rstrip(')')
  code, _, err = pax_main(['train', *sets, '--job-log-dir', str(tmp_path / 'job')], capsys)
  _one_line(code, err, 'parameters and optimizer state alone take', f'({count} parameters', 'a device here holds')
  assert not os.path.exists(tmp_path / 'job' / 'checkpoints' / '0')


def test_a_70b_model_is_still_described(capsys):
  code, out, err = pax_main(['describe', *_sets(LLAMA_70B)], capsys)
  assert code == 0, err[-3000:]
  count = int(next(line for line in out.splitlines() if line.startswith('# parameters')).split('(')[1].rstrip(')')
              .replace(',', ''))
  assert 68e9 < count < 70e9


def test_a_non_integer_in_model_params_is_one_line_with_file_and_line(tmp_path, capsys):
  job = tmp_path / 'job'
  shutil.copytree(REPO / 'tests' / 'fixtures' / 'paxml' / 'repeated', job)
  config = job / 'model_params.txt'
  lines = config.read_text().splitlines()
  n = next(i for i, line in enumerate(lines) if line.startswith('model.lm_tpl.model_dims : '))
  lines[n] = 'model.lm_tpl.model_dims : thirty-two'
  config.write_text('\n'.join(lines) + '\n')
  code, _, err = pax_main(['checkpoint', 'convert', str(job), str(tmp_path / 'out'), '--from', 'paxml'], capsys)
  _one_line(code, err, f'model_params.txt:{n + 1}: model.lm_tpl.model_dims is', 'thirty-two', 'must be an integer')
  assert sorted(os.listdir(tmp_path)) == ['job']


@pytest.mark.parametrize('positions,phrases', [
    (10 ** 12, ('config.json: max_position_embeddings is 1,000,000,000,000; paxcli reads at most 2,147,483,647',)),
    (2 * 10 ** 9, ('config.json: max_position_embeddings 2,000,000,000 cannot be built here', "of this machine's")),
])
def test_an_hf_config_claiming_too_many_positions_is_one_line(positions, phrases, tmp_path, capsys):
  src = make_hf(tmp_path / 'hf', {**CONFIG, 'max_position_embeddings': positions})
  code, _, err = pax_main(['checkpoint', 'convert', src, str(tmp_path / 'out'), '--from', 'hf'], capsys)
  _one_line(code, err, *phrases)
  assert sorted(os.listdir(tmp_path)) == ['hf']


def _script(path, body):
  path.write_text('#!/bin/bash\n' + '\n'.join(body) + '\npython3 MaxText/train.py MaxText/configs/base.yml '
                  'run_name=x steps=10\n')
  return str(path)


def test_a_doubling_maxtext_script_stops_at_the_line_past_the_bound(tmp_path, capsys):
  body = ['A0=xxxxxxxxxxxxxxxx'] + [f'A{i}="$A{i - 1}$A{i - 1}"' for i in range(1, 41)]
  script = _script(tmp_path / 'doubling.sh', body)   # A17 (line 19) is the first over 1 MiB
  code, _, err = pax_main(['import-maxtext', script, '-o', str(tmp_path / 'r.py')], capsys)
  _one_line(code, err, f'{script}: line 19: a value expands to 2,097,152 characters', 'at most 1,048,576')
  loops = ['L="' + ' '.join('abcdefghijklmnopqrstuvwxyz') + '"'] + ['for v in $L; do'] * 4 + ['X=1'] + ['done'] * 4
  script = _script(tmp_path / 'loops.sh', loops)
  code, _, err = pax_main(['import-maxtext', script, '-o', str(tmp_path / 'r.py')], capsys)
  _one_line(code, err, f'{script}: line 6: reading the script ran over 100,000 commands')
  assert sorted(os.listdir(tmp_path)) == ['doubling.sh', 'loops.sh']


@pytest.mark.slow
def test_a_70b_model_still_compiles_for_a_fake_mesh(capsys):
  """`pax bench mfu --compile-only` builds no state: the bound on what a device holds is no bar to
  planning a 70B run on eight fake CPU devices (it reports that the step does not fit them)."""
  code, out, err = pax_main(['bench', 'mfu', '--exp', 'lm_cloud.LmCloudSpmdTest', *_sets(LLAMA_70B),
                             '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--compile-only',
                             '--num-devices', '8', '--json'], capsys)
  assert code == 0, err[-3000:]
  import json
  row = json.loads(out)[0]
  assert row['status'] in ('compiled', 'does not fit') and row['params'] > 4e10, row
