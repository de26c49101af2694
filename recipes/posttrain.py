"""Preference tuning of an imported model, any family: DPO (sigmoid, label smoothing), robust DPO, hinge, IPO,
SimPO and ORPO, full or LoRA, on JSONL preference pairs (docs/guides/preference-tuning.md).

Import the model once, then tune it into a new job directory, as SFT does (recipes/finetune.py):

  pax checkpoint convert --from hf Qwen/Qwen2.5-0.5B-Instruct ./qwen
  pax train --exp posttrain.Dpo --set BASE=./qwen --set TRAIN_DATA=prefs.jsonl --job-log-dir ./qwen_dpo
  pax checkpoint convert ./qwen_dpo ./qwen_dpo_hf --to hf

each line of prefs.jsonl being {"prompt": ..., "chosen": ..., "rejected": ...}: plain text, or chat messages
read through the model's own chat template (paxcli.inputs.preference). The loss counts the completions' tokens
only. LOSS_TYPE picks the loss (Ipo, SimPo and Orpo are Dpo with theirs), BETA its strength; the reference
of the losses that have one is the starting model: a copy of its weights kept in the train state, or with
LORA_RANK > 0 the same weights with the adapters off, or its log-probabilities of every pair computed once before
the first step and kept in the job (REFERENCE; paxcli.models.preference). The log line
shows loss, rewards/margins and rewards/accuracies; TensorBoard, train_metrics.jsonl and the trackers get
every metric under TRL's names (rewards/chosen, rewards/rejected, logps/chosen, ...).

A tiny example that runs on a CPU in about a minute: `python -m paxcli.recipes.posttrain DIR` writes the
fine-tuning example's random Llama and tokenizer (recipes/finetune.py) and preference pairs of its colour
task into DIR, and prints the commands that import it and tune it with TinyDpo.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Optional

import fiddle as fdl

from paxcli import models
from paxcli.errors import UserError
from paxcli.experiment import register
from paxcli.inputs import file_input, preference
from paxcli.models.lm_experiment import _prepared_data
from paxcli.options import BadPairsName, PreferenceLossName, PreferenceReferenceName, TruncationName
from paxcli.recipes import finetune


@register
class Dpo(finetune.Sft):
  """Preference-tunes the model imported into BASE on TRAIN_DATA's pairs (DPO unless LOSS_TYPE says otherwise)."""

  LOSS_TYPE: PreferenceLossName = 'sigmoid'   # sigmoid (DPO), robust, hinge, ipo, simpo, orpo: TRL's loss_type
  BETA: float = 0.1                # the loss's beta (TRL's): how far from the reference; SimPO's reward scale
  LABEL_SMOOTHING: float = 0.0     # conservative DPO (sigmoid), robust DPO and SimPO: the chance a label is wrong
  SIMPO_GAMMA: float = 0.5         # SimPO's target reward margin
  CPO_ALPHA: float = 0.0           # SimPO: weight of an NLL term on the chosen completions (TRL's cpo_alpha)
  # The reference model of every loss but SimPO and ORPO: 'auto' is 'adapters_off' with LoRA (the same weights,
  # adapters off: no second copy) and 'copy' without (a frozen copy of the starting weights in the train state);
  # 'precomputed': each pair's reference log-probabilities, computed once before the first step, kept in the job
  REFERENCE: PreferenceReferenceName = 'auto'
  # A side longer than MAX_SEQ_LEN + 1 tokens: 'completion' cuts the completion's end (TRL's keep_start); 'none'
  # makes it a bad pair. A prompt that leaves no room for the completion is a bad pair either way.
  TRUNCATION: TruncationName = 'completion'
  # Bad pairs (a missing field, an empty completion, chosen identical to rejected, one that does not fit):
  # 'error' stops before anything compiles in one line naming the file and line; 'skip' leaves them out, counted
  BAD_PAIRS: BadPairsName = 'error'
  MAX_SEQ_LEN = 1024
  LEARNING_RATE = 1e-6
  LR_SCHEDULE = 'linear_rampup_cosine_decay'
  LR_WARMUP_STEPS = 10
  replayed = frozenset({'LOSS_TYPE', 'BETA', 'LABEL_SMOOTHING', 'SIMPO_GAMMA', 'CPO_ALPHA', 'REFERENCE', 'TRUNCATION',
                        'BAD_PAIRS'})

  def model(self) -> fdl.Config:
    """The LM of the base's knobs as a PreferenceLm (paxcli.models.preference), with the loss's settings."""
    cfg = super().model()
    fdl.update_callable(cfg, models.PreferenceLm)
    cfg.loss_type, cfg.beta, cfg.label_smoothing = self.LOSS_TYPE, self.BETA, self.LABEL_SMOOTHING
    cfg.simpo_gamma, cfg.cpo_alpha, cfg.reference = self.SIMPO_GAMMA, self.CPO_ALPHA, self.REFERENCE
    return cfg

  def _own_data_prompts(self) -> list:
    """None from the pairs (decoding while training decodes DECODE_PROMPTS, when set)."""
    return []

  def datasets(self) -> list:
    """Synthetic pairs when no TRAIN_DATA is given (plans, benchmarks: the run says so in a line); TRAIN_DATA's
    pairs replace them (LmExperiment puts own_data_datasets() first)."""
    common = dict(seq_len=self.MAX_SEQ_LEN, vocab_size=self.VOCAB_SIZE,
                  precomputed_reference=self.REFERENCE == 'precomputed')
    return [fdl.Config(preference.SyntheticPreferenceInput, name='train', is_training=True, seed=self.RANDOM_SEED,
                       **common),
            fdl.Config(preference.SyntheticPreferenceInput, name='eval', is_training=False, seed=self.RANDOM_SEED + 1,
                       num_batches=2, repeat=False, reset_for_eval=True, **common)]

  def own_data_datasets(self) -> list:
    """Preference inputs over TRAIN_DATA and EVAL_DATA (paxcli.inputs.preference), or [] when neither is set."""
    if not (self.TRAIN_DATA or self.EVAL_DATA):
      return []
    if not self.TRAIN_DATA:
      raise UserError('EVAL_DATA needs TRAIN_DATA (a glob of your preference JSONL files).')
    train, evals = file_input.anchored(self.TRAIN_DATA), file_input.anchored(self.EVAL_DATA)
    if _prepared_data(train):
      raise UserError(f'TRAIN_DATA {train} is prepared data (token ids); preference pairs are read from JSONL files '
                      '({"prompt", "chosen", "rejected"} a line).')
    common = dict(seq_len=self.MAX_SEQ_LEN, tokenizer=file_input.anchored(self.TOKENIZER), vocab_size=self.VOCAB_SIZE,
                  seed=self.RANDOM_SEED, chat_template=self.CHAT_TEMPLATE, truncation=self.TRUNCATION,
                  bad_pairs=self.BAD_PAIRS, precomputed_reference=self.REFERENCE == 'precomputed')
    return [
        fdl.Config(preference.PreferenceInput, name='train', is_training=True, data=train,
                   split='all' if evals else 'train', **common),
        fdl.Config(preference.PreferenceInput, name='eval', is_training=False, repeat=False, reset_for_eval=True,
                   data=evals or train, split='all' if evals else 'eval', **common),
    ]


@register
class Ipo(Dpo):
  """Dpo with IPO's squared loss (log-ratios per completion token, as TRL)."""
  LOSS_TYPE = 'ipo'


@register
class SimPo(Dpo):
  """Dpo with SimPO's loss: mean log-probabilities, a target margin, no reference (TRL's CPOTrainer, simpo)."""
  LOSS_TYPE = 'simpo'
  BETA = 2.0
  SIMPO_GAMMA = 1.0


@register
class Orpo(Dpo):
  """Dpo with ORPO's loss: the chosen side's NLL less BETA x the log odds ratio, no reference (TRL's ORPOTrainer)."""
  LOSS_TYPE = 'orpo'
  LEARNING_RATE = 1e-5


@register
class TinyDpo(Dpo):
  """The example's settings: rows of 64 tokens, a high learning rate, 40 steps (under a minute on CPU)."""

  MAX_SEQ_LEN = 64
  PERCORE_BATCH_SIZE = 2
  LEARNING_RATE = 1e-3
  LR_WARMUP_STEPS = 5
  NUM_TRAIN_STEPS = 40
  SAVE_INTERVAL_STEPS = 40
  EVAL_INTERVAL_STEPS = 20
  SUMMARY_INTERVAL_STEPS = 10
  ICI_MESH_SHAPE = None


# ---- the tiny example -----------------------------------------------------------------------------

WRONG = {'blue': 'red', 'green': 'purple', 'white': 'black', 'black': 'white', 'red': 'green', 'yellow': 'blue'}


def example_pairs(n: int, seed: int) -> list[dict]:
  """Pairs of the fine-tuning example's colour task: the right colour chosen, a wrong one rejected."""
  pairs = []
  for r in finetune.example_records(n, seed):
    colour = r['completion'].rstrip('.').rsplit(' ', 1)[1]
    pairs.append({'prompt': r['prompt'], 'chosen': r['completion'],
                  'rejected': r['completion'].replace(f' {colour}.', f' {WRONG[colour]}.')})
  return pairs


def write_example(directory: str) -> dict:
  """The fine-tuning example's model and tokenizer (DIR/hf) and train/eval preference pairs; their paths."""
  made = finetune.write_example(directory)
  paths = {'hf': made['hf'], 'train': os.path.join(directory, 'prefs.jsonl'),
           'eval': os.path.join(directory, 'prefs_eval.jsonl')}
  for name, seed, n in (('train', 0, 400), ('eval', 1, 40)):
    with open(paths[name], 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(p) + '\n' for p in example_pairs(n, seed))
  return paths


def main(argv: Optional[list[str]] = None) -> int:
  """`python -m paxcli.recipes.posttrain DIR`: writes the tiny example into DIR and prints what to run next."""
  parser = argparse.ArgumentParser(
      prog='python -m paxcli.recipes.posttrain',
      description='Write the tiny preference-tuning example into DIR: a random Llama in Hugging Face\'s layout with '
                  'its tokenizer (DIR/hf) and preference pairs (DIR/prefs.jsonl, DIR/prefs_eval.jsonl); then print '
                  'the commands that import and tune it.')
  parser.add_argument('directory', metavar='DIR', help='where to write the example (a new or empty directory)')
  args = parser.parse_args(argv)
  out = os.path.abspath(args.directory)
  if os.path.lexists(out) and (not os.path.isdir(out) or os.listdir(out)):
    parser.exit(2, f'error: {args.directory} exists; give a new or empty directory.\n')
  made = write_example(out)
  here = lambda path: shlex.quote(path if os.path.relpath(path).startswith('..') else os.path.relpath(path))
  base, job = os.path.join(out, 'llama'), os.path.join(out, 'dpo')
  print('\n'.join([
      f'Wrote the tiny example into {here(out)}: a random Llama ({here(made["hf"])}) and preference pairs '
      f'({here(made["train"])}, {here(made["eval"])}).', '',
      'Import the model, then tune it with DPO (about a minute on a CPU):',
      f'  pax checkpoint convert --from hf {here(made["hf"])} {here(base)}',
      f'  pax train --exp posttrain.TinyDpo --set BASE={here(base)} --set TRAIN_DATA={here(made["train"])} '
      f'--set EVAL_DATA={here(made["eval"])} --job-log-dir {here(job)}',
      f'  pax checkpoint convert {here(job)} {here(job + "_hf")} --to hf     # for transformers']))
  return 0


if __name__ == '__main__':
  sys.exit(main())
