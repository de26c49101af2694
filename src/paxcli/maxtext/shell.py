"""Reads a MaxText run script as text: finds the trainer invocation and its overrides.

Nothing in the script is ever executed. A small shell reader follows what a run script
needs: quotes, escapes, `\\` continuations, comments, variable assignments and `export`,
`${VAR:-default}` expansions, the `for ARGUMENT in "$@"` loop that turns `KEY=VALUE`
arguments into variables (with `IFS='=' read ... <<< "$ARGUMENT"`), and trainer calls
nested in a quoted command (`gcloud ... --command="python3 MaxText/train.py ..."`).
Every other command (`bash preflight.sh`, `echo ... > file`, `gsutil cp`) is skipped.
Command substitutions `$(...)` stay as literal text.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Optional

from paxcli.errors import UserError
from paxcli.files import read_text

_NAME_RE = re.compile(r'[A-Za-z_][A-Za-z0-9_]*')
_ASSIGN_RE = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)=')
_OVERRIDE_RE = re.compile(r'^([A-Za-z_][A-Za-z0-9_.]*)=(.*)$', re.S)
_RESERVED_PREFIX = {'do', 'then', 'else', '{', '}', '!', 'time', 'fi', 'esac'}
_LOOP_HEADS = {'for', 'while', 'until', 'select'}
_REDIRECT_OPS = ('<<<', '<<-', '<<', '>>', '>&', '<&', '>|', '<>', '>', '<')
_TRAINER_MODULES = {'MaxText.train', 'maxtext.train', 'MaxText.train_compile',
                    'maxtext.trainers.pre_train.train', 'maxtext.trainers.pre_train.train_compile'}
MAX_SCRIPT_BYTES = 1 << 20  # a run script is a few KB; more is the wrong file (or /dev/zero)
MAX_NESTING = 64  # `$(...)` / `${...}` inside each other; real scripts nest two or three deep
# Expansion is bounded as the script is (a few KB of text): no one value grows past MAX_VALUE_CHARS
# (A="$A$A" forty times would be a terabyte), and reading the whole script expands at most
# MAX_EXPANDED_CHARS characters and runs at most MAX_COMMANDS commands (loops over loops).
MAX_VALUE_CHARS = 1 << 20
MAX_EXPANDED_CHARS = 64 << 20
MAX_COMMANDS = 100_000
_TRAINER_FILES = {'train.py', 'train_compile.py'}


@dataclasses.dataclass
class Part:
  """A piece of a shell word: quote is '' (unquoted), "'", '"', '\\\\' (escaped) or '$(' ."""
  text: str
  quote: str = ''


@dataclasses.dataclass
class Command:
  words: list[list[Part]]
  line: int
  herestring: Optional[list[Part]] = None


@dataclasses.dataclass
class Override:
  key: str
  value: str
  line: int
  origin: str = 'script'   # 'script', 'env M_<KEY>' or 'argument'


@dataclasses.dataclass
class ScriptInfo:
  """What a run script asks MaxText to do."""
  path: str
  entry: str                       # 'MaxText/train.py' or '-m maxtext.trainers.pre_train.train'
  config_path: Optional[str]       # the base.yml path given to the trainer
  overrides: list[Override]
  env: dict[str, str]              # exported variables and command-prefix settings at the call
  line: int
  notes: list[str]
  skipped: list[str]


# ---- lexer ----------------------------------------------------------------------


class _Lexer:
  """Splits script text into commands of words; records no semantics."""

  def __init__(self, text: str):
    self.text = text.replace('\r\n', '\n')
    self.i = 0
    self.line = 1
    self.commands: list[Command] = []
    self.words: list[list[Part]] = []
    self.parts: Optional[list[Part]] = None
    self.pending: Optional[str] = None        # redirect operator waiting for its target
    self.herestring: Optional[list[Part]] = None
    self.heredocs: list[tuple[str, bool]] = []
    self.start_line = 1

  def run(self) -> list[Command]:
    text = self.text
    while self.i < len(text):
      c = text[self.i]
      nxt = text[self.i + 1] if self.i + 1 < len(text) else ''
      if c == '\\' and nxt == '\n':
        self.i += 2
        self.line += 1
      elif c in ' \t':
        self._flush_word()
        self.i += 1
      elif c == '\n':
        self._end_command()
        self.i += 1
        self.line += 1
        self._skip_heredocs()
      elif c == '#' and self.parts is None:
        end = text.find('\n', self.i)
        self.i = len(text) if end < 0 else end
      elif c == "'":
        end = text.find("'", self.i + 1)
        if end < 0:
          raise UserError(f'line {self.line}: unterminated single quote.')
        self._add(Part(text[self.i + 1:end], "'"))
        self.line += text.count('\n', self.i, end)
        self.i = end + 1
      elif c == '"':
        self._double_quoted()
      elif c == '\\':
        self._add(Part(nxt, '\\'))
        self.i += 2
      elif c == '$' and nxt == '(':
        self._add(Part(self._balanced('(', ')'), '$('))
      elif c == '`':
        end = text.find('`', self.i + 1)
        end = len(text) - 1 if end < 0 else end
        self._add(Part(text[self.i:end + 1], '$('))
        self.i = end + 1
      elif c == '$' and nxt == '{':
        self._add(Part(self._balanced('{', '}'), ''))
      elif c in '<>' or (c == '&' and nxt == '>'):
        self._redirect()
      elif c in ';&|()':
        self._end_command()
        self.i += 1
      else:
        self._add(Part(c, ''))
        self.i += 1
    self._end_command()
    return self.commands

  def _add(self, part: Part) -> None:
    if self.parts is None:
      self.parts = []
      if not self.words:
        self.start_line = self.line
    if part.quote == '' and self.parts and self.parts[-1].quote == '':
      self.parts[-1] = Part(self.parts[-1].text + part.text, '')
    else:
      self.parts.append(part)

  def _flush_word(self) -> None:
    if self.parts is None:
      return
    word, self.parts = self.parts, None
    if self.pending is None:
      self.words.append(word)
      return
    op, self.pending = self.pending, None
    if op == '<<<':
      self.herestring = word
    elif op in ('<<', '<<-'):
      self.heredocs.append((''.join(p.text for p in word), op == '<<-'))
    # Any other redirect target (a file) is dropped: nothing is ever written.

  def _end_command(self) -> None:
    self._flush_word()
    self.pending = None
    if self.words:
      self.commands.append(Command(self.words, self.start_line, self.herestring))
    self.words = []
    self.herestring = None

  def _double_quoted(self) -> None:
    text, j = self.text, self.i + 1
    out = []
    while j < len(text) and text[j] != '"':
      if text[j] == '\\' and j + 1 < len(text):
        out.append(text[j:j + 2])
        j += 2
        continue
      if text[j] == '$' and text[j + 1:j + 2] in ('(', '{'):
        opening = text[j + 1]
        depth, k = 0, j + 1
        while k < len(text):
          if text[k] == opening:
            depth += 1
            self._check_depth(depth, opening)
          elif text[k] == {'(': ')', '{': '}'}[opening]:
            depth -= 1
            if depth == 0:
              break
          k += 1
        out.append(text[j:k + 1])
        j = k + 1
        continue
      out.append(text[j])
      j += 1
    if j >= len(text):
      raise UserError(f'line {self.line}: unterminated double quote.')
    body = ''.join(out)
    self.line += body.count('\n')
    self._add(Part(body, '"'))
    self.i = j + 1

  def _balanced(self, opening: str, closing: str) -> str:
    text, j, depth = self.text, self.i + 1, 0
    while j < len(text):
      if text[j] == opening:
        depth += 1
        self._check_depth(depth, opening)
      elif text[j] == closing:
        depth -= 1
        if depth == 0:
          break
      j += 1
    chunk = text[self.i:j + 1]
    self.line += chunk.count('\n')
    self.i = j + 1
    return chunk

  def _check_depth(self, depth: int, opening: str) -> None:
    if depth > MAX_NESTING:
      raise UserError(f'line {self.line}: `${opening}` nested more than {MAX_NESTING} deep; paxcli reads '
                      'run scripts as text and does not follow that. Simplify the script.')

  def _redirect(self) -> None:
    # A word of digits right before the operator is a file descriptor (2>&1): drop it.
    if self.parts is not None and all(p.quote == '' and p.text.isdigit() for p in self.parts):
      self.parts = None
    self._flush_word()
    text = self.text
    if text.startswith('&>', self.i):
      op = '&>'
    else:
      op = next(o for o in _REDIRECT_OPS if text.startswith(o, self.i))
    self.i += len(op)
    if op in ('>&', '<&'):
      m = re.match(r'\d+-?|-', text[self.i:])
      if m:
        self.i += m.end()
        return
    self.pending = op

  def _skip_heredocs(self) -> None:
    while self.heredocs:
      delimiter, strip_tabs = self.heredocs.pop(0)
      delimiter = delimiter.strip('\'"')
      while self.i < len(self.text):
        end = self.text.find('\n', self.i)
        end = len(self.text) if end < 0 else end
        line = self.text[self.i:end]
        self.i = end + 1
        self.line += 1
        if (line.lstrip('\t') if strip_tabs else line) == delimiter:
          break


def lex(text: str) -> list[Command]:
  return _Lexer(text).run()


# ---- expansion ------------------------------------------------------------------


class _Shell:
  """Walks the commands in order, tracking variables; never runs anything."""

  def __init__(self, args: list[str], notes: list[str]):
    self.args = list(args)
    self.env: dict[str, str] = {}
    self.exported: set[str] = set()
    self.notes = notes
    self.unset_seen: set[str] = set()
    self.invocations: list[tuple[list[str], dict[str, str], int]] = []
    self.skipped: list[str] = []
    self.branch_noted = False
    self.line = 0            # the script line being read, for messages
    self.expanded = 0        # characters expanded so far (MAX_EXPANDED_CHARS)
    self.commands_run = 0    # commands read so far, loop bodies once per item (MAX_COMMANDS)

  # -- variables --

  def lookup(self, name: str) -> str:
    if name.isdigit():
      n = int(name)
      return self.args[n - 1] if 0 < n <= len(self.args) else ''
    if name in ('@', '*'):
      return ' '.join(self.args)
    if name == '#':
      return str(len(self.args))
    if name in self.env:
      return self.env[name]
    if name not in self.unset_seen:
      self.unset_seen.add(name)
    return ''

  def expand_text(self, text: str, in_dq: bool) -> str:
    """Expands $NAME, ${NAME}, ${NAME:-default} (and := :+ - = +) in a text."""
    out, j = [], 0
    while j < len(text):
      c = text[j]
      if c == '\\' and in_dq and j + 1 < len(text):
        nxt = text[j + 1]
        # \<newline> continues the line; \$ \` \" \\ are escapes; others keep the backslash.
        out.append('' if nxt == '\n' else nxt if nxt in '$`"\\' else c + nxt)
        j += 2
      elif c == '$' and text.startswith('${', j):
        k = _closing(text, j + 1, '{', '}')
        out.append(self._brace(text[j + 2:k]))
        j = k + 1
      elif c == '$' and text.startswith('$(', j):
        k = _closing(text, j + 1, '(', ')')
        out.append(self._command_substitution(text[j:k + 1]))
        j = k + 1
      elif c == '$':
        m = _NAME_RE.match(text, j + 1)
        if m:
          out.append(self.lookup(m.group()))
          j = m.end()
        elif j + 1 < len(text) and (text[j + 1].isdigit() or text[j + 1] in '@*#'):
          out.append(self.lookup(text[j + 1]))
          j += 2
        else:
          out.append(c)
          j += 1
      else:
        out.append(c)
        j += 1
    return self._bounded(''.join(out))

  def _bounded(self, value: str) -> str:
    """`value`, counted against the expansion bounds; UserError naming the line past them."""
    self.expanded += len(value)
    if len(value) > MAX_VALUE_CHARS:
      raise UserError(f'line {self.line}: a value expands to {len(value):,} characters; paxcli expands at most '
                      f'{MAX_VALUE_CHARS:,} (a run script\'s values are short). Simplify the script.')
    if self.expanded > MAX_EXPANDED_CHARS:
      raise UserError(f'line {self.line}: reading the script expanded over {MAX_EXPANDED_CHARS:,} characters of '
                      'variables; paxcli stops there (a run script needs far less). Simplify the script.')
    return value

  def _brace(self, inner: str) -> str:
    m = re.match(r'^([A-Za-z_][A-Za-z0-9_]*|\d+|[@*#])(?:(:?[-=+?])(.*))?$', inner, re.S)
    if not m:
      self.notes.append(f'${{{inner}}}: this form of expansion is not understood; left empty.')
      return ''
    name, op, word = m.group(1), m.group(2), m.group(3) or ''
    is_set = name in self.env or (name.isdigit() and int(name) <= len(self.args))
    value = self.env.get(name, '') if not name.isdigit() else self.lookup(name)
    if op is None:
      return self.lookup(name)
    empty_counts = op.startswith(':')
    present = is_set and (value != '' or not empty_counts)
    kind = op[-1]
    if kind == '-':
      return value if present else self.expand_text(word, in_dq=True)
    if kind == '=':
      if not present:
        self.env[name] = self.expand_text(word, in_dq=True)
      return self.env[name]
    if kind == '+':
      return self.expand_text(word, in_dq=True) if present else ''
    return value  # '?': would abort when unset; we only read

  def _command_substitution(self, text: str) -> str:
    self.notes.append(f'{text}: command substitution not run; its text is kept as the value.')
    return text

  def expand_word(self, word: list[Part]) -> list[str]:
    """A word's fields after expansion (unquoted expansions split on whitespace)."""
    if len(word) == 1 and word[0].quote == '"' and word[0].text in ('$@', '${@}'):
      return list(self.args)
    fields: list[str] = []
    cur: Optional[str] = None
    for part in word:
      if part.quote in ("'", '\\'):
        cur = (cur or '') + part.text
      elif part.quote == '"':
        cur = (cur or '') + self.expand_text(part.text, in_dq=True)
      elif part.quote == '$(':
        cur = (cur or '') + self._command_substitution(part.text)
      else:
        expanded = self.expand_text(part.text, in_dq=False)
        pieces = re.split(r'[ \t\n]+', expanded)
        for n, piece in enumerate(pieces):
          if n > 0 and cur is not None:
            fields.append(cur)
            cur = None
          if piece:
            cur = (cur or '') + piece
    if cur is not None:
      fields.append(cur)
    return fields

  def expand_joined(self, word: list[Part]) -> str:
    """A word expanded without field splitting (assignments, here-strings)."""
    out = []
    for part in word:
      if part.quote in ("'", '\\'):
        out.append(part.text)
      elif part.quote == '$(':
        out.append(self._command_substitution(part.text))
      else:
        out.append(self.expand_text(part.text, in_dq=part.quote == '"'))
    return ''.join(out)

  # -- commands --

  def run(self, commands: list[Command]) -> None:
    i = 0
    while i < len(commands):
      cmd = commands[i]
      self.line = cmd.line
      self.commands_run += 1
      if self.commands_run > MAX_COMMANDS:
        raise UserError(f'line {cmd.line}: reading the script ran over {MAX_COMMANDS:,} commands (its loops, item '
                        'by item); paxcli stops there (a run script needs far fewer). Simplify the script.')
      words = _strip_reserved(cmd.words)
      head = _plain(words[0]) if words else None
      if not words:
        i += 1
      elif head in _LOOP_HEADS:
        i = self._loop(commands, i, words)
      elif head in ('if', 'elif', 'case', 'done'):
        if head != 'done' and not self.branch_noted:
          self.branch_noted = True
          self.notes.append(f'line {cmd.line}: `{head}` conditions are not evaluated; every '
                            'branch is read in order.')
        i += 1
      else:
        self._simple(words, cmd)
        i += 1

  def _loop(self, commands: list[Command], i: int, words: list[list[Part]]) -> int:
    end = _matching_done(commands, i)
    body = commands[i + 1:end]
    head = _plain(words[0])
    if head != 'for' or len(words) < 2:
      self.notes.append(f'line {commands[i].line}: `{head}` loop condition not evaluated; '
                        'its body is read once.')
      self.run(body)
      return end + 1
    var = _plain(words[1]) or ''
    if len(words) > 2 and _plain(words[2]) == 'in':
      items = [f for w in words[3:] for f in self.expand_word(w)]
    else:
      items = list(self.args)
    for item in items:
      self.env[var] = item
      self.run(body)
    return end + 1

  def _simple(self, words: list[list[Part]], cmd: Command) -> None:
    prefix: dict[str, str] = {}
    n = 0
    while n < len(words) and words[n][0].quote == '' and _ASSIGN_RE.match(words[n][0].text):
      name, _, value = self.expand_joined(words[n]).partition('=')
      prefix[name] = value
      n += 1
    if n == len(words):
      self.env.update(prefix)
      return
    argv = [f for w in words[n:] for f in self.expand_word(w)]
    if not argv:
      return
    name = os.path.basename(argv[0])
    if name in ('export', 'declare', 'typeset', 'local', 'readonly'):
      self._export(argv[1:], exported=name in ('export',) or '-x' in argv[1:])
    elif name == 'unset':
      for var in argv[1:]:
        self.env.pop(var, None)
    elif name == 'read':
      self._read(argv[1:], prefix, cmd)
    elif name in ('source', '.'):
      self.notes.append(f'line {cmd.line}: `{" ".join(argv)}` not read (sourced files are not '
                        'followed); pass the variables it sets as KEY=VALUE arguments.')
    else:
      self._other(argv, prefix, cmd)

  def _export(self, args: list[str], exported: bool) -> None:
    for arg in args:
      if arg.startswith('-'):
        continue
      var, eq, value = arg.partition('=')
      if not _NAME_RE.fullmatch(var):
        continue
      if eq:
        self.env[var] = value
      if exported:
        self.exported.add(var)

  def _read(self, args: list[str], prefix: dict[str, str], cmd: Command) -> None:
    names = [a for a in args if not a.startswith('-')]
    if not names:
      return
    line = self.expand_joined(cmd.herestring) if cmd.herestring is not None else ''
    ifs = prefix.get('IFS', self.env.get('IFS', ' \t\n'))
    if ifs.strip() == '':
      values = line.strip().split(None, len(names) - 1)
    else:
      values = re.split('[' + re.escape(ifs) + ']', line, maxsplit=len(names) - 1)
    for name, value in zip(names, values + [''] * (len(names) - len(values))):
      self.env[name] = value

  def _other(self, argv: list[str], prefix: dict[str, str], cmd: Command) -> None:
    if os.path.basename(argv[0]) not in ('echo', 'printf') and _trainer_start(argv) is not None:
      env = {k: self.env[k] for k in self.exported if k in self.env}
      env.update(prefix)
      self.invocations.append((argv, env, cmd.line))
      return
    nested = [a for a in argv[1:] if re.search(r'\s', a) and _mentions_trainer(a)]
    if nested and os.path.basename(argv[0]) not in ('echo', 'printf'):
      for text in nested:
        before = len(self.invocations)
        self.run(lex(text))
        for k in range(before, len(self.invocations)):
          inner_argv, env, _ = self.invocations[k]
          self.invocations[k] = (inner_argv, env, cmd.line)
      return
    self.skipped.append(f'line {cmd.line}: {" ".join(argv)[:80]}')


def _plain(word: list[Part]) -> Optional[str]:
  """The word's text if it is a plain unquoted literal (for keyword checks)."""
  if len(word) == 1 and word[0].quote == '':
    return word[0].text
  return None


def _strip_reserved(words: list[list[Part]]) -> list[list[Part]]:
  k = 0
  while k < len(words) and _plain(words[k]) in _RESERVED_PREFIX:
    k += 1
  return words[k:]


def _matching_done(commands: list[Command], i: int) -> int:
  depth = 0
  for j in range(i, len(commands)):
    words = _strip_reserved(commands[j].words)
    head = _plain(words[0]) if words else None
    if head in _LOOP_HEADS:
      depth += 1
    elif head == 'done':
      depth -= 1
      if depth == 0:
        return j
  return len(commands)


def _mentions_trainer(text: str) -> bool:
  return any(t in text for t in ('train.py', 'train_compile.py')) or any(
      m in text for m in _TRAINER_MODULES)


def _trainer_start(argv: list[str]) -> Optional[int]:
  """Index of the trainer word (script path or module name) in argv, or None."""
  for j, arg in enumerate(argv):
    if os.path.basename(arg) in _TRAINER_FILES and (
        j == 0 or 'python' in os.path.basename(argv[0]) or 'maxtext' in arg.lower()
        or argv[j + 1:j + 2] and argv[j + 1].endswith(('.yml', '.yaml'))):
      return j
    if arg == '-m' and j + 1 < len(argv):
      module = argv[j + 1]
      if module in _TRAINER_MODULES or (module.lower().startswith('maxtext') and
                                        module.endswith(('.train', '.train_compile'))):
        return j + 1
  return None


# ---- entry point ----------------------------------------------------------------


def read_script(path: str, args: list[str] = ()) -> ScriptInfo:
  """Parses a MaxText run script (never running it) and returns its trainer call.

  Args:
    path: the script file.
    args: KEY=VALUE arguments, as if given to the script on its command line.

  Raises:
    UserError: unreadable file, bad quoting, or no trainer invocation.
  """
  text = read_text(path, 'MaxText script', MAX_SCRIPT_BYTES)
  notes: list[str] = []
  try:
    commands = lex(text)
    shell = _Shell(list(args), notes)
    if args and not _has_args_loop(commands):
      # No `for ARGUMENT in "$@"` loop: the arguments still fill the script's variables.
      for arg in args:
        var, eq, value = arg.partition('=')
        if eq and _NAME_RE.fullmatch(var):
          shell.env[var] = value
          shell.exported.add(var)
    shell.run(commands)
  except UserError as e:   # the lexer's and the shell's messages name the line; this names the file
    raise UserError(f'{path}: {e}') from None
  if not shell.invocations:
    others = sorted({w for s in shell.skipped for w in s.split() if w.endswith('.sh')})
    hint = f' It runs {", ".join(others)}: import the script that calls the trainer.' if others else ''
    raise UserError(f'{path}: no MaxText trainer invocation found (expected `python3 '
                    'MaxText/train.py <base.yml> key=value ...` or `python3 -m '
                    f'maxtext.trainers.pre_train.train <base.yml> key=value ...`).{hint}')
  if len(shell.invocations) > 1:
    lines = ', '.join(str(line) for _, _, line in shell.invocations)
    notes.append(f'{len(shell.invocations)} trainer invocations (lines {lines}); using the last.')
  argv, env, line = shell.invocations[-1]
  info = _invocation(path, argv, env, line, notes)
  info.skipped = shell.skipped
  for name in sorted(shell.unset_seen):
    if not name.isdigit():
      notes.append(f'${name} is not set by the script; it expanded to an empty string '
                   f'(give {name}=... after the script to set it).')
  return info


def _has_args_loop(commands: list[Command]) -> bool:
  for cmd in commands:
    words = _strip_reserved(cmd.words)
    if len(words) >= 4 and _plain(words[0]) == 'for' and _plain(words[2]) == 'in':
      if any(p.text in ('$@', '${@}', '$*') for w in words[3:] for p in w):
        return True
  return False


def _invocation(path: str, argv: list[str], env: dict[str, str], line: int,
                notes: list[str]) -> ScriptInfo:
  start = _trainer_start(argv)
  entry = argv[start] if argv[start - 1:start] != ['-m'] else f'-m {argv[start]}'
  rest = argv[start + 1:]
  config_path = None
  if rest and '=' not in rest[0]:
    config_path, rest = rest[0], rest[1:]
  overrides = []
  for var, value in sorted(env.items()):
    if var.startswith('M_') and len(var) > 2:
      overrides.append(Override(var[2:].lower(), value, line, f'env {var}'))
  for arg in rest:
    m = _OVERRIDE_RE.match(arg)
    if m:
      overrides.append(Override(m.group(1), m.group(2), line))
    else:
      notes.append(f'trainer argument {arg!r} is not key=value; ignored.')
  return ScriptInfo(path=path, entry=entry, config_path=config_path, overrides=overrides,
                    env=env, line=line, notes=notes, skipped=[])


def _closing(text: str, start: int, opening: str, closing: str) -> int:
  """Index of the `closing` that matches the `opening` at text[start] (len(text) if none does)."""
  depth, k = 0, start
  while k < len(text):
    depth += {opening: 1, closing: -1}.get(text[k], 0)
    if depth == 0:
      break
    k += 1
  return k
