"""GRPO (group relative policy optimisation, as TRL's GRPOTrainer computes it) on an imported model or from
scratch: the model samples NUM_GENERATIONS completions of each prompt with paxcli's own decoder, Python reward
functions score them, and the loss moves it towards the completions that beat their group's mean.

  pax checkpoint convert --from hf Qwen/Qwen2.5-0.5B-Instruct ./qwen
  pax train --exp grpo.Grpo --set BASE=./qwen --set TRAIN_DATA=prompts.jsonl --job-log-dir ./qwen_grpo

each line of prompts.jsonl a prompt and the fields its rewards read: {"prompt": "...", "answer": "..."} (or
{"prompt": [{"role": "user", "content": "..."}], ...}, through the model's chat template). The built-in reward
is exact_match: the completion's answer between ANSWER_START and ANSWER_END (or from the completion's start
when the prompt ends with ANSWER_START) against the record's ANSWER_FIELD. Your own rewards are Python (an
experiment is code): subclass and return them from `reward_functions()`, each called as TRL calls one,
`f(prompts, completions, completion_ids, **fields) -> [float | None, ...]` (paxcli.models.rewards):

  class MyGrpo(grpo.Grpo):
    def reward_functions(self):
      return [rewards.exact_match(), my_format_reward]

The knobs are TRL's GRPOConfig's (NUM_GENERATIONS, MAX_COMPLETION_LENGTH, TEMPERATURE, TOP_P, TOP_K, BETA,
EPSILON, EPSILON_HIGH, NUM_ITERATIONS, LOSS_TYPE, SCALE_REWARDS, REWARD_WEIGHTS) and STOP, stop strings;
each step's global batch (PERCORE_BATCH_SIZE x devices) is one rollout batch of (global batch /
NUM_GENERATIONS) prompts. docs/guides/grpo.md has the whole story.

A CPU example that learns: `python -m paxcli.recipes.grpo DIR` writes a task with a verifiable answer (adding
two numbers 0-4 written in words: "three plus four is" -> "seven"), its word-level tokenizer and prompts into DIR
and prints the command that trains GrpoAddition on them (a model of the default recipe's size, from scratch);
the run writes its reward curve to DIR's job directory (reward_curve.csv and .svg: `plot_reward`).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sys
from typing import Literal, Optional

import fiddle as fdl
import numpy as np
import tokenizers as hf   # the tokenizers library (paxcli reads tokenizer.json with it): the example's tokenizer

from paxcli import files
from paxcli.errors import UserError
from paxcli.experiment import register
from paxcli.inputs import file_input
from paxcli.inputs.rollout_prompts import RolloutPromptsInput
from paxcli import models
from paxcli.jobdir import layout
from paxcli.models import rewards
from paxcli.models.llama import LLAMA
from paxcli.recipes.finetune import Sft


@register
class Grpo(Sft):
  """GRPO on the model imported into BASE (or, without BASE, from scratch) over TRAIN_DATA's prompts."""

  MAX_SEQ_LEN = 256
  PERCORE_BATCH_SIZE = 1
  LEARNING_RATE = 1e-6          # TRL's GRPOConfig default
  LR_SCHEDULE = 'constant'
  LR_WARMUP_STEPS = 0
  NUM_TRAIN_STEPS = 200
  SAVE_INTERVAL_STEPS = 50
  EVAL_INTERVAL_STEPS = 0
  NUM_GENERATIONS: int = 8           # completions sampled per prompt (G)
  MAX_COMPLETION_LENGTH: int = 64    # new tokens per completion at most
  TEMPERATURE: float = 1.0           # sampling temperature; the loss scores the samples at it too
  TOP_P: float = 1.0
  TOP_K: int = 0                     # 0: off
  STOP: list[str] = []               # a completion ends at the first of these strings (or EOS)
  LOSS_TYPE: Literal['grpo', 'bnpo', 'dr_grpo', 'dapo'] = 'dapo'   # TRL's normalisations (paxcli.models.grpo)
  BETA: float = 0.0                  # KL to the reference; 0: no reference kept
  EPSILON: float = 0.2               # the ratio's clip below
  EPSILON_HIGH: Optional[float] = None   # and above (None: EPSILON)
  NUM_ITERATIONS: int = 1            # optimisation steps per rollout batch (TRL's mu)
  SCALE_REWARDS: Literal['group', 'batch', 'none'] = 'group'   # advantages over the group's std, the batch's, none
  KL_BIAS_CORRECTION: bool = True   # the KL term times the ratio (TRL's use_bias_correction_kl)
  REWARD_WEIGHTS: list[float] = []   # one per reward function; []: 1 each
  # TRL's log_completions: each rollout batch (prompt, completion, rewards, advantage a line) into
  # decoder_out/rollouts/decode_step<k>.jsonl of the job directory
  LOG_COMPLETIONS: bool = False
  ANSWER_FIELD: str = 'answer'       # exact_match: the record's field holding the right answer
  ANSWER_START: str = '<answer>'     # exact_match: the marks around the answer in a completion
  ANSWER_END: str = '</answer>'
  replayed = frozenset({'NUM_GENERATIONS', 'MAX_COMPLETION_LENGTH', 'TEMPERATURE', 'TOP_P', 'TOP_K', 'STOP',
                        'LOSS_TYPE', 'BETA', 'EPSILON', 'EPSILON_HIGH', 'NUM_ITERATIONS', 'SCALE_REWARDS',
                        'KL_BIAS_CORRECTION', 'REWARD_WEIGHTS', 'LOG_COMPLETIONS', 'ANSWER_FIELD', 'ANSWER_START',
                        'ANSWER_END'})

  def reward_functions(self) -> list:
    """The reward functions (paxcli.models.rewards' convention); override to add your own."""
    return [rewards.exact_match(self.ANSWER_FIELD, self.ANSWER_START, self.ANSWER_END)]

  def model(self) -> fdl.Config:
    cfg = super().model()
    fdl.update_callable(cfg, models.GrpoLm)   # loaded on first use (jax): `pax experiments` stays quick
    for field, knob in (('loss_type', 'LOSS_TYPE'), ('beta', 'BETA'), ('epsilon', 'EPSILON'),
                        ('epsilon_high', 'EPSILON_HIGH'), ('temperature', 'TEMPERATURE'), ('top_p', 'TOP_P'),
                        ('top_k', 'TOP_K'), ('max_completion_length', 'MAX_COMPLETION_LENGTH'),
                        ('num_generations', 'NUM_GENERATIONS'), ('num_iterations', 'NUM_ITERATIONS'),
                        ('scale_rewards', 'SCALE_REWARDS'), ('kl_bias_correction', 'KL_BIAS_CORRECTION')):
      setattr(cfg, field, getattr(self, knob))
    cfg.stop = tuple(self.STOP)
    return cfg

  def train_config(self) -> fdl.Config:
    train = super().train_config()
    # GRPO's loss sits around 0 with either sign (advantages are centred): a spike over its median means nothing.
    train.loss_spike_factor = 0.0
    return train

  def own_data_datasets(self) -> list:
    """The prompts of TRAIN_DATA (paxcli.inputs.rollout_prompts); none while it is not given."""
    if not self.TRAIN_DATA:
      return []
    if not isinstance(self.TRAIN_DATA, str):
      raise UserError('GRPO reads TRAIN_DATA as a glob of JSONL prompt files; a mixture is not supported.')
    required = sorted({f for fn in self.reward_functions() for f in getattr(fn, 'required_fields', ())})
    return [fdl.Config(RolloutPromptsInput, name='train', is_training=True, data=file_input.anchored(self.TRAIN_DATA),
                       tokenizer=file_input.anchored(self.TOKENIZER), chat_template=self.CHAT_TEMPLATE,
                       seq_len=self.MAX_SEQ_LEN, completion_room=self.MAX_COMPLETION_LENGTH,
                       required_fields=tuple(required), vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED)]

  def datasets(self) -> list:
    own = self.own_data_datasets()
    if not own:
      raise UserError('GRPO samples completions of prompts: set TRAIN_DATA to a JSONL file of '
                      '{"prompt": ..., "answer": ...} records.')
    return own


# ---- the CPU example ------------------------------------------------------------------------------

WORDS = ('zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine', 'ten', 'eleven', 'twelve',
         'thirteen', 'fourteen', 'fifteen', 'sixteen', 'seventeen', 'eighteen')
EXAMPLE_SPECIAL = ('<pad>', '<eos>', '<bos>')
EXAMPLE_WORDS = WORDS + ('plus', 'is', '<answer>', '</answer>')


@register
@LLAMA.preset
class GrpoAddition(Grpo):
  """The CPU example: the default recipe's model size (4 layers, 256 wide), from scratch, learning to add two
  numbers 0-4 written in words by GRPO alone. Each step samples 16 completions of 8 prompts; the answer is the
  completion, one word (the prompt opens <answer>). The mean reward starts near 1/26 (a random word) and rises
  above 0.8 in 60 steps (docs/guides/grpo.md has the curve; 2-3 minutes on 2 shared CPU cores)."""

  NUM_LAYERS = 4
  MODEL_DIMS = 256
  HIDDEN_DIMS = 704
  NUM_HEADS = 4
  VOCAB_SIZE = 26   # the example tokenizer's words
  MAX_SEQ_LEN = 16
  PERCORE_BATCH_SIZE = 128
  ICI_MESH_SHAPE = None
  CHECKPOINT_POLICY = 'none'
  LEARNING_RATE = 1e-4   # 3e-4 and more: each prompt's answer collapses onto one word before it is right
  WEIGHT_DECAY = 0.0
  NUM_TRAIN_STEPS = 60
  SAVE_INTERVAL_STEPS = 30
  SUMMARY_INTERVAL_STEPS = 5
  NUM_GENERATIONS = 16
  MAX_COMPLETION_LENGTH = 1
  LOSS_TYPE = 'dapo'


def example_records(n: int, seed: int, largest: int = 4) -> list[dict]:
  """Additions of two numbers 0-`largest` written in words, the prompt opening the answer span."""
  rng = np.random.default_rng(seed)
  pairs = rng.integers(0, largest + 1, size=(n, 2))
  return [{'prompt': f'{WORDS[a]} plus {WORDS[b]} is <answer>', 'answer': WORDS[a + b]} for a, b in pairs]


def write_word_tokenizer(directory: str) -> str:
  """A word-level tokenizer.json (the tokenizers library) over the example's words, <eos> its end-of-text
  token and <bos> put before each text; its tokenizer_config.json names them."""
  vocab = {w: i for i, w in enumerate(EXAMPLE_SPECIAL + EXAMPLE_WORDS)}
  tok = hf.Tokenizer(hf.models.WordLevel(vocab, unk_token='<pad>'))
  tok.pre_tokenizer = hf.pre_tokenizers.WhitespaceSplit()
  tok.decoder = hf.decoders.WordPiece(prefix='##')   # joins words with spaces
  tok.add_special_tokens(list(EXAMPLE_SPECIAL))
  tok.post_processor = hf.processors.TemplateProcessing(single='<bos> $A', special_tokens=[('<bos>', 2)])
  path = os.path.join(directory, 'tokenizer.json')
  tok.save(path)
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump({'bos_token': '<bos>', 'eos_token': '<eos>', 'pad_token': '<pad>'}, f)
  return path


def write_example(directory: str, n: int = 512, seed: int = 0) -> dict:
  """The example's files in `directory`: prompts.jsonl and tokenizer.json. Returns their paths."""
  os.makedirs(directory, exist_ok=True)
  prompts = os.path.join(directory, 'prompts.jsonl')
  with open(prompts, 'w', encoding='utf-8') as f:
    for record in example_records(n, seed):
      f.write(json.dumps(record) + '\n')
  return {'prompts': prompts, 'tokenizer': write_word_tokenizer(directory)}


def plot_reward(job_dir: str) -> tuple[str, str]:
  """reward_curve.csv (step, reward, reward_std) and reward_curve.svg (the mean reward by step) from a run's
  train_metrics.jsonl, written into the job directory: the curve the docs show."""
  rows = []
  for line in files.read_text(layout.train_metrics(job_dir), 'train metrics', 64 << 20).splitlines():
    record = json.loads(line)
    if 'reward' in record:
      rows.append((int(record['step']), float(record['reward']), float(record.get('reward_std', 0.0))))
  if not rows:
    raise UserError(f'{layout.train_metrics(job_dir)} holds no reward: is {job_dir} a GRPO run?')
  csv_path, svg_path = os.path.join(job_dir, 'reward_curve.csv'), os.path.join(job_dir, 'reward_curve.svg')
  with open(csv_path, 'w', newline='', encoding='utf-8') as f:
    writer = csv.writer(f)
    writer.writerow(['step', 'reward', 'reward_std'])
    writer.writerows(rows)
  with open(svg_path, 'w', encoding='utf-8') as f:
    f.write(reward_svg([(s, r) for s, r, _ in rows]))
  return csv_path, svg_path


def reward_svg(points: list[tuple[int, float]], width: int = 560, height: int = 280) -> str:
  """A line chart of (step, mean reward in [0, 1]) as SVG text: axes, ticks at 0, 0.5 and 1, the curve."""
  left, right, top, bottom = 50, 20, 20, 40
  last = max(s for s, _ in points) or 1
  x = lambda s: left + (width - left - right) * s / last
  y = lambda r: top + (height - top - bottom) * (1 - min(max(r, 0.0), 1.0))
  line = ' '.join(f'{x(s):.1f},{y(r):.1f}' for s, r in points)
  ticks = ''.join(f'<line x1="{left}" x2="{width - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>'
                  f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}</text>' for v in (0, 0.5, 1))
  steps = ''.join(f'<text x="{x(s):.1f}" y="{height - bottom + 16}" text-anchor="middle">{s}</text>'
                  for s in sorted({points[0][0], points[len(points) // 2][0], last}))
  return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
          f'font-size="12">{ticks}{steps}'
          f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{line}"/>'
          f'<text x="{(left + width - right) / 2}" y="{height - 6}" text-anchor="middle">step</text>'
          f'<text x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
          f'transform="rotate(-90 14 {(top + height - bottom) / 2})">mean reward</text></svg>\n')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description='Write the GRPO addition example into DIR and print how to run it.')
  parser.add_argument('directory')
  parser.add_argument('--plot', metavar='JOB_DIR', help='write reward_curve.csv and .svg of a finished run instead')
  args = parser.parse_args(argv)
  if args.plot:
    for path in plot_reward(args.plot):
      print(path)
    return
  paths = write_example(args.directory)
  job = os.path.join(args.directory, 'job')
  print('Train (the mean reward rises from about 0.05 to above 0.8):\n  pax train --exp grpo.GrpoAddition '
        f'--set TRAIN_DATA={shlex.quote(paths["prompts"])} --set TOKENIZER={shlex.quote(paths["tokenizer"])} '
        f'--job-log-dir {shlex.quote(job)}\nThen the curve:\n  python -m paxcli.recipes.grpo {shlex.quote(args.directory)} '
        f'--plot {shlex.quote(job)}')


if __name__ == '__main__':
  main(sys.argv[1:])
