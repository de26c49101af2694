"""ClassificationModel: a second model family trained and evaluated by the same engine.

Docstrings of 8 standard-library packages (no download); chance is 1/8 and answering the
largest package always scores about 0.18. The test trains a small classifier briefly and
asks for eval accuracy of at least 0.30 (the margin stated in the issue's note).
"""

import json

from conftest import pax_main

SETS = ['NUM_LAYERS=1', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=2', 'MAX_SEQ_LEN=32', 'PERCORE_BATCH_SIZE=4',
        'NUM_TRAIN_STEPS=150', 'LR_DECAY_END=150', 'EVAL_INTERVAL_STEPS=150', 'SUMMARY_INTERVAL_STEPS=50',
        'SAVE_INTERVAL_STEPS=150']


def test_classifier_learns_stdlib_packages_and_reports_accuracy_in_eval(tmp_path, capsys):
  sets = [a for kv in SETS for a in ('--set', kv)]
  job = str(tmp_path / 'cls')
  code, out, err = pax_main(['train', '--exp', 'classify.StdlibDocsClassifier', *sets, '--job-log-dir', job], capsys)
  assert code == 0, err[-3000:]
  assert 'eval' in out and 'accuracy' in out
  code, out, err = pax_main(['eval', '--exp', 'classify.StdlibDocsClassifier', *sets, '--job-log-dir', job,
                             '--json'], capsys)
  assert code == 0, err[-3000:]
  metrics = json.loads(out.strip().splitlines()[-1])['results']['eval']
  assert metrics['num_examples'] > 100
  assert metrics['accuracy'] >= 0.30, metrics  # chance 0.125, majority class ~0.18
