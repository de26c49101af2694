"""The code's shape, measured: import cycles, layer order, local imports, long functions.

    python benchmarks/structure.py [--src src/paxcli] [--json]

Prints a table of the measures issue #18 asks for, read from the sources with `ast`
(nothing is imported or run):
  - import cycles between paxcli modules (every import, module level or in a function);
  - imports from a lower layer to a higher one, for the layer order
    cli > loops > perf > jobdir/runtime/convert/maxtext > models > layers/inputs > config;
  - function-local imports (an `import` inside a function body);
  - the longest functions, and the length of the train loop function;
  - files that spell job-directory paths by hand: a distinctive job-directory file name
    ('train.lock', 'eval_done.jsonl', 'checkpoints_damaged', ...) anywhere as a string, and a
    common word ('checkpoints', 'summaries', 'tokenizer', 'profile', ...) where it is a path
    part (an argument of os.path.join or files.member after the first, compared with a path's
    basename or component, or between '/' in an f-string). paxcli.jobdir.layout is the one
    module meant to; FOREIGN_LAYOUTS lists the modules that spell another program's directory
    layout with the same words (shown, not counted).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

# Layer of a module by its first package component under paxcli (higher number = higher layer).
# Modules not listed count as the lowest layer (0: config, experiment, errors, ...). perf (device
# peaks, timing, profiles) sits above the runtime: `pax describe` needs the runtime, not perf; models
# (the LM, its families, the experiment bases) above the layers and inputs they are built from.
LAYERS = {
    'cli': 6, 'api': 6,
    'loops': 5,
    'perf': 4,
    'jobdir': 3, 'runtime': 3, 'convert': 3, 'maxtext': 3,
    'models': 2, 'families': 2,
    'layers': 1, 'inputs': 1,
}
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
    edges[module] = targets
    names = path_parts(tree, parents)
    if names and module != JOBDIR_MODULE:
      jobdir_files[module] = names
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
      'files_naming_jobdir_paths': len([k for k in jobdir_files if k not in FOREIGN_LAYOUTS]),
      'jobdir_files': {k: sorted(v) for k, v in sorted(jobdir_files.items()) if k not in FOREIGN_LAYOUTS},
      'foreign_layouts': {k: sorted(v) for k, v in sorted(jobdir_files.items()) if k in FOREIGN_LAYOUTS},
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
  console.print(f'job-directory names spelled outside {JOBDIR_MODULE}: ' + (', '.join(
      f'{k.split(".", 1)[1]} ({", ".join(v)})' for k, v in result['jobdir_files'].items()) or 'none'))
  for module, names in result['foreign_layouts'].items():
    console.print(f'not counted: {module.split(".", 1)[1]} ({", ".join(names)}): {FOREIGN_LAYOUTS[module]}')


if __name__ == '__main__':
  main()
