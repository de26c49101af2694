"""Writes a translation as a Python recipe: an LmExperiment subclass with the knobs set."""

from __future__ import annotations

import keyword
import os
import re
from typing import Any

from paxcli import files, gencode
from paxcli.errors import UserError
from paxcli.maxtext import defaults as mt
from paxcli.maxtext.translate import Translation

_INDENT = '  '
# Overrides that shrink any imported model to a few seconds of CPU training.
TINY = ('NUM_LAYERS=2', 'MODEL_DIMS=64', 'HIDDEN_DIMS=128', 'NUM_HEADS=4', 'NUM_KV_HEADS=None',
        'DIMS_PER_HEAD=16', 'VOCAB_SIZE=256', 'MAX_SEQ_LEN=32', 'PERCORE_BATCH_SIZE=1',
        'ICI_MESH_SHAPE=None', 'DCN_MESH_SHAPE=None', 'NUM_TRAIN_STEPS=2')


def cpu_check(exp: str, class_name: str, unsupported: bool) -> list[str]:
  """The --set overrides and job directory of a recipe's tiny check on CPU (after `pax train --exp EXP`):
  its own job directory, so that the full run never resumes the tiny one."""
  tiny = list(TINY) + (['UNSUPPORTED_FEATURES={}'] if unsupported else [])
  return [f'--set {s}' for s in tiny] + [f'--job-log-dir runs/{class_name}_cpu_check']


def default_stem(script_path: str) -> str:
  """`2xv4-128.sh` -> `2xv4_128`: the script's name as a Python module name part."""
  stem = os.path.splitext(os.path.basename(script_path))[0]
  return re.sub(r'[^0-9A-Za-z]+', '_', stem).strip('_').lower() or 'script'


def default_output(script_path: str) -> str:
  return f'maxtext_{default_stem(script_path)}.py'


def default_class_name(script_path: str) -> str:
  """`2xv4-128.sh` -> `MaxText2xv4_128`; digits on both sides of a break keep a `_`."""
  stem = os.path.splitext(os.path.basename(script_path))[0]
  name = 'MaxText'
  for part in [p for p in re.split(r'[^0-9A-Za-z]+', stem) if p]:
    if name[-1].isdigit() and part[0].isdigit():
      name += '_'
    name += part[0].upper() + part[1:]
  return name


def check_class_name(name: str) -> str:
  if not name.isidentifier() or keyword.iskeyword(name):
    raise UserError(f'--class-name {name!r} is not a valid Python class name.')
  return name


def _literal(value: Any, indent: int) -> str:
  """A Python literal; a non-empty dict one entry per line (env strings are long)."""
  if isinstance(value, dict) and value:
    pad = ' ' * (indent + 4)
    items = [f'{pad}{k!r}: {_literal(v, indent + 4)},' for k, v in value.items()]
    return '{\n' + '\n'.join(items) + '\n' + ' ' * indent + '}'
  return repr(value)


def _comment(text: str) -> str:
  return gencode.comment(text)


def render(t: Translation, class_name: str, output_path: str) -> str:
  """The recipe source for a translation.

  Text of the script, its paths and the command line appears only as repr literals (written
  for the docstring by gencode.in_docstring) and in one-line comments: a script whose trainer
  call holds `\"\"\"; import os; ...` stays text.
  """
  era = mt.ERAS[t.era]
  q = gencode.in_docstring
  script = os.path.abspath(t.script.path)
  exp = q(f'{output_path}:{class_name}')
  call = f'{t.script.entry} {t.script.config_path or ""}'.rstrip()
  lines = [
      f'"""MaxText run {q(os.path.basename(t.script.path))} as a paxcli experiment (pax import-maxtext).',
      '',
      f'Source script: {q(script)}',
      f'  line {int(t.script.line)}: {q(call)}',
      f'MaxText era: {t.era} ({era.rule}).',
      f'  Assumed because {q(t.era_reason)}.',
      f'Defaults: {q(t.defaults)}; {q(t.defaults_reason)}.',
  ]
  if t.preset:
    lines.append(f'Model preset: {q(t.preset)} (applied before the script\'s own keys).')
  lines += [
      '',
      'Run:',
      f'  pax describe --exp {exp}',
      f'  pax train --exp {exp}',
      'A tiny check on CPU' + (' (it accepts UNSUPPORTED_FEATURES: it checks that the recipe builds and'
                               if t.unsupported else ':'),
  ]
  if t.unsupported:
    lines.append('trains, not that it matches MaxText):')
  check = cpu_check(exp, class_name, bool(t.unsupported))
  lines += [
      f'  pax train --exp {exp} \\',
      '    ' + ' '.join(check[:5]) + ' \\',
      '    ' + ' '.join(check[5:10]) + ' \\',
      '    ' + ' '.join(check[10:]),
  ]
  if t.unsupported:
    lines += ['', 'UNSUPPORTED_FEATURES lists what paxcli cannot reproduce; `pax train` refuses',
              'to run until you accept the difference with --set UNSUPPORTED_FEATURES={}.']
  lines += ['"""', '', 'from paxcli.models import LmExperiment', '', '',
            f'class {class_name}(LmExperiment):',
            f'{_INDENT}"""{q(os.path.basename(t.script.path))} (MaxText era {t.era})."""', '']
  by_knob = {row.knob: row for row in t.rows}
  for knob, value in t.knobs.items():
    row = by_knob.get(knob)
    text = f'{_INDENT}{knob} = {_literal(value, len(_INDENT))}'
    if row is not None and row.key and '\n' not in text:
      joiner = ' = ' if ',' in row.key else '='
      note = f'{row.key}{joiner}{row.raw}' if row.raw else row.key
      if row.after:
        note += f' -> {row.after}'
      text += f'  # {_comment(note)}'
    lines.append(text)
  if t.untranslated:
    lines += ['', f'{_INDENT}# MaxText settings not translated (key = value: reason):']
    for u in t.untranslated:
      lines.append(f'{_INDENT}#   {_comment(u.key)} = {_comment(u.value)}: {_comment(u.reason)}')
  if t.warnings:
    lines += ['', f'{_INDENT}# Warnings from the import:']
    lines += [f'{_INDENT}#   {_comment(w)}' for w in t.warnings]
  if t.notes:
    lines += ['', f'{_INDENT}# Notes from the import:']
    lines += [f'{_INDENT}#   {_comment(n)}' for n in t.notes]
  return '\n'.join(lines) + '\n'


def write(t: Translation, class_name: str, output_path: str, force: bool) -> str:
  """Writes the recipe (files.write_output); never replaces an existing file unless `force`."""
  files.check_output(output_path, 'the recipe', force=force)
  source = render(t, class_name, output_path)
  compile(source, output_path, 'exec')  # a bug here must not leave a broken recipe behind
  gencode.check_shape(source, output_path)   # nor one that holds more than knobs
  files.write_output(output_path, source, 'the recipe')
  return source
