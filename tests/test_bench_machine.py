"""benchmarks/machine.py: the processor and instruction sets printed beside every benchmark's table, and
`--isa avx2`, which runs a benchmark as on a processor without AVX-512 (CPUID masked for the process)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MACHINE = REPO / 'benchmarks' / 'machine.py'


def _flags() -> set:
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    return set(next((line.split(':', 1)[1].split() for line in f if line.startswith('flags')), []))


def _run(*args, script=MACHINE, env=None):
  done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                        env={**os.environ, **(env or {})})
  assert done.returncode == 0, done.stderr
  return done.stdout


@pytest.mark.skipif(not os.path.exists('/proc/cpuinfo'), reason='reads Linux /proc/cpuinfo')
def test_the_line_names_the_processor_and_what_it_has():
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    name = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  out = _run()
  assert out.startswith(name + ',')
  flags = _flags()
  assert ('AVX2 yes' if 'avx2' in flags else 'AVX2 no') in out
  assert ('AVX-512 none' in out) == ('avx512f' not in flags)
  assert ('AMX none' in out) == ('amx_tile' not in flags)


@pytest.mark.skipif(not os.path.exists('/proc/cpuinfo') or not {'avx512f', 'cpuid_fault'} <= _flags()
                    or not shutil.which('cc'), reason='needs AVX-512 to hide, CPUID faulting and a C compiler')
def test_isa_avx2_hides_avx512_and_amx_from_every_library_of_the_process(tmp_path):
  """The restarted process sees an AVX2 processor: numpy's own CPUID reading, and so paxcli's choice of
  the decoding layout (paxcli.layers.cpu_isa), which follows what the matrix kernels see."""
  script = tmp_path / 'bench.py'
  script.write_text(f'import sys\nsys.path.insert(0, {str(MACHINE.parent)!r})\nimport machine\n'
                    'machine.restrict(sys.argv[1])\nimport os\nfrom paxcli.layers import cpu_isa\n'
                    'print(cpu_isa.vector_isa(), os.environ.get("XLA_FLAGS"), machine.describe())\n')
  native = _run('native', script=script, env={'HOME': str(tmp_path)})
  assert native.startswith('avx512 ') and 'AVX-512 F ' in native
  out = _run('avx2', script=script, env={'HOME': str(tmp_path)})
  assert out.startswith('avx2 ') and '--xla_cpu_max_isa=AVX2' in out
  assert 'AVX2 yes; AVX-512 none; AMX none (restricted to avx2' in out
  assert (tmp_path / '.cache' / 'paxcli-bench' / 'cpuid_avx2.so').exists()


@pytest.mark.slow
def test_decode_roofline_sets_each_step_beside_its_products_and_names_the_processor():
  """benchmarks/decode_roofline.py on a tiny Llama: a row per batch size with both steps and both products,
  the processor under the table."""
  out = _run('--layers', '1', '--dims', '32', '--heads', '2', '--kv-heads', '1', '--hidden', '64', '--vocab', '128',
             '--prompt-len', '4', '--new-tokens', '3', '--batch-sizes', '1,2', '--repeats', '1',
             script=REPO / 'benchmarks' / 'decode_roofline.py', env={'COLUMNS': '250'})
  rows = [line for line in out.splitlines() if line.startswith('batch ')]
  assert [r.split(':')[0] for r in rows] == ['batch 1', 'batch 2']
  assert all('paxcli' in r and 'products' in r and 'transformers' in r for r in rows)
  assert machine_line(out)


def machine_line(out: str) -> bool:
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    name = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
  return any(line.startswith(name + ',') for line in out.splitlines())
