"""The default LM trained through SeqIO: a seqio task over local TFRecord files.

`pax train --exp seqio_stdlib.StdlibDocsSeqIOLm` registers the seqio task
`stdlib_docs` (the stdlib docstrings written once as TFRecord files of
tf.train.Example {'text'}, tokenized by paxcli's own sentencepiece model, cached in
~/.cache/paxcli) and trains on it with packing through SeqIOInput. Nothing is
downloaded. Expect about the default's loss curve (7.6 falling below 6 by step 100);
start-up takes a few seconds longer (tensorflow and seqio load).
"""

import fiddle as fdl

from paxcli.experiment import register
from paxcli.inputs.corpus import register_seqio_task
from paxcli.inputs.seqio_input import SeqIOInput
from paxcli.recipes.default import StdlibDocsLm


@register
class StdlibDocsSeqIOLm(StdlibDocsLm):
  """The default LM fed by SeqIOInput (seqio task over local TFRecords, packed)."""

  def datasets(self) -> list:
    task = register_seqio_task(self.VOCAB_SIZE)
    lengths = {'targets': self.MAX_SEQ_LEN}
    return [
        fdl.Config(SeqIOInput, name='train', is_training=True, mixture_name=task, split_name='train',
                   task_feature_lengths=lengths, pack=True, seed=self.RANDOM_SEED),
        fdl.Config(SeqIOInput, name='eval', is_training=False, mixture_name=task, split_name='validation',
                   task_feature_lengths=lengths, pack=False, repeat=False, reset_for_eval=True),
    ]
