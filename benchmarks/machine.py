"""The machine a benchmark ran on, printed beside its table: the processor and the vector instructions the
process sees (AVX2, the AVX-512 families, AMX), since XLA:CPU's kernels and torch's pick their code from them.

  from machine import describe
  console.print(describe())      # 'Intel(R) Xeon(R) Processor, 2 of 2 CPUs; AVX2 yes; AVX-512 F CD BW ...'

`--isa avx2` (add_isa_argument, then restrict(args.isa) first thing in main) runs the benchmark as on a
processor without AVX-512 or AMX: the script starts again with benchmarks/cpuid_avx2.c preloaded (built once
with the C compiler into ~/.cache/paxcli-bench), which answers every CPUID query of the process with those
bits cleared (Linux's CPUID faulting: YNNPACK's, oneDNN's and torch's kernel choice follow CPUID, not
XLA's --xla_cpu_max_isa), with XLA_FLAGS=--xla_cpu_max_isa=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 set as well.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MARK = 'PAXCLI_BENCH_ISA'   # set in the restarted process: which restriction it runs under
AVX512 = ('F', 'CD', 'BW', 'DQ', 'VL', 'IFMA', 'VBMI', 'VBMI2', 'VNNI', 'BITALG', 'VPOPCNTDQ', 'BF16', 'FP16')
AMX = ('amx_tile', 'amx_int8', 'amx_bf16', 'amx_fp16')


def processor() -> str:
  """The CPU's model name (Linux's /proc/cpuinfo), else what Python's platform module says."""
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  except OSError:
    pass
  import platform
  return platform.processor() or platform.machine()


def _seen() -> dict:
  """CPUID's features as this process sees them (numpy reads CPUID itself: a masked CPUID shows here)."""
  import numpy as np
  core = getattr(np, '_core', None) or getattr(np, 'core', None)
  return dict(getattr(getattr(core, '_multiarray_umath', None), '__cpu_features__', None) or {})


def _kernel_flags() -> set:
  try:
    with open('/proc/cpuinfo', encoding='utf-8', errors='replace') as f:
      return set(next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), []))
  except OSError:
    return set()


def isa() -> str:
  """'AVX2 yes; AVX-512 F CD ...; AMX tile int8 bf16' as this process sees them, and the restriction."""
  seen, flags = _seen(), _kernel_flags()
  avx512 = [f for f in AVX512 if seen.get('AVX512' + f)]
  restricted = os.environ.get(MARK)
  # AMX is not in numpy's list: the kernel's flags, hidden with AVX-512 when CPUID is masked.
  amx = [f[4:] for f in AMX if f in flags] if not restricted else []
  text = (f"AVX2 {'yes' if seen.get('AVX2') else 'no'}; AVX-512 {' '.join(avx512) or 'none'}; "
          f"AMX {' '.join(amx) or 'none'}")
  if restricted:
    hidden = [f[4:] for f in AMX if f in flags] or ['none']
    text += f' (restricted to {restricted}: the processor has AMX {" ".join(hidden)})'
  return text


def describe() -> str:
  """One line: processor, CPUs this process may use, the instruction sets it sees, the load average."""
  usable = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  load = f'; load average {os.getloadavg()[0]:.1f}' if hasattr(os, 'getloadavg') else ''
  return f'{processor()}, {usable} of {os.cpu_count()} CPUs; {isa()}{load}'


def add_isa_argument(parser) -> None:
  parser.add_argument('--isa', choices=('native', 'avx2'), default='native',
                      help='avx2: run as on a processor without AVX-512 and AMX (CPUID masked; benchmarks/machine.py)')


def restrict(choice: str) -> None:
  """With 'avx2', start this script again under the AVX2 restriction (once); then check that it holds."""
  if choice == 'native' or os.environ.get(MARK) == choice:
    if choice != 'native' and _seen().get('AVX512F'):
      sys.exit('--isa avx2: this Linux does not let a process trap CPUID (no cpuid_fault in /proc/cpuinfo '
               'flags); AVX-512 stays visible, so the run would not be an AVX2 one.')
    return
  library = _build_mask()
  env = dict(os.environ)
  env[MARK] = choice
  env['LD_PRELOAD'] = ' '.join(filter(None, [library, env.get('LD_PRELOAD')]))
  env['XLA_FLAGS'] = ' '.join(filter(None, [env.get('XLA_FLAGS'), '--xla_cpu_max_isa=AVX2']))
  env['ONEDNN_MAX_CPU_ISA'] = 'AVX2'
  env['ATEN_CPU_CAPABILITY'] = 'avx2'
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, *sys.argv], env)


def _build_mask() -> str:
  """benchmarks/cpuid_avx2.c built into a shared library (rebuilt when the source is newer)."""
  source = os.path.join(HERE, 'cpuid_avx2.c')
  cache = os.path.join(os.path.expanduser('~'), '.cache', 'paxcli-bench')
  os.makedirs(cache, exist_ok=True)
  library = os.path.join(cache, 'cpuid_avx2.so')
  if not os.path.exists(library) or os.path.getmtime(library) < os.path.getmtime(source):
    compiler = os.environ.get('CC', 'cc')
    done = subprocess.run([compiler, '-O2', '-shared', '-fPIC', '-o', library + '.tmp', source, '-ldl'],
                          capture_output=True, text=True)
    if done.returncode:
      sys.exit(f'--isa avx2 needs a C compiler ({compiler}) to build {source}:\n{done.stderr.strip()}')
    os.replace(library + '.tmp', library)
  return library


if __name__ == '__main__':
  import argparse
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_isa_argument(parser)
  restrict(parser.parse_args().isa)
  print(describe())
