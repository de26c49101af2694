"""The code's shape, measured: import cycles, layer order, local imports, long functions, the rules kept.

    python benchmarks/structure.py [--src src/paxcli] [--json]

Prints a table of the measures, read from the sources with `ast` (nothing is imported or run), for
src/paxcli and recipes/ (installed as paxcli.recipes):
  - import cycles between paxcli modules (every import, module level or in a function);
  - imports against the layer order (LAYERS: from a lower layer to a higher one, or within a layer from
    a package to one before it), the package root placed in the top layer beside api, whose functions it
    hands out;
  - imports made by name at run time (importlib.import_module, spec_from_file_location, __import__), each
    declared in DYNAMIC_IMPORTS with what it loads; those that load downward are layer-checked too;
  - function-local imports (an `import` inside a function body), against LOCAL_IMPORT_BUDGET;
  - the longest functions, and the length of the train loop function, against TRAIN_LOOP_BUDGET;
  - modules that must import no jax or flax (the model families, the registry, the recipes: `pax
    experiments` and recipes read them without starting JAX), through their module-level paxcli imports;
  - files that spell job-directory paths by hand: a distinctive job-directory file name
    ('train.lock', 'eval_done.jsonl', 'checkpoints_damaged', ...) anywhere as a string, and a
    common word ('checkpoints', 'summaries', 'tokenizer', 'profile', ...) where it is a path
    part (an argument of os.path.join or files.member after the first, compared with a path's
    basename or component, or between '/' in an f-string). paxcli.jobdir.layout is the one
    module meant to; FOREIGN_LAYOUTS lists the modules that spell another program's directory
    layout with the same words (shown, not counted).
tests/test_structure.py asserts each rule.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

# The layers, top down; in a layer, its packages in order (by the first name under paxcli; '' is the package
# root, paxcli/__init__.py). A module imports from the layers below its own, and in its own layer from its
# own package and the packages after it; never above, never before. perf (device peaks, timing, profiles) sits
# above the runtime: `pax describe` needs the runtime, not perf; the recipes (paxcli.recipes) use what is
# trained and the job directory's layout, and no loop or command.
LAYERS = (
    ('cli', '', 'api'),
    ('loops',),
    ('recipes', 'perf'),
    ('convert', 'maxtext', 'jobdir', 'runtime'),
    ('models', 'families'),
    ('layers', 'inputs'),
    ('config', 'experiment', 'gencode', 'compat', 'optim', 'tasks', 'options', 'data', 'files', 'values', 'version',
     'errors'),
)
_RANK = {package: (len(LAYERS) - i, len(layer) - j) for i, layer in enumerate(LAYERS) for j, package in enumerate(layer)}
# Imports by name at run time, by the module that makes them: (what they load, how, why). A 'lazy' load is an
# import deferred (layer-checked like any); a 'plugin' load goes up by design; an 'alias' serves a moved module
# under its old name. A target ending in '.*' is any module under it.
DYNAMIC_IMPORTS = {
    'paxcli': (('paxcli.api',), 'lazy', "the package root hands out api's functions on first use: pax --help "
                                        'stays fast'),
    'paxcli.models': (('paxcli.models.*', 'paxcli.layers.*'), 'lazy', 'public names loaded on first use: the '
                      'experiment bases without flax; the names it used to re-export from paxcli.layers'),
    'paxcli.convert.formats': (('paxcli.convert.*',), 'lazy', 'the checkpoint readers, each registering itself, '
                               'loaded when a format is first needed'),
    'paxcli.experiment': (('paxcli.recipes.*',), 'plugin', 'the recipes, and the experiment modules and files '
                          '--exp names'),
    'paxcli.compat': (('paxcli.models.*',), 'alias', 'a moved module under its old name (MOVED_MODULES)'),
}
_DYNAMIC_CALLS = ('import_module', 'spec_from_file_location', '__import__')
# Modules that import no jax or flax at module level, through their paxcli imports: what `pax experiments`
# and the recipes read (the families, the registry, the knob tables, the experiment bases).
JAX_FREE = ('paxcli.models.registry', 'paxcli.models.lm_experiment', 'paxcli.recipes.*')
HEAVY = ('jax', 'flax', 'optax', 'orbax', 'tensorflow', 'torch')
LOCAL_IMPORT_BUDGET = 120
TRAIN_LOOP_BUDGET = 80
# Names of a job directory's entries (see paxcli/jobdir/layout.py). Distinctive ones count wherever
# they appear as a string; common words only as a path part (see path_parts).
JOBDIR_FILE_NAMES = ('checkpoints_damaged', 'checkpoints_unfinished', 'decoder_out', 'train.lock', 'spm.model',
                     'train_metrics.jsonl', 'eval_metrics.jsonl', 'eval_done.jsonl', 'config.txt', 'invocations.txt',
                     'format.json')
JOBDIR_WORDS = ('checkpoints', 'summaries', 'tokenizer', 'profile', 'state', 'meta', 'metadata')
JOBDIR_MODULE = 'paxcli.jobdir.layout'
# Modules whose path words name another program's layout, not a paxcli job directory.
FOREIGN_LAYOUTS = {
    'paxcli.convert.paxml': "a paxml job directory (checkpoints/checkpoint_<step>/state)",
    'paxcli.convert.maxtext': "a MaxText run directory (checkpoints/<step>/items)",
    'paxcli.inputs.corpus': "the corpus cache's own spm.model",
    'paxcli.inputs.classify': "the classification input's own spm.model",
    'paxcli.inputs.file_input': "the tokenizer cache's spm.model (~/.cache/paxcli/tokenizers)",
}


def module_name(root: str, path: str, package: str = '') -> str:
  """The dotted name of the file `path` under `root` (the paxcli source, or a directory installed as `package`)."""
  if package:
    rel = os.path.relpath(path, root)[:-3].replace(os.sep, '.')
    rel = package if rel == '__init__' else f'{package}.{rel}'
  else:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, '.')
  return rel[:-len('.__init__')] if rel.endswith('.__init__') else rel


def package_of(module: str) -> str:
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else ''


def layer_of(module: str) -> int:
  """The layer of a module, from 1 (the bottom); 0 for a package in no layer."""
  return _RANK.get(package_of(module), (0, 0))[0]


def placed(module: str) -> bool:
  return package_of(module) in _RANK


def allowed(a: str, b: str) -> bool:
  """Whether module `a` may import module `b`: its own package, a layer below, or a package after it in its layer."""
  pa, pb = package_of(a), package_of(b)
  return pa == pb or _RANK.get(pb, (0, 0)) < _RANK.get(pa, (0, 0))


def violations(edges: dict) -> list[str]:
  """'a -> b' for every import against the layer order (upward, or back in the same layer)."""
  return sorted(f'{a} -> {b}' for a, targets in edges.items() for b in targets if not allowed(a, b))


def resolve_from(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
  if not node.level:
    return node.module or ''
  base = module.split('.')
  base = base if is_pkg else base[:-1]
  base = base[:len(base) - (node.level - 1)]
  return '.'.join(base + ([node.module] if node.module else []))


def _is_path_join(call: ast.Call) -> bool:
  """os.path.join(...) or files.member(...): calls whose later arguments are path parts."""
  f = call.func
  name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ''
  return name in ('join', 'member') and not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Constant))


def _joined_words(call: ast.Call) -> set[str]:
  """Job-directory words a join spells onto its base, through other such words or computed parts
  (`join(job, 'checkpoints')`, `join(d, str(step), 'meta', 'metadata')`); a word after another
  literal (`join(trace, 'plugins', 'profile')`: TensorBoard's layout) is not the job directory's."""
  found = set()
  args = call.args[1:2] if getattr(call.func, 'attr', getattr(call.func, 'id', '')) == 'member' else call.args[1:]
  for arg in args:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
      if arg.value not in JOBDIR_WORDS:
        break
      found.add(arg.value)
  return found


def path_parts(tree: ast.AST, parents: dict) -> set[str]:
  """Job-directory names the module spells: file names anywhere, words as path parts."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and _is_path_join(node):
      found |= _joined_words(node)
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
      continue
    value, parent = node.value, parents.get(node)
    if value in JOBDIR_FILE_NAMES or value in JOBDIR_WORDS and isinstance(parent, ast.Compare):
      found.add(value)
    elif isinstance(parent, ast.JoinedStr) and '/' in value:
      found.update(p for p in value.split('/') if p in JOBDIR_WORDS + JOBDIR_FILE_NAMES)
  return found


class Scan:
  """What the sources say: modules (name -> path), imports (edges: every one; top_edges: module level only,
  within paxcli), module-level imports of HEAVY packages, run-time imports by name (module -> lines),
  function-local imports, function lengths, job-directory names spelled."""

  def __init__(self):
    self.modules, self.edges, self.top_edges, self.heavy, self.dynamic = {}, {}, {}, {}, {}
    self.local_imports, self.functions, self.jobdir_files = 0, [], {}


def _targets(module: str, node, is_pkg: bool, modules: dict) -> set[str]:
  """The paxcli modules an import statement reads: `from paxcli import files` reads paxcli.files, not the root."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names]
  else:
    base = resolve_from(module, node, is_pkg)
    names = [f'{base}.{a.name}' if f'{base}.{a.name}' in modules else base for a in node.names]
  out = set()
  for n in names:
    while n and n not in modules:
      n = n.rpartition('.')[0]
    if n and n != module and n.startswith('paxcli'):
      out.add(n)
  return out


def _in_function(node, parents: dict) -> bool:
  p = parents.get(node)
  while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
    p = parents.get(p)
  return p is not None


def _dynamic_call(node) -> bool:
  f = getattr(node, 'func', None)
  name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ''
  return isinstance(node, ast.Call) and name in _DYNAMIC_CALLS


def scan(root: str, extra: tuple = ()) -> Scan:
  """The sources under `root` (the paxcli package), and each (directory, package name) of `extra`."""
  out = Scan()
  for base, package in ((root, ''), *extra):
    for dirpath, _, names in os.walk(base):
      for name in sorted(names):
        if name.endswith('.py'):
          path = os.path.join(dirpath, name)
          out.modules[module_name(base, path, package)] = path
  for module, path in sorted(out.modules.items()):
    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read())
    is_pkg = path.endswith('__init__.py')
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    targets, top, heavy = set(), set(), set()
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        found = _targets(module, node, is_pkg, out.modules)
        targets |= found
        if _in_function(node, parents):
          out.local_imports += 1
        else:
          top |= found
          first = (node.names[0].name if isinstance(node, ast.Import) else node.module or '').split('.')[0]
          if first in HEAVY and not getattr(node, 'level', 0):
            heavy.add(first)
      elif _dynamic_call(node):
        out.dynamic.setdefault(module, []).append(node.lineno)
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out.functions.append((node.end_lineno - node.lineno + 1, f'{module}.{node.name}'))
    out.edges[module], out.top_edges[module], out.heavy[module] = targets, top, heavy
    names = path_parts(tree, parents)
    if names and module != JOBDIR_MODULE:
      out.jobdir_files[module] = names
  out.functions.sort(reverse=True)
  return out


def _matches(module: str, pattern: str) -> bool:
  return module.startswith(pattern[:-1]) if pattern.endswith('.*') else module == pattern


def dynamic_problems(found: Scan) -> list[str]:
  """Run-time imports by name that DYNAMIC_IMPORTS does not declare (or declares where there are none), and
  declared lazy loads against the layer order."""
  problems = [f'{m} (line {", ".join(map(str, lines))}): an import by name DYNAMIC_IMPORTS does not declare'
              for m, lines in sorted(found.dynamic.items()) if m not in DYNAMIC_IMPORTS]
  problems += [f'{m}: declared in DYNAMIC_IMPORTS, but it imports nothing by name' for m in DYNAMIC_IMPORTS
               if m not in found.dynamic and m in found.modules]
  for m, (targets, kind, _) in DYNAMIC_IMPORTS.items():
    for target in targets if kind == 'lazy' else ():
      loaded = [t for t in found.modules if _matches(t, target)]
      problems += [f'{m} -> {t} (loaded by name)' for t in loaded if t != m and not allowed(m, t)]
  return problems


def heavy_imports(found: Scan) -> dict[str, list[str]]:
  """JAX_FREE module -> the chain of module-level paxcli imports that reaches a HEAVY import, where one does."""
  roots = [m for m in found.modules for p in JAX_FREE if _matches(m, p)]
  out = {}
  for root in roots:
    seen, stack = {root: [root]}, [root]
    while stack:
      m = stack.pop()
      if found.heavy.get(m):
        out[root] = seen[m] + [sorted(found.heavy[m])[0]]
        break
      for t in sorted(found.top_edges.get(m, ())):
        for parent in _parents(t):   # importing paxcli.a.b runs paxcli.a's __init__ first
          if parent not in seen and parent in found.modules:
            seen[parent] = seen[m] + [parent]
            stack.append(parent)
  return out


def _parents(module: str) -> list[str]:
  parts = module.split('.')
  return ['.'.join(parts[:i]) for i in range(2, len(parts) + 1)]


def cycles(edges: dict) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  sys.setrecursionlimit(10000)
  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def report(root: str, extra: tuple = ()) -> dict:
  """Every measure and rule of the sources, as main prints them and tests/test_structure.py asserts them."""
  found = scan(root, extra)
  train_fn = next((n for n, name in found.functions if name.endswith('loops.train._train')), None)
  lines = sum(1 for p in found.modules.values() for _ in open(p, encoding='utf-8'))
  counted = {k: sorted(v) for k, v in sorted(found.jobdir_files.items()) if k not in FOREIGN_LAYOUTS}
  return {
      'modules': len(found.modules), 'source_lines': lines,
      'import_cycles': len(cycles(found.edges)), 'cycle_members': cycles(found.edges),
      'unplaced_modules': sorted(m for m in found.modules if not placed(m)),
      'layer_violations': len(violations(found.edges)), 'violations': violations(found.edges),
      'dynamic_imports': {m: lines for m, lines in sorted(found.dynamic.items())},
      'dynamic_problems': dynamic_problems(found),
      'function_local_imports': found.local_imports, 'local_import_budget': LOCAL_IMPORT_BUDGET,
      'train_loop_lines': train_fn, 'train_loop_budget': TRAIN_LOOP_BUDGET,
      'longest_functions': [f'{name} ({n})' for n, name in found.functions[:8]],
      'jax_free_importing_jax': {m: ' -> '.join(chain) for m, chain in sorted(heavy_imports(found).items())},
      'files_naming_jobdir_paths': len(counted), 'jobdir_files': counted,
      'foreign_layouts': {k: sorted(v) for k, v in sorted(found.jobdir_files.items()) if k in FOREIGN_LAYOUTS},
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  here = os.path.dirname(os.path.abspath(__file__))
  parser.add_argument('--src', default=os.path.join(here, '..', 'src', 'paxcli'))
  parser.add_argument('--recipes', default=os.path.join(here, '..', 'recipes'))
  parser.add_argument('--json', action='store_true')
  args = parser.parse_args()
  result = report(os.path.normpath(args.src), ((os.path.normpath(args.recipes), 'paxcli.recipes'),))
  if args.json:
    print(json.dumps(result, indent=1))
    return
  from rich.console import Console
  from rich.table import Table
  table = Table(title='paxcli source shape')
  table.add_column('measure')
  table.add_column('value', justify='right')
  table.add_column('rule', justify='right')
  rules = {'import_cycles': '0', 'layer_violations': '0', 'function_local_imports': f'< {LOCAL_IMPORT_BUDGET}',
           'train_loop_lines': f'< {TRAIN_LOOP_BUDGET}', 'files_naming_jobdir_paths': '0'}
  for key in ('modules', 'source_lines', 'import_cycles', 'layer_violations', 'function_local_imports',
              'train_loop_lines', 'files_naming_jobdir_paths'):
    table.add_row(key, str(result[key]), rules.get(key, ''))
  table.add_row('run-time imports by name', str(len(result['dynamic_imports'])), 'declared')
  table.add_row('jax-free modules importing jax', str(len(result['jax_free_importing_jax'])), '0')
  console = Console(width=None if sys.stdout.isatty() else 200)
  console.print(table)
  console.print('layers, top down: ' + ' > '.join('/'.join(p or '(root)' for p in layer) for layer in LAYERS))
  for comp in result['cycle_members']:
    console.print('cycle: ' + ' <-> '.join(comp))
  for row in result['violations']:
    console.print(f'against the layer order: {row}')
  for row in result['unplaced_modules']:
    console.print(f'in no layer: {row}')
  for row in result['dynamic_problems']:
    console.print(f'import by name: {row}')
  for module, chain in result['jax_free_importing_jax'].items():
    console.print(f'imports jax: {chain}')
  console.print('longest functions: ' + ', '.join(result['longest_functions']))
  console.print(f'job-directory names spelled outside {JOBDIR_MODULE}: ' + (', '.join(
      f'{k.split(".", 1)[1]} ({", ".join(v)})' for k, v in result['jobdir_files'].items()) or 'none'))
  for module, names in result['foreign_layouts'].items():
    console.print(f'not counted: {module.split(".", 1)[1]} ({", ".join(names)}): {FOREIGN_LAYOUTS[module]}')


if __name__ == '__main__':
  main()
