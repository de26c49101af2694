"""Inputs: TFRecord on tf.data, host sharding, Pax eval semantics, SeqIO, resume positions."""

import os

import numpy as np
import pytest

from paxcli.errors import UserError
from paxcli.loops.evaluate import EvalReader, check_semantics
from paxcli.inputs.base import EndOfInput
from paxcli.inputs.synthetic import SyntheticLmInput
from paxcli.inputs.tfrecord import TFRecordInput


def write_tfrecord(path, records):
  """records: list of {name: list of int | float | bytes}."""
  import tensorflow as tf
  with tf.io.TFRecordWriter(str(path)) as writer:
    for rec in records:
      feature = {}
      for name, values in rec.items():
        if isinstance(values[0], bytes):
          feature[name] = tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
        elif isinstance(values[0], float):
          feature[name] = tf.train.Feature(float_list=tf.train.FloatList(value=values))
        else:
          feature[name] = tf.train.Feature(int64_list=tf.train.Int64List(value=values))
      writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def token_records(n, seed=0):
  rng = np.random.default_rng(seed)
  return [{'targets': [int(x) for x in rng.integers(1, 50, size=int(rng.integers(3, 12)))],
           'score': [float(i)], 'name': [f'doc{i}'.encode()]} for i in range(n)]


def read_all(inp):
  out = []
  while True:
    try:
      out.append(inp.get_next())
    except EndOfInput:
      return out


def test_tfrecord_reads_back_exactly(tmp_path):
  records = token_records(7)
  write_tfrecord(tmp_path / 'data.tfrecord', records)
  inp = TFRecordInput(file_pattern=str(tmp_path / '*.tfrecord'), batch_size=3, seq_len=12, shuffle=False,
                      repeat=False, num_infeed_hosts=1, infeed_host_index=0)
  assert inp.features == {'name': 'bytes', 'score': 'float', 'targets': 'int64'}  # inferred
  batches = read_all(inp)
  assert [b['targets'].shape for b in batches] == [(3, 12)] * 3  # last batch padded to 3 rows
  for i, rec in enumerate(records):
    b, r = divmod(i, 3)
    row = batches[b]['targets'][r]
    assert list(row[:len(rec['targets'])]) == rec['targets'] and not row[len(rec['targets']):].any()
    assert batches[b]['score'][r][0] == rec['score'][0]
    assert batches[b]['name'][r][0] == rec['name'][0]
  assert not batches[2]['targets'][1:].any()  # the two padding rows

  lm = TFRecordInput(file_pattern=str(tmp_path / 'data.tfrecord'), batch_size=7, seq_len=6, lm_feature='targets',
                     shuffle=False, repeat=False, num_infeed_hosts=1, infeed_host_index=0)
  batch = lm.get_next()
  for r, rec in enumerate(records):
    tokens = rec['targets'][:7]
    n = len(tokens) - 1
    assert list(batch['ids'][r][:n]) == tokens[:-1] and list(batch['labels'][r][:n]) == tokens[1:]
    assert list(batch['weights'][r]) == [1.0] * n + [0.0] * (6 - n)


@pytest.mark.parametrize('num_files,num_hosts', [(4, 2), (3, 4), (1, 3)])
def test_host_shards_are_disjoint_and_complete(tmp_path, num_files, num_hosts):
  names = []
  for f in range(num_files):
    recs = [{'name': [f'f{f}r{i}'.encode()]} for i in range(5 + f)]
    names += [r['name'][0] for r in recs]
    write_tfrecord(tmp_path / f'part-{f}.tfrecord', recs)
  seen = []
  for host in range(num_hosts):
    inp = TFRecordInput(file_pattern=str(tmp_path / 'part-*'), batch_size=2, repeat=False, shuffle=True, seed=3,
                        num_infeed_hosts=num_hosts, infeed_host_index=host)
    got = [v[0] for b in read_all(inp) for v in b['name'] if len(v[0])]
    seen.append(got)
  flat = [x for host in seen for x in host]
  assert sorted(flat) == sorted(names)  # complete, and (no duplicates) disjoint
  assert all(seen)  # every host has data


def test_tfrecord_skip_continues_where_it_stopped(tmp_path):
  write_tfrecord(tmp_path / 'd.tfrecord', token_records(40))
  make = lambda: TFRecordInput(file_pattern=str(tmp_path / 'd.tfrecord'), batch_size=4, seq_len=8,
                               lm_feature='targets', seed=5, num_infeed_hosts=1, infeed_host_index=0)
  straight = make()
  expected = [straight.get_next() for _ in range(15)]  # spans more than one epoch (10 batches)
  resumed = make()
  resumed.skip(6)
  for want in expected[6:]:
    got = resumed.get_next()
    np.testing.assert_array_equal(got['ids'], want['ids'])


def _synthetic(**kw):
  return SyntheticLmInput(name='e', is_training=False, seq_len=4, vocab_size=20, batch_size=2, num_infeed_hosts=1,
                          infeed_host_index=0, **kw)


def test_eval_semantics_rows():
  # (True, None): one epoch of a finite input.
  reader = EvalReader(_synthetic(num_batches=3, repeat=False, reset_for_eval=True), {})
  first = [b['ids'] for b in reader.batches()]
  again = [b['ids'] for b in reader.batches()]
  assert len(first) == 3 and all((a == b).all() for a, b in zip(first, again))
  # (False, N): the next N batches each run, rolling on.
  rolling = _synthetic(repeat=True, reset_for_eval=False, eval_loop_num_batches=2)
  reader = EvalReader(rolling, {})
  run1, run2 = list(reader.batches()), list(reader.batches())
  assert len(run1) == len(run2) == 2 and rolling.batches_read == 4
  assert not (run1[0]['ids'] == run2[0]['ids']).all()
  # The rows that make no sense are refused, with the table.
  with pytest.raises(UserError, match='same first 2 batches'):
    check_semantics(_synthetic(num_batches=3, repeat=False, reset_for_eval=True, eval_loop_num_batches=2))
  with pytest.raises(UserError, match='needs eval_loop_num_batches'):
    check_semantics(_synthetic(repeat=True, reset_for_eval=False))
  with pytest.raises(UserError, match='repeats forever'):
    check_semantics(_synthetic(repeat=True, reset_for_eval=True))
  with pytest.raises(UserError, match='needs a repeating input'):
    check_semantics(_synthetic(num_batches=2, repeat=False, reset_for_eval=False, eval_loop_num_batches=1))


def test_eval_padding_gives_exact_metrics_over_four_hosts(tmp_path):
  """10 examples over 4 hosts (3, 3, 2, 2 records): short hosts pad; metrics equal one pass."""
  import jax

  from paxcli import config

  from paxcli.runtime import engine

  from paxcli.runtime import sharding
  from paxcli.loops.evaluate import make_eval_step
  from paxcli.runtime.sharding import to_global
  write_tfrecord(tmp_path / 'eval.tfrecord', token_records(10, seed=1))
  resolved = config.resolve('lm_cloud.LmCloudSpmdTest', ['MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4',
                                                         'PERCORE_BATCH_SIZE=1', 'MAX_SEQ_LEN=8', 'VOCAB_SIZE=64'])
  setup = engine.build(resolved)  # 8 devices, global batch 8 = 4 hosts x 2 rows
  params = engine.init_state(setup, 0)['params']
  batch_sharding = sharding.batch_sharding(setup.mesh)
  step = make_eval_step(setup, batch_sharding)
  common = dict(file_pattern=str(tmp_path / 'eval.tfrecord'), seq_len=8, lm_feature='targets', shuffle=False,
                repeat=False, reset_for_eval=True, is_training=False)
  readers = [EvalReader(TFRecordInput(batch_size=2, num_infeed_hosts=4, infeed_host_index=h, **common), {})
             for h in range(4)]
  KEYS = ('loss/sum', 'accuracy/sum', 'loss/weight', 'examples')  # noqa: N806
  totals = np.zeros(4)
  steps = 0
  while True:
    pieces = [r.next() for r in readers]
    if not any(has for _, has in pieces):  # what the collective decides
      break
    steps += 1
    global_batch = {k: np.concatenate([b[k] for b, _ in pieces]) for k in pieces[0][0]}
    sums = step({'params': params}, to_global(global_batch, batch_sharding, 8))
    totals += [float(sums[k]) for k in KEYS]
  assert steps == 2  # hosts hold 2, 2, 1, 1 batches
  # The reference: all 10 examples in one host's single pass (16 rows, 6 of them padding).
  single = TFRecordInput(batch_size=16, num_infeed_hosts=1, infeed_host_index=0, **common).get_next()
  ref = step({'params': params}, to_global(single, batch_sharding, 16))
  assert totals[3] == 10
  np.testing.assert_allclose(totals[:3], [float(ref[k]) for k in KEYS[:3]], rtol=1e-5)
  assert len(jax.devices()) == 8


@pytest.fixture(scope='module')
def seqio_task():
  from paxcli.inputs.corpus import register_seqio_task
  return register_seqio_task(2048)


def test_seqio_input_on_a_local_task(seqio_task):
  from paxcli.inputs.seqio_input import SeqIOInput
  common = dict(mixture_name=seqio_task, task_feature_lengths={'targets': 64}, batch_size=4, seed=1)
  packed = SeqIOInput(split_name='train', pack=True, is_training=True, num_infeed_hosts=1, infeed_host_index=0,
                      **common)
  batch = packed.get_next()
  assert set(batch) == {'ids', 'labels', 'weights', 'segment_ids', 'positions'}
  assert batch['ids'].shape == (4, 64)
  assert batch['segment_ids'].max() > 1  # several documents packed in a row
  # Decoder inputs are the targets shifted right within each segment.
  row = batch['labels'][0]
  assert (batch['ids'][0][1:10] == row[:9]).all() or batch['segment_ids'][0][1] != batch['segment_ids'][0][0]
  text = packed.ids_to_strings(batch['labels'][:1])[0]
  assert len(text) > 40 and text.isprintable()


def test_seqio_hosts_read_disjoint_complete_shards(seqio_task, tmp_path):
  import functools

  import seqio
  import tensorflow as tf

  from paxcli.inputs.corpus import write_tfrecords
  from paxcli.inputs.seqio_input import SeqIOInput
  texts = [f'document {i}: ' + ' '.join(['word'] * (i % 5 + 1)) for i in range(23)]
  write_tfrecord(tmp_path / 'docs.tfrecord', [{'text': [t.encode()]} for t in texts])
  vocab = seqio.SentencePieceVocabulary(write_tfrecords(2048)['spm'])
  name = f'unique_docs_{os.getpid()}'
  seqio.TaskRegistry.add(
      name, source=seqio.TFExampleDataSource({'validation': str(tmp_path / 'docs.tfrecord')},
                                             {'text': tf.io.FixedLenFeature([], tf.string)}),
      preprocessors=[functools.partial(seqio.preprocessors.rekey, key_map={'targets': 'text'}),
                     seqio.preprocessors.tokenize, seqio.preprocessors.append_eos_after_trim],
      output_features={'targets': seqio.Feature(vocab, add_eos=True)})
  hosts = []
  for h in range(3):
    inp = SeqIOInput(mixture_name=name, split_name='validation', task_feature_lengths={'targets': 32},
                     batch_size=2, pack=False, repeat=False, reset_for_eval=True, num_infeed_hosts=3,
                     infeed_host_index=h)
    rows = [(r, w) for b in read_all(inp) for r, w in zip(b['labels'], b['weights']) if w.any()]
    hosts.append(inp.ids_to_strings([r for r, _ in rows], [int(w.sum()) for _, w in rows]))
  assert all(hosts)
  assert sorted(t for host in hosts for t in host) == sorted(texts)  # disjoint and complete


def test_seqio_errors(seqio_task):
  from paxcli.inputs.seqio_input import SeqIOInput
  with pytest.raises(UserError, match='No seqio task or mixture is registered'):
    SeqIOInput(mixture_name='stdlib_doc', task_feature_lengths={'targets': 8})
  with pytest.raises(UserError, match="no split 'test'"):
    SeqIOInput(mixture_name=seqio_task, split_name='test', task_feature_lengths={'targets': 8})


def test_synthetic_and_corpus_are_defined_per_global_batch():
  """Host h of n gets its block of the global batch one process would read alone."""
  from paxcli.inputs.corpus import StdlibDocsInput
  for cls, extra in ((SyntheticLmInput, {}), (StdlibDocsInput, {'vocab_size': 2048})):
    whole = cls(batch_size=8, num_infeed_hosts=1, infeed_host_index=0, seq_len=16, is_training=True, **extra)
    parts = [cls(batch_size=2, num_infeed_hosts=4, infeed_host_index=h, seq_len=16, is_training=True, **extra)
             for h in range(4)]
    for _ in range(3):
      want = whole.get_next()['ids']
      got = np.concatenate([p.get_next()['ids'] for p in parts])
      np.testing.assert_array_equal(got, want)
