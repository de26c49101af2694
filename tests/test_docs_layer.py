"""The docs' "Writing a layer" example (docs/guides/writing-a-layer.md), run exactly as printed (only the job directory
moves into a temp dir): the workshop's FeedForward inside the LM, its non-trainable
variable, summary, aux loss and random noise honoured by the train loop, and resume."""

import json
import os
import re
import shlex

import numpy as np
import pytest

from conftest import REPO, pax_main


PAGE = REPO / 'docs' / 'guides' / 'writing-a-layer.md'


def _page_example():
  """The page's first Python block (my_layers.py) and first shell block (the command)."""
  text = PAGE.read_text()
  code = re.search(r'```python\n(.*?)```', text, re.S).group(1)
  command = re.search(r'```bash\n(.*?)```', text, re.S).group(1).strip()
  return code, command


@pytest.fixture(scope='module', autouse=True)
def _user_rank_promotion():
  """A user's shell allows numpy rank promotion (conftest forbids it): the example adds `inputs + b`."""
  import jax
  before = jax.config.jax_numpy_rank_promotion
  jax.config.update('jax_numpy_rank_promotion', 'allow')
  yield
  jax.config.update('jax_numpy_rank_promotion', before)


@pytest.fixture(scope='module')
def example(tmp_path_factory):
  code, command = _page_example()
  assert code.startswith('# my_layers.py\n')
  work = tmp_path_factory.mktemp('docs_layer')
  (work / 'my_layers.py').write_text(code)
  argv = shlex.split(command)
  assert argv[0] == 'pax'
  job = str(work / 'job')
  argv = [job if a == '/tmp/my_lm' else a for a in argv[1:]]
  cwd = os.getcwd()
  os.chdir(work)
  try:
    code, out, err = pax_main(argv, _Capsys())
  finally:
    os.chdir(cwd)
  assert code == 0, err[-3000:]
  return work, job, argv, out


class _Capsys:
  """pax_main's capsys for a module-scoped fixture: output goes to a buffer."""

  def __init__(self):
    import io
    import sys
    self.out, self.err = io.StringIO(), io.StringIO()
    self._saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = self.out, self.err

  def readouterr(self):
    import sys
    import types
    sys.stdout, sys.stderr = self._saved
    return types.SimpleNamespace(out=self.out.getvalue(), err=self.err.getvalue())


def _records(job):
  with open(os.path.join(job, 'train_metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _restored_state(work, job, argv, step):
  from paxcli import config
  from paxcli.runtime import engine
  from paxcli.jobdir import restore
  sets = [argv[i + 1] for i, a in enumerate(argv) if a == '--set']
  cwd = os.getcwd()
  os.chdir(work)
  try:
    resolved = config.resolve('my_layers.py:MyLm', sets)
  finally:
    os.chdir(cwd)
  setup = engine.build(resolved)
  return restore.restore(setup, job, step).state


def test_docs_layer_trains_with_summaries_aux_losses_and_non_trainable_vars(example):
  work, job, argv, result = example
  records = _records(job)
  assert [r['step'] for r in records] == [10, 20]
  last = records[-1]
  aux = {k: v for k, v in last.items() if k.startswith('aux_loss/')}
  assert set(aux) == {'aux_loss/layer_0/mlp/l2', 'aux_loss/layer_1/mlp/l2'}
  assert all(v > 0 for v in aux.values())
  # The reported loss is what was optimised: the model's loss plus every aux loss.
  assert last['loss'] == pytest.approx(last['model_loss'] + sum(aux.values()), rel=1e-5)
  assert {'summary/layer_0/mlp/inputs_mean', 'summary/layer_1/mlp/inputs_mean'} <= set(last)

  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  events = EventAccumulator(os.path.join(job, 'summaries', 'train'))
  events.Reload()
  tags = set(events.Tags()['scalars'])
  assert {'summary/layer_0/mlp/inputs_mean', 'aux_loss/layer_1/mlp/l2', 'model_loss'} <= tags
  assert [e.step for e in events.Scalars('summary/layer_0/mlp/inputs_mean')] == [10, 20]

  state = _restored_state(work, job, argv, 20)
  moving = state['non_trainable']['layer_0']['mlp']['moving_mean']
  np.testing.assert_array_equal(np.asarray(moving), np.full(moving.shape, 20.0))  # +1 per step, saved
  assert 'moving_mean' not in str(list(state['opt_state']))  # the optimizer never sees it


def test_docs_layer_resumes_with_the_same_random_stream_and_variables(example, capsys):
  work, job, argv, _ = example
  straight = _records(job)[-1]
  split = str(work / 'split')
  base = [a for a in argv]
  base[base.index('--job-log-dir') + 1] = split
  cwd = os.getcwd()
  os.chdir(work)
  try:
    code, _, err = pax_main([*base, '--set', 'NUM_TRAIN_STEPS=10'], capsys)
    assert code == 0, err
    code, out, err = pax_main([*base], capsys)
    assert code == 0, err
  finally:
    os.chdir(cwd)
  assert 'Resumed from step 10' in out
  resumed = _records(split)[-1]
  assert resumed['step'] == 20
  # The layer adds next_prng_key() noise: equal losses need the same keys after the resume.
  assert resumed['loss'] == pytest.approx(straight['loss'], rel=1e-6)
  state = _restored_state(work, split, base, 20)
  np.testing.assert_array_equal(np.asarray(state['non_trainable']['layer_1']['mlp']['moving_mean']), 20.0)
