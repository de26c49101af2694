"""`pax bench mfu`: step time, tokens/s, model TFLOP/s, MFU, HFU and memory of an experiment."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from paxcli.cli import common

bench_app = typer.Typer(help='Benchmarks: `pax bench mfu` times the train step (MFU, HFU, memory).',
                        no_args_is_help=True)


@bench_app.command('mfu')
def mfu(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = typer.Option(None, '--job-log-dir', metavar='DIR', help='Bench the experiment '
                                              'and --set settings this job was trained with (--exp/--set on top).'),
    sweep: List[str] = typer.Option([], '--sweep', metavar='KNOB=a,b,c', help='KNOB=a,b,c: one row per value; repeat the option '
                                    'for every combination (e.g. --sweep PERCORE_BATCH_SIZE=4,8,16).'),
    steps: int = typer.Option(10, '--steps', min=1, help='Timed steps after warm-up.'),
    warmup: int = typer.Option(2, '--warmup', min=0, help='Untimed steps after compilation.'),
    compile_only: bool = typer.Option(False, '--compile-only', help='Compile and report per-device memory '
                                      'against the device\'s memory; run no step.'),
    num_devices: Optional[int] = typer.Option(None, '--num-devices', min=1, metavar='N', help='Make N fake CPU devices '
                                              '(to check a large mesh plan on a laptop; with --compile-only).'),
    topology: Optional[str] = typer.Option(None, '--topology', metavar='TYPE', help='With --compile-only: compile '
                                           'for this TPU slice (v4-128, v5p-256, v5e-16 or v5litepod-16, v6e-256) '
                                           "with the TPU's own compiler, no TPU needed (libtpu: pip install "
                                           "'paxcli[tpu]'); memory against its HBM."),
    num_slices: int = typer.Option(1, '--num-slices', min=1, metavar='N', help='With --topology: N such slices '
                                   'joined over DCN (multislice; DCN_MESH_SHAPE multiplies to N).'),
    peak_tflops: Optional[float] = typer.Option(None, '--peak-tflops', help='Peak TFLOP/s per device to '
                                                'divide by (default: the table by device kind, or measured).'),
    device_memory: Optional[str] = typer.Option(None, '--device-memory', metavar='SIZE', help='Memory per device '
                                                '(e.g. 80GB) to check the compiled program against, instead of '
                                                'what the device reports: plan for another accelerator.'),
    plot: Optional[str] = typer.Option(None, '--plot', metavar='FILE.png', help='Write a PNG of MFU and tokens/s against the sweep.'),
    force: bool = typer.Option(False, '--force', help='Replace an existing --plot file.'),
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
    pax bench mfu --exp c4.C4Spmd16BAdam32Replicas --compile-only --topology v4-64
  """
  from paxcli import api
  from paxcli.loops import bench
  plot = api.output_arg(plot, '--plot')
  if plot:  # checked before any row runs, written after the table: a failing plot never loses the numbers
    bench.check_plot_path(plot, force)
  err = common.console(stderr=True)
  rows = api.bench_mfu(exp, overrides=overrides, job_dir=job_log_dir, sweep=sweep, steps=steps, warmup=warmup, compile_only=compile_only,
                       num_devices=num_devices, peak_tflops=peak_tflops, device_memory=device_memory, pgle=pgle,
                       pgle_profile=pgle_profile, console=err, topology=topology, num_slices=num_slices)
  if json_out:
    typer.echo(json.dumps(rows, indent=1, default=str))
  else:
    common.console(wide=True).print(bench.table(rows, compile_only))  # piped: rows never wrap
  if plot:
    bench.plot(rows, plot)
    err.print(f'Plot written to {plot}.', highlight=False, markup=False)


def register(app: typer.Typer) -> None:
  app.add_typer(bench_app, name='bench')
