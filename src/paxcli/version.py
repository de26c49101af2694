"""The installed paxcli's version: pyproject.toml's, read once from the distribution's metadata (one place).
paxcli.__version__ is this, for users; paxcli's own modules read it here, below every layer that records it
(job directories, trackers, `pax version`)."""

from __future__ import annotations

import functools


@functools.cache
def current() -> str:
  """The version, read on first use; a source tree never installed says so."""
  from importlib import metadata  # 25 ms of imports (email, zipfile, csv): not for `pax --help`
  try:
    return metadata.version('paxcli')
  except metadata.PackageNotFoundError:
    return '0+unknown (not installed)'
