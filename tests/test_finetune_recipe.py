"""recipes/finetune.py from a fresh shell: an imported HF Llama, fine-tuned on prompt/completion
JSONL, gets a lower completion loss on held-out pairs; prompts weigh 0; the base is only read."""

import json
import os
import shutil

import numpy as np
import pytest

from conftest import run_pax
from paxcli.recipes import finetune


def _tree(path):
  return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs}


def _eval_loss(*args, cwd=None):
  r = run_pax('eval', '--exp', 'finetune.TinyLlamaSft', *args, '--json', cwd=cwd)
  assert r.returncode == 0, r.stderr
  return json.loads(r.stdout.strip().splitlines()[-1])['results']['eval']['loss']


@pytest.mark.slow   # three fresh processes: about 40 s alone, 80 s on a shared machine
def test_finetune_of_an_imported_llama_lowers_the_completion_loss_from_a_fresh_shell(tmp_path):
  made = finetune.write_example(str(tmp_path))
  base, job = str(tmp_path / 'llama'), str(tmp_path / 'sft')
  r = run_pax('checkpoint', 'convert', '--from', 'hf', made['hf'], base, '--no-verify', cwd=str(tmp_path))
  assert r.returncode == 0, r.stderr
  sets = ['--set', f'BASE={base!r}', '--set', f'TRAIN_DATA={made["train"]!r}', '--set', f'EVAL_DATA={made["eval"]!r}']
  # the base's completion loss, evaluated on a copy: BASE itself is never written
  shutil.copytree(base, str(tmp_path / 'before'))
  before = _eval_loss(*sets, '--job-log-dir', str(tmp_path / 'before'))
  untouched = _tree(base)
  r = run_pax('train', '--exp', 'finetune.TinyLlamaSft', *sets, '--set', 'NUM_TRAIN_STEPS=30',
              '--set', 'EVAL_INTERVAL_STEPS=30', '--job-log-dir', job)
  assert r.returncode == 0, r.stderr
  assert f'Starting from the weights of {base} step' in r.stdout + r.stderr and '(INIT_FROM)' in r.stdout + r.stderr
  with open(os.path.join(job, 'eval_metrics.jsonl')) as f:
    after = [json.loads(line) for line in f][-1]
  assert after['step'] == 30 and after['loss'] < 0.5 * before, (before, after)
  assert _tree(base) == untouched
  kept = json.load(open(os.path.join(job, 'tokenizer', 'tokenizer_config.json')))
  assert kept['chat_template'] == finetune.CHAT_TEMPLATE   # the shipped tokenizer went with the job


def test_prompt_tokens_weigh_nothing_and_texts_start_with_the_shipped_bos(tmp_path):
  from paxcli.inputs.file_input import FileLmInput
  from paxcli.inputs.tokenizers import load
  made = finetune.write_example(str(tmp_path))
  path = os.path.join(made['hf'], 'tokenizer.json')
  inp = FileLmInput(name='eval', is_training=False, data=made['eval'], tokenizer=path, seq_len=64, batch_size=4,
                    repeat=False)
  tok, records = load(path), [json.loads(line) for line in open(made['eval'])]
  batch = inp.get_next()
  for ids, labels, weights, segments in zip(batch['ids'], batch['labels'], batch['weights'], batch['segment_ids']):
    for s in set(segments[segments > 0].tolist()):
      doc = segments == s
      record = records.pop(0)
      assert ids[doc][0] == tok.bos_id
      trained = labels[doc][weights[doc] == 1].tolist()
      assert trained == tok.encode(record['completion']) + [tok.eos_id]
      assert np.all(weights[doc][:len(tok.encode(record['prompt']))] == 0)


def _score(job, out, *sets, cwd):
  r = run_pax('score', '--exp', 'finetune.TinyLlamaSft', *sets, '--job-log-dir', job, 'requests.jsonl', '--output', out,
              cwd=cwd)
  assert r.returncode == 0, r.stderr
  return [json.loads(line) for line in open(os.path.join(cwd, out))]


@pytest.mark.slow   # eleven fresh processes: about 2 minutes on a shared machine
def test_lora_finetune_of_an_imported_llama_from_a_fresh_shell(tmp_path):
  """The README's LoRA path with relative paths: train adapters on the imported base, then every
  command applies them (score, eval, decode equal the merged model's), and they export."""
  from paxcli.jobdir import restore
  cwd = str(tmp_path)
  finetune.write_example(cwd)
  assert run_pax('checkpoint', 'convert', '--from', 'hf', 'hf', 'llama', '--no-verify', cwd=cwd).returncode == 0
  untouched = _tree(str(tmp_path / 'llama'))
  base = ['--set', "BASE='llama'"]
  lora = base + ['--set', 'LORA_RANK=8']
  data = ['--set', "TRAIN_DATA='sft.jsonl'", '--set', "EVAL_DATA='sft_eval.jsonl'"]
  r = run_pax('train', '--exp', 'finetune.TinyLlamaSft', *lora, *data, '--set', 'NUM_TRAIN_STEPS=30',
              '--set', 'SAVE_INTERVAL_STEPS=15', '--set', 'EVAL_INTERVAL_STEPS=30', '--job-log-dir', 'sft', cwd=cwd)
  assert r.returncode == 0, r.stderr
  assert 'LoRA adapters train' in r.stdout
  assert _tree(str(tmp_path / 'llama')) == untouched   # BASE is only read
  job = str(tmp_path / 'sft')
  for step in (15, 30):   # checkpoints of the adapters alone, naming the base
    assert all('_lora_' in '/'.join(map(str, k)) for k in _flat_keys(restore.saved_metadata(job, step)['params']))
    assert restore.read_meta(job, step)['base']['job_dir'] == str(tmp_path / 'llama')

  # The completion log-likelihood of the held-out pairs: higher than the base's, the merged model's.
  with open(tmp_path / 'sft_eval.jsonl') as f, open(tmp_path / 'requests.jsonl', 'w') as out:
    for line in f:
      pair = json.loads(line)
      out.write(json.dumps({'context': pair['prompt'], 'continuation': pair['completion']}) + '\n')
  before = _score('llama', 'base.jsonl', *base, cwd=cwd)
  after = _score('sft', 'lora.jsonl', *lora, cwd=cwd)
  assert sum(r['logprob'] for r in after) > 0.5 * sum(r['logprob'] for r in before)   # logprobs < 0: loss halved
  assert run_pax('checkpoint', 'convert', 'sft', 'merged', '--merge-lora', cwd=cwd).returncode == 0
  merged = _score('merged', 'merged.jsonl', *base, cwd=cwd)
  np.testing.assert_allclose([r['logprob'] for r in after], [r['logprob'] for r in merged], atol=1e-3)

  with open(os.path.join(job, 'eval_metrics.jsonl')) as f:
    trained = [json.loads(line) for line in f][-1]
  evaluated = _eval_loss(*lora, *data, '--job-log-dir', job, cwd=cwd)
  assert abs(evaluated - trained['loss']) < 1e-5   # eval applies the adapters, as training's eval did
  decoded = {}
  for name, sets in (('sft', lora), ('merged', base)):
    r = run_pax('decode', '--exp', 'finetune.TinyLlamaSft', *sets, '--job-log-dir', name, '--prompt',
                'Q: What colour is the sky?\nA:', '--max-decode-steps', '6', '--json', cwd=cwd)
    assert r.returncode == 0, r.stderr
    decoded[name] = json.loads(r.stdout.strip().splitlines()[-1])
  assert decoded['sft']['decoded_ids'] == decoded['merged']['decoded_ids']

  for to, name in (('hf', 'config.json'), ('peft', 'adapter_config.json')):
    r = run_pax('checkpoint', 'convert', 'sft', f'out_{to}', '--to', to, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert os.path.isfile(tmp_path / f'out_{to}' / name)
  assert os.path.isfile(tmp_path / 'out_hf' / 'tokenizer.json')   # the shipped tokenizer goes out with the model
  assert json.load(open(tmp_path / 'out_peft' / 'adapter_config.json'))['target_modules'] == ['q_proj', 'v_proj']


def _flat_keys(tree):
  import jax
  return [tuple(getattr(k, 'key', k) for k in path)
          for path, _ in jax.tree_util.tree_flatten_with_path(dict(tree), is_leaf=lambda x: hasattr(x, 'shape'))[0]]
