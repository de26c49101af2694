"""The code's layering and the rules docs/development/architecture.md states, checked in the default suite
(benchmarks/structure.py measures them): no import cycles between paxcli modules, every module (recipes/
too) in a layer and importing only below it or after its package in its layer, the package root in the top
layer, every import by name declared, the model families and recipes free of jax, job-directory paths spelled
only in jobdir/layout.py, and the budgets of function-local imports and the train loop's length. The package
version comes from the installed distribution's metadata."""

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


def _report(structure, root, recipes=None) -> dict:
  return structure.report(str(root), ((str(recipes), 'paxcli.recipes'),) if recipes else ())


def test_paxcli_keeps_its_layers():
  structure = _structure()
  got = _report(structure, REPO / 'src' / 'paxcli', REPO / 'recipes')
  assert got['cycle_members'] == [], f'import cycles: {got["cycle_members"]}'
  assert got['violations'] == [], f'imports against the layer order: {got["violations"]}'
  assert got['unplaced_modules'] == [], f'modules in no layer (benchmarks/structure.py LAYERS): {got["unplaced_modules"]}'
  assert got['dynamic_problems'] == [], got['dynamic_problems']
  assert set(got['dynamic_imports']) == set(structure.DYNAMIC_IMPORTS)
  assert any(m.startswith('paxcli.recipes.') for m in structure.scan(str(REPO / 'src' / 'paxcli'), (
      (str(REPO / 'recipes'), 'paxcli.recipes'),)).modules)   # recipes/ is scanned


def test_the_rules_the_architecture_page_states_hold():
  structure = _structure()
  got = _report(structure, REPO / 'src' / 'paxcli', REPO / 'recipes')
  assert got['jobdir_files'] == {}, f'job-directory paths spelled outside jobdir/layout.py: {got["jobdir_files"]}'
  assert got['jax_free_importing_jax'] == {}, got['jax_free_importing_jax']
  assert got['function_local_imports'] < structure.LOCAL_IMPORT_BUDGET
  assert got['train_loop_lines'] < structure.TRAIN_LOOP_BUDGET, 'loops/train.py _train: keep the work in hooks'
  text = (REPO / 'docs' / 'development' / 'architecture.md').read_text()
  for layer in structure.LAYERS:   # the page names every package of every layer
    for package in layer:
      assert not package or f'`{package}' in text, f'architecture.md does not place {package}'


def test_the_family_modules_and_recipes_load_without_jax():
  """What the AST check follows, run: the registry, every family and every recipe, imported."""
  code = ('import sys; from paxcli import experiment; experiment.import_all_recipes(); '
          'import paxcli.models.registry; '
          'print(sorted({m.split(".")[0] for m in sys.modules} & {"jax", "flax", "optax", "orbax", "torch"}))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == '[]'


def test_the_check_sees_each_fault(tmp_path):
  """The same scan on a small package with each fault reports each: an upward import (in a function too), a
  cycle, an import back within a layer, the root's contents used from below (a submodule through the root is
  fine), an import by name nobody declared, a module in no layer, and a jax import reached from a family."""
  root = tmp_path / 'paxcli'
  for package in ('runtime', 'perf', 'models', 'layers', 'jobdir', 'convert', 'misc'):
    (root / package).mkdir(parents=True)
    (root / package / '__init__.py').write_text('')
  files = {
      '__init__.py': 'VERSION = 1\n',
      'errors.py': '',
      'runtime/engine.py': 'def summary():\n  from paxcli.perf import flops\n',
      'perf/flops.py': '',
      'models/lm.py': 'import jax\nfrom paxcli.layers import block\n',
      'models/registry.py': 'from paxcli.models import llama\n',
      'models/llama.py': 'from paxcli.models import lm\n',
      'models/lm_experiment.py': '',
      'layers/block.py': 'def build():\n  from paxcli.models import lm\n',
      'jobdir/format.py': 'from paxcli import VERSION, errors\nfrom paxcli.convert import core\n',
      'convert/core.py': 'import importlib\nimportlib.import_module("paxcli.perf.flops")\n',
      'misc/thing.py': '',
  }
  for name, text in files.items():
    (root / name).write_text(textwrap.dedent(text))
  got = _report(_structure(), root)
  assert 'paxcli.runtime.engine -> paxcli.perf.flops' in got['violations']
  assert 'paxcli.layers.block -> paxcli.models.lm' in got['violations']
  assert 'paxcli.jobdir.format -> paxcli.convert.core' in got['violations']   # back within its layer
  assert 'paxcli.jobdir.format -> paxcli' in got['violations']                # the root's VERSION from below
  assert 'paxcli.jobdir.format -> paxcli.errors' not in got['violations']
  assert got['cycle_members'] == [['paxcli.layers.block', 'paxcli.models.lm']]
  assert got['unplaced_modules'] == ['paxcli.misc', 'paxcli.misc.thing']
  assert any(p.startswith('paxcli.convert.core (line 2): an import by name') for p in got['dynamic_problems'])
  assert got['jax_free_importing_jax']['paxcli.models.registry'] == ('paxcli.models.registry -> paxcli.models.llama '
                                                                      '-> paxcli.models.lm -> jax')


def test_describe_path_does_not_import_perf():
  """`pax describe` builds the runtime's summary: neither it nor the engine loads paxcli.perf."""
  code = ('import sys; from paxcli.runtime import engine; from paxcli.models import lm; '
          'print(sorted(m for m in sys.modules if m.startswith("paxcli.perf")))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout
  assert out.strip() == '[]'


def test_version_is_the_installed_distributions():
  import paxcli
  from paxcli import version
  assert paxcli.__version__ == version.current() == importlib.metadata.version('paxcli')
  assert "__version__ = '" not in (REPO / 'src' / 'paxcli' / '__init__.py').read_text()
