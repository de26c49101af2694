"""TRACKERS: W&B and MLflow get TensorBoard's scalars, the config and the run's identity; a resume
continues their runs; a tracker failing mid-run never stops training; a missing library is one line.

The real libraries in their local modes: W&B offline (its `.wandb` files read back with W&B's own
reader, `wandb leet inspect --json`), MLflow's file store (read back with its client).
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import pax_main

pytest.importorskip('wandb')
pytest.importorskip('mlflow')

EXP = 'paxcli.models.LmExperiment'
TINY = ['NUM_LAYERS=1', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'VOCAB_SIZE=64', 'MAX_SEQ_LEN=16',
        'PERCORE_BATCH_SIZE=1', 'SUMMARY_INTERVAL_STEPS=2', 'EVAL_INTERVAL_STEPS=2', 'SAVE_INTERVAL_STEPS=2']


def _sets(*items):
  return [a for s in [*TINY, *items] for a in ('--set', s)]


@pytest.fixture
def local_modes(monkeypatch):
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('MLFLOW_ALLOW_FILE_STORE', 'true')  # MLflow 3 asks for this to use its file store
  for name in ('WANDB_PROJECT', 'WANDB_ENTITY', 'WANDB_DIR', 'MLFLOW_TRACKING_URI', 'MLFLOW_EXPERIMENT_NAME'):
    monkeypatch.delenv(name, raising=False)


def _wandb_records(run_dir):
  """W&B's own reading of an offline run's transaction log: one dict per record."""
  [log] = glob.glob(os.path.join(run_dir, 'run-*.wandb'))
  out = subprocess.run([sys.executable, '-m', 'wandb', 'leet', 'inspect', '--json', log], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL, check=True).stdout
  return [json.loads(line) for line in out.splitlines() if line.strip()]


def _tensorboard(job, name):
  """{(tag, step): value} of one summaries/<name> directory, read by TensorBoard's own loader."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  acc = EventAccumulator(os.path.join(job, 'summaries', name), size_guidance={'scalars': 0})
  acc.Reload()
  return {(f'{name}/{tag}', e.step): e.value for tag in acc.Tags()['scalars'] for e in acc.Scalars(tag)}


def _identity(job, steps):
  from paxcli.jobdir import trackers
  config = {'knobs.NUM_LAYERS': '2', 'knobs.NUM_TRAIN_STEPS': repr(steps), 'knobs.TRACKERS': "['wandb', 'mlflow']"}
  return trackers.Identity(job, 'tiny.Lm', config, ''.join(f'{k} = {v}\n' for k, v in config.items()), 'pax train')


def test_a_summary_writer_sends_its_scalars_to_both_and_a_reopened_job_continues_their_runs(tmp_path, local_modes):
  """The writer's scalars reach W&B and MLflow under `<writer>/<tag>` at their steps; opening the
  trackers again for the same job, at the same destination, continues the same runs (the ids kept in
  <job>/trackers/, with only a digest of where they went)."""
  from mlflow.tracking import MlflowClient

  from paxcli.jobdir import trackers
  from paxcli.jobdir.summaries import SummaryWriter
  from paxcli.tasks import TrackersConfig
  job, store = str(tmp_path / 'job'), (tmp_path / 'mlruns').as_uri()
  lines = []
  settings = TrackersConfig(names=['wandb', 'mlflow'], mlflow_tracking_uri=store, wandb_project='p')
  for steps, run in ((2, [(1, 0.5), (2, 0.25)]), (4, [(3, 0.125)])):
    with trackers.open_trackers(settings, _identity(job, steps), lines.append) as tracked:
      writer = SummaryWriter(str(tmp_path / 'job' / 'summaries' / 'train'), trackers=tracked)
      for step, loss in run:
        writer.scalars(step, {'loss': loss, 'aux_loss/moe': 2 * loss})
      writer.close()
  wandb_id = json.load(open(os.path.join(job, 'trackers', 'wandb.json')))['run_id']
  record = json.load(open(os.path.join(job, 'trackers', 'mlflow.json')))
  mlflow_id = record['run_id']
  assert set(record) == {'run_id', 'place'} and store not in json.dumps(record)   # an id, never a destination
  assert [ln.split(' run ')[0] for ln in lines] == ['W&B: started', 'MLflow: started', 'W&B: continues',
                                                    'MLflow: continues'], lines
  history = {}
  for part in sorted(glob.glob(os.path.join(job, 'trackers', 'wandb', 'offline-run-*'))):
    records = _wandb_records(part)
    assert [r['run']['run_id'] for r in records if r['type'] == 'run'] == [wandb_id]
    history.update({r['history']['item']['_step']: {k: v for k, v in r['history']['item'].items() if k[0] != '_'}
                    for r in records if r['type'] == 'history'})
  assert history == {s: {'train/loss': v, 'train/aux_loss/moe': 2 * v} for s, v in ((1, .5), (2, .25), (3, .125))}
  client = MlflowClient(store)
  [run] = client.search_runs([client.get_experiment_by_name('paxcli').experiment_id])
  assert run.info.run_id == mlflow_id and run.info.status == 'FINISHED'
  assert [(m.step, m.value) for m in client.get_metric_history(mlflow_id, 'train/aux_loss/moe')] == [
      (1, 1.0), (2, 0.5), (3, 0.25)]
  assert run.data.params['knobs.NUM_TRAIN_STEPS'] == '2' and run.data.tags['changed.knobs.NUM_TRAIN_STEPS'] == '4'


@pytest.mark.slow  # two trainings with both trackers: ~45 s on 2 loaded cores
def test_wandb_and_mlflow_log_tensorboards_scalars_and_a_resume_continues_their_runs(tmp_path, capsys,
                                                                                       local_modes):
  from mlflow.tracking import MlflowClient
  job, store = str(tmp_path / 'job'), (tmp_path / 'mlruns').as_uri()
  trackers = "TRACKERS=['wandb', 'mlflow']"
  code, out, err = pax_main(['train', '--exp', EXP, *_sets('NUM_TRAIN_STEPS=4', trackers,
                                                           f'MLFLOW_TRACKING_URI={store!r}', "WANDB_PROJECT='tiny'"),
                             '--job-log-dir', job], capsys)
  assert code == 0, err
  first = out + err
  # The resume names the same store and project (the job keeps only the runs' ids): it continues the runs.
  code, out, err = pax_main(['train', '--exp', EXP, *_sets('NUM_TRAIN_STEPS=6', trackers,
                                                           f'MLFLOW_TRACKING_URI={store!r}', "WANDB_PROJECT='tiny'"),
                             '--job-log-dir', job], capsys)
  assert code == 0, err
  wandb_run = json.load(open(os.path.join(job, 'trackers', 'wandb.json')))
  mlflow_run = json.load(open(os.path.join(job, 'trackers', 'mlflow.json')))
  assert f"W&B: started run {wandb_run['run_id']} (job), project tiny" in first
  assert f"W&B: continues run {wandb_run['run_id']}" in out
  assert f"MLflow: continues run {mlflow_run['run_id']} in experiment paxcli at {store}" in out
  board = {**_tensorboard(job, 'train'), **_tensorboard(job, 'eval')}
  assert {s for _, s in board} == {2, 4, 6} and ('train/loss', 6) in board and ('eval/loss', 6) in board

  # W&B: two offline parts (one per invocation) of one run, which `wandb sync` uploads as one.
  parts = sorted(glob.glob(os.path.join(job, 'trackers', 'wandb', 'offline-run-*')))
  assert len(parts) == 2 and all(p.endswith('-' + wandb_run['run_id']) for p in parts)
  logged, configs = {}, []
  for part in parts:
    records = _wandb_records(part)
    [run] = [r['run'] for r in records if r['type'] == 'run']
    assert run['run_id'] == wandb_run['run_id'] and run['project'] == 'tiny'
    configs.append(run['config']['update'])
    for r in records:
      if r['type'] == 'history':
        item = r['history']['item']
        logged.update({(k, item['_step']): v for k, v in item.items() if not k.startswith('_')})
  assert logged.keys() == board.keys()  # every TensorBoard scalar, at its step, and nothing else
  for key, value in board.items():
    assert logged[key] == pytest.approx(value, rel=1e-6), key
  assert configs[0]['knobs.NUM_LAYERS'] == 1 and configs[1]['knobs.NUM_TRAIN_STEPS'] == 6
  assert configs[0]['paxcli']['job_dir'] == job and 'pax train' in configs[1]['paxcli']['command']

  # MLflow: one run holding every step, its config as parameters and config.txt.
  client = MlflowClient(store)
  [experiment] = [e for e in client.search_experiments() if e.name == 'paxcli']
  [run] = client.search_runs([experiment.experiment_id])
  assert run.info.run_id == mlflow_run['run_id'] and run.info.status == 'FINISHED'
  assert run.info.run_name == 'job' and run.data.tags['paxcli.job_dir'] == job
  for key in {k for k, _ in board}:
    history = {(key, m.step): m.value for m in client.get_metric_history(run.info.run_id, key)}
    assert history == pytest.approx({k: v for k, v in board.items() if k[0] == key}, rel=1e-6), key
  assert run.data.params['knobs.NUM_LAYERS'] == '1' and run.data.params['knobs.NUM_TRAIN_STEPS'] == '4'
  assert run.data.tags['changed.knobs.NUM_TRAIN_STEPS'] == '6'  # MLflow keeps a parameter's first value
  config_txt = client.download_artifacts(run.info.run_id, 'config.txt', str(tmp_path))
  assert open(config_txt).read() == open(os.path.join(job, 'config.txt')).read()


class _TripWire:
  """The trainer's console output; at the first summary line it takes the MLflow store away (the
  tracker's server going away mid-run): renamed in one step, while the tracker may be writing to it."""

  def __init__(self, store):
    self.store, self.text = store, ''

  def write(self, text):
    self.text += text
    if 'step 2: loss' in self.text and os.path.isdir(self.store):
      os.rename(self.store, self.store + '.gone')
    return len(text)

  def flush(self):
    pass


def test_a_tracker_that_fails_mid_run_warns_and_training_goes_on(tmp_path, local_modes):
  from rich.console import Console

  from paxcli import api
  store, job = tmp_path / 'mlruns', str(tmp_path / 'job')
  wire = _TripWire(str(store))
  last = api.train(EXP, overrides=[*TINY, 'NUM_TRAIN_STEPS=6', 'EVAL_INTERVAL_STEPS=0', "TRACKERS=['mlflow']",
                                   f'MLFLOW_TRACKING_URI={store.as_uri()!r}'], job_dir=job,
                   console=Console(file=wire, width=200))
  assert last['step'] == 6
  assert not store.exists()
  assert wire.text.count('warning: MLflow could not log') == 1, wire.text  # one line for the whole outage
  assert 'training goes on, and the scalars are in TensorBoard' in wire.text
  steps = [json.loads(line)['step'] for line in open(os.path.join(job, 'train_metrics.jsonl'))]
  assert steps == [2, 4, 6]


def test_a_tracker_asked_for_but_not_installed_is_one_line_before_any_compile(tmp_path, capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, 'mlflow', None)  # how Python hides a package: find_spec gives None
  job = tmp_path / 'job'
  code, out, err = pax_main(['train', '--exp', EXP, *_sets('NUM_TRAIN_STEPS=2', "TRACKERS=['mlflow']"),
                             '--job-log-dir', str(job)], capsys)
  assert code == 2
  [line] = [ln for ln in err.splitlines() if ln.strip()]
  assert "the mlflow package is not installed: pip install 'paxcli[trackers]'" in line
  assert not (job / 'checkpoints').exists() and not (job / 'summaries').exists()
  code, _, err = pax_main(['train', '--exp', EXP, *_sets("TRACKERS=['wandbb']"), '--job-log-dir', str(job)], capsys)
  assert code == 2 and "TRACKERS must be list['wandb' | 'mlflow']" in err


def test_a_damaged_run_record_starts_a_new_run_and_says_so(tmp_path, local_modes):
  from mlflow.tracking import MlflowClient

  from paxcli.jobdir import trackers
  from paxcli.tasks import TrackersConfig
  job, store = str(tmp_path / 'job'), (tmp_path / 'mlruns').as_uri()
  os.makedirs(os.path.join(job, 'trackers'))
  with open(os.path.join(job, 'trackers', 'mlflow.json'), 'w') as f:
    f.write('{"run_id": ')  # cut short
  lines = []
  with trackers.open_trackers(TrackersConfig(names=['mlflow'], mlflow_tracking_uri=store), _identity(job, 2),
                              lines.append):
    pass
  assert lines[0].startswith('MLflow: cannot continue the run recorded in') and 'not valid JSON' in lines[0]
  run_id = json.load(open(os.path.join(job, 'trackers', 'mlflow.json')))['run_id']
  assert lines[1].startswith(f'MLflow: started run {run_id}')
  assert MlflowClient(store).get_run(run_id).info.status == 'FINISHED'


def test_a_jobs_tracker_record_chooses_a_run_id_never_a_destination(tmp_path, capsys, local_modes, monkeypatch):
  """Issue 37, 2: a received job's trackers/mlflow.json naming another store (a database outside the job, a
  server) or a run id that is no id is not followed: the resume logs where this invocation says, in a new
  run, and says so in a line; nothing is made outside."""
  from mlflow.tracking import MlflowClient
  store, job, outside = (tmp_path / 'mlruns').as_uri(), tmp_path / 'job', tmp_path / 'outside'
  monkeypatch.setenv('MLFLOW_TRACKING_URI', store)
  args = ['train', '--exp', EXP, *_sets("TRACKERS=['mlflow']", 'EVAL_INTERVAL_STEPS=0'), '--job-log-dir', str(job)]
  code, out, err = pax_main([*args, '--set', 'NUM_TRAIN_STEPS=2'], capsys)
  assert code == 0, err
  first = json.loads((job / 'trackers' / 'mlflow.json').read_text())['run_id']
  from paxcli.jobdir import trackers
  client = MlflowClient(store)   # a run of another experiment of the same store, named with this store's digest
  foreign = client.create_run(client.create_experiment('someone-elses')).info.run_id
  hostile = [{'run_id': first, 'tracking_uri': f'sqlite:///{outside}/mlflow.db', 'experiment': 'paxcli'},
             {'run_id': first, 'tracking_uri': 'http://127.0.0.1:9/', 'experiment': 'paxcli'},
             {'run_id': '../../../etc/passwd', 'place': 'x'}, {'run_id': 'a' * 65},
             {'run_id': foreign, 'place': trackers.place('mlflow', store, 'paxcli')}]
  for steps, record in enumerate(hostile, start=3):
    (job / 'trackers' / 'mlflow.json').write_text(json.dumps(record))
    code, out, err = pax_main([*args, '--set', f'NUM_TRAIN_STEPS={steps}'], capsys)
    assert code == 0, err
    said = ' '.join((out + err).split())
    why = ('was logged to another store or experiment' if 'tracking_uri' in record else
           'belongs to another experiment' if record['run_id'] == foreign else 'is not a run id')
    assert why in said, said
    assert 'MLflow: started run' in said and f'at {store}' in said, said
    kept = json.loads((job / 'trackers' / 'mlflow.json').read_text())
    assert set(kept) == {'run_id', 'place'} and kept['run_id'] != first
  assert not outside.exists()
  runs = client.search_runs([client.get_experiment_by_name('paxcli').experiment_id])
  assert len(runs) == 1 + len(hostile) and all(r.info.status == 'FINISHED' for r in runs)
  # the record as paxcli writes it continues its run at the same destination
  code, out, err = pax_main([*args, '--set', 'NUM_TRAIN_STEPS=8'], capsys)
  assert code == 0 and f"MLflow: continues run {kept['run_id']}" in out + err, out + err


def test_a_wandb_record_naming_a_project_or_entity_is_not_followed(tmp_path, local_modes):
  """The W&B record's project and entity (as older paxcli wrote them, or planted) are not where the run goes:
  this invocation's project is, in a new run; the record then holds the id and a digest only."""
  from paxcli.jobdir import trackers
  from paxcli.tasks import TrackersConfig
  job = tmp_path / 'job'
  (job / 'trackers').mkdir(parents=True)
  (job / 'trackers' / 'wandb.json').write_text(json.dumps({'run_id': 'abcd1234', 'project': 'theirs',
                                                           'entity': 'someone-else'}))
  lines = []
  with trackers.open_trackers(TrackersConfig(names=['wandb'], wandb_project='mine'), _identity(str(job), 2),
                              lines.append):
    pass
  assert lines[0].startswith("W&B: the job's run abcd1234 was logged to another project or entity than this "
                             "invocation's ('mine')"), lines
  kept = json.loads((job / 'trackers' / 'wandb.json').read_text())
  assert set(kept) == {'run_id', 'place'} and kept['run_id'] != 'abcd1234'
  assert lines[1].startswith(f"W&B: started run {kept['run_id']}") and 'project mine' in lines[1], lines
  [part] = glob.glob(os.path.join(job, 'trackers', 'wandb', 'offline-run-*'))
  [run] = [r['run'] for r in _wandb_records(part) if r['type'] == 'run']
  assert run['project'] == 'mine' and run.get('entity', '') in ('', None), run
