"""The command line of this invocation, and the job directory's record of them.

Every `pax train` / `pax eval` on a job directory appends one line to its
`invocations.txt` (never rewritten): the UTC time, paxcli's version and the command
line, so a run's history stays readable after resumes with other settings.
"""

from __future__ import annotations

import datetime
import shlex
import sys
from typing import Optional

from paxcli import __version__
from paxcli.jobdir import layout, storage

_argv: Optional[list[str]] = None  # set by the CLI's main(); else sys.argv


def set_argv(argv: list[str]) -> None:
  global _argv
  _argv = list(argv)


def command_line() -> str:
  argv = _argv if _argv is not None else sys.argv[1:]
  return shlex.join(['pax', *argv])


def record(job_dir: str) -> None:
  """Appends `<UTC time>  paxcli <version>  <command line>` to job_dir/invocations.txt."""
  storage.makedirs(job_dir)
  now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%dT%H:%M:%SZ')
  storage.append_text(layout.invocations(job_dir), f'{now}  paxcli {__version__}  {command_line()}\n')
