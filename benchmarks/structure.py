"""The code's shape, measured: import cycles, layer order, local imports, long functions.

    python benchmarks/structure.py [--src src/paxcli] [--json]

Prints a table of the measures issue #18 asks for, read from the sources with `ast`
(nothing is imported or run):
  - import cycles between paxcli modules (every import, module level or in a function);
  - imports from a lower layer to a higher one, for the layer order
    cli > loops > jobdir/runtime/perf/convert/maxtext > models/layers/inputs > config;
  - function-local imports (an `import` inside a function body);
  - the longest functions, and the length of the train loop function;
  - files that join job-directory paths by hand (a literal 'checkpoints', 'summaries',
    'decoder_out', 'train.lock', ... next to os.path.join or '/').
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

# Layer of a module by its first package component under paxcli (higher number = higher layer).
# Modules not listed count as the lowest layer (0: config, experiment, errors, ...).
LAYERS = {
    'cli': 4, 'api': 4,
    'loops': 3,
    'jobdir': 2, 'runtime': 2, 'perf': 2, 'convert': 2, 'maxtext': 2,
    'models': 1, 'layers': 1, 'inputs': 1, 'families': 1,
}
JOBDIR_NAMES = ('checkpoints', 'checkpoints_damaged', 'summaries', 'decoder_out', 'train.lock', 'tokenizer.model',
                'train_metrics.jsonl', 'eval_metrics.jsonl', 'config.txt', 'profile')


def module_name(root: str, path: str) -> str:
  rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, '.')
  return rel[:-len('.__init__')] if rel.endswith('.__init__') else rel


def layer_of(module: str) -> int:
  parts = module.split('.')
  return LAYERS.get(parts[1], 0) if len(parts) > 1 else 0


def resolve_from(module: str, node: ast.ImportFrom, is_pkg: bool) -> str:
  if not node.level:
    return node.module or ''
  base = module.split('.')
  base = base if is_pkg else base[:-1]
  base = base[:len(base) - (node.level - 1)]
  return '.'.join(base + ([node.module] if node.module else []))


def scan(root: str):
  modules, edges, local_imports, functions, jobdir_files = {}, {}, 0, [], {}
  for dirpath, _, names in os.walk(root):
    for name in sorted(names):
      if name.endswith('.py'):
        path = os.path.join(dirpath, name)
        modules[module_name(root, path)] = path
  for module, path in sorted(modules.items()):
    with open(path, encoding='utf-8') as f:
      source = f.read()
    tree = ast.parse(source)
    is_pkg = path.endswith('__init__.py')
    targets = set()
    parents = {}
    for node in ast.walk(tree):
      for child in ast.iter_child_nodes(node):
        parents[child] = node
    for node in ast.walk(tree):
      if isinstance(node, (ast.Import, ast.ImportFrom)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [resolve_from(module, node, is_pkg)] +
                 [resolve_from(module, node, is_pkg) + '.' + a.name for a in node.names])
        for n in names:
          while n and n not in modules:
            n = n.rpartition('.')[0]
          if n and n != module and n.startswith('paxcli'):
            targets.add(n)
        p = parents.get(node)
        while p is not None and not isinstance(p, (ast.FunctionDef, ast.AsyncFunctionDef)):
          p = parents.get(p)
        if p is not None:
          local_imports += 1
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        functions.append((node.end_lineno - node.lineno + 1, f'{module}.{node.name}'))
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in JOBDIR_NAMES:
        jobdir_files.setdefault(module, set()).add(node.value)
    edges[module] = targets
  return modules, edges, local_imports, sorted(functions, reverse=True), jobdir_files


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


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--src', default=os.path.join(os.path.dirname(__file__), '..', 'src', 'paxcli'))
  parser.add_argument('--json', action='store_true')
  args = parser.parse_args()
  root = os.path.normpath(args.src)
  modules, edges, local_imports, functions, jobdir_files = scan(root)
  found = cycles(edges)
  upward = sorted((a, b) for a, targets in edges.items() for b in targets if layer_of(b) > layer_of(a))
  train_fn = next((n for n, name in functions if name.endswith('._train')), None)
  lines = sum(1 for p in modules.values() for _ in open(p, encoding='utf-8'))
  result = {
      'modules': len(modules), 'source_lines': lines,
      'import_cycles': len(found), 'cycle_members': found,
      'upward_imports': len(upward), 'upward': [f'{a} -> {b}' for a, b in upward],
      'function_local_imports': local_imports,
      'train_loop_lines': train_fn,
      'longest_functions': [f'{name} ({n})' for n, name in functions[:8]],
      'files_naming_jobdir_paths': len(jobdir_files),
      'jobdir_files': {k: sorted(v) for k, v in sorted(jobdir_files.items())},
  }
  if args.json:
    print(json.dumps(result, indent=1))
    return
  from rich.console import Console
  from rich.table import Table
  table = Table(title='paxcli source shape')
  table.add_column('measure')
  table.add_column('value', justify='right')
  for key in ('modules', 'source_lines', 'import_cycles', 'upward_imports', 'function_local_imports',
              'train_loop_lines', 'files_naming_jobdir_paths'):
    table.add_row(key, str(result[key]))
  console = Console(width=None if sys.stdout.isatty() else 200)
  console.print(table)
  for comp in found:
    console.print('cycle: ' + ' <-> '.join(comp))
  for row in result['upward']:
    console.print(f'upward import: {row}')
  console.print('longest functions: ' + ', '.join(result['longest_functions']))
  console.print('job-directory names spelled in: ' + ', '.join(
      f'{k.split(".", 1)[1]} ({", ".join(v)})' for k, v in result['jobdir_files'].items()))


if __name__ == '__main__':
  main()
