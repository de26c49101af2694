"""`pax lm-eval`: lm-evaluation-harness' own evaluator on a checkpoint, printed as the harness prints it."""

from __future__ import annotations

import contextlib
import sys
from typing import List, Optional

import typer

from paxcli.cli import common


def lm_eval_command(
    tasks: List[str] = typer.Option(..., '--tasks', '-t', metavar='TASKS', help='A task YAML file is code: it may '
                                    'run Python functions of files beside it (!function): give only files you trust. '
                                    'lm-eval tasks, groups or tags, comma-separated or repeated (hellaswag,arc_easy), '
                                    'glob patterns, or task YAML files.'),
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = common.job_dir_option(),
    include_path: List[str] = typer.Option([], '--include-path', metavar='DIR', help='A directory of task YAMLs is '
                                           'code: its YAMLs may run Python functions beside them (!function): only '
                                           'directories you trust. Your own task YAMLs (repeatable).'),
    num_fewshot: Optional[int] = typer.Option(None, '--num-fewshot', help='Few-shot examples per prompt (default: '
                                              'each task\'s own).'),
    limit: Optional[float] = typer.Option(None, '--limit', help='Documents per task (below 1: a fraction); for '
                                          'trying things, not for reporting.'),
    batch_size: int = typer.Option(0, '--batch-size', min=0, help='Requests computed together (0: up to 64, and '
                                   'at most 4,096 tokens a batch when scoring).'),
    step: Optional[int] = typer.Option(None, '--step', help='Checkpoint step (default: the latest).'),
    dtype: Optional[str] = typer.Option(None, '--dtype', help='Activation dtype (default: FPROP_DTYPE).'),
    gen_kwargs: Optional[str] = typer.Option(None, '--gen-kwargs', metavar='K=V,...', help='Generation settings '
                                             'over the tasks\' own (the harness\' --gen_kwargs: max_gen_toks=64,'
                                             'until=...).'),
    log_samples: bool = typer.Option(False, '--log-samples', help='Also write each document, its requests and the '
                                     "model's answers (one JSONL per task, beside the results)."),
    seed: int = typer.Option(0, '--seed', help='The harness\' random seeds (few-shot sampling).'),
    output: Optional[str] = typer.Option(None, '--output', '-o', help='Results JSON (default <job dir>/lm_eval/'
                                         'results_step<k>_<n>.json, n counting up).'),
    json_out: bool = typer.Option(False, '--json', help='Print the results JSON to stdout instead of the tables.'),
    coordinator: Optional[str] = common.coordinator_option(),
    num_processes: Optional[int] = common.num_processes_option(),
    process_id: Optional[int] = common.process_id_option(),
) -> None:
  """lm-evaluation-harness tasks on a checkpoint: the harness' own evaluator, the model batched on the mesh."""
  from paxcli import api
  err = common.console(stderr=True)
  names = [t.strip() for arg in tasks for t in arg.split(',')]
  evaluated = api.lm_eval(
      names, exp, overrides=overrides, job_dir=job_log_dir, include_path=include_path, num_fewshot=num_fewshot,
      limit=limit, batch_size=batch_size, step=step, dtype=dtype, gen_kwargs=gen_kwargs, log_samples=log_samples,
      seed=seed, output=output, coordinator=coordinator, num_processes=num_processes, process_id=process_id,
      console=err, progress=_bars(err) if sys.stderr.isatty() else None)
  if evaluated.path is None:  # processes other than 0 print nothing
    return
  if json_out:
    from paxcli.loops.harness.command import to_json
    sys.stdout.write(to_json(dict(evaluated)) + '\n')
  else:
    info = evaluated['paxcli']
    limit_note = f', limit: {limit:g}' if limit is not None else ''
    sys.stdout.write(f'paxcli ({info["experiment"]}, {info["job_dir"]} step {info["step"]}){limit_note}, num_fewshot: '
                     f'{num_fewshot}, batch_size: {batch_size or "auto"}\n')
    for table in evaluated.tables:
      sys.stdout.write(table + '\n')
  sys.stdout.flush()
  s = evaluated.stats
  err.print(f'{s["requests"]:,} requests ({s["loglikelihood"]:,} loglikelihood, {s["loglikelihood_rolling"]:,} '
            f'rolling, {s["generate_until"]:,} generate_until) in {s["seconds"]:.1f} s: {s["requests_per_sec"]:,.1f} '
            f'requests/s; compilation {s["compile_s"]:.1f} s, not in the rate\nWrote the results to {evaluated.path}',
            highlight=False)


def _bars(console):
  """progress(label, total) for the model's requests: a transient rich bar per kind."""

  @contextlib.contextmanager
  def bar(label: str, total: int):
    with common.progress(console, label) as shown:
      task = shown.add_task(label, total=total)
      yield lambda n: shown.advance(task, n)

  return bar


def register(app: typer.Typer) -> None:
  app.command('lm-eval')(lm_eval_command)
