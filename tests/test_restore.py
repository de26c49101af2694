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


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  job = str(tmp_path_factory.mktemp('restore') / 'job')
  from paxcli.cli.app import main
  try:
    main(['train', *TINY, '--job-log-dir', job, '--set', 'task.train.num_train_steps=4',
          '--set', 'task.train.save_interval_steps=2'])
  except SystemExit as e:
    assert not e.code
  return job


def _setup(extra=()):
  from paxcli import config, engine
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', _overrides(TINY) + list(extra))
  return resolved, engine.build(resolved)


def test_choose_step_latest_chosen_and_errors(trained, tmp_path):
  from paxcli import restore
  from paxcli.errors import UserError
  assert restore.choose_step(trained) == 4
  assert restore.choose_step(trained, 2) == 2
  with pytest.raises(UserError, match=r'No complete checkpoint at step 3 .*complete steps: 2, 4'):
    restore.choose_step(trained, 3)
  with pytest.raises(UserError, match='No complete checkpoint in .*--no-checkpoint to decode'):
    restore.choose_step(str(tmp_path / 'none'), purpose='decode')


def test_params_only_equals_full_state_and_skips_the_optimizer(trained):
  from paxcli import restore
  resolved, setup = _setup()
  full = restore.restore(setup, trained, 4)
  params_only = restore.restore(setup, trained, 4, params_only=True)
  assert set(full.state) == {'step', 'params', 'opt_state'} and set(params_only.state) == {'step', 'params'}
  assert int(full.state['step']) == 4 and full.meta['step'] == 4
  import jax
  for a, b in zip(jax.tree.leaves(full.state['params']), jax.tree.leaves(params_only.state['params'])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Arrays land on the experiment's shardings.
  for leaf, want in zip(jax.tree.leaves(params_only.state['params']),
                        jax.tree.leaves(setup.state_shardings['params'])):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)


def test_restore_onto_another_mesh_reshards(trained):
  import jax

  from paxcli import restore
  _, setup = _setup()
  _, other = _setup(['ICI_MESH_SHAPE=[1,2,4]'])
  a = restore.restore(setup, trained, 2, params_only=True).state['params']
  b = restore.restore(other, trained, 2, params_only=True).state['params']
  for x, y, s in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(other.state_shardings['params'])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert y.sharding.is_equivalent_to(s, y.ndim)


def test_other_shapes_are_refused_with_the_differences(trained):
  from paxcli import restore
  from paxcli.errors import UserError
  resolved, setup = _setup(['MODEL_DIMS=64'])
  flat = {k: repr(v) for k, v in resolved.flat().items()}
  with pytest.raises(UserError, match=r'(?s)Cannot evaluate the checkpoint at step 4.*MODEL_DIMS: checkpoint 32'):
    restore.restore(setup, trained, 4, params_only=True, flat_now=flat, action='evaluate')


def test_train_resumes_a_params_only_checkpoint_with_fresh_optimizer(trained, tmp_path, capsys):
  """A params-only checkpoint (what conversion writes) fine-tunes: params kept, optimizer fresh."""
  import jax

  from paxcli import checkpoint as ckpt
  from paxcli import restore
  _, setup = _setup()
  got = restore.restore(setup, trained, 4, params_only=True)
  job = str(tmp_path / 'params_only')
  writer = ckpt.Checkpointer(os.path.join(job, 'checkpoints'), max_to_keep=0)
  writer.save(4, got.state, {**got.meta, 'state_shapes': {k: v for k, v in got.meta['state_shapes'].items()
                                                          if not k.startswith('opt_state/')}})
  writer.close()
  assert restore.saved_state_keys(job, 4) == {'step', 'params'}
  code, out, err = pax_main(['train', *TINY, '--job-log-dir', job, '--set', 'task.train.num_train_steps=6',
                             '--set', 'task.train.save_interval_steps=2'], capsys)
  assert code == 0, err
  assert 'holds parameters only: the optimizer state starts fresh' in out and 'Resumed from step 4' in out
  assert restore.saved_state_keys(job, 6) == {'step', 'params', 'opt_state'}
  del jax


def test_train_keeps_the_tokenizer_in_the_job_dir(tmp_path, capsys):
  from paxcli import tokenizer
  job = str(tmp_path / 'default')
  code, out, err = pax_main(['train', '--job-log-dir', job, '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
                             '--set', 'HIDDEN_DIMS=64', '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1',
                             '--set', 'NUM_TRAIN_STEPS=1', '--set', 'EVAL_INTERVAL_STEPS=0'], capsys)
  assert code == 0, err
  tok = tokenizer.load(job)
  assert tok is not None and tok.path == tokenizer.job_dir_file(job)
  assert tok.vocab_size == 2048 and tok.eos_id == 1
  text = 'Return the number of items.'
  assert tok.decode(tok.encode(text)) == text
  # A run on the synthetic input has no tokenizer.
  assert tokenizer.load(str(tmp_path / 'nothing')) is None
