"""LmExperiment: the base for decoder-only Transformer language-model experiments."""

from __future__ import annotations

import functools
from typing import Optional, Union

import fiddle as fdl

from paxcli import files
from paxcli.errors import UserError
from paxcli.inputs import file_input, prepared
from paxcli.inputs.synthetic import SyntheticLmInput
from paxcli.models.knobs import LM_KNOBS, declare, flat_settings
from paxcli.models.training import TrainingExperiment


@declare(LM_KNOBS)
class LmExperiment(TrainingExperiment):
  """A decoder-only Transformer LM; knobs as in Pax's LmCloud and MaxText models.

  The model knobs (NUM_LAYERS, MODEL_DIMS, NORM_TYPE, ...) are declared by the table
  paxcli.models.knobs.LM_KNOBS; the optimizer and loop knobs by TrainingExperiment.
  Subclasses set knobs and, where they need more, override `task()` (call super and
  edit the config, e.g. `task.train.num_train_steps = 300`) or `datasets()`. TRAIN_DATA
  replaces the inputs of every LM experiment, one that overrides `datasets()` too
  (__init_subclass__ puts own_data_datasets() in front of the override).
  """

  DECODE_INTERVAL_STEPS: int = 0  # 0: no decoding during training; else greedy on DECODE_PROMPTS
  # texts, or lists of token ids for models without a tokenizer; with TRAIN_DATA and not set with --set, up to
  # four prompts of the held-out data (a prompt/completion's prompt, a text's first words)
  DECODE_PROMPTS: list = []
  DECODE_MAX_STEPS: int = 32      # tokens decoded for each prompt during training
  # LoRA (LORA_RANK > 0): a PEFT adapter directory (`pax checkpoint convert --to peft` writes one) the adapters
  # start from; None: A random, B = 0.
  LORA_INIT: Optional[str] = None

  # Your own data (README "Your own data", paxcli.inputs.file_input): a glob, or {glob: weight} for a
  # mixture, of .txt, .jsonl, .parquet, TFRecord or ArrayRecord files; replaces the experiment's inputs.
  TRAIN_DATA: Optional[Union[str, dict[str, float]]] = None
  EVAL_DATA: Optional[Union[str, dict[str, float]]] = None  # None: 1 in 20 TRAIN_DATA documents (by text hash)
  TEXT_FIELD: str = 'text'        # the JSONL / Parquet / tf.train.Example field that holds the text
  TOKENIZER: Optional[str] = None  # a sentencepiece .model or a tokenizer.json; None: trained on TRAIN_DATA
  # Chat records ({"messages": [...]}): '' the tokenizer's own chat template (its default), refused in one line
  # when it ships none, unless paxcli trained the tokenizer; a name of another template it ships; 'paxcli' for
  # paxcli's own <|user|>/<|assistant|> format
  CHAT_TEMPLATE: str = ''
  # TRAIN_DATA naming a prepared directory (`pax data prepare`) is read with Grain (paxcli.inputs.grain_input):
  # Grain worker processes per process; 0: a prefetch thread, which keeps 39x ahead of one H100 on Llama1B
  # (benchmarks/input_resume.py) while each worker costs 1-6 s at every start: more for many GPUs per host
  DATA_WORKERS: int = 0
  DATA_STREAMS: int = 16  # fixed for a run; at least processes x DATA_WORKERS
  # What a job's record may set (Experiment.replayed): decoding while training, the adapters' start and the
  # data (read, never written) and how chat records were rendered (a template's name, checked against the
  # tokenizer's own). Not DATA_WORKERS: how many processes this machine runs is its user's choice.
  replayed = frozenset({'DECODE_INTERVAL_STEPS', 'DECODE_PROMPTS', 'DECODE_MAX_STEPS', 'LORA_INIT', 'TRAIN_DATA',
                        'EVAL_DATA', 'TEXT_FIELD', 'TOKENIZER', 'DATA_STREAMS', 'CHAT_TEMPLATE'})

  def __init_subclass__(cls, **kwargs):
    """A subclass's own datasets() gives way to TRAIN_DATA when the knob is set: recipes, a user's
    experiment files and generated recipes all train on the user's files by the knob alone, none
    having to remember to ask (the seqio recipe once did not)."""
    super().__init_subclass__(**kwargs)
    own = cls.__dict__.get('datasets')
    if own is not None and not getattr(own, 'own_data_first', False):
      @functools.wraps(own)
      def datasets(self) -> list:
        return self.own_data_datasets() or own(self)
      datasets.own_data_first = True
      cls.datasets = datasets

  def model(self) -> fdl.Config:
    """LanguageModel built from templates the knobs fill; edit a template to swap a layer:

      task.model.lm_tpl.block_tpl.ffn_tpl = fdl.Config(MyFeedForward, ...)
      task.model.lm_tpl.block_tpl.attention_tpl.use_bias = False
      task.model.lm_tpl.block_tpl.norm_tpl = fdl.Config(MyNorm)
    """
    from paxcli.models.lm import lm_config  # flax: recipes import this module, `pax experiments` stays quick
    return lm_config(**flat_settings(self.knobs(), LM_KNOBS))

  def train_config(self) -> fdl.Config:
    train = super().train_config()
    train.decode_interval_steps = self.DECODE_INTERVAL_STEPS
    train.decode_prompts = list(self.DECODE_PROMPTS) if not self._own_data_decodes() else self._own_data_prompts()
    train.decode_max_steps = self.DECODE_MAX_STEPS
    train.lora_init = files.path_knob(self.LORA_INIT) if self.LORA_INIT else None
    return train

  def _own_data_decodes(self) -> bool:
    """Whether decoding while training takes its prompts from TRAIN_DATA: a recipe's own DECODE_PROMPTS belong
    to its own data (the stdlib's, the default's), so a run on the user's files decodes the user's prompts
    unless DECODE_PROMPTS is set for it (--set, or an instance's own)."""
    return bool(self.TRAIN_DATA and self.DECODE_INTERVAL_STEPS and 'DECODE_PROMPTS' not in vars(self))

  def _own_data_prompts(self) -> list:
    """Prompts from the held-out side of the user's data (EVAL_DATA, else TRAIN_DATA's eval split); none for
    prepared data, whose records are ids."""
    if _prepared_data(file_input.anchored(self.TRAIN_DATA)):
      return []
    data = file_input.anchored(self.EVAL_DATA or self.TRAIN_DATA)
    return file_input.sample_prompts(data, self.TEXT_FIELD, 'all' if self.EVAL_DATA else 'eval')

  def datasets(self) -> list:
    """The user's files when TRAIN_DATA is set, else synthetic LM data; override for real inputs
    (an override is still replaced by TRAIN_DATA when set: __init_subclass__)."""
    return self.own_data_datasets() or [
        fdl.Config(SyntheticLmInput, name='train', is_training=True, seq_len=self.MAX_SEQ_LEN,
                   vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED),
        fdl.Config(SyntheticLmInput, name='eval', is_training=False, seq_len=self.MAX_SEQ_LEN,
                   vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED + 1, num_batches=2, repeat=False,
                   reset_for_eval=True),
    ]

  def own_data_datasets(self) -> list:
    """Inputs over TRAIN_DATA and EVAL_DATA (paxcli.inputs.file_input), or [] when neither is set."""
    if not (self.TRAIN_DATA or self.EVAL_DATA or self.TOKENIZER):
      return []
    if not self.TRAIN_DATA:
      raise UserError('EVAL_DATA and TOKENIZER need TRAIN_DATA (a glob of your training files).')
    train, evals = file_input.anchored(self.TRAIN_DATA), file_input.anchored(self.EVAL_DATA)
    if _prepared_data(train):
      return self._prepared_datasets(train, evals)
    common = dict(seq_len=self.MAX_SEQ_LEN, text_field=self.TEXT_FIELD, tokenizer=file_input.anchored(self.TOKENIZER),
                  tokenizer_data=train, vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED,
                  chat_template=self.CHAT_TEMPLATE)
    return [
        fdl.Config(file_input.FileLmInput, name='train', is_training=True, data=train, split='all' if evals else 'train',
                   **common),
        fdl.Config(file_input.FileLmInput, name='eval', is_training=False, repeat=False, reset_for_eval=True,
                   data=evals or train, split='all' if evals else 'eval', **common),
    ]

  def _prepared_datasets(self, train, evals) -> list:
    """Grain inputs over a prepared directory or a {directory: weight} mixture of them: the train
    split, and for eval EVAL_DATA (prepared too) or the directories' own eval splits; none when
    one of them has none."""
    from paxcli.inputs.grain_input import GrainLmInput  # grain: only for runs on prepared data
    if self.TOKENIZER:
      raise UserError(f'TOKENIZER is set, but {train} is prepared data: its ids come from its own tokenizer '
                      f'({prepared.MANIFEST} names it); leave TOKENIZER unset.')
    if self.CHAT_TEMPLATE:
      raise UserError(f'CHAT_TEMPLATE is set, but {train} is prepared data: its chats were rendered when it was '
                      'prepared (pax data prepare --chat-template); leave CHAT_TEMPLATE unset.')
    if evals is not None and not _prepared_data(evals):
      raise UserError(f'TRAIN_DATA {train} is prepared data; EVAL_DATA must be a prepared directory too '
                      f'(`pax data prepare`), got {evals!r}.')
    if evals is not None:  # ids of another tokenizer than the model trains on would evaluate nonsense
      named = [(d, prepared.read_manifest(d)) for data in (train, evals) for d, _ in file_input.sources(data)]
      prepared.check_one_tokenizer(named, 'TRAIN_DATA and EVAL_DATA')
    common = dict(seq_len=self.MAX_SEQ_LEN, vocab_size=self.VOCAB_SIZE, seed=self.RANDOM_SEED,
                  num_streams=self.DATA_STREAMS)
    inputs = [fdl.Config(GrainLmInput, name='train', is_training=True, data=train, split='train',
                         workers=self.DATA_WORKERS, **common)]
    eval_split = _eval_split(evals or train, whole=evals is not None)
    if eval_split:
      inputs.append(fdl.Config(GrainLmInput, name='eval', is_training=False, repeat=False, reset_for_eval=True,
                               data=evals or train, split=eval_split, workers=0, **common))
    return inputs


def _prepared_data(data) -> bool:
  """Whether TRAIN_DATA / EVAL_DATA names prepared data: a prepared directory, or a mixture whose
  keys all are; a mixture of prepared directories and files is refused (they are read by two
  different inputs, which do not mix)."""
  names = [data] if isinstance(data, str) else list(data) if isinstance(data, dict) else []
  ready = [isinstance(n, str) and prepared.is_prepared(n) for n in names]
  if any(ready) and not all(ready):
    raise UserError(f'The mixture {data!r:.200} has prepared directories and files: mix either only prepared '
                    'directories (exact resume, Grain) or only files; prepare the files too with '
                    '`pax data prepare FILES OUT`.')
  return bool(names) and all(ready)


def _eval_split(data, whole: bool) -> Optional[str]:
  """The split to evaluate on: the directories' eval split; for EVAL_DATA directories without one,
  their train split (all of it is eval data); None when a TRAIN_DATA directory has no eval split."""
  directories = [data] if isinstance(data, str) else list(data)
  if all(prepared.read_manifest(d).records('eval') for d in directories):
    return 'eval'
  return 'train' if whole else None
