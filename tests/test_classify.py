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


def test_the_classifier_has_training_knobs_and_its_own_model_knobs_only(capsys):
  code, out, err = pax_main(['describe', '--exp', 'classify.StdlibDocsClassifier'], capsys)
  assert code == 0, err
  knobs = {line.split(' = ')[0][len('knobs.'):] for line in out.splitlines() if line.startswith('knobs.')}
  assert {'LEARNING_RATE', 'LR_SCHEDULE', 'NUM_TRAIN_STEPS', 'EVAL_INTERVAL_STEPS', 'NUM_CLASSES', 'NUM_HEADS'} <= knobs
  lm_only = {'USE_BIAS', 'NORM_EPSILON', 'POSITION_EMBEDDING', 'DECODE_PROMPTS', 'NUM_STAGES', 'CHECKPOINT_POLICY',
             'FPROP_DTYPE', 'SEPARATE_EMBEDDING', 'ATTENTION_IMPL', 'USE_REPEATED_LAYER'}
  assert not knobs & lm_only, knobs & lm_only
  assert 'task.model.num_classes = 8' in out and 'FLOPs per token: 639 KFLOP' in out
