"""The fine-tune example as a new user walks it (issue 32, items 0, 3 and 4): the commands
`python -m paxcli.recipes.finetune` prints, then every reader and export of the job given only its
directory; a LoRA run on the imported model keeps the model's tokenizer, and its PEFT adapter, given
--base-model, loads in PEFT and computes `pax score`'s log-likelihood. Real transformers, PEFT, torch."""

import json
import os
import subprocess
import sys

import pytest

import prepared_data
from conftest import pax_ok, printed_commands, run_pax

pytestmark = pytest.mark.slow   # a conversion, two fine-tunes and torch: minutes on a shared machine

REQUEST = {'context': 'Q: What colour is the snow?\nA:', 'continuation': ' The snow is white.'}


@pytest.fixture(scope='module')
def example(tmp_path_factory):
  """The example's printed commands run from a fresh shell: the import, then the fine-tune (30 steps)."""
  cwd = tmp_path_factory.mktemp('finetune_job')
  commands = printed_commands('finetune', cwd)
  pax_ok(cwd, *commands[0][1:], '--no-verify')                       # pax checkpoint convert --from hf ...
  trained = pax_ok(cwd, *commands[1][1:], '--set', 'NUM_TRAIN_STEPS=30')   # pax train --exp finetune.TinyLlamaSft ...
  (cwd / 'requests.jsonl').write_text(json.dumps(REQUEST) + '\n')
  return cwd, commands, trained.stdout + trained.stderr


def test_the_fine_tune_is_evaluated_decoded_and_scored_by_its_directory_alone(example):
  cwd, commands, _ = example
  assert ['pax', 'eval', '--job-log-dir', 'ex/sft'] in commands
  trainer = json.loads(open(cwd / 'ex' / 'sft' / 'eval_metrics.jsonl').read().splitlines()[-1])
  evaluated = json.loads(pax_ok(cwd, 'eval', '--job-log-dir', 'ex/sft', '--json').stdout)
  assert trainer['step'] == evaluated['step'] == 30
  assert evaluated['results']['eval']['loss'] == pytest.approx(trainer['loss'], rel=1e-5)
  decoded = json.loads(pax_ok(cwd, 'decode', '--job-log-dir', 'ex/sft', '--prompt', REQUEST['context'],
                              '--max-decode-steps', '6', '--json').stdout.splitlines()[-1])
  assert decoded['decoded'].strip()
  scored = pax_ok(cwd, 'score', 'requests.jsonl', '--job-log-dir', 'ex/sft', '--output', 'scores.jsonl')
  assert 'Wrote 1 result to' in scored.stderr
  assert json.loads((cwd / 'scores.jsonl').read_text())['logprob'] < 0


def test_the_hf_export_keeps_the_bases_context_and_transformers_loads_it_without_warnings(example):
  cwd, commands, _ = example
  export = next(c for c in commands if '--to' in c and 'hf' in c)
  pax_ok(cwd, *export[1:])
  config = json.load(open(cwd / 'ex' / 'sft_hf' / 'config.json'))
  assert config['max_position_embeddings'] == 256   # the base's, not the fine-tune's rows of 64
  load = subprocess.run([sys.executable, '-c', 'import transformers as t; t.AutoModelForCausalLM.from_pretrained('
                         '"ex/sft_hf"); t.AutoTokenizer.from_pretrained("ex/sft_hf"); print("ok")'], cwd=cwd,
                        capture_output=True, text=True, timeout=600)
  assert load.returncode == 0 and 'ok' in load.stdout, load.stderr[-3000:]
  assert 'max_position_embeddings' not in load.stderr and 'rope' not in load.stderr.lower(), load.stderr[-3000:]


PEFT_SCORE = r'''
import json, sys, torch
from peft import AutoPeftModelForCausalLM
from transformers import AutoTokenizer
request = json.loads(sys.argv[1])
model = AutoPeftModelForCausalLM.from_pretrained('ex/adapter').eval()
tok = AutoTokenizer.from_pretrained(model.peft_config['default'].base_model_name_or_path)
whole = tok(request['context'] + request['continuation']).input_ids
head = tok(request['context']).input_ids
with torch.no_grad():
  logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
print(sum(float(logp[i - 1, whole[i]]) for i in range(len(head), len(whole))))
'''


def test_lora_on_the_imported_model_keeps_its_tokenizer_and_its_peft_adapter_loads(example, tmp_path):
  """The issue's path: `--exp llama/recipe.py:HfLlama --set INIT_FROM=llama --set LORA_RANK=4 --set
  TRAIN_DATA=...` trains on the imported tokenizer's ids (no new sentencepiece); another TOKENIZER is
  refused; the adapter, written with --base-model, is what AutoPeftModelForCausalLM loads, and PEFT's
  log-likelihood of a text is `pax score`'s of the job given by its directory."""
  cwd, _, _ = example
  lora = ['train', '--exp', 'ex/llama/recipe.py:HfLlama', '--set', 'INIT_FROM=ex/llama', '--set', 'LORA_RANK=4',
          '--set', 'TRAIN_DATA=ex/sft.jsonl', '--set', 'EVAL_DATA=ex/sft_eval.jsonl', '--set', 'MAX_SEQ_LEN=64',
          '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'NUM_TRAIN_STEPS=20', '--set', 'LEARNING_RATE=3e-3']
  other = str(tmp_path / 'other.json')
  prepared_data.write_tokenizer(other, 64)
  refused = run_pax(*lora, '--set', f'TOKENIZER={other}', '--job-log-dir', 'ex/refused', cwd=cwd)
  assert refused.returncode == 2 and f'INIT_FROM={cwd}/ex/llama carries the tokenizer' in refused.stderr, refused.stderr
  assert len(refused.stderr.strip().splitlines()) == 1 and not os.path.exists(cwd / 'ex' / 'refused')
  out = pax_ok(cwd, *lora, '--job-log-dir', 'ex/lora')
  text = out.stdout + out.stderr
  assert 'sentencepiece' not in text and 'trainable (LoRA adapters)' in text
  kept = (cwd / 'ex' / 'lora' / 'tokenizer' / 'tokenizer.json').read_bytes()
  assert kept == (cwd / 'ex' / 'llama' / 'tokenizer' / 'tokenizer.json').read_bytes()
  pax_ok(cwd, 'checkpoint', 'convert', 'ex/lora', 'ex/adapter', '--to', 'peft', '--base-model', 'ex/hf')
  config = json.load(open(cwd / 'ex' / 'adapter' / 'adapter_config.json'))
  assert config['base_model_name_or_path'] == str(cwd / 'ex' / 'hf')
  pax_ok(cwd, 'score', 'requests.jsonl', '--job-log-dir', 'ex/lora', '--output', 'lora_scores.jsonl')
  ours = json.loads((cwd / 'lora_scores.jsonl').read_text())['logprob']
  peft = subprocess.run([sys.executable, '-c', PEFT_SCORE, json.dumps(REQUEST)], cwd=cwd, capture_output=True,
                        text=True, timeout=600)
  assert peft.returncode == 0, peft.stderr[-3000:]
  assert float(peft.stdout.strip().splitlines()[-1]) == pytest.approx(ours, abs=1e-3)
