"""`pax lm-eval`: the harness' own evaluator on a paxcli checkpoint gives the numbers its Hugging Face
backend gives on the same weights exported `--to hf` (loglikelihood, rolling and generate_until tasks
defined in local YAMLs over local JSONL data: no download); bad input is one line.
"""

import json
import os
import shutil
import sys

import pytest

from conftest import pax_main, run_pax
from tiny_lm import EXP, KNOBS, sets

pytest.importorskip('lm_eval')
OFFLINE = {'HF_DATASETS_OFFLINE': '1', 'HF_HUB_OFFLINE': '1'}
TASKS = ['tiny_mc', 'tiny_ppl', 'tiny_gen']

MC = [('Return the number of', [' items in the list.', ' purple elephants dancing.', ' xyz qqq.'], 0),
      ('If the optional argument', [' is given, it is used.', ' banana the of.', ' zzz.'], 0),
      ('Raise ValueError if', [' the value is negative.', ' cat dog sky.', ' !!!'], 0),
      ('Create a new', [' file object.', ' a the the.', ' 42 42 42.'], 1),
      ('The default value is', [' None.', ' purple.', ' jump.'], 0),
      ('This function returns', [' a string.', ' the moon.', ' swim fast.'], 2)]
TEXTS = ['Return the number of items in the list. If the optional argument is given, it is used as the default '
         'value for the new object, and a ValueError is raised when the value is negative or not an integer, '
         'as the module documents for every function that takes a count.',  # longer than a window: rolling
         'Create a new file object.', 'This is a short text.']
PROMPTS = [('Return the number of', 'items'), ('If the optional argument', 'is'),
           ('Raise ValueError if the', 'value'), ('Create a new', 'file')]


def _task(name, data, body):
  return (f'task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n'
          f'test_split: test\n{body}')


def write_tasks(directory):
  """Three harness tasks over local JSONL files: multiple choice, rolling perplexity, generation."""
  os.makedirs(directory, exist_ok=True)
  rows = {'mc': [{'question': q, 'choices': c, 'answer': a} for q, c, a in MC],
          'ppl': [{'text': t} for t in TEXTS], 'gen': [{'prompt': p, 'target': t} for p, t in PROMPTS]}
  for name, items in rows.items():
    with open(os.path.join(directory, f'{name}.jsonl'), 'w') as f:
      f.writelines(json.dumps(r) + '\n' for r in items)
  bodies = {
      'mc': ('output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
             'doc_to_target: "{{answer}}"\ntarget_delimiter: ""\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n'),
      'ppl': ('output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
              '  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n'),
      'gen': ('output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
              'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 8\n  do_sample: false\nmetric_list:\n'
              '  - metric: exact_match\n'),
  }
  for name, body in bodies.items():
    with open(os.path.join(directory, f'{name}.yaml'), 'w') as f:
      f.write(_task(f'tiny_{name}', os.path.join(directory, f'{name}.jsonl'), body))
  return directory


@pytest.fixture(scope='module')
def trained(tiny_trained, tmp_path_factory):
  """conftest's tiny trained model; a copy of its job directory, which `pax lm-eval` writes its results into."""
  base = tmp_path_factory.mktemp('lmeval')
  shared_job, hf = tiny_trained
  job = str(base / 'job')
  shutil.copytree(shared_job, job, symlinks=True)
  return base, job, hf, write_tasks(str(base / 'tasks'))


@pytest.fixture
def offline(monkeypatch):
  for k, v in OFFLINE.items():
    monkeypatch.setenv(k, v)


def _quiet():
  from rich.console import Console
  return Console(quiet=True)


def _samples(path, task):
  with open(path[:-len('.json')] + f'_samples_{task}.jsonl') as f:
    return sorted((json.loads(line) for line in f), key=lambda s: s['doc_id'])


@pytest.mark.slow  # trains and exports the tiny LM (~1 min), then runs both backends
def test_pax_lm_eval_gives_the_numbers_of_the_harness_hf_backend_on_the_exported_weights(trained, offline):
  import lm_eval
  from lm_eval.models.huggingface import HFLM
  from lm_eval.tasks import TaskManager

  from paxcli import api
  base, job, hf, tasks = trained
  ours = api.lm_eval(TASKS, EXP, overrides=KNOBS, job_dir=job, include_path=[tasks], log_samples=True,
                     console=_quiet())
  theirs = lm_eval.simple_evaluate(model=HFLM(pretrained=hf, device='cpu', dtype='float32', batch_size=4),
                                   tasks=TASKS, task_manager=TaskManager(include_path=tasks, include_defaults=False),
                                   log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)
  assert ours.path == os.path.join(job, 'lm_eval', 'results_step300_1.json')
  assert json.load(open(ours.path))['results'] == json.loads(json.dumps(ours['results']))
  assert ours['paxcli']['loglikelihood'] == 18 and ours['paxcli']['loglikelihood_rolling'] == 3
  assert ours['paxcli']['generate_until'] == 4
  mine, hers = ours['results'], theirs['results']
  for metric in ('acc,none', 'acc_norm,none'):
    assert mine['tiny_mc'][metric] == hers['tiny_mc'][metric], metric
  assert mine['tiny_gen']['exact_match,none'] == hers['tiny_gen']['exact_match,none']
  for metric in ('word_perplexity,none', 'byte_perplexity,none', 'bits_per_byte,none'):
    assert mine['tiny_ppl'][metric] == pytest.approx(hers['tiny_ppl'][metric], rel=1e-4), metric
  # Request by request: log-likelihoods within 1e-3, the same greedy flags, the same generations.
  for task in ('tiny_mc', 'tiny_ppl'):
    for a, b in zip(_samples(ours.path, task), theirs['samples'][task], strict=True):
      for (x,), (y,) in zip(a['resps'], b['resps'], strict=True):
        if task == 'tiny_mc':
          assert x[0] == pytest.approx(y[0], abs=1e-3) and x[1] == y[1]
        else:
          assert x == pytest.approx(y, abs=1e-3)
  generated = [(a['resps'][0][0], b['resps'][0][0]) for a, b in zip(
      _samples(ours.path, 'tiny_gen'), theirs['samples']['tiny_gen'], strict=True)]
  assert all(x == y for x, y in generated) and all(x.strip() for x, _ in generated), generated


@pytest.mark.slow  # shares the trained fixture
def test_pax_lm_eval_from_a_fresh_shell_prints_the_harness_table_and_writes_the_job_directory(trained):
  base, job, hf, tasks = trained
  args = ['lm-eval', '--tasks', 'tiny_mc,tiny_gen', '--include-path', 'tasks', '--job-log-dir', 'job', *sets(),
          '--limit', '3']
  r = run_pax(*args, cwd=str(base), env=OFFLINE)
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert lines[0].startswith('paxcli (default.StdlibDocsLm, ') and 'limit: 3' in lines[0]
  rows = [[c.strip() for c in ln.split('|')[1:-1]] for ln in lines if ln.startswith('|')]
  assert rows[0] == ['Tasks', 'Version', 'Filter', 'n-shot', 'Metric', '', 'Value', '', 'Stderr']  # make_table's
  assert ['tiny_gen', 'Yaml', 'none', '0', 'exact_match'] == rows[2][:5] and rows[3][:5] == [
      'tiny_mc', 'Yaml', 'none', '0', 'acc']
  assert 'requests/s' in r.stderr and 'results_step300_' in r.stderr
  r2 = run_pax(*args, '--json', cwd=str(base), env=OFFLINE)
  assert r2.returncode == 0, r2.stderr
  printed = json.loads(r2.stdout)
  assert set(printed['results']) == {'tiny_mc', 'tiny_gen'} and printed['n-samples']['tiny_mc']['effective'] == 3
  written = sorted(os.listdir(os.path.join(job, 'lm_eval')))
  assert [n for n in written if n.endswith('.json')][-2:] == ['results_step300_2.json', 'results_step300_3.json']


def test_lm_eval_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, 'lm_eval', None)  # how Python hides a package: find_spec gives None
  code, _, err = pax_main(['lm-eval', '--tasks', 'hellaswag', '--job-log-dir', str(tmp_path)], capsys)
  assert code == 2 and "not installed: pip install 'paxcli[eval]'" in err and len(err.strip().splitlines()) == 1


def test_bad_tasks_and_job_directories_are_one_line_before_any_weights(tmp_path, capsys, offline):
  tasks = write_tasks(str(tmp_path / 'tasks'))
  base = ['lm-eval', '--exp', EXP, *sets(), '--include-path', tasks]
  code, _, err = pax_main([*base, '--tasks', 'tiny_mcq', '--job-log-dir', str(tmp_path / 'job')], capsys)
  assert code == 2 and "lm-eval has no task, group or tag 'tiny_mcq'. Did you mean 'tiny_mc'" in err
  code, _, err = pax_main([*base, '--tasks', 'tiny_mc', '--job-log-dir', str(tmp_path / 'job')], capsys)
  assert code == 2 and 'No complete checkpoint in' in err and len(err.strip().splitlines()) == 1
  code, _, err = pax_main([*base, '--tasks', 'tiny_mc', '--include-path', str(tmp_path / 'none')], capsys)
  assert code == 2 and 'is not a directory of task YAML files' in err
