"""`pax eval`: metrics of each eval dataset from the latest checkpoint."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from paxcli.cli import common


def eval_command(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = common.job_dir_option(),
    no_checkpoint: bool = typer.Option(False, '--no-checkpoint', help='Evaluate freshly initialised weights.'),
    json_out: bool = typer.Option(False, '--json', help='Print the metrics as JSON.'),
    coordinator: Optional[str] = common.coordinator_option(),
    num_processes: Optional[int] = common.num_processes_option(),
    process_id: Optional[int] = common.process_id_option(),
) -> None:
  """Evaluate an experiment's eval datasets from its latest checkpoint; writes summaries/eval_<name>."""
  from paxcli.evaluate import evaluate, results_table
  common.start_processes(coordinator, num_processes, process_id)  # before anything starts JAX
  resolved = common.resolve(exp, overrides)
  job_dir = job_log_dir or common.default_job_dir(resolved.experiment.registered_name())
  out = evaluate(resolved, job_dir, common.console(stderr=True), use_checkpoint=not no_checkpoint)
  import jax
  if jax.process_index() != 0:
    return
  if json_out:
    typer.echo(json.dumps(out))
  else:
    common.console().print(results_table(out['step'], out['results']))


def register(app: typer.Typer) -> None:
  app.command('eval', short_help='Evaluate checkpoints on the eval inputs.')(eval_command)
