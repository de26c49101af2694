"""`pax eval`: metrics of each eval dataset from a checkpoint, or of each new checkpoint (--follow)."""

from __future__ import annotations

import json
import os
from typing import List, Optional

import typer

from paxcli.cli import common


def eval_command(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = common.job_dir_option(),
    step: Optional[int] = typer.Option(None, '--step', metavar='N', min=0,
                                       help='Evaluate the checkpoint at step N. Default: the latest.'),
    follow: bool = typer.Option(
        False, '--follow', help='Beside a running trainer: wait for new checkpoints in the job directory and '
        'evaluate each once (steps already evaluated, listed in eval_done.jsonl, are skipped, also after a '
        'restart; several followers share the work). Stops after the last step of this config '
        '(num_train_steps, with --set), or once no trainer runs on the job (train.lock) and no new checkpoint '
        'came.'),
    timeout: Optional[float] = typer.Option(
        None, '--timeout', metavar='SECONDS', min=0.0,
        help="With --follow: stop after this long even if the last step has not come. Default: stop once no "
        'trainer runs on the job (none has come for 120 s, or it finished or died) and no new checkpoint came.'),
    poll: float = typer.Option(10.0, '--poll', metavar='SECONDS', min=0.01,
                               help='With --follow: seconds between looks for new checkpoints.'),
    no_checkpoint: bool = typer.Option(False, '--no-checkpoint', help='Evaluate freshly initialised weights.'),
    json_out: bool = typer.Option(False, '--json', help='Print the metrics as JSON (with --follow: one line per '
                                                       'checkpoint).'),
    coordinator: Optional[str] = common.coordinator_option(),
    num_processes: Optional[int] = common.num_processes_option(),
    process_id: Optional[int] = common.process_id_option(),
) -> None:
  """Evaluate the eval datasets from the latest checkpoint (or --step N, or each new one with --follow).

  Writes summaries/eval (TensorBoard) and eval_metrics.jsonl in the job directory
  (summaries/eval_N and eval_N_metrics.jsonl for an eval input named N).
  """
  from paxcli.errors import UserError
  if follow and (step is not None or no_checkpoint):
    raise UserError('--follow evaluates every new checkpoint; it does not go with --step or --no-checkpoint.')
  if timeout is not None and not follow:
    raise UserError('--timeout goes with --follow.')
  if step is not None and no_checkpoint:
    raise UserError('--step N picks a checkpoint; --no-checkpoint evaluates fresh weights. Give one of them.')
  from paxcli.jobdir import invocation
  from paxcli.loops.evaluate import evaluate, follow as follow_run, results_table
  common.start_processes(coordinator, num_processes, process_id)  # before anything starts JAX
  resolved = common.resolve(exp, overrides)
  job_dir = common.job_dir(job_log_dir, resolved)
  import jax
  main = jax.process_index() == 0
  record = (lambda: invocation.record(job_dir)) if main and not no_checkpoint else None
  if record and os.path.isdir(job_dir):  # never made here: a follower records at its first evaluation
    record()
    record = None
  if not (follow or no_checkpoint):  # a mistyped job directory is refused before any work
    from paxcli.jobdir import restore
    restore.choose_step(job_dir, step=step, purpose='evaluate')
  if follow:
    emit = (lambda r: typer.echo(json.dumps(r))) if json_out and main else None
    out = follow_run(resolved, job_dir, common.console(stderr=json_out), timeout=timeout, poll_seconds=poll,
                     on_result=emit, on_first=record)
    if main and not json_out:
      common.console().print(f'Evaluated {len(out)} checkpoint(s): steps {", ".join(str(r["step"]) for r in out) or "none"}.',
                             highlight=False)
    return
  out = evaluate(resolved, job_dir, common.console(stderr=True), use_checkpoint=not no_checkpoint, step=step)
  if not main:
    return
  if json_out:
    typer.echo(json.dumps(out))
  else:
    common.console().print(results_table(out['step'], out['results']))


def register(app: typer.Typer) -> None:
  app.command('eval', short_help='Evaluate checkpoints on the eval inputs.')(eval_command)
