"""The code's layering, checked in the default suite: no import cycles between paxcli modules and no
import from a lower layer to a higher one (benchmarks/structure.py: cli > loops > perf >
jobdir/runtime/convert/maxtext > models > layers/inputs > config). The package version comes from
the installed distribution's metadata."""

import importlib.metadata
import importlib.util
import subprocess
import sys
import textwrap

from conftest import REPO


def _structure():
  spec = importlib.util.spec_from_file_location('paxcli_structure', REPO / 'benchmarks' / 'structure.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _violations(structure, root: str) -> tuple[list, list]:
  _, edges, _, _, _ = structure.scan(root)
  upward = sorted(f'{a} -> {b}' for a, targets in edges.items() for b in targets
                  if structure.layer_of(b) > structure.layer_of(a))
  return structure.cycles(edges), upward


def test_paxcli_has_no_import_cycles_and_no_upward_imports():
  cycles, upward = _violations(_structure(), str(REPO / 'src' / 'paxcli'))
  assert cycles == [], f'import cycles: {cycles}'
  assert upward == [], f'imports from a lower layer to a higher one: {upward}'


def test_the_check_sees_an_upward_import_and_a_cycle(tmp_path):
  """The same scan on a small package with both faults reports both (function-local imports too)."""
  root = tmp_path / 'paxcli'
  for package in ('runtime', 'perf', 'models', 'layers'):
    (root / package).mkdir(parents=True)
    (root / package / '__init__.py').write_text('')
  (root / '__init__.py').write_text('')
  (root / 'runtime' / 'engine.py').write_text('def summary():\n  from paxcli.perf import flops\n')
  (root / 'perf' / 'flops.py').write_text('')
  (root / 'models' / 'lm.py').write_text('from paxcli.layers import block\n')
  (root / 'layers' / 'block.py').write_text(textwrap.dedent('''\
      def build():
        from paxcli.models import lm
      '''))
  cycles, upward = _violations(_structure(), str(root))
  assert 'paxcli.runtime.engine -> paxcli.perf.flops' in upward
  assert 'paxcli.layers.block -> paxcli.models.lm' in upward
  assert cycles == [['paxcli.layers.block', 'paxcli.models.lm']]


def test_describe_path_does_not_import_perf():
  """`pax describe` builds the runtime's summary: neither it nor the engine loads paxcli.perf."""
  code = ('import sys; from paxcli.runtime import engine; from paxcli.models import lm; '
          'print(sorted(m for m in sys.modules if m.startswith("paxcli.perf")))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == '[]'


def test_version_is_the_installed_distributions():
  import paxcli
  assert paxcli.__version__ == importlib.metadata.version('paxcli')
  assert "__version__ = '" not in (REPO / 'src' / 'paxcli' / '__init__.py').read_text()
