"""The installed paxcli's version: pyproject.toml's, read once from the distribution's metadata (one place).
paxcli.__version__ is this, for users; paxcli's own modules read it here, below every layer that records it
(job directories, trackers, `pax version`)."""

from __future__ import annotations

import functools
from typing import Optional


@functools.cache
def current() -> str:
  """The version, read on first use; a source tree never installed says so."""
  return of('paxcli') or '0+unknown (not installed)'


def of(distribution: str) -> Optional[str]:
  """An installed distribution's version (`pax version` lists JAX's too), None when it is not installed."""
  from importlib import metadata  # 25 ms of imports (email, zipfile, csv): not for `pax --help`
  try:
    return metadata.version(distribution)
  except metadata.PackageNotFoundError:
    return None
