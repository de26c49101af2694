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


def _eval_loss(*args):
  r = run_pax('eval', '--exp', 'finetune.TinyLlamaSft', *args, '--json')
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
  assert 'Starting from the parameters of' in r.stdout and 'INIT_FROM' in r.stdout
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
