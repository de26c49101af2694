"""What a decode asks for: DecodeOptions, checked before any start-up, and command-line text.

Light on purpose (no JAX): `pax decode` checks its options with these before it starts a backend.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from paxcli.errors import UserError, shorten


@dataclasses.dataclass
class DecodeOptions:
  max_decode_steps: int = 64
  temperature: Optional[float] = None   # None or 0 with no top-k/top-p: greedy
  top_k: Optional[int] = None
  top_p: Optional[float] = None
  num_samples: int = 1
  seed: int = 0
  beam_size: int = 0                     # >0: beam search
  length_penalty: float = 0.0
  eos_ids: tuple = ()
  stop: tuple = ()
  batch_size: int = 0                    # rows per batch; 0: up to 64
  ignore_eos: bool = False               # EOS ids do not stop a row (they are kept in decoded_ids)
  min_length: int = 0                    # no row stops (EOS, stop string) before this many new tokens

  @property
  def sampling(self) -> bool:
    if self.temperature == 0:
      return False
    return self.temperature is not None or self.top_k is not None or self.top_p is not None

  def check(self, vocab_size: Optional[int] = None) -> None:
    """UserError for options that cannot decode; with `vocab_size`, also those above the vocabulary."""
    if self.top_p is not None and not 0 < self.top_p <= 1:
      raise UserError(f'--top-p must be in (0, 1], got {self.top_p}.')
    if self.top_k is not None and self.top_k < 0:
      raise UserError(f'--top-k must be at least 0 (0: no top-k), got {self.top_k}.')
    if self.temperature is not None and not (math.isfinite(self.temperature) and self.temperature >= 0):
      raise UserError(f'--temperature must be a finite number at least 0 (0: greedy), got {self.temperature}.')
    if not math.isfinite(self.length_penalty):
      raise UserError(f'--length-penalty must be a finite number, got {self.length_penalty}.')
    if not 0 <= self.seed < 2 ** 32:
      # JAX (without x64) keeps a seed's low 32 bits: a larger or negative seed would repeat another one.
      raise UserError(f'--seed must be between 0 and {2 ** 32 - 1} (32 bits; JAX keeps only those, so a larger '
                      f'seed would give the samples of a smaller one), got {shorten(self.seed, 60)}.')
    if '' in self.stop:
      raise UserError("--stop '' is empty: every text contains it, so it would stop every row at its first "
                      'token. Give a non-empty string.')
    if self.min_length < 0:
      raise UserError(f'--min-length must be at least 0, got {self.min_length}.')
    if self.max_decode_steps < 1:
      raise UserError(f'--max-decode-steps must be at least 1, got {self.max_decode_steps}.')
    if self.num_samples < 1:
      raise UserError(f'--num-samples must be at least 1, got {self.num_samples}.')
    if self.beam_size < 0:
      raise UserError(f'--beam-size must be at least 1, got {self.beam_size}.')
    if self.beam_size:
      used = [n for n, v in (('--temperature', self.temperature), ('--top-k', self.top_k),
                             ('--top-p', self.top_p)) if v is not None]
      if self.num_samples != 1:
        used.append('--num-samples')
      if used:
        raise UserError(f'Beam search (--beam-size) is deterministic; it cannot be combined with sampling '
                        f'options ({", ".join(used)}).')
    elif self.length_penalty:
      raise UserError('--length-penalty applies to beam search only; add --beam-size.')
    if vocab_size is not None:
      if self.top_k and self.top_k > vocab_size:
        raise UserError(f'--top-k {self.top_k} is above the vocabulary size {vocab_size}; use at most '
                        f'{vocab_size} (or 0: no top-k).')
      if self.beam_size > vocab_size:
        raise UserError(f'--beam-size {self.beam_size} is above the vocabulary size {vocab_size}; a step '
                        f'cannot keep more beams than there are tokens.')


def check_text(text: str, option: str) -> None:
  """A command-line string the OS gave us with undecodable bytes (Python keeps them as surrogates)."""
  try:
    text.encode('utf-8')
  except UnicodeEncodeError as e:
    bad = text[e.start].encode('utf-8', 'surrogateescape')
    raise UserError(f'{option} {shorten(ascii(text), 80)} is not UTF-8 text (byte 0x{bad.hex()} at character '
                    f'{e.start}); give UTF-8 text, or token ids with --prompt-ids.') from None
