"""`pax score`: the log-likelihood of given continuations (lm-evaluation-harness' loglikelihood requests)."""

from __future__ import annotations

import json
import math
import sys
from typing import List, Optional

import typer

from paxcli.cli import common


def score_command(
    requests_file: str = typer.Argument(
        ..., metavar='REQUESTS', help='JSONL, one request a line: {"context": ..., "continuation": ...}, '
        '{"context_ids": [...], "continuation_ids": [...]}, or {"text": ...} / {"text_ids": [...]} for a whole '
        'text (rolling windows). Other fields are passed through.'),
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = common.job_dir_option(),
    batch_size: int = typer.Option(0, '--batch-size', min=0, help='Requests scored together (0: up to 64 and '
                                   'at most 4,096 tokens a batch).'),
    step: Optional[int] = typer.Option(None, '--step', help='Checkpoint step (default: the latest).'),
    no_checkpoint: bool = typer.Option(False, '--no-checkpoint', help='Score with freshly initialised weights.'),
    dtype: Optional[str] = typer.Option(None, '--dtype', help='Activation dtype (default: FPROP_DTYPE).'),
    output: Optional[str] = typer.Option(
        None, '--output', '-o', help='JSONL output (default <job dir>/scores/pax_score_step<k>_<n>.jsonl, n '
        'counting up; /dev/stdout, a FIFO or /dev/null is written into).'),
    force: bool = typer.Option(False, '--force', help='Replace an existing --output file.'),
    json_out: bool = typer.Option(False, '--json', help='Print the JSON lines to stdout too (the '
                                'summary line stays on stderr).'),
    coordinator: Optional[str] = common.coordinator_option(),
    num_processes: Optional[int] = common.num_processes_option(),
    process_id: Optional[int] = common.process_id_option(),
) -> None:
  """Log-likelihood of continuations given contexts (sum of logprobs, is-greedy), batched on the mesh."""
  from paxcli import api
  err = common.console(stderr=True)
  scored = api.score(
      requests_file, exp, overrides=overrides, job_dir=job_log_dir, batch_size=batch_size, step=step,
      no_checkpoint=no_checkpoint, dtype=dtype, output=output, force=force, coordinator=coordinator,
      num_processes=num_processes, process_id=process_id, console=err,
      progress=common.counting_bar(err, 'scoring') if sys.stderr.isatty() else None)
  if scored.path is None:  # processes other than 0 print nothing
    return
  if json_out:
    for r in scored.records:
      sys.stdout.write(json.dumps(r) + '\n')
    sys.stdout.flush()
  (err if json_out else common.console()).print(summary_table(scored.records))   # stdout is the JSON's with --json
  err.print(summary_line(scored), highlight=False)


SHOWN = 10        # requests listed in the table; the file has them all
TEXT_CHARS = 40   # of a context or continuation in a cell


def summary_table(records: list[dict]):
  """A rich table of the first requests (context, continuation, log-likelihood, tokens, greedy) and a
  total row: the summed log-likelihood, its mean per token with the perplexity it gives, the share of
  greedy requests and the truncated ones. The JSONL keeps every field, token_logprobs included."""
  table = common.table(title='pax score', title_justify='left')
  for col, just in (('line', 'right'), ('context', 'left'), ('continuation', 'left'), ('logprob', 'right'),
                    ('tokens', 'right'), ('greedy', 'center')):
    table.add_column(col, justify=just, overflow='fold')
  for r in records[:SHOWN]:
    context, continuation = _cells(r)
    table.add_row(str(r['line']), context, continuation, _logprob(r['logprob']), f'{r["num_tokens"]:,}',
                  'yes' if r['is_greedy'] else 'no')
  tokens = sum(r['num_tokens'] for r in records)
  finite = [r['logprob'] for r in records if r['logprob'] is not None]
  total = sum(finite) if len(finite) == len(records) else None
  per_token = f'{total / tokens:.4f}/token, perplexity {math.exp(-total / tokens):,.3g}' if total is not None and \
      tokens else ''
  truncated = sum(1 for r in records if r.get('truncated'))
  more = f'{len(records) - SHOWN:,} more in the file; ' if len(records) > SHOWN else ''
  table.add_section()
  table.add_row('', f'{more}{len(records):,} requests' + (f', {truncated} truncated' if truncated else ''),
                per_token, _logprob(total), f'{tokens:,}',
                f'{sum(r["is_greedy"] for r in records) / max(len(records), 1):.0%}')
  return table


def _cells(record: dict) -> tuple[str, str]:
  """The request's context and continuation (a text's start, ids shown as such), shortened for a cell."""
  if 'text' in record or 'text_ids' in record:
    return _short(record.get('text', record.get('text_ids'))), '(whole text)'
  return (_short(record.get('context', record.get('context_ids'))),
          _short(record.get('continuation', record.get('continuation_ids'))))


def _short(value) -> str:
  text = value if isinstance(value, str) else json.dumps(value)
  text = text.replace('\n', '\\n')
  return text if len(text) <= TEXT_CHARS else text[:TEXT_CHARS - 3] + '...'


def _logprob(value) -> str:
  return 'n/a' if value is None else f'{value:.4f}'


def summary_line(scored) -> str:
  """Requests and tokens per second (compilation apart: the scorer compiles ahead of time), and the file."""
  s = scored.stats
  seconds = max(s['seconds'], 1e-9)
  count = common.count
  return (f'Scored {count(s["requests"], "request")} ({count(s["windows"], "window")}, {count(s["tokens"], "token")}) '
          f'at step {scored.step}: {s["requests"] / seconds:,.1f} requests/s, {s["tokens"] / seconds:,.0f} tokens/s; '
          f'compilation {s["compile_s"]:.1f} s, not in the rates\nWrote {count(len(scored.records), "result")} to '
          f'{scored.path}')


def register(app: typer.Typer) -> None:
  app.command('score')(score_command)
