"""LoRA runs in and out: merged into a plain checkpoint (`--merge-lora`, and before `--to hf`),
adapters written in PEFT's format (`--to peft`), and a PEFT adapter directory read back (LORA_INIT).

A LoRA run's checkpoints hold its adapters and name their base (paxcli.jobdir.restore.BaseRef);
reading one restores both through the shared restore path, so the base is verified as at eval.

PEFT's layout (peft.tuners.lora, saved by `save_pretrained`): `adapter_config.json` and
`adapter_model.safetensors` with torch Linear weights [out, in] per layer,

  base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight  [r, in]
  base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight  [out, r]

where each module is the Hugging Face module of the adapted kernel in the model's family's weight map
(paxcli.models.registry: Llama's and Qwen's are self_attn.q/k/v/o_proj and mlp.gate/up/down_proj).
Ours are A [in..., r] and B [r, out...], so lora_A = A.reshape(-1, r).T, lora_B = B.reshape(r, -1).T.

A fused module (Phi-3's qkv_proj, gate_up_proj: several paxcli projections as pieces of one HF array) takes
one PEFT adapter, as PEFT's own LoRA on it is. `--to peft` writes the k adapted projections' adapters side by
side: lora_A their A's stacked [k r, in], lora_B [out, k r] writing each projection's rows from its own r
columns and zeros elsewhere, with rank_pattern k r and alpha_pattern k alpha for that module: the same update,
exactly, whatever the ranks. LORA_INIT reads such an adapter back, and PEFT's own of rank r (its one A shared
by the projections); another rank that does not split exactly is one line.
Both `--to peft` and `--merge-lora` certify what they write (paxcli.convert.certify).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import jax
import numpy as np

from paxcli import files
from paxcli.convert import certify, core, hf, hf_tokenizer, safetensors_io
from paxcli.errors import UserError, shorten
from paxcli.jobdir import checkpoint as ckpt
from paxcli.jobdir import format as job_format
from paxcli.jobdir import layout, restore
from paxcli.layers import lora
from paxcli.models import pattern
from paxcli.models.lm import flat_view
from paxcli.runtime import engine, train_state

PEFT_PREFIX = 'base_model.model.'   # PEFT's wrapper around the transformers model
PEFT_CONFIG, PEFT_WEIGHTS = 'adapter_config.json', 'adapter_model.safetensors'
_KERNEL = re.compile(r'params/layer_(\d+)/(?:attention|mlp)/(\w+)/kernel')


@dataclasses.dataclass(frozen=True)
class Target:
  """Where one projection's adapter goes in PEFT's layout: the module (base_model.model.model.layers.3.self_attn.
  q_proj), its output features, and the rows of that output that are the projection's (None: all of them; a
  piece of a fused module such as Phi-3's qkv_proj, whose query, key and value rows are three projections)."""
  module: str
  out: int
  rows: Optional[tuple[int, int]] = None

  @property
  def name(self) -> str:
    return self.module.rsplit('.', 1)[-1]


def peft_modules(model, family: Optional[str] = None) -> dict[tuple[int, str], Target]:
  """(layer, projection) -> where PEFT keeps that projection's adapter: its kernel's Hugging Face module in the
  weight map of the model's family (base_model.model.model.layers.3.self_attn.q_proj for the query of a Llama's
  layer 3; the qkv_proj rows of a Phi-3's; `family`: --family's). A model of no family with a Hugging Face layout
  is a UserError saying why."""
  view = flat_view(model)
  out = {}
  for w in hf.family_of(view, family).hf_weights(view):
    m = _KERNEL.fullmatch(w.paxcli)
    if not m or not w.hf.endswith('.weight') or w.paxcli_piece is not None:   # stacked experts take no adapters
      continue
    rows = None
    if w.hf_piece is not None:
      if w.hf_piece.axis != 0:
        raise UserError(f'{w.hf} joins {w.paxcli} with others along its input features; a PEFT LoRA on it would '
                        'adapt their sum, which paxcli\'s adapters do not compute. Leave it out of LORA_TARGETS.')
      rows = (w.hf_piece.start, w.hf_piece.end)
    out[int(m.group(1)), m.group(2)] = Target(PEFT_PREFIX + w.hf[:-len('.weight')], w.hf_shape[0], rows)
  return out


def _module_names(model) -> dict[str, str]:
  """projection -> its module's own name (q_proj, qkv_proj, ...), as PEFT's target_modules lists it."""
  return {projection: target.name for (_, projection), target in peft_modules(model).items()}


def is_lora_run(src) -> bool:
  """True for a paxcli checkpoint written by a LoRA run (adapters only, naming their base)."""
  return bool(getattr(src, 'meta', None) and src.meta.get('base'))


def _restored(src, exp: Optional[str], overrides: list):
  """(setup, params on the host: base and adapters) of a LoRA run's checkpoint."""
  resolved, _ = core.resolve_pair(src, exp, list(overrides))
  setup = engine.build(resolved)
  got = restore.restore(setup, src.job_dir, src.step, params_only=True, action='convert')
  return setup, jax.tree.map(np.asarray, jax.device_get(got.state['params']))


def _lora_side(model, params) -> certify.Side:
  return certify.paxcli_side('paxcli on the LoRA run (base + adapters)', model, params)


def _fits(setup, log) -> bool:
  leaves = jax.tree.leaves(setup.abstract_state['params'])
  return certify.fits(sum(int(np.prod(x.shape, dtype=np.int64)) for x in leaves), log)


def _scale(model) -> float:
  s = model.lora
  return s['alpha'] / s['rank']


def merge_run(src, tmp: str, exp: Optional[str], overrides: list, verify: bool, log) -> Optional[dict]:
  """Writes into job directory `tmp` a params-only checkpoint of the run with every adapter merged
  (W + alpha/r A B, float32) and LORA_RANK=0: a plain model every command reads. Returns the
  certification of the merged model against the LoRA run's (None without verify); a UserError and nothing
  written when they differ."""
  lora_setup, params = _restored(src, exp, overrides)
  model = lora_setup.model
  merged = lora.merge(params, _scale(model))
  _, plain = core.resolve_pair(src, exp, list(overrides) + ['LORA_RANK=0'])
  setup = engine.build(plain)
  abstract = {'step': setup.abstract_state['step'], 'params': setup.abstract_state['params']}
  state = jax.tree.map(lambda x, a: jax.device_put(np.asarray(x, a.dtype), a.sharding),
                       {'step': np.int32(src.step), 'params': merged}, abstract)
  result = None
  if verify and _fits(lora_setup, log):
    result = certify.certify(_lora_side(model, params),
                             certify.paxcli_side('paxcli on the merged model', setup.model, merged),
                             certify.prompts(model.vocab_size, model.max_seq_len), certify.default_tolerance(None))
    certify.check(result)
  checkpointer = ckpt.Checkpointer(layout.checkpoints(tmp), max_to_keep=0, async_save=False)
  checkpointer.save(src.step, state, {'step': src.step, 'state_shapes': train_state.shape_signature(abstract),
                                      'config': {k: repr(v) for k, v in plain.flat().items()},
                                      'checksums': train_state.checksums(state), 'merged_lora_of': src.meta['base']})
  checkpointer.close()
  with open(layout.config(tmp), 'w', encoding='utf-8') as f:
    f.write(plain.as_text())
  job_format.write_job(tmp)
  core.carry_tokenizer(src, tmp)   # so that it decodes text, and --to hf ships the tokenizer
  log(f'Merged the adapters (scale {_scale(model):g}) into the base {restore.BaseRef(**src.meta["base"]).describe()}.')
  return result


# ---- PEFT ---------------------------------------------------------------------------------------


def _layer_adapters(params: dict):
  """(layer index, projection, A, B) for every adapter, unrolled or scanned ([layers, ...], or [groups, ...]
  per position of a patterned stack's group: paxcli.models.pattern)."""
  layers = sorted((int(k.split('_')[1]), v) for k, v in params.items() if k.startswith('layer_'))
  if 'layers' in params:   # beside the scanned stack, layer_<i> entries are LAYER_PREFIX's layers
    stack, prefix = params['layers'], len(layers)
    n = prefix + len(next(iter(jax.tree.leaves(stack)))) * pattern.period_of(stack)
    layers += [(int(k.split('_')[1]), v) for k, v in pattern.unstack(stack, n, lambda x, row: x[row], prefix).items()]
  for i, layer in layers:
    for block in ('attention', 'mlp'):
      weights = layer.get(block, {})
      for name in sorted(weights):
        if name.endswith(lora.SUFFIX_A):
          projection = name[:-len(lora.SUFFIX_A)]
          yield i, projection, weights[name], weights[projection + lora.SUFFIX_B]


def export_peft(src, tmp: str, exp: Optional[str], overrides: list, log, verify: bool = True,
                tolerance: Optional[float] = None, base_model: Optional[str] = None,
                family: Optional[str] = None) -> dict:
  """Writes the run's adapters into directory `tmp` as PEFT's adapter_config.json + adapter_model.safetensors,
  then certifies them (_certify_peft; 'verify' in the result); a UserError when they differ from the run.

  base_model_name_or_path (what PEFT loads the adapters onto): `base_model` (a Hugging Face id, or a
  directory, made absolute), else the directory the base was converted from (--from hf) when it is still
  there, else the paxcli base checkpoint, said in a line: PEFT cannot load that one."""
  setup, params = _restored(src, exp, overrides)
  model = setup.model
  s = model.lora
  names = peft_modules(model, family)
  by_module = {}   # module -> [(target, A, B)] of its projections, in their order in the module
  for i, projection, a, b in _layer_adapters(params):
    target = names[i, projection]
    by_module.setdefault(target.module, []).append((target, a, b))
  tensors, ranks = {}, {}
  for module, parts in by_module.items():
    tensors[f'{module}.lora_A.weight'], tensors[f'{module}.lora_B.weight'] = _peft_pair(parts, s['rank'])
    rank = tensors[f'{module}.lora_A.weight'].shape[0]
    if rank != s['rank']:
      ranks[module.rsplit('.', 1)[-1]] = rank
  modules = sorted({k.split('.')[-3] for k in tensors})
  base_model_path = _base_model(src.meta['base'], base_model, log)
  config = {
      'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': s['rank'], 'lora_alpha': s['alpha'],
      'lora_dropout': s['dropout'], 'target_modules': modules, 'bias': 'none', 'fan_in_fan_out': False,
      'use_rslora': False, 'use_dora': False, 'init_lora_weights': True, 'inference_mode': True,
      'modules_to_save': None, 'layers_to_transform': None, 'layers_pattern': None, 'rank_pattern': ranks,
      'alpha_pattern': {m: s['alpha'] * (r // s['rank']) for m, r in ranks.items()}, 'revision': None,
      'base_model_name_or_path': base_model_path,
  }
  arrays = [(name, x.shape, x.dtype.name) for name, x in sorted(tensors.items())]
  written = safetensors_io.write(tmp, arrays, lambda name, put: put(tensors[name]), {'format': 'pt'},
                                 max_shard_bytes=1 << 62)
  os.rename(os.path.join(tmp, written[0]), os.path.join(tmp, PEFT_WEIGHTS))
  with open(os.path.join(tmp, PEFT_CONFIG), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
  tok = src.extra_files().get('tokenizer')
  if tok:   # beside the adapters, as TRL saves them: AutoTokenizer (its chat templates too) reads the directory
    hf_tokenizer.export(tmp, tok, max(flat_view(model).max_seq_len, core.longest_context(src) or 0))
  fused = ''.join(f'; {m}: r={r}, alpha={s["alpha"] * (r // s["rank"]):g} (its {r // s["rank"]} adapted projections\' '
                  'adapters side by side: the same update)' for m, r in ranks.items())
  log(f'Wrote {len(tensors)} adapter arrays ({", ".join(modules)}; r={s["rank"]}, alpha={s["alpha"]:g}{fused})'
      f'{" and the tokenizer" if tok else ""}.')
  out = {'bytes_written': int(sum(x.nbytes for x in tensors.values())), 'arrays': len(tensors)}
  if verify and _fits(setup, log):
    out['verify'] = _certify_peft(setup, params, tmp, certify.default_tolerance(None) if tolerance is None
                                  else tolerance, family)
    certify.check(out['verify'])
  return out


def _peft_pair(parts: list, rank: int) -> tuple[np.ndarray, np.ndarray]:
  """PEFT's (lora_A [r', in], lora_B [out, r']) of one module from paxcli's adapters (A [in..., r], B [r, out...])
  of the projections it holds. A fused module's projections (Phi-3's q, k and v in qkv_proj) are one PEFT adapter
  of rank r' = k x r: their A's stacked, and a B that writes each projection's rows from its own r columns only,
  zero elsewhere, which is exactly the sum of their updates (alpha scales alike: alpha_pattern is k x alpha)."""
  parts = sorted(parts, key=lambda part: part[0].rows or (0, 0))
  target, a, b = parts[0]
  if target.rows is None:
    return np.ascontiguousarray(a.reshape(-1, rank).T), np.ascontiguousarray(b.reshape(rank, -1).T)
  lora_a = np.concatenate([a.reshape(-1, rank).T for _, a, _ in parts])
  lora_b = np.zeros((target.out, len(parts) * rank), b.dtype)
  for j, (t, _, b) in enumerate(parts):
    lora_b[t.rows[0]:t.rows[1], j * rank:(j + 1) * rank] = b.reshape(rank, -1).T
  return np.ascontiguousarray(lora_a), lora_b


def _certify_peft(setup, params: dict, written: str, tolerance: float, family: Optional[str] = None) -> dict:
  """The LoRA run against the adapters in directory `written`: PEFT's LoRA on transformers' model of the base
  where both are installed, else paxcli's own reading of the adapters (read_peft) on the base."""
  model, view = setup.model, flat_view(setup.model)
  ids = certify.prompts(view.vocab_size, view.max_seq_len)
  if certify.have_peft():
    result = certify.peft_side(hf.family_of(view, family), view, certify.base_weights(params, view.num_layers, pattern.prefix_of(view)), written)
  else:
    adapters = read_peft(written, model, setup.abstract_state['params'])
    result = certify.paxcli_side('paxcli on the base with the written adapters read back (PEFT or transformers is '
                                 f'not installed; {certify.INSTALL_HINT})', model, _overlay(params, adapters))
  return certify.certify(_lora_side(model, params), result, ids, tolerance)


def _overlay(tree: dict, new: dict) -> dict:
  """`tree` with the leaves of `new` (nested alike) in place of its own."""
  return {k: (_overlay(v, new[k]) if isinstance(v, dict) else new[k]) if k in new else v for k, v in tree.items()}


def _base_model(base: dict, given: Optional[str], log) -> str:
  """base_model_name_or_path of the adapters of a run on checkpoint `base` (its meta's BaseRef)."""
  if given:
    return os.path.abspath(given) if os.path.isdir(given) else given
  checkpoint = layout.step_dir(base['job_dir'], base['step'])
  origin = core.hf_origin(checkpoint)
  other = origin and hf.other_layout(origin)
  if other:   # PEFT would look for the adapters' modules under other names there, and silently apply none
    log(f'base_model_name_or_path: {checkpoint}, the paxcli base: the Hugging Face model it was converted from '
        f'({origin}) is a {other}, whose modules are named otherwise than the adapters\'; pass --base-model with '
        'the directory `pax checkpoint convert BASE DIR --to hf` writes from the base.')
    return checkpoint
  if origin:
    log(f'base_model_name_or_path: {origin}, the Hugging Face model the base was converted from '
        '(--base-model names another).')
    return origin
  log(f'base_model_name_or_path: {checkpoint}, the paxcli base, which PEFT cannot load: pass --base-model with '
      'the Hugging Face id or directory of that model.')
  return checkpoint


# adapter_config.json, as PEFT's LoraConfig writes it: what paxcli checks, and what it may ignore.
# Keys whose setting changes the adapted function, with the setting paxcli computes (any other is
# refused by name); r, lora_alpha and target_modules are checked against the run's LoRA knobs.
PEFT_NEUTRAL = {
    'peft_type': ('LORA',), 'fan_in_fan_out': (False, None), 'bias': ('none', None), 'use_rslora': (False, None),
    'use_dora': (False, None), 'modules_to_save': (None, []), 'layers_to_transform': (None, []),
    'exclude_modules': (None, []),
    'megatron_config': (None,), 'trainable_token_indices': (None, [], {}), 'alora_invocation_tokens': (None, []),
    'use_qalora': (False, None), 'layer_replication': (None, []), 'lora_bias': (False, None),
    'target_parameters': (None, []), 'arrow_config': (None,), 'monteclora_config': (None,), 'kasa_config': (None,),
    'use_bdlora': (None, False),
}
# Read for a fused module only (an adapter of another rank there: --to peft writes k x r on Phi-3's qkv_proj).
PEFT_PATTERNS = ('rank_pattern', 'alpha_pattern')
# Keys that name, describe or initialise the adapter, or act only in training: the weights say the rest.
PEFT_HARMLESS = {
    'task_type', 'auto_mapping', 'peft_version', 'base_model_name_or_path', 'revision', 'inference_mode',
    'lora_dropout', 'init_lora_weights', 'loftq_config', 'eva_config', 'corda_config', 'lora_ga_config',
    'runtime_config', 'megatron_core', 'qalora_group_size', 'layers_pattern', 'velora_config',
    'ensure_weight_tying', 'r', 'lora_alpha', 'target_modules',
}
MAX_PEFT_CONFIG_BYTES = 1 << 20


def read_peft(directory: str, model, abstract_params: dict) -> dict:
  """The adapters of PEFT directory `directory` as this model's trainable params (nested, host
  arrays), checked against the model's LoRA settings; UserError naming what does not fit."""
  config = check_peft(directory, model)
  s = model.lora
  src = safetensors_io.SafetensorsSource(files.member(directory, PEFT_WEIGHTS, 'PEFT weights'))
  trainable = train_state.split_trainable(model, abstract_params)[0]
  out = {}
  lm = getattr(model, 'lm_tpl', None)
  period, prefix = pattern.period(getattr(lm, 'layer_pattern', ())), pattern.prefix_of(lm)
  pairs = _PeftPairs(directory, src, peft_modules(model), s, config)
  for path_keys, leaf in _flat_paths(trainable):
    *scope, name = path_keys
    projection, part = (name[:-len(lora.SUFFIX_A)], 'A') if name.endswith(lora.SUFFIX_A) else \
        (name[:-len(lora.SUFFIX_B)], 'B')
    layers = _layers_of(scope, leaf.shape[0] if scope[0] == 'layers' else 0, period, prefix)
    per_layer = tuple(leaf.shape[1:] if scope[0] == 'layers' else leaf.shape)
    # PEFT's torch Linear layout: lora_A [r, in], lora_B [out, r]; ours A [in..., r], B [r, out...]
    want = ((per_layer[-1], int(np.prod(per_layer[:-1]))) if part == 'A'
            else (int(np.prod(per_layer[1:])), per_layer[0]))
    blocks = []
    for i in layers:
      key, x = pairs.of(i, projection, part)
      if tuple(x.shape) != want:   # the same number of values in another shape is another adapter: never reshaped
        raise UserError(f'{directory}: {PEFT_WEIGHTS}: {key} has shape {list(x.shape)}, but this run needs '
                        f'{list(want)} (LORA_RANK {s["rank"]}, the model\'s dimensions).')
      blocks.append(np.asarray(x, np.float32).T.reshape(per_layer))
    out[tuple(path_keys)] = np.stack(blocks) if scope[0] == 'layers' else blocks[0]
  unread = sorted(set(pairs.have) - pairs.used)
  if unread:
    raise UserError(f'{directory}: {PEFT_WEIGHTS} holds {len(unread)} array(s) this run would not apply, first '
                    f'{shorten(unread[0], 120)} (LORA_TARGETS={list(s["targets"])}); applying the rest would compute '
                    'another function.')
  return core.nest({'/'.join(k): v for k, v in out.items()})


class _PeftPairs:
  """PEFT's arrays of a directory as each (layer, projection)'s own lora_A [r, in] and lora_B [out, r]: a plain
  module's as they are; a fused module's (one adapter of rank R on Phi-3's qkv_proj) split exactly into the rank-r
  adapters of the projections the run adapts, or one line saying why it cannot be."""

  def __init__(self, directory: str, src, targets: dict, settings: dict, config: dict):
    self.directory, self.src, self.targets, self.s = directory, src, targets, settings
    self.have = {a.name: tuple(a.shape) for a in src.arrays()}
    self.ranks, self.alphas = config.get('rank_pattern') or {}, config.get('alpha_pattern') or {}
    self.used = set()

  def _read(self, key: str) -> np.ndarray:
    if key not in self.have:
      raise UserError(f'{self.directory}: {PEFT_WEIGHTS} has no {key} (LORA_TARGETS={list(self.s["targets"])} '
                      'needs it).')
    self.used.add(key)
    return self.src.read(key)

  def of(self, layer: int, projection: str, part: str) -> tuple[str, np.ndarray]:
    """(the PEFT array's name, lora_A or lora_B of the projection in PEFT's orientation)."""
    target = self.targets[layer, projection]
    key = f'{target.module}.lora_{part}.weight'
    if target.rows is None:
      return key, self._read(key)
    a, b = self._read(f'{target.module}.lora_A.weight'), self._read(f'{target.module}.lora_B.weight')
    return key, self._split(layer, projection, target, a, b)[0 if part == 'A' else 1]

  def _split(self, layer: int, projection: str, target: Target, a: np.ndarray, b: np.ndarray):
    r, name, where = self.s['rank'], target.name, f'{self.directory}: {PEFT_WEIGHTS}: {target.module}'
    rank = a.shape[0]
    if rank != self.ranks.get(name, r) or b.shape != (target.out, rank):
      raise UserError(f'{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not one adapter of rank '
                      f'{self.ranks.get(name, r)} on its {target.out} outputs.')
    pieces = sorted((t.rows, p) for (i, p), t in self.targets.items() if i == layer and t.module == target.module)
    adapted = [p for _, p in pieces if lora.targets_projection(self.s['targets'], p)]
    stray = [p for rows, p in pieces if p not in adapted and np.any(b[rows[0]:rows[1]])]
    if stray:
      raise UserError(f'{where} also adapts {", ".join(stray)}, which LORA_TARGETS={list(self.s["targets"])} leaves '
                      'alone; add it there.')
    scale = (self.alphas.get(name, self.s['alpha']) / rank) / (self.s['alpha'] / r)
    rows = b[target.rows[0]:target.rows[1]]
    if rank == r:   # the projections share PEFT's A: each keeps a copy
      return a, rows * scale
    j = adapted.index(projection)
    block = slice(j * r, (j + 1) * r)
    if rank == len(adapted) * r and not np.any(np.delete(rows, np.arange(block.start, block.stop), axis=1)):
      return a[block], rows[:, block] * scale   # side by side, as --to peft writes them
    raise UserError(f'{where}: an adapter of rank {rank} on {name} does not split exactly into rank-{r} adapters of '
                    f'{", ".join(adapted)} (LORA_RANK {r}): set LORA_RANK to {rank} to read it.')


def check_peft(directory: str, model) -> dict:
  """Reads PEFT directory `directory`'s adapter_config.json (a regular file inside it, bounded JSON)
  and checks it against the model's LoRA settings (check_peft_config): one line, before any weight."""
  if not os.path.isdir(directory):
    raise UserError(f'LORA_INIT={shorten(directory, 200)} is not a directory; give the PEFT adapter directory '
                    f'(with {PEFT_CONFIG} and {PEFT_WEIGHTS}).')
  config_path = files.member(directory, PEFT_CONFIG, 'PEFT config')
  config = files.read_json(config_path, f'LORA_INIT: {PEFT_CONFIG}', MAX_PEFT_CONFIG_BYTES)
  if not isinstance(config, dict):
    raise UserError(f'{config_path}: a JSON {type(config).__name__}, not an object of LoraConfig fields.')
  check_peft_config(config, config_path, model.lora, _module_names(model))
  return config


def check_peft_config(config: dict, path: str, settings: dict, modules: dict) -> None:
  """UserError naming the first field of adapter_config.json that makes PEFT compute another function
  than this run's LoRA (rank, alpha, targets, and everything PEFT_NEUTRAL lists); unknown fields too.
  `modules`: projection -> the name of its module (q_proj, ...) in the model's family."""
  def shown(value) -> str:
    return shorten(json.dumps(value), 80)

  for field, value in (('r', settings['rank']), ('lora_alpha', settings['alpha'])):
    if config.get(field) != value or isinstance(config.get(field), bool):
      raise UserError(f'{path}: {field} is {shown(config.get(field))}, but this run needs {value!r} '
                      '(set LORA_RANK / LORA_ALPHA to the adapter\'s).')
  for field, neutral in PEFT_NEUTRAL.items():
    if field in config and not any(config[field] == v and type(config[field]) is type(v) for v in neutral):
      raise UserError(f'{path}: {field} is {shown(config[field])}; paxcli\'s LoRA computes only '
                      f'{shown(neutral[0])} there (it would compute another function). Not read.')
  fused = {name for name in modules.values() if list(modules.values()).count(name) > 1}
  for field in PEFT_PATTERNS:
    value = config.get(field) or {}
    bad = not isinstance(value, dict) or any(k not in fused or isinstance(v, bool) or not isinstance(v, (int, float))
                                             or v <= 0 for k, v in value.items())
    if bad:
      raise UserError(f'{path}: {field} is {shown(config[field])}; paxcli reads one only for a fused module of the '
                      f'model ({", ".join(sorted(fused)) or "it has none"}), a positive number each.')
  unknown = sorted(set(config) - set(PEFT_NEUTRAL) - set(PEFT_PATTERNS) - PEFT_HARMLESS)
  if unknown:
    raise UserError(f'{path}: {shorten(", ".join(unknown), 120)}: unknown to paxcli, so it may change what the '
                    'adapter computes. Not read; remove from the file what you know does not.')
  _check_targets(config.get('target_modules'), path, settings['targets'], modules)


def _check_targets(targets, path: str, lora_targets, modules: dict) -> None:
  """PEFT's target_modules (a list of module names, or 'all-linear') must be the projections
  LORA_TARGETS adapts: an adapter on another module would be dropped, changing the function."""
  ours = {name for p, name in modules.items() if lora.targets_projection(lora_targets, p)}
  if targets == 'all-linear':
    theirs = set(modules.values())
  elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
    theirs = {t.rsplit('.', 1)[-1] for t in targets}
  else:
    raise UserError(f'{path}: target_modules is {shorten(json.dumps(targets), 80)}; paxcli reads a list of module '
                    'names (q_proj, v_proj, ...) or "all-linear", not a pattern.')
  if theirs != ours:
    raise UserError(f'{path}: target_modules is {sorted(theirs)}, but LORA_TARGETS={list(lora_targets)} adapts '
                    f'{sorted(ours)}; set LORA_TARGETS to the adapter\'s modules.')


def _layers_of(scope: list, rows: int, period: int, prefix: int = 0) -> list[int]:
  """The layer indices of a trainable leaf's rows: layer_<i>/...: [i]; layers/...: every row; layers/block_<j>/...
  of a patterned stack (`period` layers per group): row g is layer g * period + j; counted after the `prefix`
  layers of LAYER_PREFIX."""
  if scope[0] != 'layers':
    return [int(scope[0].split('_')[1])]
  if not (len(scope) > 1 and scope[1].startswith('block_')):
    return [prefix + g for g in range(rows)]
  j = int(scope[1].split('_')[1])
  return [prefix + g * period + j for g in range(rows)]


def _flat_paths(tree: dict):
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    yield tuple(str(k) for k in train_state.keys(path)), leaf


def resolve_lora_target(to: str, merge_lora: bool, src) -> None:
  """Refuses what a LoRA run's checkpoint cannot be converted to as it is, in one line."""
  if merge_lora and not is_lora_run(src):
    raise UserError(f'--merge-lora: {src.path} is not a LoRA run\'s checkpoint (its meta names no base).')
  if to == 'peft' and not is_lora_run(src):
    raise UserError(f'--to peft writes LoRA adapters; {src.path} is not a LoRA run\'s checkpoint.')
  if is_lora_run(src) and to in ('orbax', 'safetensors') and not merge_lora:
    raise UserError(f'{src.path} holds LoRA adapters on a frozen base: pass --merge-lora for a plain checkpoint '
                    '(W + scale A B), or --to peft for the adapters in PEFT\'s format.')
