"""What cached decoding must agree with: a language model's plain forward pass, no cache.

For tests: `LanguageModel(...)(ids_BxL)` gives logits for every position (causal), so greedy
tokens and log-likelihoods can be recomputed from the whole prefix and compared with the
decoder's.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def full_recompute_greedy(model, params, prompt_ids: Sequence[int], steps: int) -> list[int]:
  """Greedy tokens by re-running the model on the whole prefix for every token.

  The prefix is right-padded to MAX_SEQ_LEN (one compile); attention is causal, so the
  logits at its last token are those of the prefix alone.
  """
  length = model.max_seq_len
  fwd = jax.jit(lambda p, x, n: jnp.argmax(model.apply({'params': p}, x)[0, n - 1]))
  ids = list(prompt_ids)
  out = []
  for _ in range(steps):
    padded = np.zeros((1, length), np.int32)
    padded[0, :len(ids)] = ids
    tok = int(fwd(params, padded, len(ids)))
    out.append(tok)
    ids.append(tok)
  return out


def teacher_forced_logprob(model, params, prompt_ids: Sequence[int], decoded_ids: Sequence[int]) -> float:
  """The log-likelihood of `decoded_ids` after the prompt, from one forward pass over both."""
  ids = list(prompt_ids) + list(decoded_ids)
  logits = model.apply({'params': params}, jnp.asarray([ids[:-1]], jnp.int32))[0]
  logp = jax.nn.log_softmax(logits, axis=-1)
  p = len(prompt_ids)
  return float(sum(logp[p - 1 + i, t] for i, t in enumerate(decoded_ids)))
