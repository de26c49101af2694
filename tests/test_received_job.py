"""A job directory is received data too (issue 37, 1 and 7): its record sets model and data knobs only, every
value a record, a config or a ledger gives is bounded before anything is built from it, a checkpoint's
metadata is checked like its arrays, and received text is printed as text. Everything through the CLI, on
one tiny job trained once for the module; each hostile case ends in one line, nothing made outside.
(Tracker records: tests/test_trackers.py; the bucket ledger: tests/test_bucket_jobdir.py.)"""

import io
import json
import os
import shutil

import pytest

from conftest import pax_main, run_pax

EXP = 'paxcli.models.LmExperiment'
TINY = ['NUM_LAYERS=1', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'VOCAB_SIZE=64', 'MAX_SEQ_LEN=16',
        'PERCORE_BATCH_SIZE=1', 'EVAL_INTERVAL_STEPS=0', 'DECODE_INTERVAL_STEPS=0', 'NUM_TRAIN_STEPS=2',
        'SAVE_INTERVAL_STEPS=2']
BIG = '123456789012345678901234567890123456789'   # 39 digits


def _sets(items):
  return [a for s in items for a in ('--set', s)]


def _one_line(code, err, *phrases, exit_code=2):
  """The one error of a refusal (an indented list under it, as `the weights do not match` gives, belongs to it),
  holding every phrase; warnings and the line naming the job's own settings are not it."""
  lines = [ln for ln in err.strip().splitlines() if ln.strip() and '(as trained' not in ln
           and not ln.startswith('warning:')]
  assert code == exit_code and len([ln for ln in lines if not ln.startswith(' ')]) == 1, (code, err[-3000:])
  assert 'Traceback' not in err and lines[0].startswith('error:'), err[-3000:]
  text = ' '.join(' '.join(lines).split())
  for phrase in phrases:
    assert phrase in text, (phrase, text)
  return text


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A tiny job with one checkpoint (step 2), trained in a fresh process."""
  root = tmp_path_factory.mktemp('received')
  result = run_pax('train', '--exp', EXP, *_sets(TINY), '--job-log-dir', str(root / 'job'), cwd=str(root))
  assert result.returncode == 0, result.stderr[-3000:]
  return root / 'job'


@pytest.fixture
def job(trained, tmp_path):
  """A copy of the trained job, for a test to make hostile."""
  copy = tmp_path / 'job'
  shutil.copytree(trained, copy)
  return copy


def _record(job, *overrides, experiment=EXP):
  with open(job / 'experiment.jsonl', 'a') as f:
    f.write(json.dumps({'experiment': experiment, 'overrides': [*TINY, *overrides]}) + '\n')


# ---- 1. the job record sets model and data knobs only ----------------------------------------------------


def test_a_record_never_sets_the_process_environment_paths_or_destinations(job, tmp_path):
  """The issue's case and variants, read by `pax eval` in a fresh process: PLATFORM_ENV (a dump flag, a loader
  variable, a bucket endpoint), tracker destinations, the fast tier's path, worker processes, a dotted
  task.train field and a key of terminal escapes are left out, said in one line (escaped); the job's model
  knobs still apply, and so does the PLATFORM_ENV of the user's own --set; nothing is made outside."""
  outside = tmp_path / 'outside'
  platform_env = {'cpu': {'XLA_FLAGS': f'--xla_dump_to={outside}/dump', 'LD_PRELOAD': f'{outside}/x.so',
                          'STORAGE_EMULATOR_HOST': 'http://127.0.0.1:9'}}
  _record(job, f'PLATFORM_ENV={platform_env!r}', f"MLFLOW_TRACKING_URI='sqlite:///{outside}/mlflow.db'",
          "TRACKERS=['mlflow']", f"LOCAL_CHECKPOINT_DIR='{outside}/tier'", 'LOCAL_CHECKPOINT_EVERY=1',
          'DATA_WORKERS=64', f"task.train.local_checkpoint_dir='{outside}'", '\x1b[2J\x1b]8;;http://x\x07=1')
  own = "PLATFORM_ENV={'cpu': {'PAXCLI_TEST_MARK': '1'}}"   # the user's own command line: applied
  result = run_pax('eval', '--exp', EXP, '--set', own, '--job-log-dir', str(job), '--json', cwd=str(tmp_path))
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Set PAXCLI_TEST_MARK for platform cpu' in result.stderr
  [note] = [ln for ln in result.stderr.splitlines() if 'record also sets' in ln]
  for key in ('PLATFORM_ENV', 'MLFLOW_TRACKING_URI', 'TRACKERS', 'LOCAL_CHECKPOINT_DIR', 'LOCAL_CHECKPOINT_EVERY',
              'DATA_WORKERS', 'task.train.local_checkpoint_dir', '\\x1b[2J\\x1b]8;;http://x\\x07'):
    assert key in note, (key, note)
  assert 'only from your own command line' in note
  assert '\x1b' not in result.stderr and 'Set XLA_FLAGS' not in result.stderr and 'LD_PRELOAD' not in result.stdout
  assert '(as trained)' in result.stderr and 'MODEL_DIMS=16' in result.stderr   # model knobs still come from it
  assert json.loads(result.stdout)['step'] == 2
  assert not outside.exists() and not (tmp_path / 'mlflow.db').exists()


def test_every_knob_is_classified_and_a_new_one_is_left_out_of_replays_by_default(tmp_path):
  """Deny by default: the knobs a record may not set are exactly the process and destination ones below; a
  knob someone adds is left out until its class lists it in `replayed` (this test then names it too)."""
  from paxcli import experiment
  process = {'PLATFORM_ENV', 'DATA_WORKERS', 'LOCAL_CHECKPOINT_DIR', 'LOCAL_CHECKPOINT_EVERY', 'LOCAL_CHECKPOINT_KEEP',
             'TRACKERS', 'TRACKER_RUN_NAME', 'WANDB_PROJECT', 'WANDB_ENTITY', 'MLFLOW_TRACKING_URI', 'MLFLOW_EXPERIMENT'}
  left_out = {k for cls in experiment.import_all_recipes().values() for k in cls.knob_types() if not cls.replayable(k)}
  assert left_out == process
  lm = experiment.lookup(EXP)
  assert lm.replayable('task.model.lm_tpl.num_layers') and not lm.replayable('task.train.learning_rate')
  assert not lm.replayable('datasets.train.seq_len') and not lm.replayable('task.model..x')
  (tmp_path / 'mine.py').write_text(
      'from paxcli.models import LmExperiment\n\n\nclass Mine(LmExperiment):\n  MY_SIZE: int = 1\n'
      "  MY_CACHE: str = ''\n  replayed = frozenset({'MY_SIZE'})\n")
  mine = experiment.lookup(f'{tmp_path / "mine.py"}:Mine')
  assert mine.replayable('MY_SIZE') and not mine.replayable('MY_CACHE') and mine.replayable('NUM_LAYERS')


def test_a_records_values_are_bounded_before_anything_is_built(job, capsys):
  """A 39-digit MODEL_DIMS from the record (naming the record) or from --set, a vocabulary no 32-bit index
  reaches, an infinite learning rate: one line each, exit 2, before any array."""
  _record(job, f'MODEL_DIMS={BIG}')
  code, _, err = pax_main(['eval', '--exp', EXP, '--job-log-dir', str(job)], capsys)
  _one_line(code, err, 'experiment.jsonl', 'MODEL_DIMS is an integer of 39 digits')
  _record(job, 'VOCAB_SIZE=1099511627776')
  code, _, err = pax_main(['eval', '--exp', EXP, '--job-log-dir', str(job)], capsys)
  _one_line(code, err, 'VOCAB_SIZE is 1,099,511,627,776', '2,147,483,647')
  _record(job, 'LEARNING_RATE=1e999')
  code, _, err = pax_main(['eval', '--exp', EXP, '--job-log-dir', str(job)], capsys)
  _one_line(code, err, 'LEARNING_RATE is inf; it must be a finite number')
  code, _, err = pax_main(['eval', '--exp', EXP, '--set', f'MODEL_DIMS={BIG}', '--no-checkpoint'], capsys)
  _one_line(code, err, 'MODEL_DIMS is an integer of 39 digits')


# ---- 7. knob values that pass type checks and used to crash later ---------------------------------------


@pytest.mark.parametrize('sets,phrase', [
    (['NUM_EXPERTS=4', "MOE_DISPATCH='capacity'", 'EXPERT_CAPACITY_FACTOR=1e308'], 'EXPERT_CAPACITY_FACTOR is 1e+308'),
    (["FP8='delayed'", 'FP8_AMAX_HISTORY=0'], 'FP8_AMAX_HISTORY must be at least 1'),
    (['NUM_EXPERTS=4', "FP8='delayed'", 'FP8_AMAX_HISTORY=-1'], 'FP8_AMAX_HISTORY must be at least 1'),
    (['RANDOM_SEED=-1'], 'RANDOM_SEED must be from 0'),
    (['QUERY_PRE_ATTN_SCALAR=-1'], 'QUERY_PRE_ATTN_SCALAR must be positive'),
    (['PERCORE_BATCH_SIZE=1e308'], 'paxcli feeds at most 1,048,576 a step'),
    (["LR_SCHEDULE='linear_rampup_cosine_decay'", 'LR_WARMUP_STEPS=1099511627776'], 'counts steps in a 32-bit'),
    (['NUM_EXPERTS=1000000000'], 'NUM_EXPERTS of at most 65,536'),
    (['SLIDING_WINDOW=4611686018427387904'], 'SLIDING_WINDOW of at most 2,147,483,647'),
    (["LAYER_PATTERN=('a', 'b')", "LAYER_KINDS={'a': {'HIDDEN_DIMS': 10000000000000}}"], "LAYER_KINDS['a']: HIDDEN"),
    (['ATTEN_LOGIT_CAP=1e300'], 'ATTEN_LOGIT_CAP is 1e+300'),
])
def test_knob_values_that_would_crash_later_are_one_line(sets, phrase, capsys):
  code, _, err = pax_main(['bench', 'mfu', '--exp', EXP, *_sets([*TINY, *sets]), '--compile-only'], capsys)
  _one_line(code, err, phrase)


# ---- 7. configs and sources: counts bounded before anything is built --------------------------------------


def _hf(tmp_path, **changes):
  from test_untrusted_files import CONFIG, make_hf
  return make_hf(tmp_path / 'hf', {**CONFIG, **changes})


GEMMA2 = {'architectures': ['Gemma2ForCausalLM'], 'model_type': 'gemma2', 'hidden_act': 'gelu_pytorch_tanh',
          'hidden_activation': 'gelu_pytorch_tanh'}


@pytest.mark.parametrize('changes,phrase', [
    ({'num_hidden_layers': 10**9}, 'num_hidden_layers is 1,000,000,000; paxcli reads at most 65,536'),
    ({**GEMMA2, 'num_hidden_layers': 10**9}, 'num_hidden_layers is 1,000,000,000'),
    ({'architectures': ['MixtralForCausalLM'], 'model_type': 'mixtral', 'num_local_experts': 10**9,
      'num_experts_per_tok': 2}, 'num_local_experts is 1,000,000,000'),
    ({'architectures': ['Qwen3MoeForCausalLM'], 'model_type': 'qwen3_moe', 'num_experts': 10**9,
      'num_experts_per_tok': 2, 'moe_intermediate_size': 16}, 'num_experts is 1,000,000,000'),
    ({'architectures': ['Qwen3MoeForCausalLM'], 'model_type': 'qwen3_moe', 'num_experts': 65536,
      'num_experts_per_tok': 2, 'moe_intermediate_size': 16}, 'says 65,536 experts a layer; the weights hold 0'),
    ({'hidden_size': 10**14}, 'hidden_size is 100,000,000,000,000'),
    ({'rope_scaling': [1, 2]}, 'rope_scaling [1, 2]'),
    ({'rope_scaling': {'rope_type': ['linear'], 'factor': 2}}, 'rope_scaling'),
    ({**GEMMA2, 'rope_scaling': [{'rope_type': 'linear', 'factor': 2}]}, 'rope_scaling'),
    ({**GEMMA2, 'rope_scaling': 'linear'}, 'rope_scaling'),
])
def test_a_hugging_face_config_is_bounded_before_anything_is_listed(changes, phrase, tmp_path, capsys):
  """An HF config.json whose counts would have listed weight names for a billion layers or experts (4 GB and
  a minute), or whose rope_scaling is no object: one line, at once, nothing written."""
  code, _, err = pax_main(['checkpoint', 'convert', _hf(tmp_path, **changes), str(tmp_path / 'out'), '--from', 'hf'],
                          capsys)
  _one_line(code, err, phrase)
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('key,phrase', [
    ('model.lm_tpl.stacked_transformer_tpl.num_layers', 'it must be an integer from 1 to 65,536'),
    ('model.lm_tpl.stacked_transformer_tpl.num_experts', 'it must be an integer from 0 to 65,536'),
])
def test_a_paxml_config_is_bounded_before_anything_is_listed(key, phrase, tmp_path, capsys):
  from test_convert_paxml import FIXTURES
  job = tmp_path / 'pax'
  shutil.copytree(os.path.join(FIXTURES, 'stacked'), job)
  params = job / 'model_params.txt'
  params.write_text('\n'.join(f'{key} : 1000000000' if line.startswith(f'{key} :') else line
                              for line in params.read_text().splitlines()) + '\n')
  code, _, err = pax_main(['checkpoint', 'convert', str(job), str(tmp_path / 'out'), '--from', 'paxml'], capsys)
  _one_line(code, err, f'model_params.txt:', key, phrase)


def test_a_maxtext_script_is_bounded_before_a_recipe_is_written(tmp_path, capsys):
  script = (os.path.join(os.path.dirname(__file__), 'fixtures', 'maxtext', 'mixtral-8x7b.sh'))
  for extra, phrase in (('num_experts=1000000000', 'num_experts: NUM_EXPERTS is 1,000,000,000'),
                        ('base_emb_dim=' + BIG, 'base_emb_dim: MODEL_DIMS is')):
    with open(script) as f:
      (tmp_path / 'm.sh').write_text(f.read().replace('reuse_example_batch=1', f'reuse_example_batch=1 {extra}'))
    code, _, err = pax_main(['import-maxtext', str(tmp_path / 'm.sh'), '-o', str(tmp_path / 'r.py')], capsys)
    _one_line(code, err, phrase)
    assert not (tmp_path / 'r.py').exists()


# ---- 7. a checkpoint's metadata is checked like its arrays -------------------------------------------------


def _meta(job):
  return job / 'checkpoints' / '2' / 'meta' / 'metadata'


def test_a_checkpoints_metadata_replaced_by_unrelated_json_is_refused(job, capsys):
  """An unrelated large JSON, the metadata without its shape record, of another step, with its shapes or
  checksums edited, or too large to be metadata: `pax eval` refuses it, naming it, exit 1 (damaged), and the
  checkpoint is left in place."""
  original = json.loads(_meta(job).read_text())
  first_array = sorted(original['state_shapes'])[0]
  cases = [
      ({'data': [{'id': i, 'text': 'x' * 100} for i in range(20000)]}, 'no record of the arrays\' shapes'),
      ({k: v for k, v in original.items() if k != 'state_shapes'}, 'no record of the arrays\' shapes'),
      ({**original, 'step': 7}, 'it is the metadata of step 7'),
      ({**original, 'state_shapes': {**original['state_shapes'], first_array: [3, 3, 3]}},
       "differs from orbax's description of the arrays"),
      ({**original, 'checksums': {'not/an/array': 'ab'}}, 'its checksums are not those of its arrays'),
      ({k: v for k, v in original.items() if k != 'checksums'}, 'no checksums of the arrays'),
  ]
  for meta, phrase in cases:
    _meta(job).write_text(json.dumps(meta))
    code, _, err = pax_main(['eval', '--exp', EXP, '--job-log-dir', str(job)], capsys)
    _one_line(code, err, 'step 2', phrase, exit_code=1)
    assert (job / 'checkpoints' / '2').is_dir()
  with open(_meta(job), 'w') as f:   # past the size bound: refused before it is parsed
    f.write('{"pad": "')
    f.write('x' * (65 << 20))
    f.write('"}')
  code, _, err = pax_main(['eval', '--exp', EXP, '--job-log-dir', str(job)], capsys)
  _one_line(code, err, 'is over 67,108,864 bytes', exit_code=1)
  _meta(job).write_text(json.dumps(original))
  code, _, err = pax_main(['eval', '--exp', EXP, '--job-log-dir', str(job)], capsys)
  assert code == 0, err


# ---- 7. pax goodput: bounded numbers, valid JSON, text as text, bounded lines ------------------------------


def _ledger_line(path, **record):
  with open(path, 'a') as f:
    f.write(json.dumps(record) + '\n')


def test_pax_goodput_reads_a_hostile_ledger_as_bounded_numbers_and_plain_text(tmp_path, capsys):
  """Huge finite numbers (sums that would overflow), a failure reason of rich markup (a broken tag, a link)
  and terminal escapes, a line over the line bound: the table prints the reason as text, --json is strict
  JSON, the bad lines are skipped and counted."""
  from paxcli.jobdir import layout, ledger
  job = str(tmp_path / 'job')
  os.makedirs(layout.goodput(job))
  p0, launch = layout.goodput_ledger(job, 0), layout.launch_ledger(job)
  closed = lambda **s: {k: float(s.get(k, 0.0)) for k in ledger.PROCESS_CATEGORIES}
  reason = '[link=http://evil]click[/link] [/bold] \x1b]8;;http://x\x1b\\here\x1b]8;;\x1b\\ \x1b[2J'
  _ledger_line(launch, kind='launch', id='L1', t=99.0)
  _ledger_line(p0, kind='start', inc='a', t=100.0, launch='L1', attempt=0)
  _ledger_line(p0, kind='progress', inc='a', t=1.7e308, closed=closed(productive=1.7e308, startup=1e308),
               open=['productive', 1e308], step=10**30, steps={'productive': 10**30})
  _ledger_line(p0, kind='progress', inc='a', t=117.0, closed=closed(productive=1e300, startup=5.0),
               open=['productive'], step=12, steps={'productive': 12})
  _ledger_line(launch, kind='failure', id='L1', t=119.0, attempt=0, reason=reason, steps={'0': 13})
  _ledger_line(p0, kind='start', inc='b', t=121.0, launch='L1', attempt=1)
  with open(p0, 'a') as f:   # a line over the bound (64 KiB): skipped, never held whole
    f.write('{"kind": "progress", "inc": "b", "t": 130, "pad": "' + 'x' * (1 << 20) + '"}\n')
  _ledger_line(p0, kind='end', inc='b', t=140.0, closed=closed(productive=19.0), step=24, steps={'productive': 12},
               status=0)
  _ledger_line(launch, kind='end', id='L1', t=141.0, code=0)
  code, out, err = pax_main(['goodput', job, '--json'], capsys)
  assert code == 0, err
  account = json.loads(out, parse_constant=lambda c: pytest.fail(f'{c} in --json'))
  assert account['lines_skipped'] == 2 and account['wall_seconds'] < 100 and account['restarts'][0]['reason'] == reason
  code, out, err = pax_main(['goodput', job], capsys)
  assert code == 0, err
  assert '[link=http://evil]click[/link] [/bold]' in out and '\x1b' not in out and '\\x1b[2J' in out


def test_the_bounded_line_reader_never_reads_more_than_the_bound_at_once():
  """files.bounded_lines (the ledger's reader): a long line is yielded as None after reads of at most the bound
  plus one byte, or a megabyte; the lines around it come through whole."""
  from paxcli import files

  class Counting(io.BytesIO):
    largest = 0

    def readline(self, size=-1):
      assert size > 0
      line = super().readline(size)
      Counting.largest = max(Counting.largest, len(line))
      return line

  data = b'short\n' + b'y' * (5 << 20) + b'\n' + b'last'
  assert list(files.bounded_lines(Counting(data), 100)) == [b'short\n', None, b'last']
  assert Counting.largest <= 1 << 20


# ---- 7. lm-eval: a task file is code ------------------------------------------------------------------------


def test_lm_eval_says_first_that_a_task_file_is_code(capsys):
  from conftest import REPO
  code, out, _ = pax_main(['lm-eval', '--help'], capsys)
  assert code == 0
  tasks_help = ' '.join(out[out.index('--tasks'):].split())
  assert tasks_help.startswith('--tasks TASKS A task YAML file is code'), tasks_help[:200]
  guide = (REPO / 'docs' / 'guides' / 'lm-eval.md').read_text()
  assert guide.split('## Tasks\n\n', 1)[1].startswith('**A task file is code.**')


@pytest.mark.slow   # a train start up to its first step: about a minute on 2 loaded cores
def test_a_step_past_the_devices_memory_is_one_line(tmp_path, capsys):
  """Of the same kind: settings that pass every check but ask a step for more memory than the device holds
  (XLA's RESOURCE_EXHAUSTED, here hundreds of GB) end in one line saying what to lower, not a traceback."""
  code, _, err = pax_main(['train', '--exp', EXP, *_sets([*TINY, 'PERCORE_BATCH_SIZE=4096', 'VOCAB_SIZE=1048576']),
                           '--job-log-dir', str(tmp_path / 'job')], capsys)
  _one_line(code, err, 'The device ran out of memory (RESOURCE_EXHAUSTED', 'lower PERCORE_BATCH_SIZE')
