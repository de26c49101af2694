"""`pax decode`: generate text from a checkpoint with a KV cache (greedy, sampling, beam search)."""

from __future__ import annotations

import json
from typing import List, Optional

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
        'pax_decode_step<k>_<n>.jsonl, n counting up: never the trainer\'s decode_step<k>.jsonl).'),
    json_out: bool = typer.Option(False, '--json', help='Print the JSON lines to stdout instead of a table.'),
    coordinator: Optional[str] = common.coordinator_option(),
    num_processes: Optional[int] = common.num_processes_option(),
    process_id: Optional[int] = common.process_id_option(),
) -> None:
  """Generate continuations of prompts from a checkpoint (KV cache; greedy, sampling or beam search)."""
  from paxcli.loops.decode import DecodeOptions
  from paxcli.errors import UserError
  opts = DecodeOptions(max_decode_steps=max_decode_steps, temperature=temperature, top_k=top_k, top_p=top_p,
                       num_samples=num_samples, seed=seed, beam_size=beam_size, length_penalty=length_penalty,
                       eos_ids=tuple(eos_id), stop=tuple(stop), batch_size=batch_size, ignore_eos=ignore_eos,
                       min_length=min_length)
  opts.check()  # option errors before any start-up
  from paxcli.loops.decode import check_text
  for text in prompt:
    check_text(text, '--prompt')
  for text in stop:
    check_text(text, '--stop')
  if dtype is not None and dtype not in ('float32', 'bfloat16', 'float16'):
    raise UserError(f'--dtype must be one of float32, bfloat16, float16; got {dtype!r}.')
  if not (prompt or prompts_file or prompt_ids or dataset):
    raise UserError('No prompts: give --prompt TEXT, --prompts-file FILE, --prompt-ids 1,2,3 or --dataset NAME.')
  from paxcli import api
  prompts_file, output = api.path_arg(prompts_file, '--prompts-file'), api.path_arg(output, '--output')
  run = api.open_run(exp, overrides, job_log_dir, coordinator=coordinator, num_processes=num_processes,
                     process_id=process_id, log=common.console(stderr=True).print)
  from paxcli.loops import decode
  decode.decode_command(run.resolved, run.job_dir, opts, texts=prompt, prompts_file=prompts_file, prompt_ids=prompt_ids,
                        dataset=dataset, num_prompts=num_prompts, step=step, use_checkpoint=not no_checkpoint,
                        dtype=dtype, output=output, json_out=json_out)


def register(app: typer.Typer) -> None:
  app.command('decode')(decode_command)
