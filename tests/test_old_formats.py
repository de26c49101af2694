"""Job directories and checkpoints of every format version restore, evaluate, decode and resume.

Each tests/fixtures/formats/<format>-paxcli-<version>/ was written by that paxcli
(make_fixtures.py there) with what it computed from its own checkpoints in expected.json; today's
paxcli must compute the same. A format version without a fixture fails
test_every_format_has_a_fixture: add one when jobdir/format.py's FORMAT_VERSION grows.
"""

import json
import shutil

import pytest

from conftest import REPO, pax_main
from paxcli.jobdir import format as job_format
from paxcli.jobdir import layout

FIXTURES = sorted((REPO / 'tests' / 'fixtures' / 'formats').glob('*/expected.json'))
NAMES = [p.parent.name for p in FIXTURES]


def _fixture(name, tmp_path, job):
  src = REPO / 'tests' / 'fixtures' / 'formats' / name
  expected = json.loads((src / 'expected.json').read_text())
  shutil.copytree(src / job, tmp_path / job)
  return expected, str(tmp_path / job)


def _format_of(job_dir):
  meta = json.loads(open(layout.meta_file(layout.step_dir(job_dir, 2))).read())
  return job_format.of(meta)


def test_every_format_has_a_fixture():
  found = {_format_of(str(p.parent / 'lm')) for p in FIXTURES}
  assert found == set(range(job_format.FORMAT_VERSION + 1)), (found, NAMES)


@pytest.mark.parametrize('name', NAMES)
def test_eval_gives_what_the_writing_version_gave(name, tmp_path, capsys):
  expected, job = _fixture(name, tmp_path, 'lm')
  code, out, err = pax_main(['eval', *expected['lm'], '--job-log-dir', job, '--json'], capsys)
  assert code == 0, err
  result = json.loads(out.strip().splitlines()[-1])
  assert result['step'] == expected['lm_step']
  assert result['results']['eval']['loss'] == pytest.approx(expected['lm_eval_loss'], rel=1e-5)


@pytest.mark.parametrize('name', NAMES)
def test_decode_with_the_kept_tokenizer_gives_the_same_text(name, tmp_path, capsys):
  expected, job = _fixture(name, tmp_path, 'docs')
  code, out, err = pax_main(['decode', *expected['docs'], '--job-log-dir', job, *expected['prompt'], '--json'], capsys)
  assert code == 0, err
  record = json.loads(out.strip().splitlines()[0])
  assert record['decoded_ids'] == expected['docs_decoded_ids']
  assert record['decoded'] == expected['docs_decoded']


@pytest.mark.parametrize('name', NAMES)
def test_training_resumes_and_writes_todays_format(name, tmp_path, capsys):
  expected, job = _fixture(name, tmp_path, 'lm')
  args = ['train', *expected['lm'], '--set', 'NUM_TRAIN_STEPS=4', '--set', 'SAVE_INTERVAL_STEPS=4', '--job-log-dir', job]
  code, out, err = pax_main(args, capsys)
  assert code == 0, err
  assert 'Resumed from step 2' in out
  meta = json.loads(open(layout.meta_file(layout.step_dir(job, 4))).read())
  assert job_format.of(meta) == job_format.FORMAT_VERSION
  assert json.loads(open(layout.format_file(job)).read())['format_version'] == job_format.FORMAT_VERSION


def test_a_newer_format_is_refused_in_one_line(tmp_path, capsys):
  expected, job = _fixture(NAMES[-1], tmp_path, 'lm')
  path = layout.meta_file(layout.step_dir(job, 2))
  meta = json.loads(open(path).read())
  meta.update(format_version=job_format.FORMAT_VERSION + 1, paxcli_version='99.0')
  open(path, 'w').write(json.dumps(meta))
  code, _, err = pax_main(['eval', *expected['lm'], '--job-log-dir', job], capsys)
  assert code == 2
  assert f'written by paxcli 99.0 in format {job_format.FORMAT_VERSION + 1}' in err and 'Upgrade paxcli' in err
  assert 'Traceback' not in err
  # The trainer refuses a job directory a newer paxcli marked, before it writes anything.
  open(layout.format_file(job), 'w').write(json.dumps({'format_version': 99}))
  before = open(layout.invocations(job)).read()
  code, _, err = pax_main(['train', *expected['lm'], '--job-log-dir', job], capsys)
  assert code == 2 and 'format 99' in err
  assert open(layout.invocations(job)).read() == before
