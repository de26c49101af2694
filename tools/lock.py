"""Writes constraints.txt: the exact versions installed for paxcli and its extras, as this venv has them.

  .venv/bin/python tools/lock.py            # print the lock
  .venv/bin/python tools/lock.py --write    # write constraints.txt (`make lock`, `make upgrade`)

The lock is the dependency closure of paxcli with the extras named in EXTRAS, read from the
installed packages' own metadata (requirements, their environment markers and extras), so a
package installed by hand beside them is not locked. Versions drop a local part (torch
2.13.0+cpu is locked as torch==2.13.0, which the CPU wheel satisfies and pip finds on this
disk or on PyPI). `make` installs with `-c constraints.txt`: a fresh install gets the versions
the suite passed with.
"""

from __future__ import annotations

import argparse
import platform
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ('test', 'docs')
SKIP = {'paxcli', 'pip'}  # the project itself, and the installer (make upgrades it)


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
  """Canonical name -> installed version of every distribution `root[extras]` needs here."""
  found: dict[str, str] = {}
  todo: list[tuple[str, frozenset[str]]] = [(root, frozenset(extras))]
  seen: set[tuple[str, frozenset[str]]] = set()
  while todo:
    name, wanted = todo.pop()
    if (name, wanted) in seen:
      continue
    seen.add((name, wanted))
    dist = metadata.distribution(name)
    found[canonicalize_name(name)] = dist.version
    for line in dist.requires or []:
      req = Requirement(line)
      if _applies(req, wanted):
        todo.append((req.name, frozenset(req.extras)))
  return found


def _applies(req: Requirement, extras: frozenset[str]) -> bool:
  """Whether a requirement holds on this machine for a distribution installed with `extras`."""
  if req.marker is None:
    return True
  env = default_environment()
  return any(req.marker.evaluate({**env, 'extra': e}) for e in (extras or {''}))


def render(versions: dict[str, str]) -> str:
  head = [
      '# The versions paxcli was tested with: `make` installs with `-c constraints.txt`.',
      '# Written by tools/lock.py (`make lock`, `make upgrade`) from a venv that passed the suite;',
      f'# Python {platform.python_version()} on {sys.platform} {platform.machine()}. Do not edit by hand.',
  ]
  pins = [f'{name}=={_public(v)}' for name, v in sorted(versions.items()) if name not in SKIP]
  return '\n'.join(head + pins) + '\n'


def _public(version: str) -> str:
  return re.sub(r'\+.*$', '', version)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--write', action='store_true', help='write constraints.txt instead of printing')
  args = parser.parse_args()
  text = render(closure('paxcli', EXTRAS))
  if args.write:
    (ROOT / 'constraints.txt').write_text(text)
    print(f'wrote {ROOT / "constraints.txt"} ({text.count(chr(10)) - 3} pins)')
  else:
    sys.stdout.write(text)


if __name__ == '__main__':
  main()
