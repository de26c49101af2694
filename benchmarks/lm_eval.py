"""lm-eval speed: requests/s of `pax lm-eval` against lm-evaluation-harness' own Hugging Face backend,
on the same CPU and the same weights.

  .venv/bin/python benchmarks/lm_eval.py [--exp default.StdlibDocsLm] [--steps 20] [--docs 64]
                                         [--batch-size 16] [--set K=V ...]

Trains the experiment for --steps (a checkpoint to read; speed does not depend on how good it is),
exports it `--to hf`, and writes three harness tasks over stdlib docstrings (no download): multiple
choice (4 loglikelihood requests a document), rolling perplexity (loglikelihood_rolling) and
generation (generate_until, 16 new tokens at most, stopping at a newline). Each task runs on its
own, through the harness' `simple_evaluate` both times: paxcli's PaxLM (`pax lm-eval`), timed on a
second run after a first that compiles its shapes (compile seconds are shown apart), and the `hf`
backend (transformers on torch's CPU build, float32, --batch-size), timed on a second run too.
Requests/s is the harness' whole run (task building, tokenizing, metrics included) over its
requests. The metric columns say whether the two agree. Machines are shared and noisy: compare
within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import machine   # benchmarks/machine.py: the processor beside the table

# Run as a script, this file's directory comes first on sys.path, and this file is named lm_eval.py:
# `import lm_eval` would import it instead of the harness.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or '.') != os.path.dirname(os.path.abspath(__file__))]


def _docstrings() -> list[str]:
  """Sentences of the standard library's docstrings: text the default experiment was trained on."""
  import collections
  import inspect
  import json as json_module
  import pathlib
  import textwrap
  sentences = []
  for module in (collections, inspect, json_module, pathlib, textwrap, os, random, argparse):
    for obj in [module, *vars(module).values()]:
      doc = getattr(obj, '__doc__', None)
      doc = ' '.join(doc.split()) if isinstance(doc, str) else ''
      sentences += [s.strip() + '.' for s in doc.split('. ') if 8 <= len(s.split()) <= 40]
  return sorted(set(sentences))


def write_tasks(directory: str, docs: int) -> dict:
  """Three task YAMLs over local JSONL files; returns {task: output type}."""
  rng = random.Random(0)
  sentences = _docstrings()
  picked = rng.sample(sentences, min(len(sentences), docs * 2))
  rows = {'mc': [], 'ppl': [], 'gen': []}
  for n in range(docs):
    words = picked[n % len(picked)].split()
    wrong = [' ' + ' '.join(rng.sample(words, len(words) - 5)) for _ in range(3)]
    rows['mc'].append({'question': ' '.join(words[:5]), 'choices': [' ' + ' '.join(words[5:])] + wrong, 'answer': 0})
    rows['ppl'].append({'text': ' '.join(picked[(n + i) % len(picked)] for i in range(3))})
    rows['gen'].append({'prompt': ' '.join(words[:6]), 'target': ' '.join(words[6:8])})
  bodies = {
      'mc': ('multiple_choice', 'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
             'target_delimiter: ""\nmetric_list:\n  - metric: acc\n'),
      'ppl': ('loglikelihood_rolling', 'doc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
              '  - metric: word_perplexity\n'),
      'gen': ('generate_until', 'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\ngeneration_kwargs:\n'
              '  until: ["\\n"]\n  max_gen_toks: 16\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n'),
  }
  for name, items in rows.items():
    data = os.path.join(directory, f'{name}.jsonl')
    with open(data, 'w') as f:
      f.writelines(json.dumps(r) + '\n' for r in items)
    kind, body = bodies[name]
    with open(os.path.join(directory, f'{name}.yaml'), 'w') as f:
      f.write(f'task: bench_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n'
              f'test_split: test\noutput_type: {kind}\n{body}')
  return {f'bench_{name}': bodies[name][0] for name in rows}


def _metric(results: dict, task: str) -> float:
  values = [v for k, v in results['results'][task].items() if k.endswith(',none') and 'stderr' not in k]
  return values[0]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', default='default.StdlibDocsLm')
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--docs', type=int, default=64, help='documents per task')
  parser.add_argument('--batch-size', type=int, default=16, help="the HF backend's batch size (paxcli: its default)")
  parser.add_argument('--set', action='append', default=[], dest='overrides')
  args = parser.parse_args()
  os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
  os.environ.setdefault('HF_HUB_OFFLINE', '1')
  import jax
  import lm_eval
  import torch
  from lm_eval.models.huggingface import HFLM
  from lm_eval.tasks import TaskManager
  from rich.console import Console
  from rich.table import Table

  import paxcli
  quiet = Console(quiet=True)
  base = tempfile.mkdtemp(prefix='paxcli-bench-lm-eval-')
  job, hf, tasks_dir = os.path.join(base, 'job'), os.path.join(base, 'hf'), os.path.join(base, 'tasks')
  overrides = list(args.overrides)
  paxcli.train(args.exp, overrides=overrides + [f'NUM_TRAIN_STEPS={args.steps}', f'SAVE_INTERVAL_STEPS={args.steps}',
                                                'EVAL_INTERVAL_STEPS=0', 'DECODE_INTERVAL_STEPS=0'],
               job_dir=job, console=quiet)
  paxcli.convert_checkpoint(job, hf, to='hf', console=quiet)
  os.makedirs(tasks_dir)
  tasks = write_tasks(tasks_dir, args.docs)
  manager = TaskManager(include_path=tasks_dir, include_defaults=False)
  hf_model = HFLM(pretrained=hf, device='cpu', dtype='float32', batch_size=args.batch_size)

  table = Table(title=f'{args.exp} ({args.steps} steps), {args.docs} documents a task; paxcli on '
                      f'{len(jax.devices())} x {jax.devices()[0].device_kind}, hf on torch {torch.__version__} '
                      f'({torch.get_num_threads()} threads)')
  for col in ('task', 'requests', 'paxcli requests/s', 'hf requests/s', 'paxcli / hf', 'paxcli compile s',
              'metric paxcli', 'metric hf'):
    table.add_column(col, justify='right')
  for task, kind in tasks.items():
    for _ in range(2):  # the first run compiles every shape it meets
      start = time.perf_counter()
      ours = paxcli.lm_eval([task], args.exp, overrides=overrides, job_dir=job, include_path=[tasks_dir], console=quiet)
      ours_s = time.perf_counter() - start
      compile_s = ours.stats['compile_s'] if _ == 0 else compile_s
    for _ in range(2):
      start = time.perf_counter()
      theirs = lm_eval.simple_evaluate(model=hf_model, tasks=[task], task_manager=manager)
      theirs_s = time.perf_counter() - start
    requests = ours.stats['requests']
    table.add_row(f'{task} ({kind})', f'{requests:,}', f'{requests / ours_s:,.1f}', f'{requests / theirs_s:,.1f}',
                  f'{theirs_s / ours_s:.2f}x', f'{compile_s:.1f}', f'{_metric(ours, task):.4g}',
                  f'{_metric(theirs, task):.4g}')
  Console(width=200).print(table)
  Console(width=200).print(machine.describe())


if __name__ == '__main__':
  main()
