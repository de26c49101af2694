"""GRPO end to end from the command line: a run's rollouts and reward metrics, the same rollouts from the seed, a
resume inside a rollout batch giving the uninterrupted run's losses, bad prompts refused before anything compiles,
a failing reward function stopping in one line with the last checkpoint kept, and (slow) the addition example
learning on the default-size model. The loss itself is held to TRL's in tests/test_grpo_trl.py."""

import json
import os
import shutil
import textwrap

import numpy as np
import pytest

from conftest import pax_main, pax_main_ok, run_pax
from paxcli.models import rewards
from paxcli.recipes import grpo as grpo_recipe

TINY = ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2', 'PERCORE_BATCH_SIZE=2',
        'NUM_GENERATIONS=4', 'LEARNING_RATE=0.01', 'SUMMARY_INTERVAL_STEPS=1']


def _sets(knobs) -> list[str]:
  return [a for k in knobs for a in ('--set', k)]


@pytest.fixture(scope='module')
def example(tmp_path_factory):
  return grpo_recipe.write_example(str(tmp_path_factory.mktemp('grpo_example')), n=64)


def _train(example, job, capsys, *knobs, exp='grpo.GrpoAddition'):
  argv = ['train', '--exp', exp, *_sets(TINY + [f'TRAIN_DATA={example["prompts"]}',
                                                f'TOKENIZER={example["tokenizer"]}', *knobs]),
          '--job-log-dir', str(job)]
  return pax_main(argv, capsys)


def _rows(job) -> list[dict]:
  with open(os.path.join(job, 'train_metrics.jsonl'), encoding='utf-8') as f:
    return [json.loads(line) for line in f if line.strip()]


def test_a_run_samples_scores_and_reports_trls_metrics(example, tmp_path, capsys):
  code, out, err = _train(example, tmp_path / 'job', capsys, 'NUM_TRAIN_STEPS=1', 'MAX_COMPLETION_LENGTH=2',
                          'STOP=["</answer>"]', 'LOG_COMPLETIONS=True')
  assert code == 0, err
  rows = _rows(tmp_path / 'job')
  assert [r['step'] for r in rows] == [1]
  for key in ('loss', 'reward', 'reward_std', 'rewards/exact_match/mean', 'frac_reward_zero_std',
              'clip_ratio/region_mean', 'completions/mean_length', 'completions/clipped_ratio'):
    assert key in rows[-1], key
  assert 0 <= rows[-1]['reward'] <= 1
  assert 1 <= rows[-1]['completions/mean_length'] <= 2
  assert 'reward ' in out and 'completions/mean_length ' in out   # the log line shows the rollout's numbers
  with open(tmp_path / 'job' / 'decoder_out' / 'rollouts' / 'decode_step1.jsonl') as f:
    logged = [json.loads(line) for line in f]
  assert len(logged) == 16 and [r['sample_index'] for r in logged[:4]] == [0, 1, 2, 3]   # 4 prompts x 4
  assert all(r['prompt'].endswith('<answer>') and '</answer>' not in r['completion'] for r in logged)
  assert [r['rewards']['exact_match'] for r in logged] == [r['reward'] for r in logged]
  assert np.mean([r['reward'] for r in logged]) == pytest.approx(rows[0]['reward'])


SAMPLE_REWARD = '''
from paxcli.recipes import grpo

def ids_mod_7(prompts, completions, completion_ids, **columns):
  """A reward of the sampled ids themselves: every sample moves the loss and its gradient."""
  return [float(sum(ids) % 7) for ids in completion_ids]

class SampleGrpo(grpo.GrpoAddition):
  def reward_functions(self):
    return [ids_mod_7]
'''


@pytest.mark.slow
def test_the_same_seed_samples_the_same_rollouts_and_a_resume_inside_a_rollout_batch_goes_on_exactly(
    example, tmp_path, capsys):
  exp = tmp_path / 'sample_grpo.py'
  exp.write_text(SAMPLE_REWARD)
  common = ('MAX_COMPLETION_LENGTH=3', 'NUM_ITERATIONS=2', 'BETA=0.04', 'SAVE_INTERVAL_STEPS=100')
  run = lambda job, *knobs: _train(example, tmp_path / job, capsys, *common, *knobs, exp=f'{exp}:SampleGrpo')
  assert run('whole', 'NUM_TRAIN_STEPS=5')[0] == 0
  assert run('again', 'NUM_TRAIN_STEPS=3')[0] == 0   # stops inside the second rollout batch (steps 3-4)
  shutil.copytree(tmp_path / 'again', tmp_path / 'edited')
  saved = tmp_path / 'edited' / 'checkpoints' / '3' / 'input' / 'process_0-of-1.json'
  state = json.loads(saved.read_text())
  assert state['steps'] == 3 and state['buffer'] is not None   # the batch of steps 3-4 is kept with step 3
  state['buffer']['advantages']['data'][0] += 1.0   # an edited rollout batch is refused, never trained on
  saved.write_text(json.dumps(state))
  code, _, err = run('edited', 'NUM_TRAIN_STEPS=5')
  assert code == 2 and 'not a GRPO rollout state this paxcli wrote' in err and str(saved) in err, err
  code, out, err = run('again', 'NUM_TRAIN_STEPS=5')
  assert code == 0, err
  assert 'Resumed from step 3' in out
  whole, again = _rows(tmp_path / 'whole'), _rows(tmp_path / 'again')
  assert [r['step'] for r in again] == [1, 2, 3, 4, 5]
  assert all(r['grad_norm'] > 0 and r['reward_std'] > 0 for r in whole)   # the samples move the model
  for a, b in zip(whole, again):
    for key in ('loss', 'reward', 'reward_std', 'kl', 'grad_norm', 'clip_ratio/region_mean', 'completions/mean_length'):
      assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a['step'], key)
  assert run('other', 'NUM_TRAIN_STEPS=1', 'RANDOM_SEED=5')[0] == 0
  assert _rows(tmp_path / 'other')[0]['reward'] != whole[0]['reward']   # another seed samples other completions


@pytest.mark.parametrize('record,phrase', [
    ({'prompt': 'one plus two is <answer>'}, "no 'answer' field"),
    ({'prompt': '', 'answer': 'three'}, '"prompt" must be a non-empty string'),
    ({'prompt': ' '.join(['one plus'] * 20) + ' is <answer>', 'answer': 'x'}, 'leave room'),
])
def test_a_bad_prompt_record_is_one_line_naming_its_file_and_line(example, tmp_path, capsys, record, phrase):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text(json.dumps({'prompt': 'one plus one is <answer>', 'answer': 'two'}) + '\n' + json.dumps(record) + '\n')
  code, _, err = _train({**example, 'prompts': str(bad)}, tmp_path / 'job', capsys, 'NUM_TRAIN_STEPS=1')
  assert code == 2
  assert f'{bad}:2' in err and phrase in err
  assert 'Traceback' not in err
  assert not os.path.exists(tmp_path / 'job')   # refused before the job directory was made


BAD_REWARDS = '''
from paxcli.recipes import grpo

def picky(prompts, completions, step, **columns):
  if step >= 3:
    {failure}
  return [1.0 for _ in completions]

class PickyGrpo(grpo.GrpoAddition):
  def reward_functions(self):
    return [picky]
'''


@pytest.mark.slow
@pytest.mark.parametrize('failure,said', [
    ("raise ValueError('cannot score this')", "raised ValueError: cannot score this (picky.py:6)"),
    ("return [float('nan') for _ in prompts]", "returned nan, not a finite number"),
])
def test_a_failing_reward_function_stops_in_one_line_and_keeps_the_last_checkpoint(
    example, tmp_path, capsys, failure, said):
  exp = tmp_path / 'picky.py'
  exp.write_text(textwrap.dedent(BAD_REWARDS).format(failure=failure))
  job = tmp_path / 'job'
  code, _, err = _train(example, job, capsys, 'NUM_TRAIN_STEPS=6', 'SAVE_INTERVAL_STEPS=2',
                        'MAX_COMPLETION_LENGTH=1', exp=f'{exp}:PickyGrpo')
  assert code == 2
  line = [l for l in err.splitlines() if 'picky' in l]
  assert len(line) == 1 and 'Traceback' not in err, err
  # 4 prompts a rollout: steps 1 and 2 took prompts 0-7
  assert "The reward function 'picky', on prompt 8 (" in line[0] and 'prompts.jsonl:' in line[0] and said in line[0]
  assert 'of the rollout of step 3' in line[0] and 'the last checkpoint is step 2, kept as it was' in line[0]
  assert sorted(os.listdir(job / 'checkpoints')) == ['2']
  exp.write_text(textwrap.dedent(BAD_REWARDS).format(failure='pass'))   # fixed: the same command, a fresh shell
  done = run_pax('train', '--exp', f'{exp}:PickyGrpo', *_sets(TINY + [
      f'TRAIN_DATA={example["prompts"]}', f'TOKENIZER={example["tokenizer"]}', 'NUM_TRAIN_STEPS=4',
      'SAVE_INTERVAL_STEPS=2', 'MAX_COMPLETION_LENGTH=1']), '--job-log-dir', str(job))
  assert done.returncode == 0, done.stderr
  assert 'Resumed from step 2' in done.stdout


def test_exact_match_reads_the_marked_span():
  match = rewards.exact_match()
  prompts = ['two plus two is', 'two plus two is <answer>', 'q', 'q']
  completions = [' <answer> four </answer> more', 'four', 'four', '<answer>five</answer>']
  assert match(prompts, completions, answer=['four', 'four', 'four', 'four']) == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.slow
def test_the_addition_example_learns_on_the_default_size_model(tmp_path, capsys):
  """The docs' example as printed: reward rising over the run, and the curve written."""
  files = grpo_recipe.write_example(str(tmp_path))
  job = tmp_path / 'job'
  # The docs' run is on one device: PERCORE_BATCH_SIZE 128 there is 16 on each of the tests' 8, the same 128 rows.
  code, out, err = pax_main(['train', '--exp', 'grpo.GrpoAddition', '--set', f'TRAIN_DATA={files["prompts"]}',
                             '--set', f'TOKENIZER={files["tokenizer"]}', '--set', 'PERCORE_BATCH_SIZE=16',
                             '--job-log-dir', str(job)], capsys)
  assert code == 0, err
  rewards_by_step = [(r['step'], r['reward']) for r in _rows(job)]
  first, last = rewards_by_step[0][1], np.mean([r for _, r in rewards_by_step[-2:]])
  assert first < 0.2 and last > first + 0.3, rewards_by_step
  csv_path, svg_path = grpo_recipe.plot_reward(str(job))
  assert open(svg_path).read().startswith("<svg") and "polyline" in open(svg_path).read()
  assert open(csv_path).read().startswith('step,reward,reward_std')


LORA_GRPO = '''
from paxcli.recipes import grpo

def ids_mod_7(prompts, completions, completion_ids, **columns):
  return [float(sum(ids) % 7) for ids in completion_ids]

class LoraGrpo(grpo.Grpo):
  def reward_functions(self):
    return [ids_mod_7]
'''


@pytest.mark.slow
def test_lora_grpo_takes_the_base_with_adapters_off_as_its_reference(tmp_path, capsys):
  """An imported model, chat prompts through its template, LoRA: the reference is the same weights with the
  adapters off, so the KL is exactly 0 at the first step (B = 0) and not once the adapters moved."""
  from paxcli.recipes import finetune
  paths = finetune.write_example(str(tmp_path / 'ex'))
  assert pax_main(['checkpoint', 'convert', '--from', 'hf', paths['hf'], str(tmp_path / 'base')], capsys)[0] == 0
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(''.join(json.dumps({'prompt': [{'role': 'user', 'content': f'What colour is the {t}?'}]}) + '\n'
                             for t in ('sky', 'grass', 'snow', 'coal')))
  exp = tmp_path / 'lora_grpo.py'
  exp.write_text(LORA_GRPO)
  code, out, err = pax_main(['train', '--exp', f'{exp}:LoraGrpo', *_sets([
      f'BASE={tmp_path / "base"}', f'TRAIN_DATA={prompts}', 'LORA_RANK=4', 'BETA=0.04', 'NUM_GENERATIONS=4',
      'PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=64', 'MAX_COMPLETION_LENGTH=6', 'NUM_TRAIN_STEPS=2',
      'SUMMARY_INTERVAL_STEPS=1', 'LEARNING_RATE=0.01']), '--job-log-dir', str(tmp_path / 'job')], capsys)
  assert code == 0, err
  assert 'trainable (LoRA adapters)' in out
  rows = _rows(tmp_path / 'job')
  assert rows[0]['kl'] == 0.0 and rows[1]['kl'] > 0, rows


@pytest.mark.slow
def test_two_processes_sample_and_train_as_one(example, tmp_path, capsys):
  """pax launch, 2 processes x 4 devices: each decodes the whole rollout batch on the global mesh and feeds its
  rows; rollouts, rewards and losses are the 1-process x 8-device run's."""
  exp = tmp_path / 'sample_grpo.py'
  exp.write_text(SAMPLE_REWARD)
  knobs = _sets(TINY + [f'TRAIN_DATA={example["prompts"]}', f'TOKENIZER={example["tokenizer"]}', 'NUM_TRAIN_STEPS=4',
                        'MAX_COMPLETION_LENGTH=3', 'NUM_ITERATIONS=2', 'BETA=0.04'])
  two = run_pax('launch', '--processes', '2', '--devices-per-process', '4', '--grace', '2', '--', 'train', '--exp',
                f'{exp}:SampleGrpo', *knobs, '--set', 'ICI_MESH_SHAPE=[1,4,1]', '--set', 'DCN_MESH_SHAPE=[2,1,1]',
                '--job-log-dir', str(tmp_path / 'two'), timeout=600)
  assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-4000:]
  # The 1-process reference in this process (its 8 fake devices): the 2-process run above is the fresh shells.
  pax_main_ok(['train', '--exp', f'{exp}:SampleGrpo', *knobs, '--set', 'ICI_MESH_SHAPE=[1,8,1]',
               '--job-log-dir', str(tmp_path / 'one')], capsys)
  rows_two, rows_one = _rows(tmp_path / 'two'), _rows(tmp_path / 'one')
  assert [r['step'] for r in rows_two] == [1, 2, 3, 4]
  for a, b in zip(rows_two, rows_one):
    for key in ('reward', 'reward_std', 'completions/mean_length'):
      assert a[key] == b[key], (a['step'], key)
    for key in ('loss', 'kl', 'grad_norm'):
      assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a['step'], key)
