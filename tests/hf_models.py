"""Reference models for the Hugging Face family tests: built by transformers' own model classes from a
family's released config.json at a reduced size, every weight random (norms around 1, biases around 0:
a weight left at its initial value could hide a mapping that drops it), saved with save_pretrained."""

import numpy as np


def reduced(released: dict, **sizes) -> dict:
  """A released config.json with its sizes replaced (what stays: the family's function-defining keys)."""
  return {**released, **sizes}


def build(config: dict, seed: int = 0):
  """transformers' model of config.json `config` (its own class for model_type), float32, random weights."""
  import torch
  import transformers
  torch.manual_seed(seed)
  settings = dict(config)
  model = transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(settings.pop('model_type'), **settings), dtype=torch.float32,
      attn_implementation='eager')
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1 + 0.3 * torch.randn_like(p))
      else:
        p.copy_((0.3 if name.endswith('bias') else 0.2) * torch.randn_like(p))
  return model.eval()


def save(model, directory: str) -> str:
  model.save_pretrained(directory)
  return str(directory)


def load(directory: str):
  import torch
  import transformers
  return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                           attn_implementation='eager').eval()


def logits(model, ids) -> np.ndarray:
  import torch
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def generate(model, prompt: list, steps: int) -> list:
  """transformers' greedy generate() of `steps` new tokens (no end-of-text stop)."""
  import torch
  out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps, min_new_tokens=steps,
                       eos_token_id=None, pad_token_id=0)
  return out[0, len(prompt):].tolist()


def log_likelihood(model, context: list, continuation: list) -> float:
  """sum log p(continuation | context) under `model` (float64 softmax of its float32 logits)."""
  x = logits(model, [context + continuation])[0].astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
  n = len(context)
  return float(sum(logp[n - 1 + j, t] for j, t in enumerate(continuation)))
