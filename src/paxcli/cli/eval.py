"""`pax eval`: metrics of each eval dataset from a checkpoint, or of each new checkpoint (--follow)."""

from __future__ import annotations

import json
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
  import jax

  from paxcli import api
  from paxcli.loops.evaluate import results_table

  def emit(record: dict) -> None:  # --follow --json: one line per checkpoint, as it is evaluated
    if json_out and jax.process_index() == 0:
      typer.echo(json.dumps(record))

  out = api.evaluate(exp, overrides=overrides, job_dir=job_log_dir, step=step, follow=follow, timeout=timeout,
                     poll=poll, no_checkpoint=no_checkpoint, coordinator=coordinator, num_processes=num_processes,
                     process_id=process_id, console=common.console(stderr=json_out or not follow), on_result=emit)
  if jax.process_index() != 0 or (follow and json_out):
    return
  if follow:
    steps = ', '.join(str(r['step']) for r in out) or 'none'
    common.console().print(f'Evaluated {len(out)} checkpoint(s): steps {steps}.', highlight=False)
  elif json_out:
    typer.echo(json.dumps(out))
  else:
    common.console().print(results_table(out['step'], out['results']))


def register(app: typer.Typer) -> None:
  app.command('eval', short_help='Evaluate checkpoints on the eval inputs.')(eval_command)
