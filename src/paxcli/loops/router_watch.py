"""Expert load in the train loop's summaries, and the warning for a router that collapsed.

Each mixture-of-experts layer (paxcli.layers.moe) reports per step `expert_load_min`,
`expert_load_max` (the smallest and largest fraction of the layer's tokens one expert received)
and `dropped_fraction`; the train step puts them in the metrics as `summary/<layer>/mlp/<name>`,
one per layer whether the stack is scanned or not. `totals` folds them into three figures for the
log line and TensorBoard (`moe/...`); `RouterWatch` reads every step's and warns once when a layer's
busiest expert has taken nearly all tokens for many steps in a row.
"""

from __future__ import annotations

from typing import Callable, Optional

LOAD_MIN, LOAD_MAX, DROPPED = 'expert_load_min', 'expert_load_max', 'dropped_fraction'


def _layers(record: dict, name: str) -> dict[str, float]:
  """{layer path: value} of one per-layer summary in a metrics record."""
  suffix = '/' + name
  return {k[len('summary/'):-len(suffix)]: v for k, v in record.items()
          if k.startswith('summary/') and k.endswith(suffix)}


def totals(record: dict) -> dict[str, float]:
  """{'moe/expert_load_min', 'moe/expert_load_max', 'moe/dropped_fraction'} over every MoE layer of a
  record (the least, the most, the mean); {} for a model without experts."""
  lows, highs, dropped = (list(_layers(record, n).values()) for n in (LOAD_MIN, LOAD_MAX, DROPPED))
  if not highs:
    return {}
  return {f'moe/{LOAD_MIN}': min(lows), f'moe/{LOAD_MAX}': max(highs),
          f'moe/{DROPPED}': sum(dropped) / max(len(dropped), 1)}


def load_note(record: dict) -> str:
  """'  experts: load 0.21-0.29 of tokens, dropped 0.4%' for a summary line; '' without experts."""
  if f'moe/{LOAD_MAX}' not in record:
    return ''
  return (f"  experts: load {record[f'moe/{LOAD_MIN}']:.2f}-{record[f'moe/{LOAD_MAX}']:.2f} of tokens, "
          f"dropped {record[f'moe/{DROPPED}']:.1%}")


class RouterWatch:
  """Warns, once per episode, when a layer's busiest expert takes at least `fraction` of its tokens (while
  another takes less: a layer whose every expert sees every token, k = E, is not collapsed) in each of
  `steps` consecutive steps."""

  def __init__(self, fraction: float, steps: int, log: Callable[[str], None]):
    self.fraction, self.steps, self._log = fraction, max(int(steps), 1), log
    self._run: dict[str, int] = {}       # layer -> consecutive collapsed steps so far
    self._first: dict[str, int] = {}     # layer -> the step its run began
    self.warned: set[str] = set()

  def __call__(self, rows: list[dict]) -> None:
    for row in rows:
      self.step(row)

  def step(self, row: dict) -> Optional[str]:
    """Reads one step's metrics; returns the warning it logged, if any."""
    lows = _layers(row, LOAD_MIN)
    message = None
    for layer, high in _layers(row, LOAD_MAX).items():
      if high >= self.fraction and lows.get(layer, 0.0) < high:
        self._first.setdefault(layer, row['step'])
        self._run[layer] = self._run.get(layer, 0) + 1
        if self._run[layer] == self.steps and layer not in self.warned:
          self.warned.add(layer)
          message = (f"warning: the router of {layer} has collapsed: one expert took at least {self.fraction:.0%} "
                     f"of its tokens in each of {self.steps} steps ({self._first[layer]}-{row['step']}; now "
                     f'{high:.0%}), so the other experts barely train. Raise LOAD_BALANCE_LOSS_WEIGHT, add '
                     'ROUTER_Z_LOSS_WEIGHT or lower the learning rate.')
          self._log(message)
      else:
        self._run.pop(layer, None)
        self._first.pop(layer, None)
        self.warned.discard(layer)   # recovered: a later collapse is warned about again
    return message
