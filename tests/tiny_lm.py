"""A tiny trained Llama-shaped LM with its own tokenizer, and its Hugging Face export: for tests that
check paxcli against a Hugging Face client on the same weights (lm-evaluation-harness' `hf` backend).

The built-in default experiment at a tiny size: a 512-piece sentencepiece model trained on stdlib
docstrings (no download), 2 layers of 32, 300 steps (loss about 3.9 against ln 512 = 6.2: enough that
greedy decoding says more than spaces), then `pax checkpoint convert JOB OUT --to hf`. About a minute on
2 cores; build it once per module.
"""

from __future__ import annotations

import os

EXP = 'default.StdlibDocsLm'
KNOBS = ['NUM_LAYERS=2', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'VOCAB_SIZE=512', 'MAX_SEQ_LEN=64',
         'PERCORE_BATCH_SIZE=1', 'NUM_TRAIN_STEPS=300', 'SAVE_INTERVAL_STEPS=300', 'SUMMARY_INTERVAL_STEPS=100',
         'EVAL_INTERVAL_STEPS=0', 'DECODE_INTERVAL_STEPS=0', 'LEARNING_RATE=0.01', 'LR_WARMUP_STEPS=5']


def sets(knobs=KNOBS) -> list[str]:
  return [a for k in knobs for a in ('--set', k)]


def train_and_export(base) -> tuple[str, str]:
  """(job directory, its HF export) under `base`."""
  from paxcli.cli.app import main
  job, hf = os.path.join(base, 'job'), os.path.join(base, 'hf')
  for argv in (['train', '--exp', EXP, *sets(), '--job-log-dir', job],
               ['checkpoint', 'convert', job, hf, '--to', 'hf']):
    try:
      main(argv)
    except SystemExit as e:
      assert not e.code, argv
  return job, hf
