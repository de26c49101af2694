"""Phi-3's LongRoPE while decoding, held against transformers' Phi3ForCausalLM (the phi3 entry of
tests/hf_models.py: an original context of 12 positions). Decoding keeps a cache; a text that grows past the
original context rotates with the long factors at every position, so its cache is computed again at that step,
as transformers' generate() does. Here each step's logits, row by row, are transformers' forward of that row's
text so far, for a row that crosses over and one beside it that does not."""

import types

import numpy as np
import pytest

import hf_models

pytest.importorskip('transformers')


@pytest.fixture(scope='module')
def phi3(hf_reference, tmp_path_factory):
  made = hf_reference('phi3')
  work = tmp_path_factory.mktemp('longrope')
  from rich.console import Console

  from paxcli import api, config
  from paxcli.convert import core, formats
  job, recipe = str(work / 'job'), str(work / 'recipe.py')
  api.convert_checkpoint(made.hf, job, fmt='hf', recipe=recipe, console=Console(quiet=True), verify=False)
  model = core.build_model(config.resolve(f'{recipe}:{made.ref.recipe_class}', []))
  params = core.load_params(formats.open_source(job), [n for n in model.abstract if n.startswith('params/')])
  return types.SimpleNamespace(hf=made.model, module=model.module.model, params=params)   # the LanguageModel


def test_decoding_across_the_original_context_gives_transformers_logits_at_every_step(phi3):
  import jax
  import jax.numpy as jnp
  from flax import linen as nn
  threshold = hf_models.REFERENCES['phi3'].config['original_max_position_embeddings']
  rng = np.random.default_rng(3)
  long, short = rng.integers(0, 128, 18).tolist(), rng.integers(0, 128, 12).tolist()
  prompt = 10   # row 0: 10 prompt tokens, then 8 steps (past the threshold at its third); row 1: 4, then 8 more (never past it)
  texts = [long, [None] * 6 + short]
  module, params = phi3.module, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), phi3.params)
  cache = nn.meta.unbox(module.init_cache(params, 2, len(long)))   # as pax decode holds it
  ids = jnp.asarray([[t or 0 for t in row[:prompt]] for row in texts], jnp.int32)
  positions = jnp.asarray([list(range(prompt)), [-1] * 6 + list(range(4))], jnp.int32)
  logits, cache = module.extend(params, cache, ids, positions)
  crossed = False
  for step in range(prompt, len(long)):
    expected = [hf_models.logits(phi3.hf, [long[:step]])[0, -1], hf_models.logits(phi3.hf, [short[:step - 6]])[0, -1]]
    np.testing.assert_allclose(np.asarray(logits[:, -1]), np.stack(expected), atol=1e-4, rtol=0)
    crossed |= step > threshold
    ids = jnp.asarray([[long[step]], [short[step - 6]]], jnp.int32)
    logits, cache = module.extend(params, cache, ids, jnp.asarray([[step], [step - 6]], jnp.int32))
  assert crossed and len(long) > threshold + 2 > len(short)


def test_packed_texts_each_take_the_factors_of_their_own_length(phi3):
  """Training and scoring pack texts into rows: a text past the original context takes the long factors, the one
  packed beside it the short ones, each as transformers computes it alone."""
  import jax
  import jax.numpy as jnp
  rng = np.random.default_rng(4)
  first, second = rng.integers(0, 128, 15).tolist(), rng.integers(0, 128, 7).tolist()   # 15 > 12 > 7
  ids = jnp.asarray([first + second], jnp.int32)
  segments = jnp.asarray([[1] * len(first) + [2] * len(second)], jnp.int32)
  positions = jnp.asarray([list(range(len(first))) + list(range(len(second)))], jnp.int32)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), phi3.params)
  ours = np.asarray(phi3.module.apply({'params': params}, ids, segments, positions))[0]
  theirs = np.concatenate([hf_models.logits(phi3.hf, [first])[0], hf_models.logits(phi3.hf, [second])[0]])
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
