"""`pax lm-eval` as a function: a resolved config, a job directory and task names in; the harness' results out.

    evaluated = lm_eval_run(resolved, job_dir, ['hellaswag'])
    evaluated['results']['hellaswag']['acc,none']     # the harness' own results dict
    evaluated.tables                                   # as the harness prints them (its make_table)

The tasks are the harness' (names, groups, tags, glob patterns, or paths of task YAML files) and
its own `simple_evaluate` runs them on a PaxLM; `include_path` adds task directories (a task's
YAML may name Python functions of its directory: point it only at directories you trust). When
every task is found under `include_path`, the harness' ~15,000 built-in tasks are not indexed
(seconds saved). Process 0 writes the results to <job dir>/lm_eval/results_step<k>_<n>.json and,
with `log_samples`, each task's documents, requests and answers beside it as JSONL.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Optional, Sequence

import jax
import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from paxcli.errors import UserError, did_you_mean, shorten
from paxcli.jobdir import layout, storage
from paxcli.loops.decode.output import check_output
from paxcli.loops.harness.model import PaxLM, Progress


class Evaluated(dict):
  """The harness' results (without per-document samples, which go to files), with what `pax lm-eval`
  prints besides them."""

  def __init__(self, results: dict, tables: list[str], path: Optional[str], stats: dict):
    super().__init__(results)
    self.tables = tables  # the harness' tables of them: tasks, and groups when there are any
    self.path = path      # the JSON written; None on processes other than 0
    self.stats = stats    # requests by kind; seconds, of which compile_s; requests_per_sec (compilation apart)


def tasks_manager(tasks: Sequence[str], include_path: Sequence[str] = ()) -> TaskManager:
  """The harness' TaskManager that knows `tasks`; a UserError naming an unknown one (did you mean)."""
  for path in include_path:
    if not os.path.isdir(path):  # the harness reads task directories of this machine only
      raise UserError(f'--include-path {shorten(path, 200)} is not a directory of task YAML files.')
  if include_path:
    local = TaskManager(include_path=list(include_path), include_defaults=False)
    if _unknown(local, tasks) == []:
      return local
  manager = TaskManager(include_path=list(include_path) or None)
  unknown = _unknown(manager, tasks)
  if unknown:
    name = unknown[0]
    raise UserError(f'lm-eval has no task, group or tag {shorten(repr(name), 120)}.'
                    f'{did_you_mean(name, manager.all_tasks)} (`lm-eval ls tasks` lists them; --include-path adds '
                    'directories of your own task YAMLs.)')
  return manager


def _unknown(manager: TaskManager, tasks: Sequence[str]) -> list[str]:
  known = set(manager.all_tasks)
  return [t for t in tasks if t not in known and not os.path.isfile(t)
          and not (any(c in t for c in '*?[') and manager.match_tasks([t]))]


def lm_eval_run(resolved, job_dir: str, tasks: Sequence[str], *, include_path: Sequence[str] = (),
                num_fewshot: Optional[int] = None, limit: Optional[float] = None, batch_size: int = 0,
                step: Optional[int] = None, dtype: Optional[str] = None, gen_kwargs: Optional[str] = None,
                log_samples: bool = False, seed: int = 0, output: Optional[str] = None,
                log: Callable[[str], None] = print, progress: Optional[Progress] = None) -> Evaluated:
  """Runs the harness' `simple_evaluate` on `tasks` with checkpoint `step` (default the latest) of `job_dir`."""
  manager = tasks_manager(tasks, include_path)  # a mistyped task before anything is built
  model = PaxLM(resolved, job_dir, step=step, batch_size=batch_size, dtype=dtype, log=log, progress=progress)
  lead = jax.process_index() == 0
  if lead:  # an unwritable output is found before the evaluation, not after it
    check_output(output or default_output(job_dir, model.wanted))
  start = time.perf_counter()
  try:
    results = lm_eval.simple_evaluate(
        model=model, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, gen_kwargs=gen_kwargs,
        task_manager=manager, log_samples=log_samples, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed)
  except UserError:
    raise
  except Exception as e:
    if model.step is not None:  # the model had begun: not a problem of the tasks
      raise
    # Building the tasks failed (a dataset that cannot be read, a bad task YAML): the harness' own message.
    text = str(e).strip().splitlines()[0] if str(e).strip() else ''
    raise UserError(f'lm-eval could not prepare the tasks {", ".join(tasks)}: {type(e).__name__}: '
                    f'{shorten(text, 300)}') from None
  seconds = time.perf_counter() - start
  samples = results.pop('samples', None) or {}
  requests, compile_s = sum(model.counts.values()), model.compile_seconds()
  stats = {**model.counts, 'requests': requests, 'seconds': seconds, 'compile_s': compile_s,
           'requests_per_sec': requests / max(seconds - compile_s, 1e-9)}
  results['paxcli'] = {'job_dir': job_dir, 'experiment': resolved.name, 'step': model.step, **stats}
  tables = [make_table(results)] + ([make_table(results, 'groups')] if results.get('groups') else [])
  path = None
  if lead:
    path = output or default_output(job_dir, model.step)
    _write(path, results, samples)
  return Evaluated(results, tables, path, stats)


def default_output(job_dir: str, step: int) -> str:
  """<job dir>/lm_eval/results_step<k>_<n>.json with the first unused n: never an earlier result."""
  return layout.first_unused(lambda n: layout.lm_eval_results(job_dir, step, n))


def to_json(results: dict) -> str:
  """The results as the harness writes them (its handler for numpy values and the like)."""
  return json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)


def _write(path: str, results: dict, samples: dict) -> None:
  try:
    storage.write_text(path, to_json(results) + '\n')
    for task, rows in samples.items():
      lines = ''.join(json.dumps(r, default=handle_non_serializable, ensure_ascii=False) + '\n' for r in rows)
      storage.write_text(layout.lm_eval_samples(path, task), lines)
  except OSError as e:
    raise UserError(f'Cannot write {shorten(path, 200)}: {e.strerror}.') from None
