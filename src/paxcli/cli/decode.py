"""`pax decode`: generate text from a checkpoint with a KV cache (greedy, sampling, beam search)."""

from __future__ import annotations

import json
import sys
from typing import List, Optional, Sequence

import typer

from paxcli.cli import common

_S = 'Sampling'
_B = 'Beam search'
_P = 'Prompts'


def decode_command(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = common.job_dir_option(),
    prompt: List[str] = typer.Option([], '--prompt', '-p', help='A text prompt (repeatable).', rich_help_panel=_P),
    prompts_file: Optional[str] = typer.Option(
        None, '--prompts-file', help='One prompt per line, or JSONL objects with "prompt" or "prompt_ids".',
        rich_help_panel=_P),
    prompt_ids: List[str] = typer.Option([], '--prompt-ids', help='A prompt as token ids: 12,15,18 (repeatable).',
                                         rich_help_panel=_P),
    dataset: Optional[str] = typer.Option(
        None, '--dataset', help="An input of the experiment's datasets() whose rows are the prompts (Pax style).",
        rich_help_panel=_P),
    num_prompts: int = typer.Option(8, '--num-prompts', min=1, help='With --dataset: how many rows to decode.',
                                    rich_help_panel=_P),
    max_decode_steps: int = typer.Option(64, '--max-decode-steps', help='New tokens at most per prompt.'),
    temperature: Optional[float] = typer.Option(None, '--temperature', help='Sampling temperature (0: greedy).',
                                                rich_help_panel=_S),
    top_k: Optional[int] = typer.Option(None, '--top-k', help='Sample among the k most likely tokens.',
                                        rich_help_panel=_S),
    top_p: Optional[float] = typer.Option(None, '--top-p', help='Nucleus sampling: smallest set with mass >= p.',
                                          rich_help_panel=_S),
    num_samples: int = typer.Option(1, '--num-samples', help='Samples per prompt.', rich_help_panel=_S),
    seed: int = typer.Option(0, '--seed', help='Sampling seed, 0 to 2**32-1; sample s of prompt i depends on (seed, i, s) only.',
                             rich_help_panel=_S),
    beam_size: int = typer.Option(0, '--beam-size', help='Beam search with this many beams.', rich_help_panel=_B),
    length_penalty: float = typer.Option(0.0, '--length-penalty', help="Pax's length_norm_alpha.",
                                         rich_help_panel=_B),
    eos_id: List[int] = typer.Option([], '--eos-id', help="End-of-sequence id (repeatable); default the tokenizer's."),
    ignore_eos: bool = typer.Option(False, '--ignore-eos', help='Do not stop at EOS: decode --max-decode-steps '
                                    'tokens (EOS ids stay in decoded_ids).'),
    min_length: int = typer.Option(0, '--min-length', help='No row stops (EOS, --stop) before this many new '
                                   'tokens.'),
    stop: List[str] = typer.Option([], '--stop', help='Stop a row when its text contains STRING (repeatable, '
                                   'not empty).'),
    batch_size: int = typer.Option(0, '--batch-size', min=0, help='Rows decoded together (0: up to 64).'),
    step: Optional[int] = typer.Option(None, '--step', help='Checkpoint step (default: the latest).'),
    no_checkpoint: bool = typer.Option(False, '--no-checkpoint', help='Decode freshly initialised weights.'),
    dtype: Optional[str] = typer.Option(None, '--dtype', help='Activation dtype (default: FPROP_DTYPE).'),
    output: Optional[str] = typer.Option(
        None, '--output', '-o', help='JSONL output (default <job dir>/decoder_out/<dataset|prompts>/'
        'pax_decode_step<k>_<n>.jsonl, n counting up: never the trainer\'s decode_step<k>.jsonl; /dev/stdout, a FIFO '
        'or /dev/null is written into).'),
    force: bool = typer.Option(False, '--force', help='Replace an existing --output file.'),
    json_out: bool = typer.Option(False, '--json', help='Print the JSON lines to stdout instead of a table.'),
    coordinator: Optional[str] = common.coordinator_option(),
    num_processes: Optional[int] = common.num_processes_option(),
    process_id: Optional[int] = common.process_id_option(),
) -> None:
  """Generate continuations of prompts from a checkpoint (KV cache; greedy, sampling or beam search)."""
  from paxcli import api
  err = common.console(stderr=True)
  decoded = api.decode(
      exp, overrides=overrides, job_dir=job_log_dir, prompt=prompt, prompts_file=prompts_file, prompt_ids=prompt_ids,
      dataset=dataset, num_prompts=num_prompts, max_decode_steps=max_decode_steps, temperature=temperature,
      top_k=top_k, top_p=top_p, num_samples=num_samples, seed=seed, beam_size=beam_size,
      length_penalty=length_penalty, eos_id=eos_id, ignore_eos=ignore_eos, min_length=min_length, stop=stop,
      batch_size=batch_size, step=step, no_checkpoint=no_checkpoint, dtype=dtype, output=output, force=force,
      coordinator=coordinator, num_processes=num_processes, process_id=process_id, console=err,
      progress=common.counting_bar(err, 'decoding') if not json_out and sys.stderr.isatty() else None)
  if decoded.path is not None:  # processes other than 0 print nothing
    _report(decoded, json_out, err)


def _report(decoded, json_out: bool, err) -> None:
  """The JSON lines on stdout (--json), else a table, the rates and where the file went."""
  if json_out:
    for r in decoded.records:
      sys.stdout.write(json.dumps(r) + '\n')
    sys.stdout.flush()
    return
  common.console().print(results_table(decoded.records, decoded.step, decoded.has_text))
  err.print(speed_line(decoded.stats) + f'\nWrote {common.count(len(decoded.records), "result")} to {decoded.path}',
            highlight=False)


def speed_line(stats: dict) -> str:
  """Steady-state rates (compilation is timed apart: the decoder compiles ahead of time)."""
  pre = stats['prefill_tokens'] / max(stats['prefill_s'], 1e-9)
  dec = stats['decode_tokens'] / max(stats['decode_s'], 1e-9)
  return (f'prefill {stats["prefill_tokens"]} tokens at {pre:,.0f} tokens/s; decode {stats["decode_tokens"]} '
          f'tokens at {dec:,.0f} tokens/s; compilation {stats.get("compile_s", 0.0):.1f} s, not in the rates')


def results_table(records: Sequence[dict], step: int, has_text: bool):
  table = common.table(title=f'Decoded at step {step}', show_lines=True)
  table.add_column('prompt #', justify='right')
  # several continuations of a prompt: their own column (beam rank, or sample index), one number each
  second = 'beam' if any('beam_rank' in r for r in records) else 'sample' if any(
      r.get('sample_index') for r in records) else None
  if second:
    table.add_column(second, justify='right')
  table.add_column('prompt', overflow='fold', ratio=1)
  table.add_column('continuation', overflow='fold', ratio=2)
  table.add_column('logprob', justify='right')
  table.add_column('stop')
  for r in records:
    numbers = [str(r['prompt_index'])] + ([str(r['beam_rank'] if second == 'beam' else r['sample_index'])]
                                          if second else [])
    prompt = r['prompt'] if has_text and r['prompt'] is not None else ' '.join(map(str, r['prompt_ids']))
    cont = r['decoded'] if has_text else ' '.join(map(str, r['decoded_ids']))
    table.add_row(*numbers, common.text(prompt), common.text(cont, style='bold'), f"{r['logprob']:.2f}", r['stop_reason'])
  return table


def register(app: typer.Typer) -> None:
  app.command('decode')(decode_command)
