"""Reward functions for GRPO (paxcli.models.grpo, paxcli.loops.rollout), in TRL's calling convention.

A reward function is plain Python that an experiment names (an experiment is code, as everywhere in Pax):

  def my_reward(prompts, completions, completion_ids, **columns) -> list[float | None]

one value per completion: `prompts` the prompt texts (one per completion: a prompt's G completions repeat
it), `completions` the completion texts (without EOS, cut at a stop string), `completion_ids` their token
ids, and each other field of the prompt's record as a keyword (`answer=[...]`), plus `step`, the train
step the rollout is for. None means "not mine to score" (TRL's convention): a completion no function
scores gets advantage 0. A function TRL's GRPOTrainer takes works here unchanged (it may ignore what it
does not read through **kwargs). Jax-free: recipes import it.

`exact_match` is the built-in verifier: the answer in a marked span of the completion against a field of
the prompt's record.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

RewardFn = Callable[..., Sequence[Optional[float]]]


def answer_span(prompt: str, completion: str, start: str, end: str) -> Optional[str]:
  """The answer a completion gives: the text after the last `start` in it (or from its beginning when the
  prompt itself ends with `start`, having opened the span), up to the first `end` after that or the end of the
  completion (a stop string is cut from the completion already). None when no span is opened. Empty `start`:
  the whole completion is the span."""
  text = completion
  if start:
    if start in completion:
      text = completion[completion.rindex(start) + len(start):]
    elif not prompt.rstrip().endswith(start.strip() or start):
      return None
  if end and end in text:
    text = text[:text.index(end)]
  return text


def normalise(text: str) -> str:
  """Whitespace runs as one space, trimmed: '  7\\n' and '7' are the same answer."""
  return ' '.join(str(text).split())


def exact_match(field: str = 'answer', start: str = '<answer>', end: str = '</answer>') -> RewardFn:
  """The built-in verifier: 1.0 when the answer span (answer_span) equals the record's `field` (whitespace
  normalised), else 0.0. Named 'exact_match' in metrics and messages."""

  def exact_match(prompts, completions, **columns):   # pylint: disable=redefined-outer-name
    answers = columns[field]
    out = []
    for prompt, completion, answer in zip(prompts, completions, answers):
      span = answer_span(prompt, completion, start, end)
      out.append(float(span is not None and normalise(span) == normalise(answer)))
    return out

  exact_match.required_fields = (field,)
  return exact_match


def name_of(fn: RewardFn) -> str:
  """How metrics and messages name a reward function: its __name__ (a functools.partial's function's)."""
  inner = getattr(fn, 'func', fn)
  return getattr(inner, '__name__', type(inner).__name__)
