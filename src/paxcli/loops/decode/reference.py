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

_FORWARDS: dict = {}   # id(model) -> (model, its jitted forward); the model held so that its id stays its own


def _forward(model):
  """The model's jitted forward pass over one row right-padded to MAX_SEQ_LEN: (greedy token [L], log-probabilities
  [L, V]) at every position. Attention is causal, so position i's are those of the row's first i + 1 ids alone.
  Jitted once per model (a Flax module cannot be a static argument: it does not hash), so that every prefix and
  every call shares one compile instead of running the model op by op."""
  hit = _FORWARDS.get(id(model))
  if hit is None or hit[0] is not model:

    def forward(params, ids_1xL):
      logits = model.apply({'params': params}, ids_1xL)[0]
      return jnp.argmax(logits, axis=-1), jax.nn.log_softmax(logits, axis=-1)

    hit = _FORWARDS[id(model)] = (model, jax.jit(forward))
    while len(_FORWARDS) > 8:
      _FORWARDS.pop(next(iter(_FORWARDS)))
  return hit[1]


def _padded(model, ids: Sequence[int]) -> np.ndarray:
  row = np.zeros((1, model.max_seq_len), np.int32)
  row[0, :len(ids)] = ids
  return row


def full_recompute_greedy(model, params, prompt_ids: Sequence[int], steps: int) -> list[int]:
  """Greedy tokens by re-running the model on the whole prefix for every token.

  The prefix is right-padded to MAX_SEQ_LEN (one compile per model); attention is causal, so
  the logits at its last token are those of the prefix alone.
  """
  fwd = _forward(model)
  ids = list(prompt_ids)
  out = []
  for _ in range(steps):
    tok = int(np.asarray(fwd(params, _padded(model, ids))[0])[len(ids) - 1])   # read on the host: no device slice
    out.append(tok)
    ids.append(tok)
  return out


def teacher_forced_logprobs(model, params, prompt_ids: Sequence[int], decoded_ids: Sequence[int]) -> list[float]:
  """The log-probability of each of `decoded_ids` after the prompt and the ones before it, from one forward pass
  over both (right-padded to MAX_SEQ_LEN as in `full_recompute_greedy`)."""
  ids = list(prompt_ids) + list(decoded_ids)
  logp = np.asarray(_forward(model)(params, _padded(model, ids[:-1]))[1])
  p = len(prompt_ids)
  return [float(logp[p - 1 + i, t]) for i, t in enumerate(decoded_ids)]


def teacher_forced_logprob(model, params, prompt_ids: Sequence[int], decoded_ids: Sequence[int]) -> float:
  """The log-likelihood of `decoded_ids` after the prompt (`teacher_forced_logprobs` summed)."""
  return float(sum(teacher_forced_logprobs(model, params, prompt_ids, decoded_ids)))
