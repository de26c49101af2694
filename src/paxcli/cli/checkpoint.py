"""`pax checkpoint inspect|convert`: read any checkpoint's metadata; convert between layouts and formats."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from paxcli.cli import common

app = typer.Typer(help='Inspect and convert checkpoints (orbax, safetensors, Hugging Face, paxml, MaxText).',
                  no_args_is_help=True)


@app.command('inspect')
def inspect_command(
    path: str = typer.Argument(..., help='Job directory, checkpoint step directory, .safetensors file or '
                               'directory, Hugging Face directory or Hub id (Org/name: from the Hugging Face cache, '
                               'downloaded if missing), paxml checkpoint or MaxText run/checkpoint.'),
    step: Optional[int] = typer.Option(None, '--step', help='Checkpoint step (default: the latest).'),
    fmt: Optional[str] = typer.Option(None, '--from', help='Format (default: detected).'),
    json_out: bool = typer.Option(False, '--json', help='Print JSON.'),
) -> None:
  """Metadata of a checkpoint (no array is read): arrays with shape, dtype, bytes, sharding; totals; config."""
  from paxcli import api
  info = api.inspect_checkpoint(path, step=step, fmt=fmt)
  if json_out:
    typer.echo(json.dumps(info, indent=1))
    return
  console = common.console()
  t = common.table(title=f'{info["format"]} checkpoint {info["path"]}  step {info["step"]}'
            + (f'  experiment {info["experiment"]}' if info.get('experiment') else ''))
  for col, just in (('name', 'left'), ('shape', 'right'), ('dtype', 'left'), ('bytes', 'right'),
                    ('sharding', 'left')):
    t.add_column(col, justify=just, overflow='fold')   # long names (Pax's) wrap, never cut
  for a in info['arrays']:
    t.add_row(a['name'], 'x'.join(map(str, a['shape'])) or 'scalar', a['dtype'], _size(a['bytes']),
              a['sharding'] or '')
  console.print(t)
  tot = info['totals']
  console.print(f'{tot["arrays"]} arrays, {_size(tot["bytes"])}; {tot["parameters"]:,} parameters '
                f'({_size(tot["parameter_bytes"])}); largest array {_size(tot["largest_array_bytes"])}'
                + ('' if 'has_optimizer_state' not in info else
                   '; optimizer state: ' + ('yes' if info['has_optimizer_state'] else 'no (params only)')))
  for note in info.get('notes', ()):
    console.print(note, highlight=False, markup=False)
  cfg = info.get('config') or {}
  shown = {k: v for k, v in cfg.items() if k.startswith(('knobs.', 'unsupported.'))} or cfg
  if shown:
    console.print({'hf': 'config.json:', 'paxml': 'The same model in paxcli knobs (from model_params.txt):'}
                  .get(info['format'], 'Saved config:'))
    for k, v in shown.items():
      console.print(f'  {k} = {v}', highlight=False, markup=False)


@app.command('convert')
def convert_command(
    source: str = typer.Argument(..., help='Checkpoint to read (as for inspect); never modified.'),
    output: str = typer.Argument(..., help='Where to write: a job directory (orbax), or a directory '
                                 '(safetensors, hf).'),
    fmt: Optional[str] = typer.Option(None, '--from', help='Source format: orbax, safetensors, hf, paxml, '
                                      'maxtext (default: detected; maxtext needs --exp with the recipe '
                                      'pax import-maxtext wrote).'),
    to: str = typer.Option('orbax', '--to', help='Output format: orbax (a paxcli job directory), '
                           'safetensors, hf (the model family\'s Hugging Face layout; a LoRA run merged), peft (a '
                           'LoRA run\'s adapters: adapter_config.json + adapter_model.safetensors).'),
    family: Optional[str] = typer.Option(None, '--family', help='--to hf or peft: the model family to write '
                                         '(llama, qwen3, ...) for a model that records none (MODEL_FAMILY) or '
                                         'another; checked against what the model computes.'),
    merge_lora: bool = typer.Option(False, '--merge-lora', help='A LoRA run: write a plain checkpoint with the '
                                    'adapters merged into the base (W + alpha/r A B).'),
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    step: Optional[int] = typer.Option(None, '--step', help='Source step (default: the latest).'),
    params_only: bool = typer.Option(False, '--params-only', help='Write parameters only (no optimizer '
                                     'state); for pax eval and decode.'),
    dtype: Optional[str] = typer.Option(None, '--dtype', help='Cast parameters: float32 or bfloat16.'),
    force: bool = typer.Option(False, '--force', help='Replace an existing output.'),
    verify: bool = typer.Option(True, '--verify/--no-verify', help='Certify: run the source and the result on '
                                'fixed prompts (transformers for Hugging Face files, PEFT for adapters, where '
                                'installed); beyond tolerance, fail and write nothing.'),
    kl_tolerance: Optional[float] = typer.Option(None, '--kl-tolerance', help='Largest mean KL accepted by '
                                                 '--verify (default 1e-5; 1e-2 with --dtype bfloat16).'),
    max_shard_size: str = typer.Option('5GB', '--max-shard-size', help='safetensors/hf: split files above '
                                       'this size.'),
    recipe: Optional[str] = typer.Option(None, '--recipe', help='--from hf, or paxml without --exp: recipe '
                                         'file to write (default: beside the output, hf_<output>.py or '
                                         'paxml_<output>.py).'),
    base_model: Optional[str] = typer.Option(
        None, '--base-model', metavar='HF_ID_OR_DIR', help='--to peft: the Hugging Face model the adapters '
        'apply to, written as base_model_name_or_path (what AutoPeftModelForCausalLM loads). Default: the '
        'directory the base was converted from with --from hf, when it is still there.'),
    json_out: bool = typer.Option(False, '--json', help='Print the result as JSON.'),
) -> None:
  """Convert a checkpoint to another layout (--set USE_REPEATED_LAYER=..., mesh), dtype, experiment or format."""
  from paxcli import api
  console = common.console(stderr=True)
  result = api.convert_checkpoint(source, output, fmt=fmt, to=to, exp=exp, overrides=overrides, step=step,
                                  params_only=params_only, dtype=dtype, force=force, verify=verify,
                                  kl_tolerance=kl_tolerance, max_shard_size=max_shard_size, recipe=recipe,
                                  merge_lora=merge_lora, base_model=base_model, family=family, console=console)
  v = result.get('verify')
  if json_out:
    typer.echo(json.dumps(result, indent=1))
  else:
    console.print(f'Wrote {result["format"]} {result["output"]} (step {result["step"]}, '
                  f'{"params only" if result["params_only"] else "full train state"}, '
                  f'{_size(result["bytes_written"])} in {result["seconds"]:.1f}s).', highlight=False)
    if v:
      from paxcli.convert import certify
      console.print(certify.line(v), highlight=False, markup=False)
    if result.get('next'):   # what to run after an import
      console.print(result['next'], highlight=False, markup=False, soft_wrap=True)   # a command to copy: one line


def _size(n: int) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB', 'TiB'):
    if n < 1024 or unit == 'TiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  return str(n)


def register(parent: typer.Typer) -> None:
  parent.add_typer(app, name='checkpoint')
