"""What XLA logs while it compiles, read instead of shown raw: its full-rematerialization warnings.

    with xla_log.rematerialized(found):   # around a compile
      compiled = lowered.compile()
    note = xla_log.remat_note(found)      # one line for the user, or None

XLA logs through C++ straight to file descriptor 2, before any Python log setting applies: the compile's
output is held (paxcli.files.held_stderr), the warnings are counted into a dict, and every other line is
shown as it came.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Optional

from paxcli import files

# XLA's SPMD partitioner, when it has no cheaper way from one sharding of an array to another, warns (a raw
# C++ log line of several hundred characters, per array) and replicates the array on every device, then
# cuts it to the new sharding.
_REMAT = re.compile(r'Involuntary full rematerialization\. The compiler cannot go from sharding (\{[^}]*\}) '
                    r'to (\{[^}]*\}) efficiently for HLO operation \S+ = (\w+\[[\d,]*\])')
REMAT_KEPT = 20


@contextlib.contextmanager
def rematerialized(row: dict):
  """XLA's full-rematerialization warnings of a compile, taken out of the terminal into `row`
  ('xla_rematerialized': the count, 'xla_rematerialized_examples': the first few {'array', 'from', 'to'}),
  which remat_note says in a line. Anything else the compile logs is shown as it was."""
  text = ''
  try:
    with files.held_stderr() as held:
      try:
        yield
      finally:
        text = held()
  finally:   # a compile that fails shows what it logged all the same
    found = [m for m in map(_REMAT.search, text.splitlines()) if m]
    if found:
      row['xla_rematerialized'] = len(found)
      row['xla_rematerialized_examples'] = [{'array': m.group(3), 'from': m.group(1), 'to': m.group(2)}
                                            for m in found[:REMAT_KEPT]]
    sys.stderr.write(''.join(line for line in text.splitlines(keepends=True) if not _REMAT.search(line)))
    sys.stderr.flush()


def remat_note(row: dict, more: str = '--json lists them') -> Optional[str]:
  """One line for a compile that rematerialized arrays in full (bench's caption, train's log), or None; `more`
  says where the whole list is."""
  n = row.get('xla_rematerialized')
  if not n:
    return None
  first = row['xla_rematerialized_examples'][0]
  return (f"XLA resharded {n} array(s) by full rematerialization (each made whole on every device, then cut to the "
          f"new sharding: memory and communication the step could do without), e.g. {first['array']} from "
          f"{first['from']} to {first['to']}; {more}.")
