"""paxcli: Pax-style machine-learning experiments on JAX.

Every `pax` command is a function here too (paxcli.api): paxcli.train, evaluate, decode,
score, lm_eval, serve, describe, bench_mfu, inspect_input, inspect_checkpoint, convert_checkpoint, import_maxtext.
They are looked up on first use, so `import paxcli` (and `pax --help`) loads none of them.
"""

import importlib

from paxcli import compat, version

_API = ('train', 'evaluate', 'decode', 'score', 'lm_eval', 'serve', 'describe', 'bench_mfu', 'inspect_input', 'inspect_checkpoint',
        'convert_checkpoint', 'import_maxtext')


compat.install()  # old module names (paxcli.lm, paxcli.families.*) keep working, with a warning


def __getattr__(name: str):
  if name == '__version__':  # read from package metadata on first use (paxcli.version)
    globals()['__version__'] = version.current()
    return globals()['__version__']
  if name in _API:  # PEP 562: paxcli.api is imported on first use only
    return getattr(importlib.import_module('paxcli.api'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted(list(globals()) + list(_API))
