"""SeqIOInput: a seqio task or mixture as a paxcli input, sharded by host.

seqio is imported only when such an input is built (it pulls in tensorflow).
Decoder-only feature conversion maps seqio's features onto the LM batch:
decoder_input_tokens -> ids, decoder_target_tokens -> labels, decoder_loss_weights ->
weights, and with packing decoder_segment_ids -> segment_ids, decoder_positions ->
positions. The encoder-decoder converter yields seqio's own feature names (for
inspection; paxcli's model is decoder-only).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from paxcli.errors import UserError, did_you_mean
from paxcli.inputs.base import decode_rows
from paxcli.inputs.tfrecord import TfDataInput, import_seqio

_DECODER_KEYS = {'decoder_input_tokens': 'ids', 'decoder_target_tokens': 'labels',
                 'decoder_loss_weights': 'weights', 'decoder_segment_ids': 'segment_ids',
                 'decoder_positions': 'positions'}


def get_mixture_or_task(name: str):
  seqio = import_seqio()
  try:
    return seqio.get_mixture_or_task(name)
  except ValueError:
    known = list(seqio.TaskRegistry.names()) + list(seqio.MixtureRegistry.names())
    raise UserError(f'No seqio task or mixture is registered as {name!r}.{did_you_mean(name, known)}') from None


@dataclasses.dataclass
class SeqIOInput(TfDataInput):
  mixture_name: Optional[str] = None
  mixture_or_task: Optional[str] = None  # Pax's other spelling; either names the task
  split_name: str = 'train'
  task_feature_lengths: Optional[dict[str, int]] = None
  feature_converter: str = 'decoder'  # 'decoder' | 'enc_dec'
  pack: bool = False
  shuffle: Optional[bool] = None  # None: shuffle when training
  use_cached: bool = False

  def __post_init__(self):
    super().__post_init__()
    self.task_name = self.mixture_name or self.mixture_or_task
    if not self.task_name:
      raise UserError(f'SeqIOInput {self.name!r} needs mixture_name (or mixture_or_task).')
    self.task = get_mixture_or_task(self.task_name)
    splits = list(getattr(self.task, 'splits', []) or [])
    if splits and self.split_name not in splits:
      raise UserError(f'seqio task {self.task_name!r} has no split {self.split_name!r}; it has '
                      f'{", ".join(splits)}.{did_you_mean(self.split_name, splits)}')
    if not self.task_feature_lengths:
      raise UserError(f'SeqIOInput {self.name!r} needs task_feature_lengths, e.g. {{"targets": 128}}.')

  def _converter(self):
    seqio = import_seqio()
    if self.feature_converter == 'decoder':
      return seqio.DecoderFeatureConverter(pack=self.pack)
    if self.feature_converter == 'enc_dec':
      return seqio.EncDecFeatureConverter(pack=self.pack)
    raise UserError(f"SeqIOInput feature_converter must be 'decoder' or 'enc_dec', got {self.feature_converter!r}.")

  def dataset(self, skip_batches: int = 0):
    seqio = import_seqio()
    shuffle = self.is_training if self.shuffle is None else self.shuffle
    ds = seqio.get_dataset(
        self.task, task_feature_lengths=dict(self.task_feature_lengths),
        feature_converter=self._converter(), dataset_split=self.split_name, use_cached=self.use_cached,
        shuffle=shuffle, num_epochs=None if self.repeat else 1, seed=self.seed,
        shard_info=seqio.ShardInfo(index=self.infeed_host_index or 0, num_shards=self.num_infeed_hosts or 1),
        verbose=False)
    ds = ds.batch(self.batch_size, drop_remainder=False)
    if skip_batches:
      ds = ds.skip(skip_batches)
    return ds.prefetch(2)

  def convert(self, batch: dict) -> dict:
    if self.feature_converter != 'decoder':
      return batch
    batch = {_DECODER_KEYS.get(k, k): v for k, v in batch.items()}
    batch['weights'] = batch['weights'].astype(np.float32)
    return batch

  def vocabulary(self):
    features = self.task.output_features
    key = 'targets' if 'targets' in features else next(iter(features))
    return features[key].vocabulary

  def tokenizer_file(self) -> Optional[str]:
    return getattr(self.vocabulary(), 'sentencepiece_model_file', None)

  def ids_to_strings(self, ids, lengths=None) -> list[str]:
    return decode_rows(self.vocabulary().decode, ids, lengths)
