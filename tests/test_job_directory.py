"""The job directory is the unit a user names (issue 32, items 1 and 3): after `make train`, `pax train
--set TRAIN_DATA='my/*.jsonl'` trains on the files in a job directory of its own; a trained job refuses
other data; and every command that reads a job, given only --job-log-dir, uses the experiment and
--set settings it was trained with. Two runs from a fresh shell are shared by every test here."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import pax_main, run_pax

WORDS = ('alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud light '
         'number return value create object string list table field record').split()
# The built-in default experiment, shrunk: one layer, rows of 32 tokens, 8 rows a step, an eval at the end.
SMALL = ['--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2',
         '--set', 'VOCAB_SIZE=512', '--set', 'MAX_SEQ_LEN=32', '--set', 'PERCORE_BATCH_SIZE=1',
         '--set', 'ICI_MESH_SHAPE=[1,8,1]', '--set', 'DECODE_INTERVAL_STEPS=0', '--set', 'NUM_TRAIN_STEPS=4',
         '--set', 'SAVE_INTERVAL_STEPS=2']
DEFAULT, OWN = os.path.join('runs', 'default.StdlibDocsLm'), os.path.join('runs', 'default.StdlibDocsLm_on_my')


def _write_data(root) -> None:
  rng = np.random.default_rng(0)
  os.makedirs(root / 'my')
  for name, docs in (('a', range(0, 120)), ('b', range(120, 200))):
    with open(root / 'my' / f'{name}.jsonl', 'w') as f:
      for i in docs:
        f.write(json.dumps({'text': f'doc{i}: ' + ' '.join(rng.choice(WORDS, size=int(rng.integers(5, 30))))}) + '\n')


@pytest.fixture(scope='module')
def first_hour(tmp_path_factory):
  """`make train` (the default experiment, shrunk), then the README's own-data command in the same
  directory, each from a fresh shell: (directory, the own-data run's output)."""
  cwd = tmp_path_factory.mktemp('first_hour')
  _write_data(cwd)
  # No eval in this run (its 98 batches of the built-in eval split at the end): no test reads its eval rows.
  made = run_pax('train', *SMALL, '--set', 'EVAL_INTERVAL_STEPS=0', cwd=cwd)
  assert made.returncode == 0, made.stderr[-3000:]
  own = run_pax('train', '--set', 'TRAIN_DATA=my/*.jsonl', *SMALL, '--set', 'EVAL_INTERVAL_STEPS=3', cwd=cwd)
  assert own.returncode == 0, own.stderr[-3000:]
  return cwd, own.stdout + own.stderr


def _steps(job) -> list[int]:
  return sorted(int(s) for s in os.listdir(os.path.join(job, 'checkpoints')) if s.isdigit())


def _lines(path) -> list[str]:
  with open(path) as f:
    return f.read().splitlines()


def test_own_data_after_make_train_trains_in_a_job_directory_named_after_the_data(first_hour):
  cwd, out = first_hour
  assert f'Job directory {OWN}, named after TRAIN_DATA' in out
  assert _steps(cwd / OWN) == [2, 4] and _steps(cwd / DEFAULT) == [2, 4]
  made = json.loads(_lines(cwd / OWN / 'experiment.jsonl')[-1])
  assert made['experiment'] == 'default.StdlibDocsLm'
  assert f"TRAIN_DATA={cwd / 'my' / '*.jsonl'}" in made['overrides']   # recorded as it reads from anywhere
  # the last step (4) is no multiple of EVAL_INTERVAL_STEPS=3: evaluated at 3 and, at the end, at 4
  assert [r['step'] for r in map(json.loads, _lines(cwd / OWN / 'eval_metrics.jsonl'))] == [3, 4]


def test_other_data_in_a_trained_job_is_refused_in_one_line(first_hour, capsys, monkeypatch):
  cwd, _ = first_hour
  monkeypatch.chdir(cwd)
  before = (_steps(DEFAULT), _lines(os.path.join(DEFAULT, 'experiment.jsonl')))
  code, out, err = pax_main(['train', '--set', 'TRAIN_DATA=my/*.jsonl', *SMALL, '--job-log-dir', DEFAULT], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert 'TRAIN_DATA: None ->' in err and 'new --job-log-dir' in err and '--force-resume' in err
  code, out, err = pax_main(['train', *SMALL, '--set', 'NUM_LAYERS=2', '--job-log-dir', DEFAULT], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1 and 'other shapes' in err and 'NUM_LAYERS' in err, err
  assert (_steps(DEFAULT), _lines(os.path.join(DEFAULT, 'experiment.jsonl'))) == before
  code, out, err = pax_main(['train', '--set', 'TRAIN_DATA=my/*.jsonl', *SMALL, '--job-log-dir', DEFAULT,
                             '--force-resume'], capsys)
  assert code == 0 and 'Run already finished' in out, err   # the user meant it: no refusal


def test_a_resume_with_the_same_settings_notes_no_difference(first_hour, capsys, monkeypatch):
  cwd, _ = first_hour
  monkeypatch.chdir(cwd)
  job = os.path.join('runs', 'resumed')
  shutil.copytree(OWN, job)
  code, out, err = pax_main(['train', '--set', 'TRAIN_DATA=my/*.jsonl', *SMALL, '--set', 'EVAL_INTERVAL_STEPS=3',
                             '--set', 'NUM_TRAIN_STEPS=5', '--job-log-dir', job], capsys)
  assert code == 0, err
  assert 'Resumed from step 4' in out
  note = out[out.index('setting(s) differ'):]
  assert 'num_train_steps' in note and 'tokenizer' not in note, note   # the kept tokenizer is no difference
  assert len(_lines(os.path.join(job, 'experiment.jsonl'))) == 2   # appended, not overwritten


TUNED = os.path.join('runs', 'tuned')
# LoRA on the `make train` job's weights with own data and shorter rows (MAX_SEQ_LEN 16 of the base's 32).
TUNE = ['train', '--set', f'INIT_FROM={DEFAULT}', '--set', 'TRAIN_DATA=my/*.jsonl', *SMALL, '--set', 'MAX_SEQ_LEN=16',
        '--set', 'LORA_RANK=4', '--set', 'NUM_TRAIN_STEPS=1', '--set', 'SAVE_INTERVAL_STEPS=1']


@pytest.fixture(scope='module')
def tuned(first_hour):
  """TUNE from a fresh shell into runs/tuned: (directory, its output)."""
  cwd, _ = first_hour
  made = run_pax(*TUNE, '--job-log-dir', TUNED, cwd=cwd)
  assert made.returncode == 0, made.stderr[-3000:]
  return cwd, made.stdout + made.stderr


def test_a_run_from_a_jobs_weights_reads_with_the_jobs_tokenizer(tuned, capsys, monkeypatch):
  """Item 0: own data trained from INIT_FROM's weights reads with the tokenizer INIT_FROM's job carries (the
  ids its embeddings learned), instead of training a new one on the data; another TOKENIZER is one line."""
  cwd, out = tuned
  base_tokenizer = (cwd / DEFAULT / 'tokenizer' / 'spm.model').read_bytes()
  assert 'sentencepiece tokenizer' not in out and '(INIT_FROM)' in out, out
  assert 'trainable (LoRA adapters) of' in out   # item 5: a LoRA run counts what it trains
  assert (cwd / TUNED / 'tokenizer' / 'spm.model').read_bytes() == base_tokenizer
  other = os.path.join(OWN, 'tokenizer', 'spm.model')   # trained on my/*.jsonl: another tokenizer than the base's
  assert (cwd / other).read_bytes() != base_tokenizer
  monkeypatch.chdir(cwd)
  code, _, err = pax_main([*TUNE, '--set', f'TOKENIZER={other}', '--job-log-dir', 'runs/refused'], capsys)
  assert code == 2 and len(err.strip().splitlines()) == 1, err
  assert f'INIT_FROM={cwd / DEFAULT} carries the tokenizer' in err and 'leave TOKENIZER unset' in err, err
  assert not os.path.exists('runs/refused')


def test_exports_of_a_fine_tune_need_no_hand_edits(tuned, tmp_path, capsys, monkeypatch):
  """Item 4: --to hf keeps the base's context (max_position_embeddings 32, not the fine-tune's rows of 16);
  --to peft writes --base-model as base_model_name_or_path (a directory made absolute), and without it says
  in a line that the paxcli base it writes instead is no model PEFT can load. (test_finetune_job loads both
  in transformers and PEFT.)"""
  cwd, _ = tuned
  monkeypatch.chdir(cwd)
  code, out, err = pax_main(['checkpoint', 'convert', TUNED, str(tmp_path / 'hf'), '--to', 'hf', '--no-verify'], capsys)
  assert code == 0, err
  config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  assert config['max_position_embeddings'] == 32 and config['rope_scaling'] is None
  os.makedirs('base_hf')
  code, out, err = pax_main(['checkpoint', 'convert', TUNED, str(tmp_path / 'adapter'), '--to', 'peft',
                             '--base-model', 'base_hf', '--no-verify'], capsys)
  assert code == 0, err
  adapter = json.loads((tmp_path / 'adapter' / 'adapter_config.json').read_text())
  assert adapter['base_model_name_or_path'] == str(cwd / 'base_hf')
  code, out, err = pax_main(['checkpoint', 'convert', TUNED, str(tmp_path / 'plain'), '--to', 'peft',
                             '--no-verify'], capsys)
  assert code == 0, err
  assert 'which PEFT cannot load: pass --base-model' in ' '.join((out + err).split()), out + err


def test_readers_given_only_the_job_directory_use_its_experiment_and_settings(first_hour, capsys, monkeypatch):
  """eval, decode, score, inspect-input and the Python API, from another directory, with no --exp or --set."""
  cwd, _ = first_hour
  monkeypatch.chdir(cwd / 'my')
  job = str(cwd / OWN)
  code, out, err = pax_main(['eval', '--job-log-dir', job, '--json'], capsys)
  assert code == 0, err
  assert '--exp default.StdlibDocsLm' in err and '(as trained)' in err and 'reads other data' not in err
  trainer = json.loads(_lines(os.path.join(job, 'eval_metrics.jsonl'))[-1])
  assert json.loads(out)['results']['eval']['loss'] == pytest.approx(trainer['loss'], rel=1e-5)
  code, out, err = pax_main(['eval', '--exp', 'default.StdlibDocsLm', '--job-log-dir', job, '--json'], capsys)
  assert code == 0 and '(as trained)' in err, err   # --exp naming the job's own experiment keeps its settings
  assert json.loads(out)['results']['eval']['loss'] == pytest.approx(trainer['loss'], rel=1e-5)
  code, out, err = pax_main(['eval', '--job-log-dir', job, '--json', '--set', 'EVAL_DATA=a.jsonl'], capsys)
  assert code == 0, err
  said = [line for line in err.splitlines() if '(as trained)' in line]
  assert len(said) == 1 and said[0].endswith('given here, on top: --set EVAL_DATA=a.jsonl.'), err
  code, out, err = pax_main(['decode', '--job-log-dir', job, '--prompt', 'doc3:', '--num-samples', '2',
                             '--temperature', '1', '--max-decode-steps', '4'], capsys)
  assert code == 0, err
  # one number a column: prompt 0, samples 0 and 1 (once shown as 0 and 0.1)
  assert re.search(r'prompt #\s*┃\s*sample', out) and re.search(r'│\s*0\s*│\s*1\s*│', out), out
  assert 'Wrote 2 results' in err
  (cwd / 'requests.jsonl').write_text(json.dumps({'context': 'doc1: alpha', 'continuation': ' beta'}) + '\n')
  code, out, err = pax_main(['score', '../requests.jsonl', '--job-log-dir', job], capsys)
  assert code == 0 and 'Scored 1 request (1 window,' in err and 'Wrote 1 result to' in err, err
  code, out, err = pax_main(['inspect-input', '--job-log-dir', job, '--num-batches', '1', '--json'], capsys)
  assert code == 0, err
  texts = ' '.join(e['text'] for e in json.loads(out.splitlines()[0])['examples'])
  assert 'doc' in texts and any(w in texts for w in WORDS)   # the job's own files, its tokenizer
  import paxcli
  from rich.console import Console
  assert paxcli.evaluate(job_dir=job, console=Console(quiet=True))['results']['eval']['loss'] == \
      pytest.approx(trainer['loss'], rel=1e-5)


def test_an_experiment_that_cannot_read_the_job_names_the_jobs_own_first(first_hour, capsys):
  cwd, _ = first_hour
  code, _, err = pax_main(['decode', '--exp', 'lm_cloud.LmCloudSpmdTest', '--job-log-dir', str(cwd / OWN),
                           '--prompt-ids', '1,2'], capsys)
  assert code == 2
  first = err.strip().splitlines()[-len(err.strip().splitlines())]
  assert 'using --exp lm_cloud.LmCloudSpmdTest as given' in first
  error = next(line for line in err.splitlines() if line.startswith('error:'))
  assert 'was trained with --exp default.StdlibDocsLm' in error and 'TRAIN_DATA=' in error and 'Cannot decode' in error


def test_another_experiment_of_the_same_shapes_is_said_to_read_other_data(first_hour, tmp_path, capsys):
  """`--exp` naming another experiment (here the same model, not registered) is used as given, without the
  job's --set: it evaluates its own inputs, and a note says so instead of a normal-looking table alone."""
  cwd, _ = first_hour
  (tmp_path / 'same.py').write_text('from paxcli.recipes.default import StdlibDocsLm\n\n\n'
                                    'class Same(StdlibDocsLm):\n  pass\n')
  code, out, err = pax_main(['eval', '--exp', f'{tmp_path / "same.py"}:Same', *SMALL, '--job-log-dir',
                             str(cwd / OWN)], capsys)
  assert code == 0, err
  assert 'without those settings' in err and 'Note: this eval reads other data than the checkpoint' in err, err


def test_a_job_naming_code_is_not_imported_on_its_word(first_hour, tmp_path, capsys):
  """A job (perhaps received) whose record names an experiment file: readers ask for --exp instead of
  importing it; a malformed record is one line."""
  cwd, _ = first_hour
  job = tmp_path / 'job'
  shutil.copytree(cwd / OWN, job)
  planted = tmp_path / 'planted.py'
  planted.write_text('raise SystemExit("ran")\n')
  with open(job / 'experiment.jsonl', 'a') as f:
    f.write(json.dumps({'experiment': f'{planted}:Lm', 'overrides': []}) + '\n')
  code, _, err = pax_main(['eval', '--job-log-dir', str(job)], capsys)
  assert code == 2 and f'add --exp {planted}:Lm' in err and len(err.strip().splitlines()) == 1, err
  with open(job / 'experiment.jsonl', 'a') as f:
    f.write('{"experiment": [1]}\n')
  code, _, err = pax_main(['eval', '--job-log-dir', str(job)], capsys)
  assert code == 2 and 'is not a job record' in err, err


def test_a_bench_of_a_job_uses_its_settings(first_hour, capsys):
  cwd, _ = first_hour
  code, out, err = pax_main(['bench', 'mfu', '--job-log-dir', str(cwd / OWN), '--compile-only', '--json'], capsys)
  assert code == 0, err
  assert '(as trained)' in err
  row = json.loads(out)[0]
  assert (row['seq_len'], row['global_batch']) == (32, 8)   # the job's MAX_SEQ_LEN and batch, not the default's


@pytest.mark.slow   # a follower and a trainer, two fresh processes side by side: about a minute on a shared machine
def test_a_follower_started_before_its_trainer_evaluates_what_the_trainer_trains(first_hour):
  """`pax eval --follow --job-log-dir D` with no --exp or --set, started first, waits for the trainer's
  record and evaluates the trainer's own data and model, stopping at the trainer's last step."""
  cwd, _ = first_hour
  job = os.path.join('runs', 'followed')
  follower = subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', 'eval', '--follow', '--timeout', '600',
                               '--poll', '1', '--job-log-dir', job, '--json'], cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
  try:
    trained = run_pax('train', '--set', 'TRAIN_DATA=my/*.jsonl', *SMALL, '--job-log-dir', job, cwd=cwd)
    assert trained.returncode == 0, trained.stderr[-3000:]
    out, err = follower.communicate(timeout=900)
  finally:
    if follower.poll() is None:
      follower.kill()
  assert follower.returncode == 0, err[-3000:]
  assert 'Waiting for a trainer to start' in err and '(as trained)' in err
  rows = {r['step']: r['results']['eval']['loss'] for r in map(json.loads, out.splitlines())}
  trainer = json.loads(_lines(cwd / job / 'eval_metrics.jsonl')[-1])
  assert sorted(rows) == [2, 4] and rows[4] == pytest.approx(trainer['loss'], rel=1e-5)
