"""The shared restore path (train, eval, decode, conversion) and the tokenizer kept in the job dir."""

import os

import numpy as np
import pytest

from conftest import pax_main

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64',
        '--set', 'NUM_HEADS=4', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'MAX_SEQ_LEN=16',
        '--set', 'VOCAB_SIZE=64', '--set', 'NUM_LAYERS=2']


def _overrides(args):
  return [args[i + 1] for i, a in enumerate(args) if a == '--set']


def _host(tree):
  import jax
  return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


@pytest.fixture(scope='module')
def saved_by_train(tmp_path_factory):
  """A run trained 4 steps, saving at 2 and 4; (job dir, {step: the state as the trainer handed it
  to the checkpointer, copied to the host at that moment}): what every restore is judged against."""
  from paxcli.jobdir import checkpoint as ckpt
  job = str(tmp_path_factory.mktemp('restore') / 'job')
  saved = {}
  save = ckpt.Checkpointer.save

  def keep_and_save(self, step, state, meta, **kwargs):
    saved[step] = _host(state)
    return save(self, step, state, meta, **kwargs)

  from paxcli.cli.app import main
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(ckpt.Checkpointer, 'save', keep_and_save)
    try:
      main(['train', *TINY, '--job-log-dir', job, '--set', 'task.train.num_train_steps=4',
            '--set', 'task.train.save_interval_steps=2'])
    except SystemExit as e:
      assert not e.code
  assert sorted(saved) == [2, 4]
  return job, saved


@pytest.fixture(scope='module')
def trained(saved_by_train):
  return saved_by_train[0]


def _assert_trees_equal(got, want):
  import jax
  paths_got = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)]
  paths_want = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)]
  assert paths_got == paths_want
  for name, a, b in zip(paths_want, jax.tree.leaves(got), jax.tree.leaves(want)):
    a = np.asarray(jax.device_get(a))
    assert a.dtype == b.dtype, name
    np.testing.assert_array_equal(a, b, err_msg=name)


def _setup(extra=()):
  from paxcli import config
  from paxcli.runtime import engine
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', _overrides(TINY) + list(extra))
  return resolved, engine.build(resolved)


def test_choose_step_latest_chosen_and_errors(trained, tmp_path):
  from paxcli.jobdir import restore
  from paxcli.errors import UserError
  assert restore.choose_step(trained) == 4
  assert restore.choose_step(trained, 2) == 2
  with pytest.raises(UserError, match=r'No complete checkpoint at step 3 .*complete steps: 2, 4'):
    restore.choose_step(trained, 3)
  with pytest.raises(UserError, match='No complete checkpoint in .*--no-checkpoint to decode'):
    restore.choose_step(str(tmp_path / 'none'), purpose='decode')


def test_restore_gives_the_values_saved_and_params_only_skips_the_optimizer(saved_by_train):
  """Both restores judged against the arrays the trainer saved (kept at save time)."""
  import jax

  from paxcli.jobdir import restore
  trained, saved = saved_by_train
  resolved, setup = _setup()
  full = restore.restore(setup, trained, 4)
  params_only = restore.restore(setup, trained, 4, params_only=True)
  assert set(full.state) == {'step', 'params', 'opt_state'} and set(params_only.state) == {'step', 'params'}
  assert int(full.state['step']) == 4 and full.meta['step'] == 4 and int(saved[4]['step']) == 4
  _assert_trees_equal(full.state, saved[4])
  _assert_trees_equal(params_only.state, {'step': saved[4]['step'], 'params': saved[4]['params']})
  # The two saves differ (training moved the weights), so equality above is no accident.
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(saved[2]['params']),
                                                       jax.tree.leaves(saved[4]['params'])))
  # Arrays land on the experiment's shardings.
  for leaf, want in zip(jax.tree.leaves(params_only.state['params']),
                        jax.tree.leaves(setup.state_shardings['params'])):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)


def test_restore_onto_another_mesh_reshards(saved_by_train):
  import jax

  from paxcli.jobdir import restore
  trained, saved = saved_by_train
  _, other = _setup(['ICI_MESH_SHAPE=[1,2,4]'])
  b = restore.restore(other, trained, 2, params_only=True).state['params']
  _assert_trees_equal(b, saved[2]['params'])
  for y, s in zip(jax.tree.leaves(b), jax.tree.leaves(other.state_shardings['params'])):
    assert y.sharding.is_equivalent_to(s, y.ndim)


def test_other_shapes_are_refused_with_the_differences(trained):
  from paxcli.jobdir import restore
  from paxcli.errors import UserError
  resolved, setup = _setup(['MODEL_DIMS=64'])
  flat = {k: repr(v) for k, v in resolved.flat().items()}
  with pytest.raises(UserError, match=r'(?s)Cannot evaluate the checkpoint at step 4.*MODEL_DIMS: checkpoint 32'):
    restore.restore(setup, trained, 4, params_only=True, flat_now=flat, action='evaluate')


def test_train_resumes_a_params_only_checkpoint_with_fresh_optimizer(saved_by_train, tmp_path, capsys, monkeypatch):
  """A params-only checkpoint (what conversion writes) fine-tunes: the state the trainer resumes with
  holds the saved params and a fresh optimizer state (every moment and count zero), by value."""
  import jax

  from paxcli.jobdir import checkpoint as ckpt
  from paxcli.jobdir import restore
  trained, saved = saved_by_train
  _, setup = _setup()
  got = restore.restore(setup, trained, 4, params_only=True)
  job = str(tmp_path / 'params_only')
  writer = ckpt.Checkpointer(os.path.join(job, 'checkpoints'), max_to_keep=0)
  writer.save(4, got.state, {**got.meta, 'state_shapes': {k: v for k, v in got.meta['state_shapes'].items()
                                                          if not k.startswith('opt_state/')}})
  writer.close()
  assert restore.saved_state_keys(job, 4) == {'step', 'params'}
  resumed_with = []
  real_restore = restore.restore

  def keep(*args, **kwargs):
    result = real_restore(*args, **kwargs)
    resumed_with.append(_host(result.state))
    return result
  monkeypatch.setattr(restore, 'restore', keep)
  code, out, err = pax_main(['train', *TINY, '--job-log-dir', job, '--set', 'task.train.num_train_steps=6',
                             '--set', 'task.train.save_interval_steps=2'], capsys)
  assert code == 0, err
  assert 'holds parameters only: the optimizer state starts fresh' in out and 'Resumed from step 4' in out
  assert len(resumed_with) == 1
  state = resumed_with[0]
  assert int(state['step']) == 4
  _assert_trees_equal(state['params'], saved[4]['params'])
  fresh = jax.tree.leaves(state['opt_state'])
  trained_opt = jax.tree.leaves(saved[4]['opt_state'])
  assert [x.shape for x in fresh] == [x.shape for x in trained_opt] and len(fresh) > 2 * len(
      jax.tree.leaves(saved[4]['params']))  # Adam's two moments per weight, and counts
  assert all(not np.any(x) for x in fresh)  # zero moments, zero counts: a fresh init
  assert any(np.any(x) for x in trained_opt)  # unlike the trained run's
  assert restore.saved_state_keys(job, 6) == {'step', 'params', 'opt_state'}


def test_train_keeps_the_tokenizer_in_the_job_dir(tmp_path, capsys):
  from paxcli.jobdir import layout, tokenizer
  job = str(tmp_path / 'default')
  code, out, err = pax_main(['train', '--job-log-dir', job, '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
                             '--set', 'HIDDEN_DIMS=64', '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1',
                             '--set', 'NUM_TRAIN_STEPS=1', '--set', 'EVAL_INTERVAL_STEPS=0'], capsys)
  assert code == 0, err
  tok = tokenizer.load(job)
  assert tok is not None and tok.path == layout.tokenizer(job)
  assert tok.vocab_size == 2048 and tok.eos_id == 1
  text = 'Return the number of items.'
  assert tok.decode(tok.encode(text)) == text
  # A run on the synthetic input has no tokenizer.
  assert tokenizer.load(str(tmp_path / 'nothing')) is None
