"""The code blocks of a docs page: which run in tests/test_docs_tutorials.py and which say why not.

A block runs unless the line above its fence is `<!-- not run: REASON -->`. Shell blocks (bash) run
in order in one directory; a Python block whose first line is a comment naming a file
(`# make_data.py: ...`) is written to that file, another is run with `python`.
"""

import dataclasses
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((REPO / 'docs' / 'tutorials').glob('*.md'))
CODE = ('bash', 'python')
SHOWN = ('text', 'json', 'yaml', 'toml')   # output and data, shown only
NOT_RUN = re.compile(r'^<!-- not run: (.+?) -->$')
FILE = re.compile(r'^# ([\w./-]+\.py)\b')


@dataclasses.dataclass
class Block:
  page: Path
  line: int            # of the opening fence, 1-based
  lang: str
  code: str
  not_run: str | None  # the reason, when marked

  @property
  def file(self) -> str | None:
    """The file a Python block is, when its first line names one."""
    m = FILE.match(self.code) if self.lang == 'python' else None
    return m.group(1) if m else None

  def where(self) -> str:
    return f'{self.page.relative_to(REPO)}:{self.line}'


def blocks(page: Path) -> list[Block]:
  lines = page.read_text().splitlines()
  out, i = [], 0
  while i < len(lines):
    m = re.match(r'^```(\w*)\s*$', lines[i])
    if not m:
      i += 1
      continue
    start, lang = i, m.group(1)
    end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith('```'))
    above = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), '')
    marked = NOT_RUN.match(above)
    out.append(Block(page, start + 1, lang, '\n'.join(lines[start + 1:end]) + '\n',
                     marked.group(1).strip() if marked else None))
    i = end + 1
  return out
