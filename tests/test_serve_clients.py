"""`pax serve` against real clients on a real trained model (slow: each trains and starts servers).

lm-evaluation-harness' own `local-completions` model pointed at the server gives `pax lm-eval`'s numbers on
the same job; LoRA adapters of one base served side by side (one batch) give each run's `pax decode` tokens;
a model's own chat template (tokenizer_config.json) renders as transformers' apply_chat_template; a model with
a sliding window (its cache a ring) serves `pax decode`'s tokens.
"""

import json
import os
import shutil
import threading

import pytest
from rich.console import Console

from test_lm_eval import OFFLINE, TASKS, write_tasks
from test_serve import Server
from tiny_lm import EXP, KNOBS

pytest.importorskip('fastapi')
pytest.importorskip('lm_eval')
openai = pytest.importorskip('openai')

QUIET = Console(quiet=True)


@pytest.fixture(scope='module')
def trained(tmp_path_factory, tiny_trained):
  """(this module's work directory, the session's tiny trained job, its HF export): the job is only read."""
  base = tmp_path_factory.mktemp('serve_clients')
  job, hf = tiny_trained
  return base, job, hf


@pytest.fixture
def offline(monkeypatch):
  for k, v in OFFLINE.items():
    monkeypatch.setenv(k, v)


@pytest.mark.slow
def test_lm_eval_local_completions_gives_pax_lm_evals_numbers(trained, offline):
  """The harness' API models score windows of max_length - 2 tokens (max_length - 1 tokens in, one generated):
  pax lm-eval with MAX_SEQ_LEN=62 reads the same windows as local-completions with max_length=64."""
  import lm_eval
  from lm_eval.tasks import TaskManager

  import paxcli
  base, job, _ = trained
  tasks = write_tasks(str(base / 'tasks'))
  ours = paxcli.lm_eval(TASKS, EXP, overrides=KNOBS + ['MAX_SEQ_LEN=62'], job_dir=job, include_path=[tasks],
                        log_samples=True, console=QUIET, output=str(base / 'pax_lm_eval.json'))
  server = Server(['--job-log-dir', job, '--slots', '8'], cwd=str(base))
  try:
    theirs = lm_eval.simple_evaluate(
        model='local-completions', tasks=TASKS, task_manager=TaskManager(include_path=tasks, include_defaults=False),
        model_args={'base_url': f'{server.url}/completions', 'model': 'job', 'tokenizer_backend': 'remote',
                    'max_length': 64, 'num_concurrent': 8, 'max_retries': 1},
        log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
  finally:
    server.stop()
  mine, hers = ours['results'], theirs['results']
  for metric in ('acc,none', 'acc_norm,none'):
    assert mine['tiny_mc'][metric] == hers['tiny_mc'][metric], metric
  for metric in ('word_perplexity,none', 'byte_perplexity,none', 'bits_per_byte,none'):
    assert mine['tiny_ppl'][metric] == pytest.approx(hers['tiny_ppl'][metric], rel=1e-4), metric
  assert mine['tiny_gen']['exact_match,none'] == hers['tiny_gen']['exact_match,none']
  samples = {t: sorted((json.loads(line) for line in open(ours.path[:-len('.json')] + f'_samples_{t}.jsonl')),
                       key=lambda s: s['doc_id']) for t in TASKS}
  for a, b in zip(samples['tiny_mc'], theirs['samples']['tiny_mc'], strict=True):
    for (x,), (y,) in zip(a['resps'], b['resps'], strict=True):
      assert x[0] == pytest.approx(y[0], abs=1e-3) and x[1] == y[1]
  generated = [(a['resps'][0][0], b['resps'][0][0]) for a, b in zip(samples['tiny_gen'], theirs['samples']['tiny_gen'],
                                                                    strict=True)]
  assert all(x.strip() == y.strip() and x.strip() for x, y in generated), generated


def _lora_run(base, job, name, rank, targets, seed):
  import paxcli
  overrides = KNOBS + [f'INIT_FROM={job!r}', f'LORA_RANK={rank}', f'LORA_ALPHA={2.0 * rank}',
                       f'LORA_TARGETS={targets!r}', 'NUM_TRAIN_STEPS=40', 'SAVE_INTERVAL_STEPS=40',
                       'LEARNING_RATE=0.05', f'RANDOM_SEED={seed}']
  out = str(base / name)
  paxcli.train(EXP, job_dir=out, overrides=overrides, console=QUIET)
  return out, overrides


@pytest.mark.slow
def test_lora_adapters_of_one_base_are_served_in_one_batch(trained):
  """Two LoRA runs of other ranks and targets, and their base, each asked at once: every answer is its own
  run's `pax decode` (greedy), so rows of three adapters decoded together each read their own."""
  import paxcli
  base, job, _ = trained
  a, a_sets = _lora_run(base, job, 'lora_a', 4, ('query', 'value'), 1)
  b, b_sets = _lora_run(base, job, 'lora_b', 2, ('query', 'key', 'value', 'output', 'mlp'), 2)
  prompt = 'Return the number of'
  want = {}
  for name, directory, sets in (('job', job, KNOBS), ('lora_a', a, a_sets), ('sql', b, b_sets)):
    want[name] = paxcli.decode(EXP, overrides=sets, job_dir=directory, prompt=[prompt], max_decode_steps=12,
                               console=QUIET, output=str(base / f'{name}.jsonl'))[0]['decoded']
  assert len(set(want.values())) == 3, want   # the adapters change the model
  # The LoRA run as the job: its base is served beside it, the other run under the name given.
  server = Server(['--job-log-dir', a, '--lora', f'sql={b}', '--slots', '8'], cwd=str(base))
  try:
    client = server.client(timeout=600)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {'job', 'lora_a', 'sql'}
    got, threads = {}, []
    for name in ['job', 'lora_a', 'sql'] * 3:
      def ask(name=name):
        got.setdefault(name, []).append(client.completions.create(model=name, prompt=prompt, max_tokens=12,
                                                                  temperature=0).choices[0].text)
      threads.append(threading.Thread(target=ask))
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert {n: set(v) for n, v in got.items()} == {n: {w} for n, w in want.items()}
    # A request without `model` gets the job's own: the run with its adapters.
    import httpx
    r = httpx.post(f'{server.url}/completions', json={'prompt': prompt, 'max_tokens': 12, 'temperature': 0}).json()
    assert r['model'] == 'lora_a' and r['choices'][0]['text'] == want['lora_a']
  finally:
    server.stop()
  # An adapter of another base is refused in one line before serving.
  import subprocess
  import sys
  other = str(base / 'other_base')
  paxcli.train(EXP, job_dir=other, overrides=KNOBS + ['RANDOM_SEED=5', 'NUM_TRAIN_STEPS=5', 'SAVE_INTERVAL_STEPS=5'],
               console=QUIET)
  r = subprocess.run([sys.executable, '-m', 'paxcli.cli.app', 'serve', '--job-log-dir', other, '--lora', a,
                      '--port', '0'], capture_output=True, text=True, timeout=600)
  assert r.returncode != 0 and 'trained on the base' in r.stderr and 'Traceback' not in r.stderr, r.stderr


@pytest.mark.slow
def test_a_shipped_chat_template_renders_as_transformers_does(trained):
  """The job's tokenizer with a chat_template in its tokenizer_config.json: a chat request's prompt is the ids
  transformers' apply_chat_template gives (on the HF export's tokenizer with the same template), and its answer
  is `pax decode`'s on those ids."""
  import paxcli
  from transformers import AutoTokenizer
  base, job, hf = trained
  template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
              "{% if add_generation_prompt %}<assistant>{% endif %}")
  chat_job = str(base / 'chat_job')
  shutil.copytree(job, chat_job)
  config_path = os.path.join(chat_job, 'tokenizer', 'tokenizer_config.json')
  config = json.load(open(config_path)) if os.path.exists(config_path) else {}
  json.dump({**config, 'chat_template': template}, open(config_path, 'w'))
  messages = [{'role': 'system', 'content': 'Docstrings. '}, {'role': 'user', 'content': 'Return the number of'}]
  # The export splits special tokens' texts (split_special_tokens: plain text is read as sentencepiece reads it);
  # a chat model's tokenizer reads a template's `</s>` as that token, as paxcli's template renderer does.
  hf_tok = AutoTokenizer.from_pretrained(hf, split_special_tokens=False)
  ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                   chat_template=template)
  record = paxcli.decode(EXP, overrides=KNOBS, job_dir=chat_job, prompt_ids=[','.join(map(str, ids))],
                         max_decode_steps=10, console=QUIET, output=str(base / 'chat.jsonl'))[0]
  server = Server(['--job-log-dir', chat_job], cwd=str(base))
  try:
    got = server.client().chat.completions.create(model='chat_job', messages=messages, max_tokens=10, temperature=0)
  finally:
    server.stop()
  assert got.usage.prompt_tokens == len(ids)
  assert got.usage.completion_tokens == record['num_decoded_tokens']
  assert got.choices[0].message.content == record['decoded']


@pytest.mark.slow
def test_a_sliding_window_model_serves_pax_decodes_tokens(tmp_path):
  """A window shorter than the text: the model's cache is a ring, which the server keeps at its whole length."""
  import paxcli
  sets = KNOBS + ['SLIDING_WINDOW=8', 'NUM_TRAIN_STEPS=30', 'SAVE_INTERVAL_STEPS=30']
  job = str(tmp_path / 'window')
  paxcli.train(EXP, job_dir=job, overrides=sets, console=QUIET)
  prompts = ['Return the number of items in the list if', 'Create']
  want = paxcli.decode(EXP, overrides=sets, job_dir=job, prompt=prompts, max_decode_steps=20, console=QUIET,
                       output=str(tmp_path / 'window.jsonl'))
  server = Server(['--job-log-dir', job], cwd=str(tmp_path))
  try:
    client = server.client()
    for prompt, record in zip(prompts, want):
      got = client.completions.create(model='window', prompt=prompt, max_tokens=20, temperature=0)
      assert got.choices[0].text == record['decoded']
  finally:
    server.stop()
