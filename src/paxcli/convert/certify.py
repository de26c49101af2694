"""Conversions that certify themselves: `pax checkpoint convert` runs the source and the result on fixed
prompts and writes the result only when their logits agree (the output stays a temporary directory
until then, and is removed when they do not).

What runs each side:
  a Hugging Face directory   transformers' own model class (AutoModelForCausalLM from the directory: float32,
                             eager attention, safetensors only, no remote code), when transformers and torch
                             are installed (`pip install 'paxcli[hf]'`); otherwise paxcli's reading of the
                             directory, and the report says that this is what was compared
  PEFT adapters (--to peft)  PEFT's own LoRA (PeftModel.from_pretrained) on transformers' model of the run's
                             base, built from the base weights through the family's weight map; otherwise
                             paxcli's reading of the written adapters (LORA_INIT's reader) on the base
  a paxcli checkpoint        paxcli's model (JAX), parameters in float32

Prompts: PROMPT_ROWS rows of min(MAX_SEQ_LEN, PROMPT_LEN) token ids drawn with a fixed seed, the same for
every conversion of a model. Reported: max |Δ logit|, the KL divergence from the reference's next-token
distribution to the result's (mean over positions, and its largest), and top-1 agreement (the share of
positions whose most likely next token is the same). The check fails when the mean KL exceeds the tolerance
(default_tolerance: 1e-5 nats in float32, 1e-2 when the result is cast to bfloat16) or is not finite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import warnings
from typing import Callable, Optional

import numpy as np

from paxcli.convert import core
from paxcli.errors import UserError
from paxcli.layers import lora as lora_layer
from paxcli.models import pattern
from paxcli.models.weight_map import WeightMap
from paxcli.runtime import platform

PROMPT_ROWS, PROMPT_LEN, PROMPT_SEED = 2, 64, 0
INSTALL_HINT = "pip install 'paxcli[hf]' to run transformers' own model"


@dataclasses.dataclass
class Side:
  """One side of a comparison: what runs it (for the report), and ids [B, L] -> float32 logits [B, L, V]."""
  what: str
  logits: Callable[[np.ndarray], np.ndarray]


def default_tolerance(dtype: Optional[str]) -> float:
  return 1e-2 if dtype in ('bfloat16', 'float16') else 1e-5


def prompts(vocab_size: int, max_seq_len: int) -> np.ndarray:
  """The fixed prompts: PROMPT_ROWS rows of token ids from a fixed seed."""
  return np.random.default_rng(PROMPT_SEED).integers(0, vocab_size, (PROMPT_ROWS, min(max_seq_len, PROMPT_LEN)),
                                                     dtype=np.int32)


def compare(reference: np.ndarray, result: np.ndarray) -> dict:
  """max |Δ logit|, KL(reference || result) per position (mean and max), top-1 agreement, max |logit|."""
  def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
  la, lb = log_softmax(reference.astype(np.float64)), log_softmax(result.astype(np.float64))
  kl = np.sum(np.exp(la) * (la - lb), axis=-1)
  return {'max_abs_diff': float(np.max(np.abs(reference - result))), 'kl': float(np.mean(kl)),
          'kl_max': float(np.max(kl)),
          'top1_agreement': float(np.mean(reference.argmax(-1) == result.argmax(-1))),
          'max_abs_logit': float(np.max(np.abs(reference)))}


def certify(reference: Side, result: Side, ids: np.ndarray, tolerance: float) -> dict:
  """The two sides on `ids`, compared (compare) and judged against `tolerance` (mean KL): the report."""
  ref = reference.logits(ids)   # one side at a time: the first side's model is gone before the second loads
  got = result.logits(ids)
  out = compare(ref, got)
  out.update(reference=reference.what, result=result.what, kl_tolerance=tolerance,
             prompts=f'{ids.shape[0]} fixed prompts x {ids.shape[1]} tokens',
             ok=bool(np.isfinite(out['kl']) and out['kl'] <= tolerance))
  return out


def line(report: dict) -> str:
  """The report in one line, as `pax checkpoint convert` prints it."""
  r = report
  return (f'Certified on {r["prompts"]}: {r["reference"]} against {r["result"]}: max |Δ logit| '
          f'{r["max_abs_diff"]:.3g} (max |logit| {r["max_abs_logit"]:.3g}), KL {r["kl"]:.3g} (largest '
          f'{r["kl_max"]:.3g}; tolerance {r["kl_tolerance"]:g}), top-1 agreement {100 * r["top1_agreement"]:.1f}%: '
          f'{"ok" if r["ok"] else "FAILED"}')


def check(report: Optional[dict]) -> None:
  """A UserError (nothing is written) when a certification failed."""
  if report is not None and not report['ok']:
    raise UserError(f'The conversion does not compute the source\'s function, so nothing was written: '
                    f'{line(report)}.')


def fits(param_count: int, log) -> bool:
  """Whether this host holds what a certification runs (about three float32 copies of the parameters: the
  two models, one at a time, and the arrays read); a line saying why not when it does not."""
  need, memory = 3 * 4 * param_count, platform.host_memory_bytes() or 0
  if memory and need > memory:
    log(f'Not certifying: running both models needs about {need / 2**30:.0f} GiB of host memory '
        f'({memory / 2**30:.0f} GiB here); the conversion itself streamed.')
    return False
  return True


def paxcli_side(what: str, module, params: dict) -> Side:
  return Side(what, lambda ids: core.logits(module, params, ids))


# ---- transformers and PEFT -----------------------------------------------------------------------


def _hf():
  """(torch, transformers), imported where transformers' side runs: optional (paxcli[hf]), and seconds to import."""
  import torch
  import transformers
  return torch, transformers


def have(*modules: str) -> bool:
  """Whether the optional packages (transformers, torch, peft) are installed."""
  return all(importlib.util.find_spec(m) is not None for m in modules)


def have_transformers() -> bool:
  return have('transformers', 'torch')


def have_peft() -> bool:
  return have('transformers', 'torch', 'peft')


@contextlib.contextmanager
def _quiet_transformers():
  """transformers' and PEFT's own warnings (generation defaults, their deprecations, ...) and loading bars kept
  out of the command's output."""
  _, transformers = _hf()
  before, bars = transformers.logging.get_verbosity(), transformers.utils.logging.is_progress_bar_enabled()
  transformers.logging.set_verbosity_error()
  transformers.utils.logging.disable_progress_bar()
  try:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', FutureWarning)
      yield
  finally:
    transformers.logging.set_verbosity(before)
    if bars:
      transformers.utils.logging.enable_progress_bar()


def _torch_logits(model, ids: np.ndarray) -> np.ndarray:
  torch, _ = _hf()
  model.eval()
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def transformers_side(directory: str, architecture: str, label: str) -> Side:
  """transformers' model of the Hugging Face directory `directory` (its own class for config.json's model_type:
  Gemma3ForConditionalGeneration for a multimodal Gemma 3, run on the text prompts); `label` says which side it
  is (the source, the written result). The report names the class that ran."""
  def run(ids):
    torch, transformers = _hf()
    with _quiet_transformers():
      model = transformers.AutoModelForCausalLM.from_pretrained(
          directory, dtype=torch.float32, use_safetensors=True, local_files_only=True, trust_remote_code=False,
          attn_implementation='eager')
      side.what = f'transformers {type(model).__name__} (float32) on {label}'
      return _torch_logits(model, ids)
  side = Side(f'transformers {architecture} (float32) on {label}', run)
  return side


def hf_model(family, view, weights: dict):
  """transformers' model of a paxcli model: `family`'s config.json for `view` (a flat view) and its weights
  (paxcli unrolled names -> arrays) through the family's weight map."""
  torch, transformers = _hf()
  config = family.to_hf_config(view, 'float32', None)
  settings = dict(config)
  with _quiet_transformers():
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(settings.pop('model_type'), **settings), dtype=torch.float32,
        attn_implementation='eager')
  wmap = WeightMap(family.hf_weights(view))
  state = {name: torch.from_numpy(np.array(wmap.to_hf(name, lambda p: np.asarray(weights[p], np.float32)), order='C'))
           for name in wmap.hf_shapes}
  if set(state) - set(model.state_dict()):
    # The checkpoint's names are not the module's (transformers 5 fuses per-expert weights as it loads them).
    del model
    return _converted_on_load(config, state)
  missing, unexpected = model.load_state_dict(state, strict=False)
  tied = {'lm_head.weight'} if not view.separate_embedding else set()
  if unexpected or set(missing) - tied:   # a bug of the weight map, never the user's input
    raise AssertionError(f'{family.title} weight map against transformers: missing {missing}, unexpected {unexpected}')
  return model


def _converted_on_load(config: dict, state: dict):
  """transformers' model of config.json `config` from checkpoint arrays `state`, through from_pretrained's own
  renaming and fusing of checkpoint names (what it does to a directory's files, here to arrays in memory)."""
  torch, transformers = _hf()
  settings = dict(config)
  hf_config = transformers.AutoConfig.for_model(settings.pop('model_type'), **settings)
  with _quiet_transformers():
    return getattr(transformers, config['architectures'][0]).from_pretrained(
        None, config=hf_config, state_dict=state, dtype=torch.float32, attn_implementation='eager')


def peft_side(family, view, base: dict, adapters: str) -> Side:
  """PEFT's LoRA from directory `adapters` on transformers' model of the base weights `base`."""
  def run(ids):
    import peft
    with _quiet_transformers():
      model = peft.PeftModel.from_pretrained(hf_model(family, view, base), adapters, is_trainable=False)
      return _torch_logits(model, ids)
  return Side(f'PEFT\'s LoRA from the written adapters on transformers {family.hf_architectures[0]} (float32) '
              'of the base', run)


def base_weights(params: dict, num_layers: int, prefix: int = 0) -> dict:
  """A run's parameters (nested, scanned or not) as paxcli unrolled names -> arrays, adapters left out (prefix: the
  layers before the scanned stack, LAYER_PREFIX's)."""
  tree = dict(params)
  if 'layers' in tree:
    tree.update(pattern.unstack(tree.pop('layers'), num_layers, lambda x, row: x[row], prefix))
  out = {}

  def walk(node, prefix):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(value, f'{prefix}{key}/')
      elif not lora_layer.is_adapter(str(key)):
        out[f'{prefix}{key}'] = value
  walk(tree, 'params/')
  return out
