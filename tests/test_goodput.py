"""Issue 31: the goodput ledger, `pax goodput`, and the fast checkpoint tier's checks.

The stopwatch and the ledger's account are checked on a clock the test moves; a real `pax train`
(a fresh process, timed from outside) checks that the account adds up to the wall time; the fast
tier saves and restores real arrays with orbax. Faults across processes and restarts are in
test_goodput_faults.py (slow).
"""

import json
import math
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
  assert restart['process'] == 1
  assert (restart['reached_step'], restart['resumed_step'], restart['tier'], restart['redone_steps']) == (13, 10, 'fast', 3)
  assert ledger.furthest_step(*ledger.read(job)[:2]) == 24


def _launched_job(job, code, failures=(), end=True):
  """A job of one `pax launch` (two processes, started at 100): one attempt per failure ((time, process,
  reason) each), and after them one that finishes, unless the launcher gave up (a non-zero `code`) or has not
  ended (`end` False)."""
  launch = layout.launch_ledger(job)
  _line(launch, kind='launch', id='L', t=100.0, host='elsewhere', pid=1, ticks='1')
  attempts = list(failures) + ([(None, None, None)] if code == 0 or not end else [])
  for attempt, (t, process, reason) in enumerate(attempts):
    for p in (0, 1):
      path = layout.goodput_ledger(job, p)
      _line(path, kind='start', inc=f'{attempt}-{p}', t=101.0 + 20 * attempt, launch='L', attempt=attempt)
      if t is not None:
        _line(path, kind='progress', inc=f'{attempt}-{p}', t=t - 1, closed=_closed(startup=2.0),
              open=['productive', t - 1], step=5 + attempt, steps={})
      elif end:
        _line(path, kind='end', inc=f'{attempt}-{p}', t=190.0, closed=_closed(startup=2.0), step=9, steps={}, status=0)
    if t is not None:
      _line(launch, kind='failure', id='L', t=t, attempt=attempt, process=process, reason=reason,
            steps={'0': 5 + attempt})
  if end:
    _line(launch, kind='end', id='L', t=191.0, code=code)


def test_a_job_that_died_says_so_and_which_process_in_its_restart_table(tmp_path, capsys):
  """Issue 38: `pax goodput` of a job whose last failure nothing restarted says that it died, which process
  failed and how, in its caption and as the last row of its restart table; each restart names its process."""
  job = str(tmp_path / 'job')
  _launched_job(job, 137, failures=((118.0, 1, 'was killed by SIGKILL (exit code -9)'),
                                    (139.0, 0, 'exited with code 1')))
  account = ledger.summarize(job)
  assert [(r['process'], r['reason']) for r in account['restarts']] == [(1, 'was killed by SIGKILL (exit code -9)')]
  assert account['ended'] == {'state': 'died', 'process': 0, 'step': 6,
                              'reason': 'exited with code 1; pax launch did not restart it'}
  code, out, err = pax_main(['goodput', job], capsys)
  flat = ' '.join(out.split())
  assert code == 0, err
  assert 'The job died at step 6: p0 exited with code 1; pax launch did not restart it.' in flat, out
  assert 'Restarts, and the failure that ended the job' in flat, out
  rows = [[cell.strip() for cell in line.split('│')[1:-1]] for line in out.splitlines() if line.startswith('│')]
  assert rows[-2][:3] == ['1', 'p1', 'was killed by SIGKILL (exit code -9)'], out
  assert rows[-1][:3] == ['died', 'p0', 'exited with code 1; pax launch did not restart it'], out
  code, out, _ = pax_main(['goodput', job, '--json'], capsys)
  assert json.loads(out)['ended']['state'] == 'died'


def test_each_restart_is_its_own_attempts_failure(tmp_path):
  """The launcher records a failure and starts the next attempt within the kernel's 10 ms resolution of a
  process start: by time alone a restart read the failure before its own (seen as the wrong process)."""
  job = str(tmp_path / 'job')
  launch, p0 = layout.launch_ledger(job), layout.goodput_ledger(job, 0)
  _line(launch, kind='launch', id='L', t=100.0)
  for attempt, (start, failed, process) in enumerate([(100.5, 110.0, 1), (110.0, 120.0, 0), (120.0, None, None)]):
    _line(p0, kind='start', inc=str(attempt), t=start, launch='L', attempt=attempt)
    if failed is None:
      _line(p0, kind='end', inc=str(attempt), t=130.0, closed=_closed(startup=10.0), step=9, steps={}, status=0)
      continue
    _line(p0, kind='progress', inc=str(attempt), t=failed - 1, closed=_closed(startup=1.0), open=['productive', failed - 1],
          step=3, steps={})
    _line(launch, kind='failure', id='L', t=failed, attempt=attempt, process=process, reason=f'p{process} failed',
          steps={})
  _line(launch, kind='end', id='L', t=130.5, code=0)
  assert [(r['process'], r['reason']) for r in ledger.summarize(job)['restarts']] == [(1, 'p1 failed'), (0, 'p0 failed')]


def test_how_a_job_ended(tmp_path):
  """finished, died (a launcher's failure, a crash, a kill without an end line), running (a live process)."""
  job = str(tmp_path / 'finished')
  _launched_job(job, 0, failures=((118.0, 1, 'was killed by SIGKILL (exit code -9)'),))
  assert ledger.summarize(job)['ended'] == {'state': 'finished', 'process': None, 'reason': None, 'step': 9}
  job = str(tmp_path / 'refused')
  _launched_job(job, 2, failures=((118.0, 0, 'exited with code 2'),))
  assert ledger.summarize(job)['ended']['state'] == 'refused'
  job = str(tmp_path / 'launcher-running')
  _launched_job(job, None, end=False)
  assert ledger.summarize(job)['ended']['state'] == 'running'   # on another host: cannot be told from here
  # No launcher: a process's exit status, or a process without an end line (gone, or running here).
  here = ledger.whereabouts()
  job = str(tmp_path / 'crashed')
  _line(layout.goodput_ledger(job, 0), kind='start', inc='a', t=100.0, **here)
  _line(layout.goodput_ledger(job, 0), kind='end', inc='a', t=110.0, closed=_closed(startup=10.0), step=3, status=1)
  assert ledger.summarize(job)['ended'] == {'state': 'died', 'process': 0, 'reason': 'exited with status 1', 'step': 3}
  job = str(tmp_path / 'running')
  _line(layout.goodput_ledger(job, 0), kind='start', inc='a', t=100.0, **here)
  assert ledger.summarize(job)['ended']['state'] == 'running'
  gone = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True, text=True)
  job = str(tmp_path / 'killed')
  _line(layout.goodput_ledger(job, 1), kind='start', inc='a', t=100.0, host=here['host'], pid=int(gone.stdout),
        ticks='1')
  _line(layout.goodput_ledger(job, 1), kind='progress', inc='a', t=104.0, closed=_closed(startup=3.0),
        open=['productive', 103.0], step=2, steps={})
  assert ledger.summarize(job)['ended'] == {'state': 'died', 'process': 1, 'step': 2,
                                            'reason': 'was killed (its ledger has no end line)'}


def test_a_pax_process_is_timed_from_its_own_start_and_an_in_process_call_from_main(monkeypatch):
  """A `pax` process's interpreter start-up and imports are its start-up, however long a loaded machine
  makes them (here 100 s); pax called in a long-lived process (a notebook, a test) starts at main()."""
  monkeypatch.setattr(ledger, '_command_started', None)
  process_start = time.time() - 100.0
  monkeypatch.setattr(ledger, 'process_started_at', lambda: process_start)
  ledger.mark_command_start(whole_process=True)
  assert ledger.command_started() == process_start
  before = time.time()
  ledger.mark_command_start(whole_process=False)
  assert before <= ledger.command_started() <= time.time()


def test_pax_goodput_without_a_ledger_is_one_line(tmp_path, capsys):
  code, _, err = pax_main(['goodput', str(tmp_path)], capsys)
  assert code == 2 and 'No goodput ledger' in err and 'Traceback' not in err
  code, _, err = pax_main(['goodput', str(tmp_path / 'missing')], capsys)
  assert code == 2 and 'is not a directory' in err


def _ledger_lines(path) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_a_real_run_accounts_for_its_wall_time(tmp_path, capsys):
  """`pax launch -n 1 -- train`: the ledger's parts add up to the span its own records cover (the launcher's
  start line to its end line, the trainer's start line to its end line), and a clock outside the launcher
  saw at least that much. How much the ledger misses of the outside time (the interpreter's exit after the
  last line, seconds on a loaded machine) is measured by benchmarks/goodput_wall.py, not asserted."""
  job = str(tmp_path / 'job')
  cmd = [sys.executable, '-m', 'paxcli.cli.app', 'launch', '-n', '1', '--', 'train', *TINY,
         '--set', 'task.train.num_train_steps=6', '--set', 'task.train.save_interval_steps=3',
         '--set', 'task.train.eval_interval_steps=3', '--job-log-dir', job]
  began = time.time()
  result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  outside = time.time() - began
  assert result.returncode == 0, result.stderr[-3000:]
  assert '[p0] Goodput ' in result.stdout and f'pax goodput {job}' in result.stdout
  code, out, err = pax_main(['goodput', job, '--json'], capsys)
  assert code == 0, err
  account = json.loads(out)
  seconds = account['seconds']
  launcher = _ledger_lines(layout.launch_ledger(job))
  (start,), (end,) = ([r for r in launcher if r['kind'] == kind] for kind in ('launch', 'end'))
  assert math.fsum(seconds.values()) == pytest.approx(end['t'] - start['t'], abs=1e-6)
  assert account['wall_seconds'] == pytest.approx(math.fsum(seconds.values()), abs=1e-6)
  trainer = _ledger_lines(layout.goodput_ledger(job, 0))
  (began_line,), (ended_line,) = ([r for r in trainer if r['kind'] == kind] for kind in ('start', 'end'))
  assert math.fsum(ended_line['closed'].values()) == pytest.approx(ended_line['t'] - began_line['t'], abs=1e-6)
  # The launcher's start is the kernel's start time of its process, to the kernel's 10 ms: the outside clock,
  # started before it, may read up to that much less.
  assert account['wall_seconds'] <= outside + 0.02, (account['wall_seconds'], outside)
  assert account['ended'] == {'state': 'finished', 'process': None, 'reason': None, 'step': 6}
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
