"""Looking at input batches: statistics, decoded examples, host-sharding checks, raw files."""

from __future__ import annotations

import hashlib
import time
from typing import Any, Iterator

import numpy as np

from paxcli.errors import UserError, did_you_mean
from paxcli.inputs.base import EndOfInput
from paxcli.inputs.tfrecord import expand_files, read_examples

MAX_EVAL_BATCHES = 100_000  # a guard for --check-sharding on an eval input that never ends


def select_dataset(resolved, split: str):
  """'train' -> the training input, 'eval' -> the first eval input, else by name."""
  if split == 'train':
    return resolved.train_dataset()
  if split == 'eval':
    evals = resolved.eval_datasets()
    if not evals:
      raise UserError(f'{resolved.name} has no eval datasets; its inputs are {", ".join(resolved.datasets)}.')
    return evals[0]
  if split not in resolved.datasets:
    raise UserError(f'Unknown split {split!r} for {resolved.name}; its inputs are '
                    f'{", ".join(resolved.datasets)} (or train/eval).{did_you_mean(split, resolved.datasets)}')
  return resolved.datasets[split]


def host_batch_size(resolved) -> int:
  """Per-process batch: PERCORE_BATCH_SIZE x this process's devices (at least 1)."""
  import jax
  return max(1, int(round(resolved.experiment.PERCORE_BATCH_SIZE * jax.local_device_count())))


def build(cfg, batch_size: int, num_hosts: int, host_index: int):
  from paxcli.runtime import infeed
  if not 0 <= host_index < num_hosts:
    raise UserError(f'--host-index {host_index} is not in [0, {num_hosts}).')
  return infeed.build_input(cfg, process_batch=batch_size, num_hosts=num_hosts, host_index=host_index)


def feature_stats(batch: dict) -> list[dict[str, Any]]:
  """Per feature: shape, dtype, min, max; `padding`, the share of positions after a row's documents
  (segment id 0, else weight 0 for inputs without segments, else id 0); and for the token features
  `unweighted`, the share of positions inside documents that the loss skips (weight 0: prompts, chat
  headers), which is not padding."""
  weights, segments = batch.get('weights'), batch.get('segment_ids')
  rows = []
  for name, value in batch.items():
    value = np.asarray(value)
    numeric = np.issubdtype(value.dtype, np.number)
    unweighted = None
    if numeric and weights is not None and value.shape == np.shape(weights):
      pad = np.asarray(segments) == 0 if segments is not None and np.shape(segments) == value.shape \
          else np.asarray(weights) == 0
      padding = float(np.mean(pad))
      unweighted = float(np.mean((np.asarray(weights) == 0) & ~pad))
    elif numeric:
      padding = float(np.mean(value == 0))
    else:
      padding = float(np.mean([len(v) == 0 for v in value.reshape(-1)])) if value.size else 0.0
    rows.append({'feature': name, 'shape': list(value.shape), 'dtype': str(value.dtype),
                 'min': _num(value.min()) if numeric and value.size else None,
                 'max': _num(value.max()) if numeric and value.size else None,
                 'padding': padding, 'unweighted': unweighted})
  return rows


def _num(x):
  x = x.item()
  return x


def examples(inp, batch: dict, count: int) -> list[dict[str, Any]]:
  """The first `count` rows: the token ids the model reads (`ids`, whose first token of each document
  `labels` lacks) and, when the input has a vocabulary, their text."""
  ids = batch.get('ids', batch.get('labels'))
  if ids is None or not np.issubdtype(np.asarray(ids).dtype, np.integer):
    return [{k: _show(v[i]) for k, v in batch.items()} for i in range(min(count, _rows(batch)))]
  rows = min(count, ids.shape[0])
  lengths = [_length(batch, i, ids.shape[1]) for i in range(rows)]
  texts = inp.ids_to_strings(ids[:rows], lengths)
  out = [{'row': i, 'length': lengths[i], 'text': texts[i], 'ids': [int(t) for t in ids[i][:lengths[i]]]}
         for i in range(rows)]
  if 'labels' in batch and 'weights' in batch:
    for example in out:
      example['trained'] = _trained(inp, np.asarray(batch['labels'][example['row']]),
                                    np.asarray(batch['weights'][example['row']]))
  return out


def _trained(inp, labels: np.ndarray, weights: np.ndarray, most: int = 8) -> list[str]:
  """The text of the first `most` runs of consecutive targets the loss weighs (weight > 0): what a
  row trains the model to say (completions, assistant turns), the rest of its text being context."""
  runs, start = [], None
  for i, w in enumerate(list(weights > 0) + [False]):
    if w and start is None:
      start = i
    elif not w and start is not None:
      runs.append(labels[start:i])
      start = None
  runs = runs[:most]
  return inp.ids_to_strings(np.array([np.pad(r, (0, max(map(len, runs)) - len(r))) for r in runs]),
                            [len(r) for r in runs]) if runs else []


def _length(batch: dict, row: int, width: int) -> int:
  """Where a row's real tokens end: after its last document (segment ids), else after its last
  weighted position (a prompt of weight 0 inside still counts), else the whole row."""
  for key in ('segment_ids', 'weights'):
    if key in batch:
      real = np.nonzero(np.asarray(batch[key][row]))[0]
      return int(real[-1]) + 1 if real.size else 0
  return width


def _rows(batch):
  return len(next(iter(batch.values())))


def _show(v):
  v = np.asarray(v)
  if v.dtype.kind in 'SO':
    return [x.decode('utf-8', 'replace') if isinstance(x, bytes) else str(x) for x in v.reshape(-1)][:8]
  return v.reshape(-1)[:32].tolist()


def read_batches(inp, num_batches: int) -> Iterator[tuple[int, dict, float]]:
  """(index, batch, seconds to read it) for up to num_batches batches."""
  for i in range(num_batches):
    start = time.perf_counter()
    try:
      batch = inp.get_next()
    except EndOfInput:
      return
    yield i, batch, time.perf_counter() - start


def _row_digest(batch: dict, row: int) -> str:
  h = hashlib.sha1()
  for k in sorted(batch):
    if k in ('weights',):
      continue
    h.update(np.ascontiguousarray(np.asarray(batch[k])[row]).tobytes())
  return h.hexdigest()


def _real_rows(batch: dict) -> list[int]:
  weights = batch.get('weights')
  if weights is None:
    return list(range(_rows(batch)))
  return [i for i in range(len(weights)) if np.any(np.asarray(weights[i]) > 0)]


def check_sharding(cfg, batch_size: int, num_hosts: int, num_batches: int) -> dict[str, Any]:
  """Instantiates every host's input and compares what they emit.

  Training inputs: any example emitted by two hosts within the first num_batches is
  a problem. Eval inputs: each host is read to its end; an example seen on two hosts
  is a problem, and the per-host batch counts are reported (the eval loop pads the
  short hosts with zero-weight batches so that all run the same number of steps).
  """
  training = bool(cfg.is_training)
  if not training:
    from paxcli.loops.evaluate import check_semantics
    check_semantics(cfg)
  seen: dict[str, tuple[int, int, int]] = {}
  duplicates = []
  per_host = []
  for host in range(num_hosts):
    inp = build(cfg, batch_size, num_hosts, host)
    limit = num_batches if training or cfg.eval_loop_num_batches else MAX_EVAL_BATCHES
    if not training and cfg.eval_loop_num_batches:
      limit = cfg.eval_loop_num_batches
    count = examples_count = 0
    for i, batch, _ in read_batches(inp, limit):
      count += 1
      for row in _real_rows(batch):
        examples_count += 1
        digest = _row_digest(batch, row)
        if digest in seen and seen[digest][0] != host:
          duplicates.append({'example': digest[:12], 'first': seen[digest], 'again': (host, i, row)})
        seen.setdefault(digest, (host, i, row))
    per_host.append({'host': host, 'batches': count, 'examples': examples_count})
  report = {'kind': 'train' if training else 'eval', 'num_hosts': num_hosts, 'hosts': per_host,
            'duplicates': duplicates[:20], 'num_duplicates': len(duplicates)}
  report['ok'] = not duplicates and all(h['examples'] > 0 for h in per_host if training)
  if not training:
    report['eval_steps'] = max(h['batches'] for h in per_host)
  return report


def inspect_file(pattern: str, num_examples: int, scan: int = 1000) -> dict[str, Any]:
  """A raw TFRecord file of tf.train.Example: feature kinds, lengths seen, first records."""
  files = expand_files(pattern)
  kinds: dict[str, str] = {}
  lengths: dict[str, list[int]] = {}
  first = []
  scanned = 0
  start = None
  for path in files:
    for record in read_examples(path, limit=scan - scanned):
      scanned += 1
      start = start or time.perf_counter()  # after the first record: not tensorflow's import
      for name, (kind, values) in record.items():
        kinds.setdefault(name, kind)
        span = lengths.setdefault(name, [len(values), len(values)])
        span[0], span[1] = min(span[0], len(values)), max(span[1], len(values))
      if len(first) < num_examples:
        first.append({name: _preview(kind, values) for name, (kind, values) in sorted(record.items())})
    if scanned >= scan:
      break
  if not scanned:
    raise UserError(f'{pattern}: no records.')
  elapsed = time.perf_counter() - start
  return {'files': files, 'records_scanned': scanned, 'records_per_sec': (scanned - 1) / max(elapsed, 1e-9),
          'features': [{'feature': n, 'kind': kinds[n], 'min_length': lengths[n][0], 'max_length': lengths[n][1]}
                       for n in sorted(kinds)],
          'first_records': first}


def _preview(kind: str, values: list):
  if kind == 'bytes':
    return [v.decode('utf-8', 'replace')[:200] for v in values[:4]]
  return list(values[:32]) + (['...'] if len(values) > 32 else [])
