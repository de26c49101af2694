"""Supervised fine-tuning of an imported model, any family (Llama, Qwen, Gemma, Mistral, ...), on
prompt/completion or chat JSONL.

Import the model once, then fine-tune it into a new job directory; the loss counts the completions
(or the assistant turns of a chat) only (paxcli.inputs.sft, paxcli.inputs.chat_template):

  pax checkpoint convert --from hf Qwen/Qwen2.5-0.5B-Instruct ./qwen
  pax train --exp finetune.Sft --set BASE=./qwen --set TRAIN_DATA=sft.jsonl \\
      --set EVAL_DATA=sft_eval.jsonl --job-log-dir ./qwen_sft
  pax eval --job-log-dir ./qwen_sft       # the job's experiment and settings, from its directory

each line of sft.jsonl being {"prompt": "...", "completion": "..."} (or {"messages": [...]}, read
through the model's own chat template). The commands are the same for every family: BASE is the
converted job directory; the model's knobs are read from the recipe the import kept there (as data,
never run), its parameters start the run (INIT_FROM; BASE is only read) and its tokenizer as shipped
(tokenizer.json or tokenizer.model, with its special tokens and chat templates) reads the data. Every
one of these can still be set with --set; MAX_SEQ_LEN is the fine-tune's own (BASE's is the model's
longest context). LlamaSft and TinyLlamaSft are the names these had when only Llama was covered.

A tiny example that runs on a CPU in about a minute: `python -m paxcli.recipes.finetune DIR
[--family NAME]` writes a random model of the family (Llama by default: 2 layers, config.json with
Llama 3's rope_scaling) in Hugging Face's layout, a tokenizer in the family's style (its special
tokens and chat template) and prompt/completion and chat files into DIR, and prints the commands above
for them with the TinySft settings. Measured on 1 CPU device (Llama): the completion loss on the eval
pairs is 14.1 for the random base and 0.005 after the 60 steps (33 s for the train command, 8 s of it
compiling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import types
from typing import Optional

import numpy as np

from paxcli import files, gencode
from paxcli.errors import UserError
from paxcli.experiment import register
from paxcli.jobdir import layout
from paxcli.models import LmExperiment, registry
from paxcli.models.knobs import LM_KNOB, LM_KNOBS, effective

# Knobs of the base that belong to the fine-tune instead (the model's longest context is no row length).
OWN_KNOBS = ('MAX_SEQ_LEN',)


@register
class Sft(LmExperiment):
  """Fine-tunes the model imported into BASE (a job directory) on TRAIN_DATA, completions only."""

  BASE: Optional[str] = None   # the job directory `pax checkpoint convert --from hf` wrote
  replayed = frozenset({'BASE'})   # the weights it starts from, read: a job's record may name them
  MAX_SEQ_LEN = 512
  PERCORE_BATCH_SIZE = 1
  LEARNING_RATE = 2e-5
  LR_SCHEDULE = 'linear_rampup_cosine_decay'
  LR_WARMUP_STEPS = 10
  LR_MIN_RATIO = 0.1
  NUM_TRAIN_STEPS = 200
  SAVE_INTERVAL_STEPS = 100
  EVAL_INTERVAL_STEPS = 50

  def __init__(self):
    super().__init__()
    if self.BASE:   # set in a subclass; --set BASE=... goes through set_knob
      self._adopt_base()

  def set_knob(self, name: str, raw) -> None:
    super().set_knob(name, raw)
    if name == 'BASE' and self.BASE:
      self._adopt_base()

  def own_data_datasets(self) -> list:
    """No inputs while no data is given: TOKENIZER alone is BASE's, not the user's, and `pax decode`
    of the fine-tuned job (which reads its tokenizer from the job) needs no TRAIN_DATA."""
    if not (self.TRAIN_DATA or self.EVAL_DATA):
      return []
    return super().own_data_datasets()

  def _adopt_base(self) -> None:
    """The base's knobs become this experiment's defaults (a subclass made for this instance), so
    that what --set gives still wins and `pax` reports those as the command line's."""
    base = os.path.abspath(os.path.expanduser(self.BASE))
    defaults = {k: v for k, v in base_knobs(base).items() if k not in OWN_KNOBS}
    defaults['INIT_FROM'] = base
    if os.path.isfile(layout.tokenizer(base)):
      defaults['TOKENIZER'] = layout.tokenizer(base)
    cls = type(self)
    self.__class__ = type(cls.__name__, (cls,), {'_registered_name': cls.registered_name(), **defaults})
    self.BASE = base


def base_knobs(job_dir: str) -> dict:
  """The model knobs of the recipe an import wrote into `job_dir`, read as data (gencode.knobs_of)."""
  path = files.member(job_dir, layout.RECIPE_COPY, 'recipe')
  if not os.path.isfile(path):
    raise UserError(f'BASE {job_dir} holds no {layout.RECIPE_COPY}: give the directory `pax checkpoint convert '
                    '--from hf MODEL_DIR OUT` wrote (OUT).')
  classes = gencode.check_shape(files.read_text(path, 'recipe', 1 << 20), path)
  if len(classes) != 1:
    raise UserError(f'{path} holds {len(classes)} experiment classes; an import writes one.')
  return {k: v for k, v in next(iter(classes.values())).items() if k in LM_KNOB}


@register
class LlamaSft(Sft):
  """Sft under the name it had when the tutorial covered Llama only (any family's BASE works)."""


@register
class TinySft(Sft):
  """The example's settings: rows of 64 tokens, a high learning rate, 60 steps (under a minute on CPU)."""

  MAX_SEQ_LEN = 64
  PERCORE_BATCH_SIZE = 1
  LEARNING_RATE = 3e-3
  LR_WARMUP_STEPS = 5
  NUM_TRAIN_STEPS = 60
  SAVE_INTERVAL_STEPS = 60
  EVAL_INTERVAL_STEPS = 30
  SUMMARY_INTERVAL_STEPS = 10
  ICI_MESH_SHAPE = None


@register
class TinyLlamaSft(TinySft):
  """TinySft under its earlier name."""


# ---- the tiny example -----------------------------------------------------------------------------

TINY_CONFIG = {
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': 384, 'hidden_size': 64,
    'intermediate_size': 128, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,
    'head_dim': 16, 'max_position_embeddings': 256, 'rms_norm_eps': 1e-5, 'rope_theta': 500000.0,
    'rope_scaling': {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                     'original_max_position_embeddings': 64},
    'tie_word_embeddings': True, 'hidden_act': 'silu', 'attention_bias': False, 'mlp_bias': False,
    'attention_dropout': 0.0, 'torch_dtype': 'float32', 'bos_token_id': 0, 'eos_token_id': 1,
}
SPECIAL = ('<|begin_of_text|>', '<|end_of_text|>', '<|eot_id|>')
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}<|eot_id|>{% endif %}\n{% endfor %}")


@dataclasses.dataclass(frozen=True)
class Style:
  """How a family's released tokenizers read text: their special tokens (ids 0, 1, ...), the BOS put
  before every text (None: none), the end-of-text token and the chat template (in the shape of the
  released one: ChatML for Qwen, turns for Gemma, [INST] for Mistral)."""
  special: tuple[str, ...]
  bos: Optional[str]
  eos: str
  template: str


STYLES = {
    'llama': Style(SPECIAL, SPECIAL[0], SPECIAL[1], CHAT_TEMPLATE),
    'qwen': Style(('<|endoftext|>', '<|im_start|>', '<|im_end|>'), None, '<|im_end|>',
                  "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    'gemma': Style(('<pad>', '<eos>', '<bos>', '<start_of_turn>', '<end_of_turn>'), '<bos>', '<eos>',
                   "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
                   "else m['role'] %}{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
    'mistral': Style(('<unk>', '<s>', '</s>'), '<s>', '</s>',
                     "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] "
                     "+ ' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}{% endif %}"
                     "{% endfor %}"),
}
FAMILY_STYLE = {'llama': 'llama', 'qwen2': 'qwen', 'qwen3': 'qwen', 'qwen3_moe': 'qwen', 'gemma2': 'gemma',
                'gemma3': 'gemma', 'mistral': 'mistral', 'mixtral': 'mistral'}
# The sizes of the example's models of every family but Llama (whose config.json is TINY_CONFIG): the
# family's own knobs (paxcli.models.registry) at these sizes, a layer pattern's length of layers, 4 experts.
TINY_KNOBS = {'NUM_LAYERS': 2, 'MODEL_DIMS': 64, 'HIDDEN_DIMS': 128, 'NUM_HEADS': 4, 'NUM_KV_HEADS': 2,
              'DIMS_PER_HEAD': 16, 'VOCAB_SIZE': 384, 'MAX_SEQ_LEN': 256}


def example_records(n: int, seed: int) -> list[dict]:
  """Prompt/completion pairs of a task a tiny model learns fast: name the colour of a thing."""
  things = {'sky': 'blue', 'grass': 'green', 'snow': 'white', 'coal': 'black', 'blood': 'red',
            'sun': 'yellow', 'sea': 'blue', 'leaf': 'green', 'milk': 'white', 'night': 'black'}
  rng = np.random.default_rng(seed)
  names = sorted(things)
  return [{'prompt': f'Q: What colour is the {t}?\nA:', 'completion': f' The {t} is {things[t]}.'}
          for t in (names[i] for i in rng.integers(0, len(names), n))]


def write_tokenizer(directory: str, texts: list[str], vocab_size: int, style: Style = STYLES['llama']) -> None:
  """A tokenizer.json (byte-level BPE; the style's BOS added before each text) trained on `texts`, with the
  style's special tokens first, the tokenizer_config.json beside it (special tokens) and its chat template
  (chat_template.jinja, where transformers 5's save_pretrained writes one)."""
  import tokenizers as hf   # the tokenizers library: paxcli reads tokenizer.json files with it
  tok = hf.Tokenizer(hf.models.BPE())
  tok.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = hf.decoders.ByteLevel()
  tok.train_from_iterator(texts, hf.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(style.special),
                                                        show_progress=False,
                                                        initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet()))
  if style.bos:
    bos = style.special.index(style.bos)
    tok.post_processor = hf.processors.TemplateProcessing(single=f'{style.bos} $A', pair=f'{style.bos} $A $B',
                                                          special_tokens=[(style.bos, bos)])
  tok.save(os.path.join(directory, 'tokenizer.json'))
  config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': style.bos, 'eos_token': style.eos,
            'model_max_length': TINY_CONFIG['max_position_embeddings']}
  with open(os.path.join(directory, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=1)
  with open(os.path.join(directory, 'chat_template.jinja'), 'w', encoding='utf-8') as f:
    f.write(style.template)


def write_tiny_llama(directory: str, seed: int = 0, config: Optional[dict] = None) -> None:
  """A random LlamaForCausalLM of `config` (TINY_CONFIG) in Hugging Face's layout: config.json and
  model.safetensors (nn.Linear weights [out, in]), as transformers writes them."""
  from paxcli.convert import safetensors_io   # numpy only; the example's writer, not the recipe's
  config = config or TINY_CONFIG
  d, f, v = config['hidden_size'], config['intermediate_size'], config['vocab_size']
  h, k, e = config['num_attention_heads'], config['num_key_value_heads'], config['head_dim']
  shapes = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,)}
  for i in range(config['num_hidden_layers']):
    p = f'model.layers.{i}.'
    shapes.update({p + 'input_layernorm.weight': (d,), p + 'post_attention_layernorm.weight': (d,),
                   p + 'self_attn.q_proj.weight': (h * e, d), p + 'self_attn.k_proj.weight': (k * e, d),
                   p + 'self_attn.v_proj.weight': (k * e, d), p + 'self_attn.o_proj.weight': (d, h * e),
                   p + 'mlp.gate_proj.weight': (f, d), p + 'mlp.up_proj.weight': (f, d),
                   p + 'mlp.down_proj.weight': (d, f)})
  if not config['tie_word_embeddings']:
    shapes['lm_head.weight'] = (v, d)
  rng = np.random.default_rng(seed)
  weights = {n: (1 + 0.1 * rng.standard_normal(s) if n.endswith('norm.weight')
                 else rng.standard_normal(s) * (0.5 if 'embed' in n else 1 / np.sqrt(s[-1]))).astype(np.float32)
             for n, s in shapes.items()}
  os.makedirs(directory, exist_ok=True)
  safetensors_io.write(directory, [(n, s, 'float32') for n, s in shapes.items()],
                       lambda name, put: put(weights[name]), {'format': 'pt'}, 1 << 30)
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as fh:
    json.dump(config, fh, indent=1)


def write_tiny_model(directory: str, family: str, style: Style, seed: int = 0) -> None:
  """A random model of `family` in Hugging Face's layout: config.json as paxcli's export writes it for the
  family's knobs at TINY_KNOBS' sizes, and model.safetensors of every array its weight map names (Llama:
  write_tiny_llama's TINY_CONFIG, Llama 3's rope_scaling)."""
  if family == 'llama':
    return write_tiny_llama(directory, seed)
  from paxcli.convert import safetensors_io   # numpy only; the example's writer, not the recipe's
  fam = registry.by_name(family)
  knobs = {**fam.knobs, **TINY_KNOBS}
  if fam.knobs.get('LAYER_PATTERN'):
    knobs['NUM_LAYERS'] = len(fam.knobs['LAYER_PATTERN'])
  if fam.knobs.get('NUM_EXPERTS'):
    knobs.update(NUM_EXPERTS=4, EXPERTS_PER_TOKEN=2)
  model = types.SimpleNamespace(**effective(knobs, LM_KNOBS))
  ids = {'bos_token_id': style.special.index(style.bos) if style.bos else None,
         'eos_token_id': style.special.index(style.eos), 'pad_token_id': None}
  config = fam.to_hf_config(model, 'float32', ids)
  rng = np.random.default_rng(seed)
  norm = 0.0 if getattr(model, 'norm_plus_one', False) else 1.0   # Gemma stores a norm's scale less 1
  weights = {w.hf: (norm + 0.1 * rng.standard_normal(w.hf_shape) if w.hf.endswith('norm.weight')
                    else rng.standard_normal(w.hf_shape) * (0.5 if 'embed' in w.hf else 1 / np.sqrt(w.hf_shape[-1])))
             .astype(np.float32) for w in fam.hf_weights(model)}
  os.makedirs(directory, exist_ok=True)
  safetensors_io.write(directory, [(n, x.shape, 'float32') for n, x in weights.items()],
                       lambda name, put: put(weights[name]), {'format': 'pt'}, 1 << 30)
  with open(os.path.join(directory, 'config.json'), 'w', encoding='utf-8') as fh:
    json.dump(config, fh, indent=1)


def chat_records(records: list[dict]) -> list[dict]:
  """The pairs as one-turn chats: what a chat model is fine-tuned on, through its own template."""
  return [{'messages': [{'role': 'user', 'content': r['prompt'].split('Q: ', 1)[-1].split('\n')[0]},
                        {'role': 'assistant', 'content': r['completion'].strip()}]} for r in records]


def write_example(directory: str, family: str = 'llama') -> dict:
  """The tiny model of `family` (DIR/hf) and its train/eval prompt/completion and chat files; returns their paths."""
  if family not in FAMILY_STYLE:
    raise UserError(f'--family {family!r}: choose one of {", ".join(FAMILY_STYLE)}.')
  style = STYLES[FAMILY_STYLE[family]]
  hf_dir = os.path.join(directory, 'hf')
  train, evals = example_records(400, seed=0), example_records(40, seed=1)
  write_tiny_model(hf_dir, family, style)
  write_tokenizer(hf_dir, [r['prompt'] + r['completion'] for r in train], TINY_CONFIG['vocab_size'], style)
  paths = {'hf': hf_dir, 'train': os.path.join(directory, 'sft.jsonl'), 'eval': os.path.join(directory, 'sft_eval.jsonl'),
           'chat': os.path.join(directory, 'chat.jsonl'), 'chat_eval': os.path.join(directory, 'chat_eval.jsonl')}
  for name, records in (('train', train), ('eval', evals), ('chat', chat_records(train)),
                        ('chat_eval', chat_records(evals))):
    with open(paths[name], 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in records)
  return paths


def main(argv: Optional[list[str]] = None) -> int:
  """`python -m paxcli.recipes.finetune DIR`: writes the tiny example into DIR and prints what to run next."""
  parser = argparse.ArgumentParser(
      prog='python -m paxcli.recipes.finetune',
      description='Write the tiny fine-tuning example into DIR: a random model of the family in Hugging Face\'s '
                  'layout with a tokenizer in the family\'s style (DIR/hf), prompt/completion files (DIR/sft.jsonl, '
                  'DIR/sft_eval.jsonl) and the same pairs as chats (DIR/chat.jsonl, DIR/chat_eval.jsonl); then '
                  'print the commands that import, fine-tune and use it.')
  parser.add_argument('directory', metavar='DIR', help='where to write the example (a new or empty directory)')
  parser.add_argument('--family', default='llama', choices=list(FAMILY_STYLE), help='the model family (default: '
                      'llama)')
  parser.add_argument('--force', action='store_true', help='write into DIR although it holds files (files of the '
                      "example's names are replaced)")
  args = parser.parse_args(argv)
  out = os.path.abspath(args.directory)
  if os.path.lexists(out) and not os.path.isdir(out):
    parser.exit(2, f'error: {args.directory} is a file; give a new or empty directory.\n')
  if os.path.isdir(out) and os.listdir(out) and not args.force:
    parser.exit(2, f'error: {args.directory} holds files already; give a new or empty directory, or --force to '
                   "write the example into it (files of the example's names are replaced).\n")
  made = write_example(out, args.family)
  print(next_steps(out, made, args.family))
  return 0


def next_steps(out: str, made: dict, family: str = 'llama') -> str:
  """What was written, and the commands that import, fine-tune and use it (paths as typed from here)."""
  here = lambda path: path if os.path.relpath(path).startswith('..') else os.path.relpath(path)
  q = lambda path: shlex.quote(here(path))
  base, job = os.path.join(out, family), os.path.join(out, 'sft')
  title = registry.by_name(family).title
  return '\n'.join([
      f'Wrote the tiny example into {here(out)}:',
      f'  {here(made["hf"])}: a random {title} in Hugging Face\'s layout (config.json, model.safetensors, '
      'tokenizer.json, chat_template.jinja)',
      f'  {here(made["train"])}, {here(made["eval"])}: prompt/completion pairs to train on and to hold out',
      f'  {here(made["chat"])}, {here(made["chat_eval"])}: the same as chats, for the model\'s chat template',
      '',
      'Import the model, fine-tune it into a new job directory (about a minute on a CPU), then use the job by its '
      'directory:',
      f'  pax checkpoint convert --from hf {q(made["hf"])} {q(base)}',
      f'  pax train --exp finetune.TinySft --set BASE={q(base)} --set TRAIN_DATA={q(made["train"])} '
      f'--set EVAL_DATA={q(made["eval"])} --job-log-dir {q(job)}',
      f'  pax eval --job-log-dir {q(job)}',
      f'  pax decode --job-log-dir {q(job)} --prompt \'Q: What colour is the snow?\'',
      f'  pax checkpoint convert {q(job)} {q(job + "_hf")} --to hf     # for transformers',
  ])


if __name__ == '__main__':
  sys.exit(main())
