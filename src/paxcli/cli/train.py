"""`pax train` and `pax describe`: options in, paxcli.api out (imported in the commands: `pax --help` stays fast)."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from paxcli.cli import common


def train(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = common.job_dir_option(),
    verbose: bool = typer.Option(False, '--verbose', '-v', help='Also print a table of weights with shapes and shardings.'),
    coordinator: Optional[str] = common.coordinator_option(),
    num_processes: Optional[int] = common.num_processes_option(),
    process_id: Optional[int] = common.process_id_option(),
    heartbeat_timeout: Optional[float] = common.heartbeat_timeout_option(),
    profile_steps: Optional[str] = common.profile_steps_option(),
    pgle: Optional[str] = common.pgle_option(),
    pgle_profile: Optional[str] = common.pgle_profile_option(),
    force_resume: bool = typer.Option(
        False, '--force-resume', help='Go on training the run in --job-log-dir although this command gives it '
        'other data or another tokenizer (refused otherwise: such a run belongs in a new job directory).'),
) -> None:
  """Train an experiment (default: the built-in stdlib-docstrings LM). Resumes from the job directory.

  With several processes (one per host), run the same command on every host with
  --coordinator/--num-processes/--process-id, or let JAX detect the cluster; on one
  machine, `pax launch --processes N -- train ...` starts N local processes.
  """
  from paxcli import api
  api.train(exp, overrides=overrides, job_dir=job_log_dir, verbose=verbose, profile_steps=profile_steps, pgle=pgle,
            pgle_profile=pgle_profile, force_resume=force_resume, coordinator=coordinator,
            num_processes=num_processes, process_id=process_id, heartbeat_timeout=heartbeat_timeout,
            console=common.console())


def describe(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    json_out: bool = typer.Option(False, '--json', help='Print the resolved config as JSON.'),
) -> None:
  """Print an experiment's fully resolved config (knobs, task, datasets) after overrides, headed by
  its parameter count, training FLOPs per token, global batch and the devices its mesh needs.

  A pipelined experiment also gets its schedule and bubble, (S-1)/(R*M+S-1).
  """
  from paxcli import api
  described = api.describe(exp, overrides=overrides)
  summary, pipeline = described['summary'], described['pipeline']
  if json_out:
    flat = {f'summary.{k}': v for k, v in summary.items()}
    flat.update({k: _jsonable(v) for k, v in described['config'].items()})
    if pipeline:
      flat['pipeline'] = pipeline
    typer.echo(json.dumps(flat, indent=1))
  else:
    head, _, rest = described['text'].partition('\n')
    lines = [head] + summary_lines(summary) + ([f'# {pipeline}'] if pipeline else [])
    typer.echo('\n'.join(lines) + '\n' + rest, nl=False)


def summary_lines(s: dict) -> list[str]:
  """api.describe's summary as comment lines for the top of `pax describe`."""
  def count(n: float, unit: str = '') -> str:
    for suffix, size in (('T', 1e12), ('G', 1e9), ('M', 1e6), ('K', 1e3)):
      if n >= size:
        return f'{n / size:.3g} {suffix}{unit}'
    return f'{n:g} {unit}'.rstrip()

  devices = f"{s['devices']:,}" if s['devices'] else s['devices_note']
  if s['global_batch']:
    tokens = f" x {s['seq_len']:,} tokens = {s['global_batch'] * s['seq_len']:,} tokens per step" if s['seq_len'] else ''
    batch = f"{s['global_batch']:,} sequences{tokens}"
  else:
    batch = s['global_batch_note']
  flops = (f"{count(s['flops_per_token'], 'FLOP')} (training: forward + backward, the model's train_flops)"
           if s['flops_per_token'] else s['flops_per_token_note'])
  family = _family_line(s)
  active = s.get('active_parameters')
  sparse = (f"; active per token: {count(active)} ({active:,}: the experts a token is routed to)"
            if active is not None and active != s['parameters'] else '')
  return [f"# parameters: {count(s['parameters'])} ({s['parameters']:,}){sparse}",
          f'# FLOPs per token: {flops}',
          f'# global batch: {batch}',
          f'# devices needed: {devices}',
          f'# model family: {family}'] + ([f"# context parallelism: {s['context_parallel']}"]
                                          if s.get('context_parallel') else [])


def _family_line(s: dict) -> str:
  """What `# model family:` says: the family and whether the model records it (MODEL_FAMILY) or is placed by
  its function; why --to hf would refuse it, where it would."""
  name, note = s.get('family'), s.get('family_note')
  if name and not note:
    how = '' if s.get('family_recorded') else ', by its function (MODEL_FAMILY is not set)'
    return f'{name}{how} (pax checkpoint convert --to hf writes its Hugging Face layout)'
  if name:
    return f'{name} (MODEL_FAMILY); {note}'
  return f'none with a Hugging Face layout ({note})'


def _jsonable(v):
  if isinstance(v, (int, float, str, bool)) or v is None:
    return v
  if isinstance(v, (list, tuple)):
    return [_jsonable(x) for x in v]
  if isinstance(v, dict):
    return {str(k): _jsonable(x) for k, x in v.items()}
  if isinstance(v, type) or callable(v):
    return f'{getattr(v, "__module__", "")}.{getattr(v, "__qualname__", repr(v))}'
  return repr(v)


def register(app: typer.Typer) -> None:
  app.command('train', short_help='Train (or resume) an experiment.')(train)
  app.command('describe', short_help='Print the resolved config.')(describe)
