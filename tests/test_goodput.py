"""Issue 31: the goodput ledger, `pax goodput`, and the fast checkpoint tier's checks.

The stopwatch and the ledger's account are checked on a clock the test moves; a real `pax train`
(a fresh process, timed from outside) checks that the account adds up to the wall time; the fast
tier saves and restores real arrays with orbax. Faults across processes and restarts are in
test_goodput_faults.py (slow).
"""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import pax_main
from paxcli.errors import UserError
from paxcli.jobdir import layout
from paxcli.jobdir import ledger
from paxcli.loops.hooks import STEP, Chrono, Stopwatch

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32',
        '--set', 'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
        '--set', 'MAX_SEQ_LEN=16', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'task.train.summary_interval_steps=2']


class Clock:
  def __init__(self, t=1000.0):
    self.t = t

  def __call__(self):
    return self.t

  def tick(self, seconds):
    self.t += seconds


# ---- the stopwatch ------------------------------------------------------------------------------------


def test_stopwatch_puts_every_second_in_one_category_and_redone_steps_apart():
  clock = Clock()
  sw = Stopwatch(started=clock.t - 2.0, furthest_before=1, now=clock)   # 2 s of start-up already
  sw.switch(STEP)
  clock.tick(1.0)                       # step 1's work: at or below the furthest step reached before
  with sw.phase('checkpoint'):
    clock.tick(0.25)
  sw.step_done(1)
  with sw.phase('data'):
    clock.tick(0.5)
  clock.tick(3.0)                       # step 2's work: new
  sw.step_done(2)
  with sw.phase('eval'):
    clock.tick(4.0)
  sw.switch('shutdown')
  clock.tick(0.125)
  snap = sw.finish()
  assert snap['closed'] == {'productive': 3.0, 'recomputed': 1.0, 'startup': 2.0, 'compile': 0.0, 'data': 0.5,
                            'checkpoint': 0.25, 'eval': 4.0, 'shutdown': 0.125}
  assert sum(snap['closed'].values()) == clock.t - sw.started
  assert snap['steps'] == {'productive': 1, 'recomputed': 1} and snap['step'] == 2
  with pytest.raises(ValueError, match='unknown goodput category'):
    sw.switch('coffee')


def test_stopwatch_snapshot_keeps_the_open_interval_apart():
  clock = Clock()
  sw = Stopwatch(started=clock.t, now=clock)
  sw.switch(STEP)
  clock.tick(1.0)
  sw.switch(STEP)                       # the step's work so far, not yet done
  clock.tick(0.5)
  snap = sw.snapshot()
  assert snap['closed']['productive'] == 1.0 and snap['open'] == ['productive', clock.t - 0.5]
  assert sum(snap['closed'].values()) + (snap['t'] - snap['open'][1]) == clock.t - sw.started


def test_compilation_moves_to_compile_except_in_an_eval():
  sw = Stopwatch()
  with sw, Chrono(0, 10, sw) as chrono:
    jax.jit(lambda x: jnp_sin(x) * 3.0)(np.ones(7, np.float32)).block_until_ready()
    sw.step_done(1)
    with chrono.paused():
      jax.jit(lambda x: jnp_sin(x) * 5.0 + 1.0)(np.ones(9, np.float32)).block_until_ready()
  snap = sw.finish()
  assert snap['closed']['compile'] > 0 and snap['closed']['eval'] > 0
  assert sum(snap['closed'].values()) == pytest.approx(snap['t'] - sw.started, abs=1e-9)


def jnp_sin(x):
  import jax.numpy as jnp
  return jnp.sin(x)


# ---- the account --------------------------------------------------------------------------------------


def _line(path, **record):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'a') as f:
    f.write(json.dumps(record) + '\n')


def _closed(**seconds):
  return {k: float(seconds.get(k, 0.0)) for k in ledger.PROCESS_CATEGORIES}


def test_account_adds_up_across_a_kill_a_launcher_and_a_later_run(tmp_path):
  job = str(tmp_path / 'job')
  p0, launch = layout.goodput_ledger(job, 0), layout.launch_ledger(job)
  _line(launch, kind='launch', id='L1', t=100.0)
  # Attempt 0: 5 s of start-up and 10 s of steps up to step 12; killed at 118 (the open interval, from
  # 116, is lost with it); its last progress line was at 117.
  _line(p0, kind='start', inc='a', t=101.0, launch='L1', attempt=0)
  _line(p0, kind='progress', inc='a', t=117.0, closed=_closed(startup=5.0, productive=10.0), open=['productive', 116.0],
        step=12, steps={'productive': 12, 'recomputed': 0})
  _line(launch, kind='failure', id='L1', t=119.0, attempt=0, process=1, reason='was killed by SIGKILL (exit code -9)',
        steps={'0': 13, '1': 13})
  # Attempt 1 starts at 121, resumes from fast step 10, recomputes 11-13 and finishes at 140.
  _line(p0, kind='start', inc='b', t=121.0, launch='L1', attempt=1)
  _line(p0, kind='resume', inc='b', t=125.0, step=10, tier='fast')
  _line(p0, kind='end', inc='b', t=140.0, closed=_closed(startup=4.0, recomputed=3.0, productive=11.0, compile=1.0),
        step=24, steps={'productive': 11, 'recomputed': 3}, status=0)
  _line(p0, kind='progress', inc='b', t=139.0, closed=_closed(productive=99.0), open=['productive', 138.0], step=23,
        steps={})   # a progress line written after the end (a bucket's rewrite raced it): never counted
  _line(launch, kind='end', id='L1', t=140.5, code=0)
  # Process 1's run of attempt 1 started a moment before process 0's: not an earlier run (its steps are not 'reached').
  p1 = layout.goodput_ledger(job, 1)
  _line(p1, kind='start', inc='b1', t=120.9, launch='L1', attempt=1)
  _line(p1, kind='end', inc='b1', t=140.1, closed=_closed(productive=19.2), step=24, steps={'productive': 24}, status=0)
  # A day later, by hand: the idle day is nobody's run; this one is killed with a cut last line.
  _line(p0, kind='start', inc='c', t=90000.0)
  _line(p0, kind='progress', inc='c', t=90004.0, closed=_closed(startup=3.0), open=['productive', 90003.0], step=24,
        steps={})
  with open(p0, 'a') as f:
    f.write('{"kind":"progress","inc":"c","t":900')
  account = ledger.summarize(job)
  s = account['seconds']
  assert s['startup'] == 1.0 + 5.0 + 4.0 + 3.0       # the launcher's own second, then each start
  assert s['restart'] == 121.0 - 116.0                # from the last progress of the killed run to the next start
  assert s['shutdown'] == 0.5 and s['recomputed'] == 3.0 and s['productive'] == 21.0
  assert account['wall_seconds'] == pytest.approx(sum(s.values()))
  assert account['wall_seconds'] == pytest.approx((140.5 - 100.0) + (90003.0 - 90000.0))
  assert account['lines_skipped'] == 1 and account['incarnations'] == 3
  (restart,) = account['restarts']
  assert restart['reason'] == 'was killed by SIGKILL (exit code -9)' and restart['gap_seconds'] == 5.0
  assert (restart['reached_step'], restart['resumed_step'], restart['tier'], restart['redone_steps']) == (13, 10, 'fast', 3)
  assert ledger.furthest_step(*ledger.read(job)[:2]) == 24


def test_a_pax_process_is_timed_from_its_own_start_and_an_in_process_call_from_main(monkeypatch):
  """A `pax` process's interpreter start-up and imports are its start-up, however long a loaded machine
  makes them (here 100 s); pax called in a long-lived process (a notebook, a test) starts at main()."""
  monkeypatch.setattr(ledger, '_command_started', None)
  monkeypatch.setattr(ledger, 'process_started_at', lambda: time.time() - 100.0)
  ledger.mark_command_start(whole_process=True)
  assert time.time() - ledger.command_started() == pytest.approx(100.0, abs=5.0)
  ledger.mark_command_start(whole_process=False)
  assert time.time() - ledger.command_started() < 5.0


def test_pax_goodput_without_a_ledger_is_one_line(tmp_path, capsys):
  code, _, err = pax_main(['goodput', str(tmp_path)], capsys)
  assert code == 2 and 'No goodput ledger' in err and 'Traceback' not in err
  code, _, err = pax_main(['goodput', str(tmp_path / 'missing')], capsys)
  assert code == 2 and 'is not a directory' in err


def test_a_real_run_accounts_for_its_wall_time(tmp_path, capsys):
  """`pax launch -n 1 -- train`, timed from outside: the ledger's figures add up to that wall time
  (the launcher records its own start and end, so the trainer's interpreter exit is inside too)."""
  job = str(tmp_path / 'job')
  cmd = [sys.executable, '-m', 'paxcli.cli.app', 'launch', '-n', '1', '--', 'train', *TINY,
         '--set', 'task.train.num_train_steps=6', '--set', 'task.train.save_interval_steps=3',
         '--set', 'task.train.eval_interval_steps=3', '--job-log-dir', job]
  began = time.time()
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  wall = time.time() - began
  assert result.returncode == 0, result.stderr[-3000:]
  assert '[p0] Goodput ' in result.stdout and f'pax goodput {job}' in result.stdout
  code, out, err = pax_main(['goodput', job, '--json'], capsys)
  assert code == 0, err
  account = json.loads(out)
  seconds = account['seconds']
  assert sum(seconds.values()) == pytest.approx(account['wall_seconds'], rel=1e-9)
  # Within 1%, give or take the launcher's own interpreter exit after its last line (tenths of a second on a
  # loaded machine, a share of this short run); the long fault test (test_goodput_faults.py) checks 1% alone.
  assert account['wall_seconds'] == pytest.approx(wall, rel=0.01, abs=0.3), (account['wall_seconds'], wall)
  assert account['wall_seconds'] <= wall
  assert seconds['productive'] > 0 and seconds['startup'] > 0 and seconds['compile'] > 0
  assert seconds['checkpoint'] > 0 and seconds['eval'] > 0 and seconds['shutdown'] > 0 and seconds['restart'] == 0
  assert account['steps'] == {'productive': 6, 'recomputed': 0}
  code, out, _ = pax_main(['goodput', job], capsys)
  assert code == 0 and 'productive steps' in out and 'checkpoint stalls' in out and 'wall time' in out
  # TensorBoard carries it over time: an events file under summaries/goodput.
  assert any(n.startswith('events.out.tfevents') for n in os.listdir(layout.summaries(job, 'goodput')))


# ---- the fast tier ------------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def tiny_setup():
  from paxcli import config
  from paxcli.runtime import engine
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2',
                                                         'DIMS_PER_HEAD=16', 'VOCAB_SIZE=64', 'MAX_SEQ_LEN=16'])
  setup = engine.build(resolved)
  return setup, engine.init_state(setup, 0)


def _saved(state, scale):
  """The state with every float array scaled: a state of another step."""
  return jax.tree.map(lambda x: x * scale if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x, state)


def test_fast_tier_keeps_few_restores_exactly_and_falls_back_from_damage(tiny_setup, tmp_path):
  from paxcli.jobdir import fast_tier
  from paxcli.jobdir import format as job_format
  from paxcli.jobdir import restore
  from paxcli.runtime import engine
  setup, state = tiny_setup
  settings = fast_tier.Settings(str(tmp_path / 'local'), every=1, keep=2)
  tier = fast_tier.open_tier(settings, str(tmp_path / 'job'), 'job1', setup, log=print)
  shapes = engine.shape_signature(setup.abstract_state)
  for step in (1, 2, 3):
    saved = _saved(state, float(step))
    tier.save(step, saved, {'step': step, 'state_shapes': shapes, 'checksums': restore.checksums(saved)})
  tier.wait()
  assert tier.steps() == [2, 3]                                  # the newest LOCAL_CHECKPOINT_KEEP
  assert fast_tier.choose(tier, 2, print) == [3] and fast_tier.choose(tier, 3, print) == []
  got = tier.restore(3, {})
  for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(_saved(state, 3.0))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Bytes of step 3's arrays garbled on disk: refused as damaged (a restart then tries the next).
  data = [os.path.join(r, n) for r, _, names in os.walk(os.path.join(tier.step_dir(3), 'state')) for n in names
          if os.path.basename(r) == 'd']
  for path in data:
    with open(path, 'r+b') as f:
      f.seek(max(os.path.getsize(path) // 2, 0))
      f.write(b'\xff' * 64)
  with pytest.raises(restore.DamagedCheckpoint, match='step 3'):
    tier.restore(3, {})
  # A fast step a newer paxcli wrote is refused in one line, as a persistent one is (jobdir/format.py).
  meta_path = layout.meta_file(tier.step_dir(2))
  with open(meta_path) as f:
    meta = json.load(f)
  assert meta['format_version'] == job_format.FORMAT_VERSION
  with open(meta_path, 'w') as f:
    json.dump({**meta, 'format_version': job_format.FORMAT_VERSION + 1}, f)
  with pytest.raises(UserError, match='fast checkpoint at step 2 .* Upgrade paxcli'):
    tier.restore(2, {})
  tier.discard_after(2)
  assert tier.steps() == [2]
  tier.clear()
  assert not os.path.exists(tier.directory) and not os.path.exists(layout.local_tier_owner(settings.directory))


def _train_refused(capsys, tmp_path, *sets):
  args = ['train', *TINY, '--set', 'task.train.num_train_steps=2', '--job-log-dir', str(tmp_path / 'job')]
  for s in sets:
    args += ['--set', s]
  code, _, err = pax_main(args, capsys)
  lines = [l for l in err.strip().splitlines() if l.strip() and not l.startswith('WARNING')]
  assert code == 2 and 'Traceback' not in err, err[-2000:]
  return lines[-1]


def test_fast_tier_bad_input_is_one_line_before_training(tmp_path, capsys):
  blocker = tmp_path / 'a-file'
  blocker.write_text('x')
  line = _train_refused(capsys, tmp_path, f'LOCAL_CHECKPOINT_DIR={blocker}/local', 'LOCAL_CHECKPOINT_EVERY=2')
  assert 'cannot hold the fast checkpoint tier' in line and 'Not a directory' in line
  shared = tmp_path / 'shared'
  shared.mkdir()
  (shared / 'owner.json').write_text(json.dumps({'job_dir': '/somewhere/else', 'job_id': 'abc'}))
  line = _train_refused(capsys, tmp_path, f'LOCAL_CHECKPOINT_DIR={shared}', 'LOCAL_CHECKPOINT_EVERY=2')
  assert 'holds the fast checkpoint tier of another job (/somewhere/else)' in line
  line = _train_refused(capsys, tmp_path, f'LOCAL_CHECKPOINT_DIR={tmp_path}/big', 'LOCAL_CHECKPOINT_EVERY=2',
                        'LOCAL_CHECKPOINT_KEEP=100000000')
  assert 'The fast checkpoint tier needs' in line and 'but its disk has' in line and 'free' in line
  assert not os.path.exists(os.path.join(tmp_path, 'job', 'checkpoints', '1'))   # refused before any step
  line = _train_refused(capsys, tmp_path, 'LOCAL_CHECKPOINT_EVERY=2')
  assert 'also needs LOCAL_CHECKPOINT_DIR' in line
