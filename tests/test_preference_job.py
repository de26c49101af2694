"""The preference-tuning example as a new user walks it (issue 41, parts 1 and 3): the commands
`python -m paxcli.recipes.posttrain` prints, from a fresh shell with relative paths; the log line, TensorBoard's
file and train_metrics.jsonl carry TRL's metric names; the DPO run learns the pairs; a LoRA run's reference is
its base with the adapters off; the exports load in transformers and PEFT; a bad pair stops `pax train` in one
line before anything compiles. Real transformers and PEFT."""

import json
import os
import subprocess
import sys
import types

import pytest

from conftest import pax_main_ok, pax_ok, printed_commands, run_pax

pytestmark = pytest.mark.slow   # a conversion, two short tunes and torch: minutes on a shared machine

METRICS = ('rewards/chosen', 'rewards/rejected', 'rewards/margins', 'rewards/accuracies', 'logps/chosen',
           'logps/rejected', 'loss')


@pytest.fixture(scope='module')
def example(tmp_path_factory):
  """The example's printed commands: the import, then DPO (its 40 steps)."""
  cwd = tmp_path_factory.mktemp('preference_job')
  commands = printed_commands('posttrain', cwd)
  pax_ok(cwd, *commands[0][1:], '--no-verify')   # pax checkpoint convert --from hf ...
  trained = pax_ok(cwd, *commands[1][1:])        # pax train --exp posttrain.TinyDpo ...
  return cwd, commands, trained.stdout + trained.stderr


def _rows(path) -> list[dict]:
  return [json.loads(line) for line in open(path)]


@pytest.fixture
def in_example(example, monkeypatch, capsys):
  """`pax` in this process from the example's directory, relative paths as the fresh shells above (the import,
  the DPO run, the export, a checkpoint inspect and the bad pair) give them; it must succeed; returns its
  .stdout and .stderr as pax_ok does. Saves a python and jax start-up a command where the test is about what
  the command does, not about a new shell."""
  monkeypatch.chdir(example[0])

  def ok(*argv):
    out, err = pax_main_ok(argv, capsys)
    return types.SimpleNamespace(stdout=out, stderr=err)
  return ok


def test_dpo_learns_the_pairs_and_reports_trls_metrics(example):
  cwd, _, log = example
  steps = [line for line in log.splitlines() if line.startswith('step ') and 'grad_norm' in line]
  assert steps and all('rewards/margins' in line and 'rewards/accuracies' in line for line in steps), log[-3000:]
  rows = _rows(cwd / 'ex' / 'dpo' / 'train_metrics.jsonl')
  assert all(name in rows[-1] for name in METRICS)
  first, last = rows[0], rows[-1]
  assert last['loss'] < first['loss'] and last['rewards/margins'] > first['rewards/margins'] > -1
  evals = _rows(cwd / 'ex' / 'dpo' / 'eval_metrics.jsonl')
  assert evals[-1]['rewards/accuracies'] >= 0.9 and evals[-1]['loss'] < 0.5   # held-out pairs preferred
  events = os.listdir(cwd / 'ex' / 'dpo' / 'summaries' / 'train')
  assert events   # TensorBoard's event file; its scalars are train_metrics.jsonl's (one writer)


def test_the_export_loads_in_transformers_and_prefers_the_chosen_answer(example, monkeypatch):
  """The export the printed command writes (a fresh shell), read by transformers in this process from the
  example's directory."""
  import torch
  import transformers as t
  cwd, commands, _ = example
  export = next(c for c in commands if '--to' in c and 'hf' in c)
  pax_ok(cwd, *export[1:])
  monkeypatch.chdir(cwd)
  model = t.AutoModelForCausalLM.from_pretrained('ex/dpo_hf').eval()
  tok = t.AutoTokenizer.from_pretrained('ex/dpo_hf')

  def logp(prompt, answer):
    whole, head = tok(prompt + answer).input_ids, tok(prompt).input_ids
    with torch.no_grad():
      out = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
    return sum(float(out[i - 1, whole[i]]) for i in range(len(head), len(whole)))
  pairs = [json.loads(line) for line in open('ex/prefs_eval.jsonl')]
  assert sum(logp(p['prompt'], p['chosen']) > logp(p['prompt'], p['rejected']) for p in pairs) / len(pairs) >= 0.9


def test_lora_dpo_keeps_no_copy_and_its_peft_adapter_loads(example, in_example):
  cwd, _, _ = example
  out = in_example('train', '--exp', 'posttrain.TinyDpo', '--set', 'BASE=ex/llama', '--set', 'TRAIN_DATA=ex/prefs.jsonl',
                   '--set', 'LORA_RANK=4', '--set', 'NUM_TRAIN_STEPS=10', '--set', 'EVAL_INTERVAL_STEPS=0',
                   '--job-log-dir', 'ex/lora')
  assert 'trainable (LoRA adapters)' in out.stdout + out.stderr
  first = _rows(cwd / 'ex' / 'lora' / 'train_metrics.jsonl')[0]
  assert first['rewards/accuracies'] >= 0 and first['loss'] < 0.6932   # from log 2: the adapters start off
  names = [a['name'] for a in json.loads(in_example('checkpoint', 'inspect', 'ex/lora', '--json').stdout)['arrays']]
  assert names and not any(n.startswith('non_trainable/') for n in names)   # no reference copy: the base is it
  full = [a['name'] for a in json.loads(pax_ok(cwd, 'checkpoint', 'inspect', 'ex/dpo', '--json').stdout)['arrays']]
  assert any(n.startswith('non_trainable/reference_copy/params/') for n in full), full[:20]   # full DPO keeps one
  in_example('checkpoint', 'convert', 'ex/lora', 'ex/adapter', '--to', 'peft', '--base-model', 'ex/hf')
  load = subprocess.run([sys.executable, '-c', 'from peft import AutoPeftModelForCausalLM as M; '
                         'M.from_pretrained("ex/adapter"); print("ok")'], cwd=cwd, capture_output=True, text=True,
                        timeout=600)
  assert load.returncode == 0 and 'ok' in load.stdout, load.stderr[-3000:]


def test_a_bad_pair_stops_pax_train_before_anything_compiles(example):
  cwd, _, _ = example
  rows = _rows(cwd / 'ex' / 'prefs.jsonl')[:30]
  rows[17]['chosen'] = rows[17]['rejected']
  (cwd / 'bad.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
  r = run_pax('train', '--exp', 'posttrain.TinyDpo', '--set', 'BASE=ex/llama', '--set', 'TRAIN_DATA=bad.jsonl',
              '--job-log-dir', 'bad_job', cwd=cwd)
  assert r.returncode == 2, r.stderr[-3000:]
  assert 'Traceback' not in r.stderr and 'ompil' not in r.stdout + r.stderr
  assert r.stderr.strip().splitlines()[-1].endswith(
      'bad.jsonl line 18: chosen and rejected are identical: the pair prefers nothing. (BAD_PAIRS=skip leaves such '
      'pairs out, counted.)')
  assert not (cwd / 'bad_job').exists()


def test_a_resumed_run_compares_with_the_same_reference(example, in_example):
  """The reference copy is saved with the state: 20 steps, then a resume to 40, give the losses and rewards of 40
  uninterrupted steps (a reference taken again from the resumed weights would not)."""
  cwd, _, _ = example
  common = ['train', '--exp', 'posttrain.TinyDpo', '--set', 'BASE=ex/llama', '--set', 'TRAIN_DATA=ex/prefs.jsonl',
            '--set', 'EVAL_INTERVAL_STEPS=0', '--set', 'SUMMARY_INTERVAL_STEPS=5', '--set', 'SAVE_INTERVAL_STEPS=20',
            '--set', "LR_SCHEDULE='constant'", '--set', 'LR_WARMUP_STEPS=0', '--set', 'LEARNING_RATE=3e-4']
  in_example(*common, '--set', 'NUM_TRAIN_STEPS=20', '--job-log-dir', 'ex/resumed')
  assert 'Resumed from step 20' in in_example(*common, '--job-log-dir', 'ex/resumed').stdout
  in_example(*common, '--job-log-dir', 'ex/whole')
  resumed, whole = (_rows(cwd / 'ex' / name / 'train_metrics.jsonl') for name in ('resumed', 'whole'))
  assert [r['step'] for r in resumed] == [r['step'] for r in whole] == list(range(5, 45, 5))
  for a, b in zip(resumed, whole):
    assert a['loss'] == pytest.approx(b['loss'], rel=1e-6) and a['rewards/margins'] == pytest.approx(
        b['rewards/margins'], rel=1e-6, abs=1e-7), (a, b)


def test_precomputed_reference_log_probabilities_train_as_the_copy_does(example, in_example):
  """REFERENCE='precomputed': the reference's log-probabilities computed once before the first step and kept in
  the job; the run's losses and rewards are the reference copy's (the example's DPO run), `pax eval` reads them."""
  cwd, commands, _ = example
  out = in_example(*commands[1][1:-1], 'ex/precomputed', '--set', "REFERENCE='precomputed'").stdout
  assert "Reference log-probabilities (REFERENCE='precomputed') of the" in out
  assert sorted(os.listdir(cwd / 'ex' / 'precomputed' / 'reference_logps')) == ['eval.json', 'train.json']
  for name in ('train_metrics.jsonl', 'eval_metrics.jsonl'):
    copy, pre = (_rows(cwd / 'ex' / job / name) for job in ('dpo', 'precomputed'))
    assert [r['step'] for r in copy] == [r['step'] for r in pre]
    for a, b in zip(copy, pre):
      for key in ('loss', 'rewards/margins', 'rewards/chosen'):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), (name, key, a, b)
  evaluated = json.loads(in_example('eval', '--job-log-dir', 'ex/precomputed', '--json').stdout)
  assert evaluated['results']['eval']['loss'] == pytest.approx(pre[-1]['loss'], rel=1e-5)
