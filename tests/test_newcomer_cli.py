"""What a newcomer trips on (issue 13), through the CLI: ignored knobs, resume notes and
history, data that trains nothing, help text and versions, names of eval files."""

import json
import os
import re
import textwrap

import pytest

from conftest import pax_main, run_pax

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=2', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=4', '--set', 'PERCORE_BATCH_SIZE=1',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'VOCAB_SIZE=64', '--set', 'ICI_MESH_SHAPE=[1,8,1]',
        '--set', 'task.train.summary_interval_steps=5', '--set', 'task.train.save_interval_steps=5']

README_EXPERIMENT = '''
from paxcli.models import LmExperiment

class MyLm(LmExperiment):
  NUM_LAYERS = 2
  MODEL_DIMS = 32

  def task(self):
    task = super().task()
    task.train.num_train_steps = 300
    return task
'''


def test_knob_that_task_overrides_warns_with_field_and_both_values(tmp_path, capsys):
  (tmp_path / 'my_experiments.py').write_text(README_EXPERIMENT)
  exp = str(tmp_path / 'my_experiments.py') + ':MyLm'
  code, out, err = pax_main(['describe', '--exp', exp, '--set', 'NUM_TRAIN_STEPS=2'], capsys)
  assert code == 0, err
  assert 'task.train.num_train_steps = 300' in out
  warning = ' '.join(err.split())
  assert 'warning:' in warning and 'NUM_TRAIN_STEPS=2 does not reach task.train.num_train_steps' in warning
  assert 'MyLm.task() sets it to 300' in warning and 'would make it 2' in warning
  # A knob that reaches its field, or the field set directly, warns of nothing.
  for extra in (['--set', 'NUM_LAYERS=3'], ['--set', 'NUM_TRAIN_STEPS=2', '--set', 'task.train.num_train_steps=2']):
    code, out, err = pax_main(['describe', '--exp', exp, *extra], capsys)
    assert code == 0 and 'warning' not in err, err
  # The default recipe's knobs all reach their fields.
  code, _, err = pax_main(['describe', '--set', 'NUM_TRAIN_STEPS=7', '--set', 'MAX_SEQ_LEN=32',
                           '--set', 'LEARNING_RATE=0.01'], capsys)
  assert code == 0 and 'warning' not in err, err


def test_mesh_bigger_than_the_machine_says_how_to_run_it_on_fake_devices(tmp_path):
  (tmp_path / 'my_experiments.py').write_text(README_EXPERIMENT.replace('MODEL_DIMS = 32', 'ICI_MESH_SHAPE = [1, 4, 2]'))
  r = run_pax('train', '--exp', 'my_experiments.py:MyLm', cwd=tmp_path, env={'XLA_FLAGS': ''})
  assert r.returncode == 2 and 'Traceback' not in r.stderr
  assert 'XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu' in ' '.join(r.stderr.split())


def test_datasets_returning_built_objects_says_what_to_return(tmp_path, capsys):
  (tmp_path / 'plain.py').write_text(textwrap.dedent('''
      from paxcli.inputs.synthetic import SyntheticLmInput
      from paxcli.models import LmExperiment

      class PlainLm(LmExperiment):
        def datasets(self):
          return [SyntheticLmInput(name='train', is_training=True)]
      '''))
  code, _, err = pax_main(['describe', '--exp', f"{tmp_path / 'plain.py'}:PlainLm"], capsys)
  assert code == 2 and 'Traceback' not in err
  assert 'returned a SyntheticLmInput object; return fiddle configs' in ' '.join(err.split())


def test_inspect_input_says_when_the_input_ended(capsys):
  args = ['inspect-input', '--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'MAX_SEQ_LEN=16', '--set', 'VOCAB_SIZE=64',
          '--split', 'eval', '--num-examples', '0']
  code, out, err = pax_main([*args, '-n', '5'], capsys)
  assert code == 0, err
  assert 'Read 2 batches' in out and 'The input ended after 2 batches of the 5 asked for' in ' '.join(out.split())
  code, out, err = pax_main([*args, '-n', '2'], capsys)
  assert code == 0 and 'Read 2 batches' in out and 'ended' not in out


def test_resume_notes_changed_settings_and_keeps_invocation_history(tmp_path, capsys):
  job = str(tmp_path / 'job')
  code, out, err = pax_main(['train', *TINY, '--job-log-dir', job, '--set', 'NUM_TRAIN_STEPS=2'], capsys)
  assert code == 0, err
  code, out, err = pax_main(['train', *TINY, '--job_log_dir', job, '--set', 'NUM_TRAIN_STEPS=4',
                             '--set', 'LEARNING_RATE=0.0003'], capsys)
  assert code == 0, err
  assert 'Resumed from step 2' in out
  note = out[out.index('setting(s) differ'):]
  assert 'knobs.LEARNING_RATE: checkpoint 0.001 -> now 0.0003' in note
  assert 'task.train.learning_rate: checkpoint 0.001 -> now 0.0003' in note
  assert 'task.train.num_train_steps: checkpoint 2 -> now 4' in note
  assert 'MODEL_DIMS' not in note  # only what changed
  lines = open(os.path.join(job, 'invocations.txt')).read().splitlines()
  assert len(lines) == 2  # appended, not overwritten
  from paxcli import __version__
  for line, steps in zip(lines, ('NUM_TRAIN_STEPS=2', 'NUM_TRAIN_STEPS=4')):
    assert re.match(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ  paxcli ' + re.escape(__version__) + '  pax train ', line)
    assert steps in line
  assert '--job_log_dir' in lines[1]  # as the user typed it
  assert 'LEARNING_RATE=0.0003' in lines[1]
  # The run ends with where to look.
  assert f"tensorboard --logdir {os.path.join(job, 'summaries')}" in out and 'the latest 3 kept, and the one of lowest loss' in out


ZERO_WEIGHT_EXPERIMENT = '''
import dataclasses
import fiddle as fdl
from paxcli.inputs.synthetic import SyntheticLmInput
from paxcli.models import LmExperiment


@dataclasses.dataclass
class MaskedInput(SyntheticLmInput):
  """A user's input subclass: post-processes each batch (here it masks every token)."""

  def get_next(self):
    batch = super().get_next()
    batch['weights'] = 0 * batch['weights']
    return batch


class MaskedLm(LmExperiment):
  NUM_LAYERS = 2
  MODEL_DIMS = 32
  HIDDEN_DIMS = 64
  MAX_SEQ_LEN = 16
  VOCAB_SIZE = 64
  PERCORE_BATCH_SIZE = 1
  NUM_TRAIN_STEPS = 30
  SUMMARY_INTERVAL_STEPS = 5
  SAVE_INTERVAL_STEPS = 100

  def datasets(self):
    return [fdl.Config(MaskedInput, name='train', is_training=True, seq_len=self.MAX_SEQ_LEN,
                       vocab_size=self.VOCAB_SIZE)]
'''


def test_data_with_every_token_masked_stops_with_a_clear_line(tmp_path):
  (tmp_path / 'masked.py').write_text(ZERO_WEIGHT_EXPERIMENT)
  r = run_pax('train', '--exp', 'masked.py:MaskedLm', cwd=tmp_path)
  assert r.returncode != 0
  err = ' '.join(r.stderr.split())
  assert 'Steps 1-10 all had zero total weight' in err and 'Traceback' not in r.stderr
  assert 'zero total weight' in r.stdout  # the summary windows before the stop warned too
  # An experiment from a file gets a readable job directory name.
  assert os.listdir(tmp_path / 'runs') == ['masked.MaskedLm']
  assert not os.path.isdir(tmp_path / 'runs' / 'masked.MaskedLm' / 'checkpoints' / '10')


def _commands():
  """Every command and subcommand (`checkpoint convert` too), by its words."""
  from paxcli.cli.app import app
  import typer.main
  found = {}

  def walk(cmd, words):
    found[words] = cmd
    for name, sub in getattr(cmd, 'commands', {}).items():
      walk(sub, words + (name,))
  walk(typer.main.get_command(app), ())
  return found


@pytest.mark.parametrize('words', sorted(_commands()), ids=lambda w: ' '.join(w) or 'pax')
def test_help_at_80_columns_shows_every_option_name_in_full(words):
  r = run_pax(*words, '--help', env={'COLUMNS': '80'})
  assert r.returncode == 0, r.stderr
  option_lines = [line for line in r.stdout.splitlines() if line.startswith('  -')]
  assert all(len(line) <= 80 for line in option_lines), [line for line in option_lines if len(line) > 80]
  assert '…' not in r.stdout and not re.search(r'<(str|int|float|bool|list\[str\])>', r.stdout)
  cmd = _commands()[words]
  for name in getattr(cmd, 'commands', {}):  # a group lists each subcommand with a whole line of help
    assert re.search(rf'^  {re.escape(name)} +\S', r.stdout, re.M), name
    assert not re.search(rf'^  {re.escape(name)} .*\.\.\.$', r.stdout, re.M), f'{name}: help cut with ...'
  for param in cmd.params:
    for opt in param.opts + param.secondary_opts:
      if opt.startswith('-'):
        assert re.search(rf'(^|[ ,]){re.escape(opt)}([ ,=]|$)', r.stdout, re.M), f'{words}: {opt} not in full'
  if any('--set' in p.opts for p in cmd.params):
    assert '--set KEY=VALUE' in r.stdout


def test_version_flag_and_command():
  from paxcli import __version__
  r = run_pax('--version')
  assert r.returncode == 0 and r.stdout.strip() == f'paxcli {__version__}'
  r = run_pax('version', '--json')
  assert r.returncode == 0, r.stderr
  info = json.loads(r.stdout)
  import jax
  import flax
  assert info['versions']['jax'] == jax.__version__ and info['versions']['flax'] == flax.__version__
  assert info['versions']['jaxlib'] and info['versions']['orbax-checkpoint']
  assert len(info['devices']) == 8 and info['backend'] == 'cpu'
  r = run_pax('version')
  assert 'orbax-checkpoint' in r.stdout and re.search(r'devices +8 x cpu', r.stdout)


TYPO_SCRIPT = '''#!/bin/bash
python3 MaxText/train.py MaxText/configs/base.yml run_name=typo steps=10 per_devcie_batch_size=2 \\
  base_emb_dim=256 base_num_heads=4 base_mlp_dim=1024 base_num_decoder_layers=2
'''


def test_maxtext_key_unknown_to_the_eras_base_yml_is_refused_unless_lenient(tmp_path, capsys):
  script = tmp_path / 'typo.sh'
  script.write_text(TYPO_SCRIPT)
  out_file = tmp_path / 'r.py'
  code, out, err = pax_main(['import-maxtext', str(script), '-o', str(out_file)], capsys)
  assert code == 2 and not out_file.exists()
  err = ' '.join(err.split())
  assert "`per_devcie_batch_size`=2: MaxText has no such key. Did you mean 'per_device_batch_size'" in err
  assert '--lenient' in err and 'Traceback' not in err
  code, out, err = pax_main(['import-maxtext', str(script), '-o', str(out_file), '--lenient'], capsys)
  assert code == 0, err
  assert out.startswith(f'Read {script} as text (not run); its trainer call, on line 2: MaxText/train.py')
  assert 'per_devcie_batch_size' in out and 'WARNING' in out and out_file.exists()
  # A real MaxText key that the script's era did not have yet is refused too, naming the era.
  script.write_text(TYPO_SCRIPT.replace('per_devcie_batch_size=2', 'adam_weight_decay=0.1'))
  code, _, err = pax_main(['import-maxtext', str(script), '--dry-run', '--maxtext-era', 'scale'], capsys)
  assert code == 2 and "not a key of MaxText's base.yml in the scale era" in ' '.join(err.split())
  code, _, err = pax_main(['import-maxtext', str(script), '--dry-run', '--maxtext-era', 'current'], capsys)
  assert code == 0, err


def test_eval_follow_beside_a_trainer_evaluates_each_checkpoint_once_and_stops(tmp_path, capsys):
  import subprocess
  import sys
  job = str(tmp_path / 'job')
  tiny = TINY
  env = dict(os.environ)
  # The follower's --set is the trainer's: its config says where the run ends (issue 17).
  follow = subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', 'eval', *tiny, '--job-log-dir', job,
                             '--set', 'NUM_TRAIN_STEPS=15', '--follow', '--poll', '0.2', '--timeout', '400', '--json'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  try:
    r = run_pax('train', *tiny, '--job-log-dir', job, '--set', 'NUM_TRAIN_STEPS=15')
    assert r.returncode == 0, r.stderr
    out, err = follow.communicate(timeout=400)
  finally:
    follow.kill()
  assert follow.returncode == 0, err
  lines = [json.loads(line) for line in out.splitlines()]
  assert [x['step'] for x in lines] == [5, 10, 15]  # each checkpoint once, in order, then it stopped
  assert all(x['results']['eval']['num_examples'] == 16 for x in lines)
  done = [json.loads(line)['step'] for line in open(os.path.join(job, 'eval_done.jsonl'))]
  assert done == [5, 10, 15]
  metrics = [json.loads(line)['step'] for line in open(os.path.join(job, 'eval_metrics.jsonl'))]
  assert metrics == [5, 10, 15]
  # Started again, it skips what was evaluated and stops at once; --step N evaluates one chosen checkpoint.
  code, out, err = pax_main(['eval', *tiny, '--job-log-dir', job, '--set', 'NUM_TRAIN_STEPS=15', '--follow',
                             '--poll', '0.2'], capsys)
  assert code == 0, err
  assert '3 already evaluated' in out and 'Evaluated 0 checkpoint(s)' in out
  code, out, err = pax_main(['eval', *tiny, '--job-log-dir', job, '--step', '10', '--json'], capsys)
  assert code == 0, err
  assert json.loads(out)['results']['eval']['loss'] == pytest.approx(lines[1]['results']['eval']['loss'], rel=1e-5)
  code, out, err = pax_main(['eval', *tiny, '--job-log-dir', job, '--step', '7'], capsys)
  assert code == 2 and 'No complete checkpoint at step 7' in err and '5, 10, 15' in err
  assert len(open(os.path.join(job, 'invocations.txt')).read().splitlines()) == 5  # train and every eval


# The model of test_kill_during_save (its compilation is shared): a save of its ~200 MB state takes
# long enough to be caught in flight.
SAVE_SIZED = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'MODEL_DIMS=512', '--set', 'HIDDEN_DIMS=2048',
              '--set', 'NUM_LAYERS=4', '--set', 'VOCAB_SIZE=8192', '--set', 'PERCORE_BATCH_SIZE=1',
              '--set', 'MAX_SEQ_LEN=16', '--set', 'task.train.summary_interval_steps=1',
              '--set', 'task.train.save_interval_steps=1000']


@pytest.mark.slow
def test_second_ctrl_c_stops_in_one_line_and_the_run_resumes(tmp_path):
  """The first Ctrl-C asks for a save and a stop; the second, sent while that save is in flight,
  exits at once in one line. Deterministic: no save is due by the interval, so a new entry in
  checkpoints/ is the stop's save and proves the first Ctrl-C was handled; the trainer is frozen
  (SIGSTOP) while that save is seen unfinished, and the second Ctrl-C is queued before it goes on.
  The rerun resumes from the newest complete checkpoint on disk and sets the unfinished one aside."""
  import signal
  import subprocess
  import sys
  import time
  job = tmp_path / 'job'
  ckpt = job / 'checkpoints'
  first = run_pax('train', *SAVE_SIZED, '--set', 'NUM_TRAIN_STEPS=2', '--job-log-dir', str(job))
  assert first.returncode == 0, first.stderr
  assert os.listdir(ckpt) == ['2']
  out_path, err_path = tmp_path / 'out.txt', tmp_path / 'err.txt'
  with open(out_path, 'w') as out_file, open(err_path, 'w') as err_file:
    proc = subprocess.Popen([sys.executable, '-m', 'paxcli.cli.app', 'train', *SAVE_SIZED, '--set',
                             'NUM_TRAIN_STEPS=100000', '--job-log-dir', str(job)], stdout=out_file, stderr=err_file,
                            env={**os.environ, 'PYTHONUNBUFFERED': '1'})
  deadline = time.time() + 300
  while not re.search(r'^step \d+:', out_path.read_text(), re.M):  # in the train loop
    assert proc.poll() is None and time.time() < deadline, out_path.read_text() + err_path.read_text()
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  in_flight = None
  while in_flight is None:
    assert proc.poll() is None and time.time() < deadline, out_path.read_text() + err_path.read_text()
    if set(os.listdir(ckpt)) != {'2'}:
      proc.send_signal(signal.SIGSTOP)
      new = set(os.listdir(ckpt)) - {'2'}
      in_flight = [e for e in new if 'orbax-checkpoint-tmp' in e]
      assert in_flight, f'the stop save finished before it could be caught in flight: {new}'
      proc.send_signal(signal.SIGINT)
      proc.send_signal(signal.SIGCONT)
    time.sleep(0.002)
  assert proc.wait(timeout=120) == 130
  out, err = out_path.read_text(), err_path.read_text()
  assert 'error: SIGINT again: stopping without waiting for the save.' in err, err
  assert 'Traceback' not in err and 'Stopped by SIGINT' not in out, err
  stop_step = int(in_flight[0].split('.')[0])
  assert stop_step > 2
  # The save may have completed in the moment before the exit: the rerun takes what the disk holds.
  complete = sorted(int(e) for e in os.listdir(ckpt) if e.isdigit())
  unfinished = [e for e in os.listdir(ckpt) if 'orbax-checkpoint-tmp' in e]
  assert complete[-1] in (2, stop_step) and (complete[-1] == stop_step) == (not unfinished)
  r = run_pax('train', *SAVE_SIZED, '--set', f'NUM_TRAIN_STEPS={stop_step + 1}', '--job-log-dir', str(job))
  assert r.returncode == 0, r.stderr
  assert f'Resumed from step {complete[-1]} ' in r.stdout, r.stdout
  if unfinished:
    assert f'Checkpoint at step {stop_step} is unfinished (a save was interrupted)' in r.stdout, r.stdout
  assert max(int(e) for e in os.listdir(ckpt) if e.isdigit()) == stop_step + 1


def test_eval_file_names_read_well_and_old_job_dirs_keep_theirs(tmp_path):
  from paxcli.jobdir.layout import eval_paths
  from paxcli.loops.evaluate import eval_label
  new, old = tmp_path / 'new', tmp_path / 'old'
  assert eval_paths(str(new), 'eval') == (str(new / 'summaries' / 'eval'), str(new / 'eval_metrics.jsonl'))
  assert eval_paths(str(new), 'c4') == (str(new / 'summaries' / 'eval_c4'), str(new / 'eval_c4_metrics.jsonl'))
  old.mkdir()
  (old / 'eval_eval_metrics.jsonl').write_text('{"step": 5}\n')
  assert eval_paths(str(old), 'eval')[1] == str(old / 'eval_eval_metrics.jsonl')  # history stays in one file
  assert eval_label('eval') == 'eval' and eval_label('c4') == 'eval on c4'
