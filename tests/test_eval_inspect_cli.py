"""`pax eval`, eval during `pax train`, `pax inspect-input`, and their errors."""

import json
import os
import re
import textwrap

import pytest

from conftest import pax_main
from test_inputs import token_records, write_tfrecord

TINY = ['--exp', 'lm_cloud.LmCloudSpmdTest', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64',
        '--set', 'NUM_HEADS=4', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'MAX_SEQ_LEN=16',
        '--set', 'VOCAB_SIZE=64']


def test_train_runs_eval_and_pax_eval_reads_the_checkpoint(tmp_path, capsys):
  job = str(tmp_path / 'job')
  code, out, err = pax_main(['train', *TINY, '--job-log-dir', job, '--set', 'task.train.num_train_steps=10',
                             '--set', 'EVAL_INTERVAL_STEPS=5', '--set', 'task.train.save_interval_steps=10'], capsys)
  assert code == 0, err
  assert 'step 5: eval: loss' in out and 'step 10: eval: loss' in out
  with open(os.path.join(job, 'eval_metrics.jsonl')) as f:
    during = [json.loads(line) for line in f]
  assert [r['step'] for r in during] == [5, 10]
  assert all(r['num_examples'] == 16 for r in during)  # 2 batches x global batch 8
  assert os.listdir(os.path.join(job, 'summaries', 'eval'))

  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', job, '--json'], capsys)
  assert code == 0, err
  result = json.loads(out)
  assert result['step'] == 10
  # The same weights on the same data: the standalone eval equals the one at step 10.
  assert abs(result['results']['eval']['loss'] - during[-1]['loss']) < 1e-5

  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', job], capsys)
  assert code == 0 and 'Eval at step 10' in out and 'perplexity' in out

  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', str(tmp_path / 'empty')], capsys)
  assert code == 2 and 'No complete checkpoint' in err
  code, out, err = pax_main(['eval', *TINY, '--job-log-dir', str(tmp_path / 'fresh'), '--no-checkpoint', '--json'],
                            capsys)
  assert code == 0 and json.loads(out)['step'] == 0


def test_inspect_input_on_a_recipe(capsys):
  code, out, err = pax_main(['inspect-input', *TINY, '--num-batches', '2', '--json'], capsys)
  assert code == 0, err
  lines = [json.loads(line) for line in out.strip().splitlines()]
  assert [line['batch'] for line in lines[:2]] == [0, 1]
  features = {f['feature']: f for f in lines[0]['features']}
  assert features['ids']['shape'] == [8, 16] and features['weights']['padding'] == 0.0
  assert lines[0]['examples'][0]['ids'] and 'batches_per_sec' in lines[-1]['throughput']
  code, out, err = pax_main(['inspect-input', *TINY, '--split', 'eval', '--host-index', '1', '--num-hosts', '4'],
                            capsys)
  assert code == 0, err
  assert 'batch 0 (host 1 of 4)' in out and 'batches/s' in out


def test_inspect_input_decodes_text_of_the_default(capsys):
  code, out, err = pax_main(['inspect-input', '--num-batches', '1', '--json', '--set', 'PERCORE_BATCH_SIZE=1'], capsys)
  assert code == 0, err
  example = json.loads(out.splitlines()[0])['examples'][0]
  words = example['text'].split()
  assert len(words) > 20 and sum(w.isalpha() for w in words) > 10  # real English from the docstrings


def test_inspect_input_on_a_raw_tfrecord_file(tmp_path, capsys):
  write_tfrecord(tmp_path / 'train-00000.tfrecord', token_records(5))
  code, out, err = pax_main(['inspect-input', str(tmp_path / 'train-*.tfrecord'), '--json'], capsys)
  assert code == 0, err
  report = json.loads(out)
  kinds = {f['feature']: (f['kind'], f['min_length'], f['max_length']) for f in report['features']}
  assert kinds['name'] == ('bytes', 1, 1) and kinds['score'] == ('float', 1, 1)
  lengths = [len(r['targets']) for r in token_records(5)]
  assert kinds['targets'] == ('int64', min(lengths), max(lengths))
  assert report['records_scanned'] == 5 and report['first_records'][0]['name'] == ['doc0']
  code, out, err = pax_main(['inspect-input', str(tmp_path / 'train-00000.tfrecord')], capsys)
  assert code == 0 and 'targets' in out and 'int64' in out


BROKEN = '''
import dataclasses
import fiddle as fdl
from paxcli.inputs.synthetic import SyntheticLmInput
from paxcli.models import LmExperiment


@dataclasses.dataclass
class EveryHostTheSame(SyntheticLmInput):
  """Forgets infeed_host_index: every host reads host 0's rows."""

  def host_rows(self):
    return slice(0, self.batch_size)


@dataclasses.dataclass
class MaskFirstToken(SyntheticLmInput):
  """A user's post-processing: calls super().get_next() and edits the batch."""

  def get_next(self):
    batch = super().get_next()
    batch['weights'][:, 0] = 0.0
    return batch


class Broken(LmExperiment):
  def datasets(self):
    return [fdl.Config(EveryHostTheSame, name='train', is_training=True, seq_len=16, vocab_size=64)]


class Masked(LmExperiment):
  NUM_LAYERS = 1
  MODEL_DIMS = 32
  HIDDEN_DIMS = 64
  MAX_SEQ_LEN = 16
  VOCAB_SIZE = 64
  PERCORE_BATCH_SIZE = 1

  def datasets(self):
    return [fdl.Config(MaskFirstToken, name='train', is_training=True, seq_len=16, vocab_size=64)]
'''


def test_check_sharding_catches_a_broken_input(tmp_path, capsys):
  path = tmp_path / 'user_inputs.py'
  path.write_text(textwrap.dedent(BROKEN))
  code, out, err = pax_main(['inspect-input', '--exp', f'{path}:Broken', '--check-sharding', '--num-hosts', '4'],
                            capsys)
  assert code == 1
  assert 'emitted by more than one host' in out
  code, out, _ = pax_main(['inspect-input', *TINY, '--check-sharding', '--num-hosts', '4', '--json'], capsys)
  report = json.loads(out)
  assert code == 0 and report['ok'] and report['num_duplicates'] == 0
  code, out, _ = pax_main(['inspect-input', *TINY, '--split', 'eval', '--check-sharding', '--num-hosts', '4',
                           '--json'], capsys)
  report = json.loads(out)
  assert code == 0 and [h['batches'] for h in report['hosts']] == [2, 2, 2, 2]
  assert [h['examples'] for h in report['hosts']] == [16] * 4  # 2 batches x 8 rows (1 per device) each


def test_post_processing_subclass_trains(tmp_path, capsys):
  path = tmp_path / 'user_inputs.py'
  path.write_text(textwrap.dedent(BROKEN))
  code, out, err = pax_main(['inspect-input', '--exp', f'{path}:Masked', '--json', '--num-batches', '1'], capsys)
  assert code == 0, err
  features = {f['feature']: f for f in json.loads(out.splitlines()[0])['features']}
  assert features['weights']['padding'] == 1 / 16
  code, out, err = pax_main(['train', '--exp', f'{path}:Masked', '--job-log-dir', str(tmp_path / 'm'),
                             '--set', 'task.train.num_train_steps=2', '--set', 'task.train.summary_interval_steps=1'],
                            capsys)
  assert code == 0, err
  records = [json.loads(line) for line in open(tmp_path / 'm' / 'train_metrics.jsonl')]
  # What the post-processing did, by value: the batches the experiment's input gives are its parent's
  # with the first target of each row weighted 0, and nothing else changed.
  import dataclasses

  import jax
  import numpy as np

  from paxcli import config

  from paxcli.runtime import engine
  from paxcli.runtime import infeed
  from paxcli.inputs.synthetic import SyntheticLmInput
  resolved = config.resolve(f'{path}:Masked', [])
  setup = engine.build(resolved)
  masked = infeed.build_input(resolved.train_dataset(), setup)
  parent = SyntheticLmInput(**{f.name: getattr(masked, f.name) for f in dataclasses.fields(SyntheticLmInput)
                               if f.init})
  batch, plain = masked.get_next(), parent.get_next()
  assert batch['ids'].shape == (8, 16)
  np.testing.assert_array_equal(batch['ids'], plain['ids'])
  np.testing.assert_array_equal(batch['labels'], plain['labels'])
  assert np.all(plain['weights'] == 1) and np.all(batch['weights'][:, 0] == 0) and np.all(batch['weights'][:, 1:] == 1)
  # ... and training used them: 8 rows x 15 weighted targets a step, and step 1's loss is the
  # initial model's loss on the masked batch, not on the plain one.
  assert [r['step'] for r in records] == [1, 2]
  assert all(r['tokens_per_sec'] / r['steps_per_sec'] == pytest.approx(8 * 15) for r in records)
  params = jax.device_get(engine.init_state(setup, resolved.experiment.RANDOM_SEED)['params'])

  def loss(b):
    return float(setup.model.apply({'params': params}, {k: jax.numpy.asarray(v) for k, v in b.items()},
                                   deterministic=True, method='fprop')[0])
  assert records[0]['loss'] == pytest.approx(loss(batch), rel=1e-5)
  assert abs(loss(batch) - loss(plain)) > 1e-3


def test_input_errors_are_one_clear_line(tmp_path, capsys):
  def fails(argv, needle):
    code, out, err = pax_main(argv, capsys)
    assert code == 2 and needle in err and 'Traceback' not in err, (code, out, err)
  fails(['inspect-input', str(tmp_path / 'missing-*.tfrecord')], 'No file matches')
  (tmp_path / 'notes.tfrecord').write_text('this is not a TFRecord file at all, just text\n' * 5)
  fails(['inspect-input', str(tmp_path / 'notes.tfrecord')], 'is not a TFRecord file')
  fails(['inspect-input', *TINY, '--split', 'evl'], "Unknown split 'evl'")
  fails(['inspect-input', *TINY, '--set', 'datasets.eval.reset_for_eval=False', '--split', 'eval',
         '--check-sharding'], 'needs eval_loop_num_batches')
  unregistered = tmp_path / 'seqio_exp.py'
  unregistered.write_text(textwrap.dedent('''
      import fiddle as fdl
      from paxcli.inputs.seqio_input import SeqIOInput
      from paxcli.models import LmExperiment
      class NoTask(LmExperiment):
        def datasets(self):
          return [fdl.Config(SeqIOInput, name='train', is_training=True, mixture_name='no_such_task',
                             task_feature_lengths={'targets': 16})]
  '''))
  fails(['inspect-input', '--exp', f'{unregistered}:NoTask'], "No seqio task or mixture is registered as 'no_such_task'")


@pytest.mark.slow  # ~50 s; run by `make test-slow`
def test_seqio_recipe_trains_and_evaluates(tmp_path, capsys):
  code, out, err = pax_main(['train', '--exp', 'seqio_stdlib.StdlibDocsSeqIOLm', '--job-log-dir', str(tmp_path / 's'),
                             '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set', 'HIDDEN_DIMS=64',
                             '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'MAX_SEQ_LEN=32',
                             '--set', 'task.train.num_train_steps=4', '--set', 'EVAL_INTERVAL_STEPS=4',
                             '--set', 'task.train.summary_interval_steps=2'], capsys)
  assert code == 0, err
  records = [json.loads(line) for line in open(tmp_path / 's' / 'train_metrics.jsonl')]
  assert [r['step'] for r in records] == [2, 4] and all(5 < r['loss'] < 9 for r in records)
  evals = [json.loads(line) for line in open(tmp_path / 's' / 'eval_metrics.jsonl')]
  assert evals[0]['step'] == 4 and evals[0]['num_examples'] > 100  # the whole validation split


def test_inspect_input_tells_padding_from_prompts_and_shows_what_a_row_trains_on(tmp_path, capsys):
  """Prompt tokens weigh 0 but are no padding (issue 38, item 9): `padding` is the share after the
  documents, `unweighted` the share inside them that the loss skips, and each example lists the text
  it is trained to say (its completions)."""
  data = tmp_path / 'pairs.jsonl'
  data.write_text(''.join(json.dumps({'prompt': f'Q: What is {i} plus one? A:', 'completion': f' {i + 1}.'}) + '\n'
                          for i in range(40)))
  args = ['inspect-input', '--set', f'TRAIN_DATA={str(data)!r}', '--set', f'EVAL_DATA={str(data)!r}', '--set',
          'VOCAB_SIZE=320', '--set', 'MAX_SEQ_LEN=128', '--set', 'PERCORE_BATCH_SIZE=1', '--set', 'ICI_MESH_SHAPE=[1,1,1]',
          '--num-batches', '1']
  code, out, err = pax_main([*args, '--json'], capsys)
  assert code == 0, err
  record = json.loads(out.splitlines()[0])
  features = {f['feature']: f for f in record['features']}
  assert features['labels']['padding'] < 0.2 and features['labels']['unweighted'] > 0.4   # prompts: most tokens
  trained = record['examples'][0]['trained']
  assert trained and all(re.fullmatch(r' ?\d+\.</s>', t) for t in trained), trained   # completion and EOS
  code, out, err = pax_main(args, capsys)
  assert code == 0 and 'weight 0' in out and 'trained on:' in out, err
