"""paxcli against Google's paxml 1.4.0 on this CPU: the same model, float32, global batch 8.

  ../shared/tools/paxml/install.sh          # once: paxml 1.4.0 into /tmp/paxpeer (about 5 minutes)
  .venv/bin/python benchmarks/vs_paxml.py [--exp BenchTiny BenchSmall] [--steps 30]

For each experiment of ../shared/tools/paxml/pax_bench_exp.py (lm_cloud models: scanned
layers, full remat, combined QKV, sinusoidal positions, logit caps; float32; batch 8):
  1. paxml trains it for --steps steps in its own process; its `steps/sec` log lines after
     the first window (which holds the compile) give its speed;
  2. paxcli reads that run's checkpoint config (`pax checkpoint convert --from paxml`'s
     reader) to build the same model as knobs, and times its train step on one batch
     (benchmarks/train_step.py's measure: compile apart, then --steps steps).
Prints steps/s of each and paxcli / paxml (above 1: paxcli is faster). paxml's figure
includes its synthetic input; paxcli's does not (one batch reused): on these shapes the
input is a small fraction of a step. Run it on a quiet machine; compare within one run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(os.path.dirname(REPO), 'shared', 'tools', 'paxml')

_WRAPPER = '''
from paxml import experiment_registry
import pax_bench_exp

import machine   # benchmarks/machine.py: the processor beside the table

@experiment_registry.register
class Timed(pax_bench_exp.{exp}):
  NUM_TRAIN_STEPS = {steps}
  SUMMARY_INTERVAL_STEPS = {interval}

  def task(self):
    task_p = super().task()
    task_p.train.compute_steps_per_sec_interval_steps = {interval}
    return task_p
'''


def run_paxml(python: str, exp: str, steps: int, interval: int, work: str) -> tuple[float, str]:
  """(median steps/s after the first window, job directory) of a paxml run."""
  with open(os.path.join(work, 'timed_exp.py'), 'w', encoding='utf-8') as f:
    f.write(_WRAPPER.format(exp=exp, steps=steps, interval=interval))
  job = os.path.join(work, f'paxml_{exp}')
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=f'{work}:{TOOLS}')
  proc = subprocess.run([python, '-m', 'paxml.main', '--exp=timed_exp.Timed', f'--job_log_dir={job}',
                         '--alsologtostderr'], env=env, capture_output=True, text=True)
  rates = [float(m) for m in re.findall(r'steps/sec: ([0-9.]+)', proc.stderr)]
  if proc.returncode or len(rates) < 2:
    raise SystemExit(f'paxml {exp} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}')
  return statistics.median(rates[1:]), job


def paxcli_overrides(job: str) -> list[str]:
  """The paxml run's model as paxcli knobs, with the benchmark's settings."""
  from paxcli.convert.paxml import PaxmlSource
  knobs = PaxmlSource(os.path.join(job, 'checkpoints')).recipe_knobs()   # what the --from paxml recipe gets
  assert knobs['FPROP_DTYPE'] == 'float32' and knobs['USE_REPEATED_LAYER'], knobs
  return [f'{k}={v!r}' for k, v in knobs.items()] + [
      'PERCORE_BATCH_SIZE=8', 'ICI_MESH_SHAPE=[1,1,1]', "CHECKPOINT_POLICY='save_nothing'"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--exp', nargs='+', default=['BenchTiny', 'BenchSmall'])
  parser.add_argument('--steps', type=int, default=30)
  parser.add_argument('--interval', type=int, default=10, help="paxml's steps/sec window")
  parser.add_argument('--paxpeer', default='/tmp/paxpeer', help='the venv install.sh made')
  parser.add_argument('--paxml-log', nargs=2, action='append', default=[], metavar=('JOB_DIR', 'LOG'),
                      help='Reuse a paxml run of the first --exp: its job directory and its stderr log.')
  args = parser.parse_args()
  python = os.path.join(args.paxpeer, 'bin', 'python')
  if not os.path.exists(python):
    raise SystemExit(f'No paxml at {args.paxpeer}: run {TOOLS}/install.sh first.')
  sys.path.insert(0, os.path.join(REPO, 'benchmarks'))
  from train_step import measure

  import jax
  from rich.console import Console
  from rich.table import Table
  table = Table(title=f'paxml 1.4.0 vs paxcli, float32, global batch 8, {len(jax.devices())} x '
                      f'{jax.devices()[0].device_kind}')
  for col in ('experiment', 'paxml steps/s', 'paxcli steps/s', 'paxcli compile s', 'paxcli / paxml'):
    table.add_column(col, justify='left' if col == 'experiment' else 'right')
  work = tempfile.mkdtemp(prefix='pax-vs-paxml-')
  try:
    for exp in args.exp:
      if args.paxml_log:
        job, log = args.paxml_log.pop(0)
        with open(log, encoding='utf-8') as f:
          pax_rate = statistics.median([float(m) for m in re.findall(r'steps/sec: ([0-9.]+)', f.read())][1:])
      else:
        pax_rate, job = run_paxml(python, exp, args.steps, args.interval, work)
      print(f'paxml {exp}: {pax_rate:.3f} steps/s', flush=True)
      ours = measure('lm_cloud.LmCloudSpmdTest', paxcli_overrides(job), args.steps)
      print(f'paxcli {exp}: {ours["steps_per_sec"]:.3f} steps/s', flush=True)
      table.add_row(exp, f'{pax_rate:.3f}', f'{ours["steps_per_sec"]:.3f}', f'{ours["compile_s"]:.1f}',
                    f'{ours["steps_per_sec"] / pax_rate:.2f}x')
  finally:
    shutil.rmtree(work, ignore_errors=True)
  Console().print(table)
  Console().print(machine.describe())


if __name__ == '__main__':
  main()
