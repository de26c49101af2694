"""A job directory and a fast checkpoint tier are received data (issue 37, 3 and 4).

The tier works only in a directory it made and marked, deletes only the steps its mark lists,
follows no symlink, and is refused where it would overlap the job; every file a command reads
from a job or a tier is checked to stay inside it (jobdir/layout.py, files.member) and to be a
regular file. Each case runs `pax` and checks that nothing outside was read, written or lost.
"""

import json
import os
import shutil

import pytest

from conftest import pax_main, run_pax

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1']
STEPS = ['--set', 'task.train.num_train_steps=4', '--set', 'task.train.save_interval_steps=2']
TIER = ['--set', 'LOCAL_CHECKPOINT_EVERY=2']


def _error_line(code, err):
  lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith('WARNING')]
  assert code == 2 and 'Traceback' not in err, err[-3000:]
  return lines[-1]


def snapshot(root) -> dict:
  """Every entry under `root`: a file's bytes, a link's target, 'dir' for a directory (links not entered)."""
  out = {}
  for parent, dirs, names in os.walk(root):
    for name in dirs + names:
      path = os.path.join(parent, name)
      rel = os.path.relpath(path, root)
      out[rel] = ('-> ' + os.readlink(path) if os.path.islink(path) else 'dir' if os.path.isdir(path)
                  else open(path, 'rb').read() if os.path.isfile(path) else 'not a file')   # a FIFO is not opened
  return out


def assert_kept(before: dict, root) -> None:
  """Nothing of `before` (a snapshot of `root`) is lost or changed; a log a start appends to (the record of
  invocations, the goodput ledger) may have grown."""
  after = snapshot(root)
  for rel, was in before.items():
    assert rel in after, f'{rel} is gone'
    now = after[rel]
    assert now == was or (isinstance(was, bytes) and isinstance(now, bytes) and now.startswith(was)
                          and rel in ('invocations.txt', 'goodput/process_0.jsonl')), rel


def user_files(root) -> dict:
  """A directory of someone's files, with numbered directories the tier would take for its steps."""
  for rel, text in (('7/weights.bin', 'precious'), ('123/notes.txt', 'mine'), ('readme.txt', 'keep')):
    os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
    with open(os.path.join(root, rel), 'w') as f:
      f.write(text)
  return snapshot(root)


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A finished 4-step job (checkpoints 2 and 4) trained with a fast tier, which it cleared."""
  root = tmp_path_factory.mktemp('trained')
  job = str(root / 'job')
  result = run_pax('train', *TINY, *STEPS, *TIER, '--set', f'LOCAL_CHECKPOINT_DIR={root}/tier', '--job-log-dir', job)
  assert result.returncode == 0, result.stderr[-3000:]
  assert os.listdir(root / 'tier') == []   # cleared: only what it wrote, which was everything there
  return job


def _copy(trained, tmp_path, where='job') -> str:
  job = str(tmp_path / where)
  shutil.copytree(trained, job, symlinks=True)
  return job


def _train(capsys, job, tier, *more):
  """`pax train` resuming the 4-step job to step 6 (a finished job opens no tier), with the fast tier at `tier`."""
  return pax_main(['train', *TINY, *STEPS, *TIER, '--set', 'task.train.num_train_steps=6',
                   '--set', f'LOCAL_CHECKPOINT_DIR={tier}', *more, '--job-log-dir', job], capsys)


def _job_id(job) -> str:
  with open(os.path.join(job, 'goodput', 'job.json')) as f:
    return json.load(f)['id']


# ---- 3: the fast tier -------------------------------------------------------------------------------


@pytest.mark.parametrize('link', ['process_0-of-1 out', 'process_0-of-1 in', 'owner.json out', 'owner.json in'])
def test_a_link_at_the_tier_root_is_refused_and_its_target_untouched(link, trained, tmp_path, capsys):
  job = _copy(trained, tmp_path)
  tier, outside = tmp_path / 'tier', tmp_path / 'user'
  tier.mkdir()
  name, where = link.split()
  if where == 'out':
    target = str(outside)
    before = user_files(outside)
  else:   # a link to a place inside the tier: still a link, still refused
    target = str(tier / 'elsewhere')
    before = user_files(target)
  if name == 'owner.json':   # a record naming this very job, so that only the link is wrong
    record = os.path.join(target, 'owner.json')
    with open(record, 'w') as f:
      json.dump({'job_dir': job, 'job_id': 'x'}, f)
    before = snapshot(target)
    target = record
  os.symlink(target, tier / name)
  tier_before, job_before = snapshot(tier), snapshot(job)
  code, out, err = _train(capsys, job, tier)
  line = _error_line(code, err)
  assert name in line and ('symlink' in line or 'outside the directory' in line), line
  assert snapshot(os.path.dirname(target) if name == 'owner.json' else target) == before
  assert snapshot(tier) == tier_before
  assert_kept(job_before, job)
  assert sorted(os.listdir(os.path.join(job, 'checkpoints'))) == ['2', '4']   # refused before any step


@pytest.mark.parametrize('place', ['job at tier/process_0-of-1', 'tier is the job', 'tier inside the job',
                                   'tier is the checkpoints', 'tier inside the checkpoints', 'tier holds the job'])
def test_a_tier_overlapping_the_job_is_refused_and_the_job_kept(place, trained, tmp_path, capsys):
  """The issue's case first: a job placed at <tier>/process_0-of-1 was deleted whole at the end of a run."""
  where = {'job at tier/process_0-of-1': 'tier/process_0-of-1', 'tier holds the job': 'tier/runs/a'}.get(place, 'job')
  os.makedirs(tmp_path / os.path.dirname(where), exist_ok=True)
  job = _copy(trained, tmp_path, where)
  tier = {'tier is the job': job, 'tier inside the job': f'{job}/local', 'tier is the checkpoints': f'{job}/checkpoints',
          'tier inside the checkpoints': f'{job}/checkpoints/fast'}.get(place, str(tmp_path / 'tier'))
  before = snapshot(job)
  code, out, err = _train(capsys, job, tier)
  line = _error_line(code, err)
  assert 'LOCAL_CHECKPOINT_DIR=' in line and ('the job directory' in line or "the job's checkpoints" in line), line
  assert 'must be one of its own outside the job' in line
  assert_kept(before, job)
  assert sorted(os.listdir(os.path.join(job, 'checkpoints'))) == ['2', '4']


def _marked(job, process_dir, **changes):
  os.makedirs(process_dir, exist_ok=True)
  mark = {'job_dir': job, 'job_id': _job_id(job), 'made': True, 'steps': [], **changes}
  with open(os.path.join(process_dir, 'paxcli-tier.json'), 'w') as f:
    json.dump(mark, f)


@pytest.mark.parametrize('case, phrase', [
    ('user files, no mark', 'holds files the fast checkpoint tier did not make'),
    ('an unlisted step', 'the tier did not write it'),
    ('a link inside a step', 'is a symlink'),
    ('marked for another job', 'another job (/elsewhere/job)'),
    ('a mark that is no mark', 'is not a fast tier mark paxcli wrote'),
    ('a file where its directory goes', 'is a regular file, where the fast checkpoint tier keeps'),
    ('owner.json a FIFO', 'is a FIFO (named pipe), not a regular file'),
])
def test_a_tier_directory_the_tier_did_not_make_is_refused_and_kept(case, phrase, trained, tmp_path, capsys):
  job = _copy(trained, tmp_path)
  tier = tmp_path / 'tier'
  process = tier / 'process_0-of-1'
  tier.mkdir()
  outside = user_files(tmp_path / 'user')
  if case == 'user files, no mark':
    user_files(process)
  elif case == 'an unlisted step':
    _marked(job, process, steps=[5])
    user_files(process)   # its 7/ and 123/ were never written by the tier
  elif case == 'a link inside a step':
    _marked(job, process, steps=[5])
    os.makedirs(process / '5' / 'state')
    os.symlink(tmp_path / 'user', process / '5' / 'state' / 'd')
  elif case == 'marked for another job':
    _marked(job, process, job_dir='/elsewhere/job', job_id='0123')
  elif case == 'a mark that is no mark':
    _marked(job, process, steps='all of them')
  elif case == 'a file where its directory goes':
    process.write_text('mine')
  elif case == 'owner.json a FIFO':
    os.mkfifo(tier / 'owner.json')
  before = snapshot(tier)
  code, out, err = _train(capsys, job, tier)
  line = _error_line(code, err)
  assert phrase in line, line
  assert snapshot(tier) == before and snapshot(tmp_path / 'user') == outside


def test_a_finished_run_clears_only_what_its_tier_wrote(trained, tmp_path, capsys):
  """A tier root shared with someone's files, and a process directory that was there (empty): the run
  trains, saves fast steps, and at the end removes its steps, its marks and its owner record only."""
  job = _copy(trained, tmp_path)
  tier = tmp_path / 'tier'
  others = user_files(tier)
  (tier / 'process_0-of-1').mkdir()   # empty: taken and marked, but not the tier's to remove
  code, out, err = _train(capsys, job, tier, '--set', 'task.train.num_train_steps=8',
                          '--set', 'task.train.save_interval_steps=4')
  assert code == 0, err[-3000:]
  assert 'Resumed from step 4' in out and 'Fast checkpoint tier: every 2 steps' in out
  assert snapshot(tier) == {**others, 'process_0-of-1': 'dir'}


def test_the_tier_keeps_what_was_put_in_its_directory_during_a_run(tmp_path):
  """A file and a link put into the tier's own directory while it runs: `clear` removes the steps it wrote
  and leaves them (and the directory holding them)."""
  from paxcli import config
  from paxcli.jobdir import fast_tier, restore
  from paxcli.runtime import engine
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2',
                                                         'DIMS_PER_HEAD=16', 'VOCAB_SIZE=64', 'MAX_SEQ_LEN=16'])
  setup = engine.build(resolved)
  state = engine.init_state(setup, 0)
  tier = fast_tier.open_tier(fast_tier.Settings(str(tmp_path / 'tier'), every=1, keep=2), str(tmp_path / 'job'),
                             'job1', setup, log=print)
  shapes = engine.shape_signature(setup.abstract_state)
  for step in (1, 2, 3):
    tier.save(step, state, {'step': step, 'state_shapes': shapes, 'checksums': restore.checksums(state)})
  tier.wait()
  assert tier.steps() == [2, 3]
  tier.discard_after(3)   # rewrites the mark: the steps on disk (orbax removed step 1)
  with open(os.path.join(tier.directory, 'paxcli-tier.json')) as f:
    assert json.load(f)['steps'] == [2, 3]
  outside = user_files(tmp_path / 'user')
  with open(os.path.join(tier.directory, 'mine.txt'), 'w') as f:
    f.write('put here by hand')
  os.symlink(tmp_path / 'user', os.path.join(tier.directory, '9'))
  tier.clear()
  assert sorted(os.listdir(tier.directory)) == ['9', 'mine.txt']
  assert snapshot(tmp_path / 'user') == outside
  assert sorted(os.listdir(tmp_path / 'tier')) == ['process_0-of-1']   # its owner record gone with its mark


@pytest.mark.parametrize('tier, phrase', [('gs://bucket/tier', "each host's own disk"),
                                          ('gs:/bucket/tier', 'did you mean gs://bucket/tier')])
def test_a_bucket_path_for_the_tier_is_refused(tier, phrase, trained, tmp_path, capsys, monkeypatch):
  job = _copy(trained, tmp_path)
  monkeypatch.chdir(tmp_path)
  code, out, err = _train(capsys, job, tier)
  line = _error_line(code, err)
  assert f'LOCAL_CHECKPOINT_DIR={tier}' in line and phrase in line, line
  assert not os.path.exists(tmp_path / 'gs:')   # never a local directory named after the scheme


# ---- 4: reads stay inside ----------------------------------------------------------------------------


def _link_out(job, rel, tmp_path) -> str:
  """Moves `rel` of the job outside and leaves a symlink to it in its place; returns where it went."""
  target = str(tmp_path / 'outside' / rel.replace('/', '_'))
  os.makedirs(os.path.dirname(target), exist_ok=True)
  shutil.move(os.path.join(job, rel), target)
  os.symlink(target, os.path.join(job, rel))
  return target


def _state_file(job) -> str:
  """A file of step 4's arrays that only orbax (tensorstore) opens: paxcli never names it."""
  data = os.path.join(job, 'checkpoints', '4', 'state', 'ocdbt.process_0', 'd')
  return os.path.relpath(os.path.join(data, sorted(os.listdir(data))[0]), job)


@pytest.mark.parametrize('command', ['goodput', 'eval', 'train'])
@pytest.mark.parametrize('rel', ['goodput/process_0.jsonl', 'goodput', 'experiment.jsonl', 'format.json', 'checkpoints',
                                 'checkpoints/4', 'checkpoints/4/meta/metadata', 'state file', 'train_metrics.jsonl',
                                 'invocations.txt'])
def test_a_part_of_a_job_linked_out_is_refused_naming_it(command, rel, trained, tmp_path, capsys):
  """Each reader meets the one member check (layout): `pax goodput` its ledgers, `pax eval` the record, the
  format and the checkpoint, `pax train` (a resume) all of them and the metrics it trims."""
  readers = {'goodput': {'goodput/process_0.jsonl', 'goodput'},
             'eval': {'experiment.jsonl', 'checkpoints', 'checkpoints/4', 'checkpoints/4/meta/metadata', 'state file'}}
  if command in readers and rel not in readers[command]:
    pytest.skip(f'pax {command} does not read {rel}')
  job = _copy(trained, tmp_path)
  rel = _state_file(job) if rel == 'state file' else rel
  target = _link_out(job, rel, tmp_path)
  outside = snapshot(os.path.dirname(target))
  args = {'goodput': ['goodput', job], 'eval': ['eval', *TINY, '--job-log-dir', job],
          'train': ['train', *TINY, *STEPS, '--set', 'task.train.num_train_steps=6', '--job-log-dir', job]}[command]
  code, out, err = pax_main(args, capsys)
  line = _error_line(code, err)
  assert os.path.basename(rel) in line and 'outside the directory' in line and 'a symlink' in line, line
  assert snapshot(os.path.dirname(target)) == outside


def test_a_fifo_or_a_link_as_the_lock_or_a_ledger_is_one_line_without_waiting(trained, tmp_path):
  """A FIFO would block a reader forever and a link would be written through: both are refused, in a fresh
  process (a hang fails the test by its timeout), and the file a link names keeps its bytes."""
  job = _copy(trained, tmp_path)
  os.remove(os.path.join(job, 'goodput', 'process_0.jsonl'))
  os.mkfifo(os.path.join(job, 'goodput', 'process_0.jsonl'))
  result = run_pax('goodput', job, timeout=120)
  assert result.returncode == 2 and 'is not a file' in result.stderr and 'Traceback' not in result.stderr
  os.mkfifo(os.path.join(job, 'train.lock'))
  result = run_pax('eval', *TINY, '--job-log-dir', job, '--follow', '--timeout', '1', timeout=300)
  assert 'Traceback' not in result.stderr, result.stderr[-3000:]
  result = run_pax('train', *TINY, *STEPS, '--job-log-dir', job, timeout=300)
  assert result.returncode == 2 and 'train.lock is a FIFO (named pipe)' in result.stderr
  os.remove(os.path.join(job, 'train.lock'))
  config = os.path.join(job, 'config.txt')
  kept = open(config, 'rb').read()
  os.symlink(config, os.path.join(job, 'train.lock'))   # a link inside the job: never written through
  result = run_pax('train', *TINY, *STEPS, '--job-log-dir', job, timeout=300)
  assert result.returncode == 2 and 'train.lock is a symlink' in result.stderr, result.stderr[-2000:]
  assert open(config, 'rb').read() == kept
