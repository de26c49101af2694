"""Faults put into real `pax` processes for a test: a sitecustomize.py on their PYTHONPATH changes one
process of a launch (PAX_PROCESS_ID) once paxcli's train loop is imported. The processes, collectives
and files stay real; only the order or the moment of one process's death is forced, as a loaded machine
or a crash would make it.

  env = injected.env(tmp_path, injected.LATE_SAVES, PAXCLI_TEST_SAVE_LAG='2')   # for subprocess / Launch
"""

import os

_HOOK = '''
import importlib.abc, importlib.util, os, signal, sys, time

class _Patch(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != 'paxcli.loops.train':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    run = spec.loader.exec_module

    def exec_module(module):
      run(module)
      patch(module)
    spec.loader.exec_module = exec_module
    return spec

if os.environ.get('PAX_PROCESS_ID') == os.environ.get('PAXCLI_TEST_PROCESS', '1'):
  sys.meta_path.insert(0, _Patch())
'''

# Process 1 reaches each persistent save PAXCLI_TEST_SAVE_LAG seconds after process 0 (its Saver hook waits
# first): the order in which process 0 has begun to delete an old step while process 1 looks at the directory.
LATE_SAVES = '''
def patch(module):
  save = module.Saver.__call__
  def late(self, info):
    time.sleep(float(os.environ['PAXCLI_TEST_SAVE_LAG']))
    return save(self, info)
  module.Saver.__call__ = late
'''

# Process 1 kills itself (SIGKILL) right after dispatching train step PAXCLI_TEST_DIE_AT: its peer is then
# inside that step's collectives.
DIES_IN_A_STEP = '''
def patch(module):
  step = module.TrainStep.__call__
  def dying(self, state, batch):
    out = step(self, state, batch)
    self._calls = getattr(self, '_calls', 0) + 1
    if self._calls == int(os.environ['PAXCLI_TEST_DIE_AT']):
      os.kill(os.getpid(), signal.SIGKILL)
    return out
  module.TrainStep.__call__ = dying
'''


def env(tmp_path, patch: str, **variables: str) -> dict:
  """The environment variables that put `patch` into the processes started with them."""
  site = tmp_path / 'injected'
  site.mkdir(exist_ok=True)
  (site / 'sitecustomize.py').write_text(patch + _HOOK)
  path = os.pathsep.join(filter(None, [str(site), os.environ.get('PYTHONPATH')]))
  return {'PYTHONPATH': path, **variables}
