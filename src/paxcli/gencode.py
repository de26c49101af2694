"""Python source written from outside text (recipes of import-maxtext and checkpoint convert).

A recipe is Python that `pax train` imports, so text that comes from a script, a path, a
config or a checkpoint must never become code. Such text appears only as:
  - a `repr()` literal (`literal`), e.g. `SOURCE = '/models/llama'`;
  - inside a docstring, as its repr with every `"` written `\\x22` (`in_docstring`): no `\"\"\"`
    can end the docstring, and every backslash is part of an escape that repr wrote;
  - a comment on one line (`comment`): line breaks of any kind become spaces.
`check_shape` then parses the result and accepts only what the generators write: a docstring,
imports of paxcli's experiment bases, UPPERCASE constants that are literals and classes whose
bodies are a docstring and UPPERCASE literal knobs. Nothing is written that fails it, and
`knobs_of` reads such a file as data (never running it).
"""

from __future__ import annotations

import ast
from typing import Any

from paxcli.compat import MOVED_MODULES, new_module
from paxcli.errors import UserError

IMPORTS = {('paxcli.experiment', 'register'), ('paxcli.models', 'LmExperiment')}
# Recipes written before a module moved import it by its old name (paxcli.lm, paxcli.families.lm):
# still the generators' shape, kept in users' job directories.
IMPORTS |= {(old, 'LmExperiment') for old in MOVED_MODULES if new_module(old) == 'paxcli.models.lm_experiment'}
BASES = ('LmExperiment',)


def literal(value: Any) -> str:
  """`value` as a Python literal (its repr; `check_shape` refuses a repr that is not a literal)."""
  return repr(value)


def in_docstring(text: str) -> str:
  """Outside text for a triple-double-quoted docstring: its repr, with no double quote left."""
  return repr(str(text)).replace('"', '\\x22')


def comment(text: str) -> str:
  """Outside text for a `#` comment: one line, printable characters only."""
  return ' '.join(''.join(c if c.isprintable() else ' ' for c in str(text)).split())


def _is_literal(node: ast.AST) -> bool:
  try:
    ast.literal_eval(node)
  except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
    return False
  return True


def _target(stmt: ast.stmt) -> str | None:
  """The UPPERCASE name a literal is assigned to, or None."""
  if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
    target, value = stmt.targets[0], stmt.value
  elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and stmt.simple:
    target, value = stmt.target, stmt.value
  else:
    return None
  if isinstance(target, ast.Name) and target.id.isupper() and _is_literal(value):
    return target.id
  return None


def _is_docstring(stmt: ast.stmt) -> bool:
  return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def check_shape(source: str, where: str) -> dict[str, dict[str, Any]]:
  """{class name: {knob: value}} of a recipe of the generators' shape, or UserError saying why not."""
  def refuse(why: str, node: ast.AST | None = None):
    line = f', line {node.lineno}' if node is not None and hasattr(node, 'lineno') else ''
    raise UserError(f'{where}{line} is not a recipe as paxcli writes them ({why}).')

  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError) as e:
    refuse(f'not Python: {getattr(e, "msg", e)}')
  classes: dict[str, dict[str, Any]] = {}
  for i, stmt in enumerate(tree.body):
    if i == 0 and _is_docstring(stmt):
      continue
    if isinstance(stmt, ast.ImportFrom):
      names = {(stmt.module, a.name) for a in stmt.names if a.asname is None}
      if stmt.level or len(names) != len(stmt.names) or not names <= IMPORTS:
        refuse('an import other than paxcli\'s experiment bases', stmt)
      continue
    if _target(stmt):
      continue
    if not isinstance(stmt, ast.ClassDef):
      refuse(f'a {type(stmt).__name__} statement', stmt)
    if ([getattr(b, 'id', None) for b in stmt.bases] not in [[b] for b in BASES] or stmt.keywords
        or any(getattr(d, 'id', None) != 'register' for d in stmt.decorator_list)):
      refuse(f'class {stmt.name} is not a plain subclass of {" or ".join(BASES)}', stmt)
    knobs = {}
    for j, item in enumerate(stmt.body):
      if j == 0 and _is_docstring(item):
        continue
      if isinstance(item, ast.Pass):
        continue
      name = _target(item)
      if name is None:
        refuse(f'class {stmt.name} has a {type(item).__name__} statement; only UPPERCASE = literal knobs', item)
      knobs[name] = ast.literal_eval(item.value)
    classes[stmt.name] = knobs
  return classes


def knobs_of(source: str, class_name: str, where: str) -> dict[str, Any]:
  """The knobs of `class_name` in a recipe of the generators' shape, read without running it."""
  classes = check_shape(source, where)
  if class_name not in classes:
    raise UserError(f'{where} has no class {class_name!r} (it has {", ".join(classes) or "none"}).')
  return classes[class_name]
