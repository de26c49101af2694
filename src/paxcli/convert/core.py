"""Conversion driven by experiments: plan (names, layouts, shapes), stream, verify.

The source model is the experiment the checkpoint was saved with (its name and knobs
from the checkpoint's meta); the target is the same experiment with the user's --set
overrides, or another --exp. A plan maps every target array to where it comes from:
the same name, one layer of a stacked (scanned) array, or one array per layer stacked.
Everything else that differs is a mismatch, listed by name and shape.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import stat
import sys
import tempfile
from typing import Optional

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

from paxcli import config as cfg
from paxcli import experiment, files, gencode
from paxcli import values as ptypes
from paxcli.convert import formats
from paxcli.errors import UserError, shorten
from paxcli.inputs import tokenizers
from paxcli.jobdir import layout
from paxcli.jobdir import lock as joblock
from paxcli.jobdir import storage
from paxcli.models import pattern
from paxcli.models.lm_experiment import LmExperiment

_LAYER_RE = re.compile(r'(^|/)layer_(\d+)(/|$)')
_LAYERS_RE = re.compile(r'(^|/)layers(/|$)')


# ---- experiments ------------------------------------------------------------------------------


def saved_overrides(name: str, config: dict) -> list[str]:
  """--set overrides that rebuild the saved run: its knobs, then dotted model fields it changed. FP8
  is left out (none): fp8 products are a way to run the weights, not part of them, so a conversion
  writes, and certifies, the plain model's function (paxcli.layers.fp8)."""
  knobs = [f'{k[len("knobs."):]}={v}' for k, v in config.items() if k.startswith('knobs.') and k != 'knobs.FP8']
  base = {k: repr(v) for k, v in cfg.resolve(name, knobs).flat().items()}
  extra = [f'{k}={v}' for k, v in config.items()
           if k.startswith('task.model.') and not k.endswith(('__fn_or_cls__', '.fp8')) and base.get(k, v) != v]
  return knobs + extra


# The recipe a conversion from hf or paxml wrote, kept in its output too (a job directory or a
# safetensors directory): what lets a later conversion of that output find the experiment
# without importing anything (recipe_class).


def carry_tokenizer(src, job: str) -> None:
  """The source's tokenizer (a regular file inside its directory, files.member) and the
  tokenizer_config.json beside it (special tokens; every chat template shipped with it, from
  chat_template.jinja and additional_chat_templates/ too: tokenizers.folded_config) into job directory `job`,
  where every command reads them: converted and merged jobs decode text as the source did."""
  tok = src.extra_files().get('tokenizer')
  if not tok:
    return
  dest = layout.tokenizer(job, tokenizers.kind_of(tok))
  os.makedirs(os.path.dirname(dest), exist_ok=True)
  files.copy_member(tok, dest)
  config = tokenizers.folded_config_bytes(tok)   # chat_template.jinja and the named templates folded in
  if config is not None:
    files.atomic_write(layout.tokenizer_config(job), config, 0o644)


MAX_BASES = 8   # a fine-tune of a fine-tune of ...: followed this far back
MAX_META_BYTES = 64 << 20


def longest_context(src) -> Optional[int]:
  """The longest MAX_SEQ_LEN of the models a run descends from (INIT_FROM, that run's INIT_FROM, ...), by
  their checkpoints' saved configs; None for a run from scratch. A fine-tune trains on rows of its own
  MAX_SEQ_LEN, shorter than the context its base takes, and an export keeps the base's."""
  config, seen, longest = getattr(src, 'config', None) or {}, set(), None
  while len(seen) < MAX_BASES:
    path = _saved(config.get('task.train.init_from'))
    if not isinstance(path, str) or not path or path in seen:
      break
    seen.add(path)
    meta = base_meta(path)
    config = meta.get('config') if isinstance(meta, dict) and isinstance(meta.get('config'), dict) else {}
    length = _saved(config.get('knobs.MAX_SEQ_LEN'))
    if isinstance(length, int) and not isinstance(length, bool):
      longest = max(longest or 0, length)
  return longest


def base_meta(path: str) -> Optional[dict]:
  """The metadata of the checkpoint an INIT_FROM path names (a job directory: its latest complete step),
  read bounded; None when there is none."""
  from paxcli.jobdir import checkpoint as ckpt   # orbax: only for conversions of fine-tunes
  job, step = layout.split(path)
  steps = ckpt.complete_steps(layout.checkpoints(job)) if step is None else [step]
  meta = layout.meta_file(layout.step_dir(job, steps[-1])) if steps else None
  if meta is None or not storage.isfile(meta):
    return None
  data = storage.read_bytes(meta, MAX_META_BYTES)
  if len(data) > MAX_META_BYTES:
    raise UserError(f'{meta} is over {MAX_META_BYTES:,} bytes; is it checkpoint metadata?')
  return files.parse_json(data, f'checkpoint metadata {meta}')


def hf_origin(path: str) -> Optional[str]:
  """The Hugging Face model directory the checkpoint `path` names was converted from (--from hf), when it
  is still there; else None."""
  meta = base_meta(path) or {}
  origin = meta.get('converted_from') if isinstance(meta.get('converted_from'), dict) else {}
  where = origin.get('path')
  if origin.get('format') == 'hf' and isinstance(where, str) and os.path.isfile(os.path.join(where, 'config.json')):
    return where
  return None


def _saved(text):
  """A value of a saved config (its repr), parsed as a literal; None when it is not one."""
  return ptypes.parse_value(text) if isinstance(text, str) else None


def recipe_class(path: str, class_name: str, text: str, where: Optional[str] = None):
  """The experiment class of a recipe as convert writes it, made from its knobs (the text is
  parsed, never run) and served for `path:class_name` in this process."""
  knobs = gencode.knobs_of(text, class_name, where or path)
  cls = type(class_name, (LmExperiment,), {**knobs, '__module__': '_paxcli_recipe_data',
                                           '__doc__': f'{class_name} of {path}, read as data.'})
  cls._registered_name = f'{os.path.splitext(os.path.basename(path))[0]}.{class_name}'
  experiment.provide_file_class(path, class_name, cls)
  return cls


def source_dir(src) -> str:
  """The local directory a checkpoint's files are in (a job directory, a safetensors directory; the
  top files of a job directory in a bucket, downloaded)."""
  path = getattr(src, 'job_dir', None) or src.path
  return storage.local_files(path if storage.isdir(path) else os.path.dirname(storage.abspath(path)))


def trusted_experiment(src, name: str, exp: Optional[str]) -> Optional[str]:
  """`name` (an experiment a checkpoint's metadata names) when it may be resolved, else None (trusted_in)."""
  return trusted_in(source_dir(src), name, exp)


def trusted_in(directory: str, name: str, exp: Optional[str]) -> Optional[str]:
  """`name` (an experiment the files of `directory`, a job or checkpoint directory, name) when it may be
  resolved, else None.

  Metadata never chooses code to import: it may name a registered experiment (paxcli's
  recipes, or one registered by a file --exp loaded), the experiment --exp names (the user
  chose it), or the recipe a conversion wrote, read as data from the copy in the checkpoint's
  own directory (layout.RECIPE_COPY), never from the path the metadata gives.
  """
  registry = experiment.import_all_recipes()
  by_class = [key for key in registry if key.rsplit('.', 1)[-1] == name]
  module = name.rsplit('.', 1)[0] if '.' in name and ':' not in name else None
  if (name == exp or name in registry or len(by_class) == 1
      or module and f'{experiment.RECIPES_PACKAGE}.{module}' in sys.modules):   # paxcli's own recipes
    return name
  if ':' in name:
    class_name = name.rsplit(':', 1)[1]
    copy = files.member(directory, layout.RECIPE_COPY, 'recipe')
    if class_name.isidentifier() and os.path.isfile(copy):
      try:
        recipe_class(name.rsplit(':', 1)[0], class_name, files.read_text(copy, 'recipe', 1 << 20), copy)
      except UserError as e:
        raise UserError(f'{e} The checkpoint names the experiment {shorten(repr(name))}; paxcli reads the recipe '
                        'a conversion wrote as data and never runs it. If you trust the recipe, pass --exp '
                        'with it.') from None
      return name
  return None


def resolve_pair(src, exp: Optional[str], overrides: list[str]):
  """(source Resolved or None, target Resolved) for a source with a paxcli config."""
  name = getattr(src, 'experiment_name', lambda: None)() if src.config else None
  if src.config and not name and not exp:
    raise UserError(f'{src.path}: the checkpoint does not name its experiment; pass --exp.')
  if src.config:
    named = name
    name = trusted_experiment(src, name, exp) if name else None
    if name is None and not exp:
      raise UserError(f'{src.path}: its metadata names the experiment {shorten(repr(named))}, which is not a '
                      'registered experiment; paxcli never imports code a checkpoint names. If you trust it, '
                      'pass --exp with it (or the experiment to convert to).')
    saved = saved_overrides(name or exp, src.config)
    source = cfg.resolve(name or exp, saved)
    if not exp or exp == name:
      target = cfg.resolve(name, saved + list(overrides))
    else:
      target = cfg.resolve(exp, overrides)
    return source, target
  knobs = src.knobs()
  if knobs is None and not exp:
    raise UserError(f'{src.path} holds no paxcli config: name the experiment to convert to with --exp.')
  sets = [f'{k}={v!r}' for k, v in (knobs or {}).items()]
  return None, cfg.resolve(exp or 'default.StdlibDocsLm', sets + list(overrides))


@dataclasses.dataclass
class Model:
  resolved: object
  module: object             # paxcli.models.lm.flat_view of the LanguageModel: flat settings and apply
  abstract: dict             # name -> ShapeDtypeStruct of the full train state
  placeholders: list         # names of empty optimizer states (kept as placeholders in orbax)

  @property
  def spec(self):
    """The LM's settings under TransformerLm's flat field names (paxcli.models.lm.flat_view)."""
    return self.module

  @property
  def scanned(self) -> bool:
    return bool(self.module.scan_layers)

  @property
  def period(self) -> int:
    """Layers per group of the stack (paxcli.models.pattern; 1: uniform)."""
    return pattern.period(getattr(self.module, 'layer_pattern', ()))

  @property
  def prefix(self) -> int:
    """Layers before the stack's groups (LAYER_PREFIX: by their index in either layout)."""
    return pattern.prefix_of(self.module)

  def names(self, params_only: bool) -> list[str]:
    return [n for n in self.abstract if not params_only or n == 'step' or n.startswith('params/')]


def _jax():
  """jax, where a model is built or run: reading checkpoints, recipes and metadata imports none."""
  import jax
  return jax


def build_model(resolved) -> Model:
  """The model and the abstract train state of an experiment, without a mesh."""
  jax = _jax()
  from paxcli import optim
  from paxcli.models.lm import flat_view
  from paxcli.runtime import engine
  task = engine.build_task(resolved.task)
  engine.validate_model(task.model)
  tx = optim.make_optimizer(task.train)
  seq_len = getattr(resolved.train_dataset(), 'seq_len', None) or task.model.max_seq_len
  abstract = engine.unbox(jax.eval_shape(engine.make_init(task.model, tx, seq_len), jax.random.key(0)))
  flat = {formats.join(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
  empty = []
  for path, node in jax.tree_util.tree_flatten_with_path(
      abstract, is_leaf=lambda x: isinstance(x, tuple) and not x and x is not None)[0]:
    if isinstance(node, tuple) and not node:
      empty.append(formats.join(path))
  return Model(resolved, flat_view(task.model), flat, empty)


# ---- plan -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Item:
  name: str                  # target name
  shape: tuple
  dtype: str                 # dtype written
  source: str | list         # source name, or one source name per layer (stacking)
  index: Optional[int] = None  # one layer of a stacked source


def _canonical(name: str, period: int = 1, prefix: int = 0) -> tuple[str, Optional[int]]:
  """A per-layer name (`.../layer_<i>/rest`) as its scanned name and row (pattern.stacked_path), else (name, None)
  (a layer of a prefix of `prefix` layers is never stacked)."""
  m = _LAYER_RE.search(name)
  if not m:
    return name, None
  stacked, row = pattern.stacked_path(int(m.group(2)), name[m.end():], period, prefix)
  return name[:m.start()] + m.group(1) + stacked, row


def plan(src_arrays: list, target: Model, params_only: bool, dtype: Optional[str]) -> list[Item]:
  """How each target array is made from the source's; a UserError listing every mismatch."""
  have = {a.name: a for a in src_arrays}
  by_canon: dict[str, dict[int, str]] = {}
  for a in src_arrays:
    c, i = _canonical(a.name, target.period, target.prefix)
    if i is not None:
      by_canon.setdefault(c, {})[i] = a.name
  items, problems, used = [], [], set()
  for name in target.names(params_only):
    want = tuple(target.abstract[name].shape)
    out_dtype = np.dtype(target.abstract[name].dtype).name
    if dtype and name.startswith('params/') and np.issubdtype(formats.np_dtype(out_dtype), np.floating):
      out_dtype = dtype
    if name == 'step' and name not in have:   # formats without a step array keep it in their metadata
      items.append(Item(name, want, out_dtype, name))
      continue
    if name in have:
      got = tuple(have[name].shape)
      if got != want:
        problems.append(f'{name}: checkpoint {list(got)} -> experiment {list(want)}')
      items.append(Item(name, want, out_dtype, name))
      used.add(name)
      continue
    c, i = _canonical(name, target.period, target.prefix)
    if i is not None and c in have and _LAYERS_RE.search(c):   # unstack: one layer of a scanned array
      got = tuple(have[c].shape)
      if got[1:] != want or i >= got[0]:
        problems.append(f'{name}: checkpoint {c} {list(got)} -> experiment {list(want)}')
      items.append(Item(name, want, out_dtype, c, index=i))
      used.add(c)
      continue
    if i is None and _LAYERS_RE.search(name) and name in by_canon:   # stack per-layer arrays
      layers = by_canon[name]
      srcs = [layers.get(j) for j in range(want[0] if want else 0)]
      if None in srcs or len(layers) != len(srcs) or any(tuple(have[s].shape) != want[1:] for s in srcs):
        shapes = sorted({str(list(have[s].shape)) for s in layers.values()})
        problems.append(f'{name}: checkpoint {len(layers)} layers of {", ".join(shapes)} -> experiment '
                        f'{list(want)}')
      items.append(Item(name, want, out_dtype, srcs))
      used.update(s for s in srcs if s)
      continue
    problems.append(f'{name}: missing in the checkpoint -> experiment {list(want)}')
  extra = [a.name for a in src_arrays if a.name not in used and (a.name == 'step' or a.name.startswith('params/')
                                                                   or not params_only)]
  extra = [n for n in extra if n != 'step']
  problems += [f'{n}: checkpoint {list(have[n].shape)} -> not in the experiment' for n in extra]
  # The layers of one stacked source one after another: a reader that reads the whole stacked array
  # (orbax) reads it once, not once per layer.
  items.sort(key=lambda it: (it.source if isinstance(it.source, str) else it.name, it.index or 0))
  if problems:
    shown = problems[:30] + ([f'... {len(problems) - 30} more'] if len(problems) > 30 else [])
    raise UserError('The checkpoint does not fit the target experiment (other than a change of layer '
                    'layout, every array must match):\n  ' + '\n  '.join(shown))
  return items


def read_item(src, item: Item, layer: Optional[int] = None) -> np.ndarray:
  """The item's array (or its `layer`-th slice for stacked items) in the source's dtype.

  Not cast here: the writers cast block by block (formats.blocks), so a float32 -> bfloat16
  conversion never holds a whole cast copy beside the array read.
  """
  if isinstance(item.source, list):
    parts = [item.source[layer]] if layer is not None else item.source
    return np.stack([src.read(s) for s in parts]) if layer is None else np.asarray(src.read(parts[0]))
  if layer is None or item.index is not None:
    return np.asarray(src.read(item.source, index=item.index))
  return np.asarray(src.read(item.source, index=layer))


def is_layered(item: Item) -> bool:
  """Written one layer at a time: stacked from per-layer arrays, or a stacked array copied."""
  return isinstance(item.source, list) or (item.index is None and bool(_LAYERS_RE.search(item.name))
                                           and len(item.shape) > 1)


# ---- output directory ---------------------------------------------------------------------------


class Output:
  """A temporary directory beside `path`, renamed onto it at the end (never overwriting without force).

  Never over what the conversion reads: the source (`source_path`), and, once the source is open,
  every job its run reads (`refuse_inputs`: a LoRA run's base, INIT_FROM, LORA_INIT); paths are
  compared with symlinks resolved, so a link to one of them is that one. Never over anything but a
  directory paxcli writes (`_check_replaceable`), even with force: not a device, a FIFO, a user's file
  or folder. A bucket output is written in a local temporary directory and uploaded when it is whole,
  orbax's commit markers last (a reader never takes a half-uploaded checkpoint for a complete one).
  """

  def __init__(self, path: str, force: bool, source_path: str):
    self.path, self.force = storage.abspath(path), force
    # The source of a step directory (job/checkpoints/<step>) is its whole job directory.
    self.refuse_inputs([(source_path, 'the source')])
    if os.path.islink(self.path):   # --force would replace the link, not what it points to
      raise UserError(f'The output {path} is a symlink (to {os.path.realpath(path)}); give the real path.')
    self.remote = not storage.is_local(self.path)
    if self.remote:
      if storage.exists(self.path) and not force:
        raise UserError(f'The output {path} exists; pass --force to replace it.')
      self.tmp = tempfile.mkdtemp(prefix='paxcli-convert-')
      return
    if os.path.lexists(self.path):
      _check_replaceable(path, force)
    os.makedirs(os.path.dirname(self.path) or '.', exist_ok=True)
    self.tmp = self.path + f'.converting-{os.getpid()}'

  def refuse_inputs(self, inputs) -> None:
    """UserError when the output is inside or over one of `inputs`, (path, what it is) pairs."""
    for path, what in inputs:
      try:
        read = layout.job_dir_of(storage.absolute(path))
      except UserError:   # a path of no scheme paxcli reads: nothing a conversion writes can be over it
        continue
      if storage.inside(self.path, read):
        raise UserError(f'The output {shorten(self.path, 200)} would be inside or over {what} {shorten(path, 200)} '
                        '(compared with symlinks resolved); what a conversion reads is never modified. Choose '
                        'another output path.')

  def __enter__(self) -> str:
    if self.remote:
      return self.tmp
    for stale in glob.glob(glob.escape(self.path) + '.converting-*'):   # left by a killed conversion
      pid = stale.rsplit('-', 1)[-1]
      if pid.isdigit() and not joblock.pid_alive(int(pid)):
        shutil.rmtree(stale, ignore_errors=True)
    if os.path.exists(self.tmp):
      shutil.rmtree(self.tmp)
    os.makedirs(self.tmp)
    return self.tmp

  def __exit__(self, exc_type, exc, tb):
    if exc_type is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      return False
    if self.remote:
      try:
        if self.force:
          storage.rmtree(self.path)   # asked for: the old output's objects would mix with the new
        storage.upload_tree(self.tmp, self.path, last=layout.COMMIT_MARKERS)
      finally:
        shutil.rmtree(self.tmp, ignore_errors=True)
      return False
    if os.path.exists(self.path):
      old = self.path + f'.replaced-{os.getpid()}'
      os.rename(self.path, old)
      os.rename(self.tmp, self.path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.rename(self.tmp, self.path)
    return False


# What each output of `pax checkpoint convert` holds one of (a job directory, safetensors, Hugging Face,
# PEFT): --force replaces an empty directory or one holding one of these, nothing else.
_OUTPUT_MARKS = (os.path.basename(layout.checkpoints('job')), os.path.basename(layout.config('job')), 'config.json',
                 'adapter_config.json', 'model.safetensors.index.json')


def _check_replaceable(path: str, force: bool) -> None:
  shown = shorten(path, 200)
  mode = os.stat(path).st_mode
  if not stat.S_ISDIR(mode):
    kind = files.kind_of(mode)
    raise UserError(f'The output {shown} is {kind}; a conversion writes a directory and replaces nothing else '
                    '(not even with --force). Choose another output path.')
  if not force:
    raise UserError(f'The output {shown} exists; pass --force to replace it.')
  names = os.listdir(path)
  if names and not any(n in _OUTPUT_MARKS or n.endswith('.safetensors') for n in names):
    raise UserError(f'The output {shown} holds files no conversion writes ({shorten(", ".join(sorted(names)[:5]), 120)}'
                    '); --force replaces only an earlier conversion\'s output. Choose another output path.')


def paths_read(src, overrides=()) -> list[tuple[str, str]]:
  """(path, what) of the jobs a paxcli checkpoint's run reads besides its own: the base a LoRA run's
  checkpoint names, and INIT_FROM and LORA_INIT as saved or as --set gives them."""
  found = []
  base = (getattr(src, 'meta', None) or {}).get('base')
  if isinstance(base, dict) and isinstance(base.get('job_dir'), str):
    found.append((base['job_dir'], 'the base of the LoRA run'))
  config = getattr(src, 'config', None) or {}
  settings = {'task.train.init_from': 'INIT_FROM', 'task.train.lora_init': 'LORA_INIT'}
  for key, knob in settings.items():
    found.append((ptypes.saved_literal(config.get(key) if isinstance(config, dict) else None), f'the run\'s {knob}'))
  for override in overrides:
    key, _, value = str(override).partition('=')
    if key.strip() in (*settings, *settings.values()):
      found.append((ptypes.saved_literal(value), f'the {key.strip()} given'))
  return [(path, what) for path, what in found if isinstance(path, str) and path]


def progress(total_bytes: int, description: str):
  p = Progress(TextColumn('{task.description}'), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn(), console=Console(stderr=True), transient=True)
  return p, description, total_bytes


# ---- verification -------------------------------------------------------------------------------


def nest(flat: dict) -> dict:
  out: dict = {}
  for name, x in flat.items():
    node = out
    keys = name.split('/')
    for k in keys[:-1]:
      node = node.setdefault(k, {})
    node[keys[-1]] = x
  return out


def load_params(src, names: list[str]) -> dict:
  return nest({n[len('params/'):]: src.read(n) for n in names if n.startswith('params/')})


def logits(module, params: dict, ids) -> np.ndarray:
  jax = _jax()
  jnp = jax.numpy
  # float32 compute; integer leaves (WEIGHT_QUANT's codes) stay codes
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32 if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype),
                        params)
  # One compiled program for the whole forward pass: run op by op, every op compiles on its own for the shapes
  # given (a certification of a tiny model spent 20 s there, 3 s jitted).
  forward = jax.jit(lambda p, x: module.apply({'params': p}, x))
  return np.asarray(forward(params, jnp.asarray(ids)), np.float32)
