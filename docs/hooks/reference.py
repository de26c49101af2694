"""mkdocs hook: pages written from the code at every build, so they cannot disagree with it.

  reference/knobs.md      every knob of every family: from the experiment classes and knob tables
  reference/commands.md   every `pax` command with its arguments and options: from the Typer app
  reference/changelog.md  CHANGELOG.md at the top of the repository

`knob_sources()` is the one place the docs name where the knobs live.
"""

from __future__ import annotations

import io
import os
import sys
import tokenize
import typing
from typing import Any

from mkdocs.structure.files import File

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def knob_sources() -> list[tuple[str, type, tuple]]:
  """(section title, experiment class, its model knob table) for each family the reference lists."""
  from paxcli.models.classifier_experiment import CLASSIFIER_KNOBS, ClassifierExperiment
  from paxcli.models.knobs import LM_KNOBS
  from paxcli.models import LmExperiment
  return [('Language models: `LmExperiment`', LmExperiment, LM_KNOBS),
          ('Classifiers: `ClassifierExperiment`', ClassifierExperiment, CLASSIFIER_KNOBS)]


def on_files(files, config):
  """Adds the generated pages to the site's files (the nav names them)."""
  for path, text in (('reference/knobs.md', knobs_page()), ('reference/commands.md', commands_page()),
                     ('reference/changelog.md', changelog_page())):
    files.append(File.generated(config, path, content=text))
  return files


# ---- knobs ------------------------------------------------------------------------------------


def knobs_page() -> str:
  from paxcli.experiment import Experiment
  from paxcli.models.training import TrainingExperiment
  lines = ['# Knobs', '',
           'Every knob an experiment of paxcli declares, written from the code when the site is built. '
           'Set one in a class (`NUM_LAYERS = 4`) or on the command line (`--set NUM_LAYERS=4`); '
           '`pax describe --exp NAME` prints an experiment\'s values. A recipe may change a default: '
           'the values here are the base classes\'. See [Experiments and knobs](../guides/experiments.md).', '']
  lines += _class_section('Every experiment: `Experiment`', Experiment, set())
  shown = set(Experiment.knob_types())
  lines += _class_section('Every trained family: `TrainingExperiment`', TrainingExperiment, shown,
                          note='Optimizer, learning-rate schedule and loop.')
  shown |= set(TrainingExperiment.knob_types())
  for title, cls, table in knob_sources():
    in_table = {k.name for k in table}
    lines += _class_section(title, cls, shown | in_table, note='Data, decoding and other knobs of the family.')
    lines += _table_section(cls, table)
  return '\n'.join(lines) + '\n'


def _class_section(title: str, cls: type, skip: set[str], note: str = '') -> list[str]:
  """A table of the knobs `cls` declares that `skip` does not hold, with the comments beside them."""
  comments = _knob_comments(cls)
  rows = [(name, tp) for name, tp in cls.knob_types().items() if name not in skip]
  out = [f'## {title}', '']
  if note:
    out += [note, '']
  out += ['| knob | type | default | what |', '| --- | --- | --- | --- |']
  for name, tp in rows:
    out.append(f'| `{name}` | {_type_text(tp)} | {_code(getattr(cls, name, None))} | {_cell(comments.get(name, ""))} |')
  return out + ['']


def _table_section(cls: type, table: tuple) -> list[str]:
  out = [f'### Model knobs of `{cls.__name__}`', '',
         f'The knob table in `{_module_of(table)}` declares these: each knob sets the fields of '
         'the model config under `task.model` named in its row.', '',
         '| knob | type | default | sets | what |', '| --- | --- | --- | --- | --- |']
  for knob in table:
    fields = '<br>'.join(f'`{f}`' for f in knob.fields)
    out.append(f'| `{knob.name}` | {_type_text(knob.type)} | {_code(knob.default)} | {fields} | {_cell(knob.doc)} |')
  return out + ['']


def _module_of(table: tuple) -> str:
  """The module that defines a knob table (where a new knob is a row)."""
  for name, module in list(sys.modules.items()):
    if any(value is table for value in vars(module).values() if isinstance(value, tuple)):
      return name
  return table[0].__class__.__module__


def _knob_comments(cls: type) -> dict[str, str]:
  """Knob name -> the comment on its line, else the comment lines right above it, over the hierarchy."""
  import inspect
  comments: dict[str, str] = {}
  for klass in reversed(cls.__mro__):
    try:
      source = inspect.getsource(klass)
    except (OSError, TypeError):
      continue
    comments.update(_comments_in(source))
  return comments


def _comments_in(source: str) -> dict[str, str]:
  found: dict[str, str] = {}
  above: list[str] = []
  line_of_name: dict[int, str] = {}
  tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
  for i, tok in enumerate(tokens):
    if tok.type == tokenize.COMMENT:
      text = tok.string.lstrip('#').strip()
      if tok.start[0] in line_of_name:
        found[line_of_name[tok.start[0]]] = text
      else:
        above.append(text)
    elif tok.type == tokenize.NAME and tok.string.isupper() and tok.start[1] > 0 and _declares(tokens, i):
      name = tok.string
      line_of_name[tok.start[0]] = name
      if above:
        found[name] = ' '.join(above)
      above = []
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
      if tok.start[0] not in line_of_name:
        above = []
  return found


def _declares(tokens, i: int) -> bool:
  """Whether the NAME at i starts a line and is followed by ':' or '=' (a knob's declaration)."""
  before = tokens[i - 1].type if i else tokenize.NEWLINE
  after = tokens[i + 1].string if i + 1 < len(tokens) else ''
  return before in (tokenize.INDENT, tokenize.NEWLINE, tokenize.NL, tokenize.DEDENT) and after in (':', '=')


def _type_text(tp: Any) -> str:
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is typing.Literal:
    return ' \\| '.join(f'`{a!r}`' for a in args)
  if origin is typing.Union:
    inner = [a for a in args if a is not type(None)]
    text = ' or '.join(_type_text(a) for a in inner)
    return text + (' or `None`' if len(inner) < len(args) else '')
  if origin is not None:
    return f'`{_plain(tp)}`'
  return f'`{getattr(tp, "__name__", _plain(tp))}`'


def _plain(tp: Any) -> str:
  return str(tp).replace('typing.', '')


def _code(value: Any) -> str:
  return f"`{' '.join(repr(value).split())}`"


def _cell(text: str) -> str:
  """Prose for a Markdown table cell: one line; outside `code` spans, characters Markdown would
  read as markup (a pipe, <name>, *) escaped."""
  parts = ' '.join(str(text).split()).split('`')
  for i in range(0, len(parts), 2):
    parts[i] = (parts[i].replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')
                .replace('*', '\\*').replace('|', '\\|'))
  return '`'.join(parts)


# ---- commands ---------------------------------------------------------------------------------


def commands_page() -> str:
  import typer
  from paxcli.cli.app import app
  root = typer.main.get_command(app)
  lines = ['# Commands', '',
           'Every `pax` command, written from the command-line app when the site is built (`pax COMMAND '
           '--help` prints the same). Each is also a function of `paxcli`: see the '
           '[Python API](api.md).', '']
  context = root.context_class(root, info_name='pax')
  for name, command in _walk(root, context):
    lines += _command_section(name, command)
  return '\n'.join(lines) + '\n'


def _walk(group, context):
  """(full name, command) for every leaf command under `group`, in the order `pax --help` lists them."""
  for name in group.list_commands(context):
    command = group.get_command(context, name)
    if command is None or command.hidden:
      continue
    sub = command.context_class(command, info_name=name, parent=context)
    if hasattr(command, 'list_commands'):  # a group (Typer's own click: no isinstance against click's classes)
      yield from _walk(command, sub)
    else:
      yield sub.command_path, command


def _command_section(name: str, command) -> list[str]:
  context = command.context_class(command, info_name=name)
  usage = ' '.join([name, *command.collect_usage_pieces(context)])
  out = [f'## `{name}`', '', f'```text\n{usage}\n```', '']
  if command.help:
    out += [_help_text(command.help), '']
  rows = []
  for param in command.get_params(context):
    if getattr(param, 'hidden', False) or param.name == 'help':
      continue
    rows.append(_param_row(param, context))
  if rows:
    out += ['| argument or option | what |', '| --- | --- |', *rows, '']
  return out


def _help_text(text: str) -> str:
  """A docstring's paragraphs as Markdown; click's \\b (keep lines as written) becomes a text block."""
  paragraphs = [p.strip('\n') for p in text.split('\n\n')]
  out = []
  for p in paragraphs:
    if p.startswith('\b'):
      out.append('```text\n' + p[1:].strip('\n') + '\n```')
    else:
      out.append(' '.join(p.split()))
  return '\n\n'.join(out)


def _param_row(param, context) -> str:
  """One row, as `pax COMMAND --help` words it: the option's names and value, its help with default and range."""
  if param.param_type_name == 'argument':
    names = ' '.join(param.get_usage_pieces(context))
    what = getattr(param, 'help', '') or ''
    if not param.required:
      what = (what + ' (optional)').strip()
  else:
    names, what = param.get_help_record(context) or ('', '')
  return f"| `{' '.join(names.split())}` | {_cell(what)} |"


# ---- changelog --------------------------------------------------------------------------------


def changelog_page() -> str:
  with open(os.path.join(ROOT, 'CHANGELOG.md'), encoding='utf-8') as f:
    return f.read()
