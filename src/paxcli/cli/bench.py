"""`pax bench mfu`: step time, tokens/s, model TFLOP/s, MFU, HFU and memory of an experiment."""

from __future__ import annotations

import os
from typing import List, Optional

import typer

from paxcli.cli import common
from paxcli.errors import UserError

bench_app = typer.Typer(help='Benchmarks: `pax bench mfu` times the train step (MFU, HFU, memory).',
                        no_args_is_help=True)


@bench_app.command('mfu')
def mfu(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    sweep: List[str] = typer.Option([], '--sweep', metavar='KNOB=a,b,c', help='KNOB=a,b,c: one row per value; repeat the option '
                                    'for every combination (e.g. --sweep PERCORE_BATCH_SIZE=4,8,16).'),
    steps: int = typer.Option(10, '--steps', min=1, help='Timed steps after warm-up.'),
    warmup: int = typer.Option(2, '--warmup', min=0, help='Untimed steps after compilation.'),
    compile_only: bool = typer.Option(False, '--compile-only', help='Compile and report per-device memory '
                                      'against the device\'s memory; run no step.'),
    num_devices: Optional[int] = typer.Option(None, '--num-devices', min=1, metavar='N', help='Make N fake CPU devices '
                                              '(to check a large mesh plan on a laptop; with --compile-only).'),
    peak_tflops: Optional[float] = typer.Option(None, '--peak-tflops', help='Peak TFLOP/s per device to '
                                                'divide by (default: the table by device kind, or measured).'),
    device_memory: Optional[str] = typer.Option(None, '--device-memory', metavar='SIZE', help='Memory per device '
                                                '(e.g. 80GB) to check the compiled program against, instead of '
                                                'what the device reports: plan for another accelerator.'),
    plot: Optional[str] = typer.Option(None, '--plot', metavar='FILE.png', help='Write a PNG of MFU and tokens/s against the sweep.'),
    json_out: bool = typer.Option(False, '--json', help='Print every row as JSON instead of the table.'),
    pgle: Optional[str] = common.pgle_option(),
    pgle_profile: Optional[str] = common.pgle_profile_option(),
) -> None:
  """Compile the train step, time it and print step time, tokens/s, TFLOP/s per device, MFU, HFU, memory.

  \b
  Examples:
    pax bench mfu --exp bench.Llama1B
    pax bench mfu --exp E --sweep PERCORE_BATCH_SIZE=4,8,16 --sweep CHECKPOINT_POLICY=none,save_dot_only --plot mfu.png
    pax bench mfu --exp lm_cloud.LmCloudSpmd2B --compile-only --num-devices 64 --set "ICI_MESH_SHAPE=[1,64,1]"
  """
  plot, pgle_profile = common.path_arg(plot, '--plot'), common.path_arg(pgle_profile, '--pgle-profile')
  if device_memory is not None:
    from paxcli.convert.safetensors_io import parse_size
    device_memory = parse_size(device_memory, '--device-memory')
  common.positive_finite(peak_tflops, '--peak-tflops', 'TFLOP/s per device')
  if plot:
    check_plot_path(plot)
  if num_devices:
    if num_devices > MAX_FAKE_DEVICES:
      raise UserError(f'--num-devices {num_devices:,} is more than {MAX_FAKE_DEVICES:,}, the most fake CPU devices '
                      'paxcli makes: XLA\'s CPU backend fails from 4,096 fake devices, and compiling a step for '
                      f'{MAX_FAKE_DEVICES:,} already takes tens of seconds. Check a smaller mesh of the same shape '
                      '(memory per device depends on the sharded axes, not on the replica count).')
    fake_devices(num_devices)
  import json

  from paxcli.loops import bench
  console = common.console(wide=True)  # piped: rows never wrap, whatever their width
  err = common.console(stderr=True)
  from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
  progress = Progress(TextColumn('[bold]{task.description}'), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal)
  with progress:
    rows = bench.run_all(exp, overrides, sweep, steps=steps, warmup=warmup, compile_only=compile_only,
                         peak_tflops=peak_tflops, pgle=pgle, pgle_profile=pgle_profile, progress=progress,
                         log=lambda m: err.print(m, highlight=False, markup=False), device_memory=device_memory)
  if json_out:
    typer.echo(json.dumps(rows, indent=1, default=str))
  else:
    console.print(bench.table(rows, compile_only))
  if plot:  # after the table: a failing plot never loses the numbers
    bench.plot(rows, plot)
    err.print(f'Plot written to {plot}.', highlight=False, markup=False)


# Fake CPU devices: XLA's CPU backend refuses to compile for 4,096 of them ("Multiprocess computations
# aren't implemented on the CPU backend"); 2,048 compile a tiny model in about 16 s on 2 cores.
MAX_FAKE_DEVICES = 2048


def check_plot_path(path: str) -> None:
  """Before any row runs: matplotlib is there and the PNG can be written (its directory is made)."""
  import tempfile
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise UserError('--plot needs matplotlib: pip install matplotlib') from None
  directory = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise UserError(f'--plot {path} is a directory; give a file name such as mfu.png.')
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryFile(dir=directory):
      pass
  except OSError as e:
    raise UserError(f'--plot {path}: cannot write in {directory} ({e.strerror}).') from None


def fake_devices(n: int) -> None:
  """N fake CPU devices for this process; must run before jax starts a backend."""
  import sys
  if 'jax' in sys.modules:
    import jax._src.xla_bridge as xb
    if xb.backends_are_initialized():
      import jax
      if len(jax.devices()) == n and jax.default_backend() == 'cpu':
        return
      raise UserError(f'--num-devices {n}: jax already started with {len(jax.devices())} devices in this process.')
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')]
  os.environ['XLA_FLAGS'] = ' '.join(flags + [f'--xla_force_host_platform_device_count={n}'])
  os.environ['JAX_PLATFORMS'] = 'cpu'


def register(app: typer.Typer) -> None:
  app.add_typer(bench_app, name='bench')
