"""`pax checkpoint inspect` and `pax checkpoint convert`, on top of formats.py and core.py."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tempfile
import time
from typing import Optional

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from paxcli import config as cfg
from paxcli import files, gencode
from paxcli.convert import certify, core, formats, hf, hf_tokenizer, lora, orbax_io, safetensors_io
from paxcli.errors import UserError
from paxcli.inputs import tokenizers
from paxcli.jobdir import format as job_format
from paxcli.jobdir import invocation, layout, storage
from paxcli.models import registry
from paxcli.runtime import platform

TARGETS = ('orbax', 'safetensors', 'hf', 'peft')


def inspect(path: str, fmt: Optional[str] = None, step: Optional[int] = None) -> dict:
  """Metadata only: step, arrays (name, shape, dtype, bytes, sharding), totals, config."""
  src = formats.open_source(path, fmt, step)
  arrays = src.arrays()
  if src.paxcli_names:
    params = [a for a in arrays if a.name.startswith('params/')]
  else:
    params = [a for a in arrays if getattr(src, 'is_param', lambda n: True)(a.name)]
  out = {
      'path': storage.abspath(path), 'format': src.kind, 'step': src.step,
      'experiment': getattr(src, 'experiment_name', lambda: None)(),
      'arrays': [{'name': a.name, 'shape': list(a.shape), 'dtype': a.dtype, 'bytes': a.nbytes,
                  'sharding': a.sharding} for a in arrays],
      'totals': {'arrays': len(arrays), 'bytes': sum(a.nbytes for a in arrays),
                 'parameters': int(sum(a.size for a in params)), 'parameter_bytes': sum(a.nbytes for a in params),
                 'largest_array_bytes': max((a.nbytes for a in arrays), default=0)},
      'config': src.inspect_config() if hasattr(src, 'inspect_config') else (src.config or src.native),
  }
  if src.paxcli_names:
    out['has_optimizer_state'] = any(a.name.startswith('opt_state/') for a in arrays)
  if getattr(src, 'load_notes', None):   # arrays of the source paxcli does not read (and so does not list)
    out['notes'] = list(src.load_notes)
  return out


def convert(source: str, output: str, *, fmt: Optional[str] = None, to: str = 'orbax', exp: Optional[str] = None,
            overrides: tuple = (), params_only: bool = False, dtype: Optional[str] = None,
            step: Optional[int] = None, force: bool = False, verify: bool = True,
            kl_tolerance: Optional[float] = None, max_shard_bytes: int = 5 << 30,
            recipe: Optional[str] = None, merge_lora: bool = False, base_model: Optional[str] = None,
            family: Optional[str] = None, log=print) -> dict:
  if to not in TARGETS:
    raise UserError(f'Unknown output format {to!r}; choose one of {", ".join(TARGETS)}.'
                    f'{formats.did_you_mean(to, TARGETS)}')
  if dtype not in (None, 'float32', 'bfloat16'):
    raise UserError(f'--dtype {dtype!r}: choose float32 or bfloat16.')
  if to != 'orbax' and not storage.is_local(output):
    raise UserError(f'--to {to} writes local files; a bucket output ({output}) takes --to orbax (a job directory). '
                    'Write it locally and copy it to the bucket.')
  out = core.Output(output, force, source)    # refuse an existing output before any work
  t0 = time.perf_counter()
  src = formats.open_source(source, fmt, step)
  for note in getattr(src, 'load_notes', ()):   # what of the source is left out (a multimodal model's vision tower)
    log(note)
  out.refuse_inputs(core.paths_read(src, overrides))   # a LoRA run's base, INIT_FROM, LORA_INIT
  if getattr(src, 'needs_experiment', None) and not exp:
    raise UserError(src.needs_experiment)
  overrides = list(overrides)
  if base_model is not None and to != 'peft':
    raise UserError('--base-model names the model PEFT adapters apply to: it goes with --to peft.')
  if family is not None:
    if to not in ('hf', 'peft'):
      raise UserError(f'--family names the Hugging Face layout written: it goes with --to hf or --to peft, not --to {to}.')
    registry.by_name(family, '--family: ')   # a misspelt name is one line before any work
    overrides.append(f'MODEL_FAMILY={family!r}')   # the written model is one of it (checked: registry.of_model)
  if merge_lora or to == 'peft' or lora.is_lora_run(src):
    return _convert_lora(src, out, to, exp, overrides, merge_lora, dtype, force, verify, kl_tolerance,
                         max_shard_bytes, log, t0, base_model, family)
  if to == 'hf':
    overrides.append('USE_REPEATED_LAYER=False')   # HF layers are unrolled
  recipe_path = recipe_text = None
  recipe_created = False
  if (src.kind == 'hf' and not src.config) or (src.kind == 'paxml' and not exp):
    # The imported model's experiment is the recipe written for it (as pax import-maxtext does), kept in
    # the output (layout.RECIPE_COPY) and a file of its own only where --recipe asks; --exp names another.
    recipe_path, recipe_text, recipe_created = _write_recipe(src, recipe, out.path, force, log)
    if not exp:
      exp = f'{recipe_path}:{_recipe_class(src)}'
    else:
      recipe_text = None   # the job's experiment is --exp's
      recipe_path = recipe_path if recipe else None   # nothing kept in the output: nothing to say of it
  try:
    result = _convert(src, out, source, output, fmt, to, exp, overrides, params_only, dtype, step, verify,
                      kl_tolerance, max_shard_bytes, log, t0, recipe_path, recipe_text, family)
  except BaseException:
    if recipe_created and os.path.isfile(recipe_path):
      os.remove(recipe_path)   # a failed import (or certification) leaves nothing behind
    raise
  if recipe_path:   # printed last, after what was written and its certification (the CLI's `next`)
    kept = recipe_text is not None and to in ('orbax', 'safetensors')   # _carry_files wrote it into the output
    result['next'] = next_step(src, out.path, to, recipe_path if recipe_created or recipe else None, exp, kept)
  return result


def next_step(src, output: str, to: str, recipe_file: Optional[str], exp: str, kept: bool) -> str:
  """What to run after an import, paths as typed from here: a fine-tune of an --from hf import goes to a
  new job directory with the import as its BASE (which it only reads); a Pax run continues in place.
  `kept`: the output holds the recipe (not so with --exp, whose experiment the job then is)."""
  shown = lambda path: shlex.quote(path if os.path.relpath(path).startswith('..') else os.path.relpath(path))
  exp = f'{shown(exp.rsplit(":", 1)[0])}:{_recipe_class(src)}'
  said = [f'Wrote the recipe {shown(recipe_file)} (--exp {shown(recipe_file)}:{_recipe_class(src)}).'] \
      if recipe_file else []
  if kept:
    said.append(f'The recipe (the model\'s knobs, read as data) is kept in {shown(layout.recipe_copy(output))}.')
  if to != 'orbax' or not kept:
    return ' '.join(said)
  if src.kind == 'paxml':
    return ' '.join(said + [f'The converted job continues the Pax run with: pax train --exp {exp} '
                            f'--job-log-dir {shown(output)}'])
  return ' '.join(said + [f'Fine-tune it into a new job directory (the import stays as it is): pax train --exp '
                          f'finetune.Sft --set BASE={shown(output)} --set TRAIN_DATA=YOUR_DATA.jsonl '
                          f'--job-log-dir {shown(output + "_sft")}'])


def _convert(src, out, source, output, fmt, to, exp, overrides, params_only, dtype, step, verify, kl_tolerance,
             max_shard_bytes, log, t0, recipe_path, recipe_text, family=None):
  if hasattr(src, 'check_experiment'):   # paxml: the experiment must compute the Pax model's function
    src.check_experiment(cfg.resolve(exp, list(overrides)).experiment, log)
  source_res, target_res = core.resolve_pair(src, exp, overrides)
  platform.apply_platform_env(target_res.experiment.PLATFORM_ENV, log=log)  # before the models start a backend
  if not src.paxcli_names:
    if hasattr(src, 'paxcli_view'):
      # paxml: the view takes any layout and MAX_SEQ_LEN, so it is read as the target model
      source_res = source_res or (target_res if src.kind in ('paxml', 'maxtext') else _from_knobs(src, exp))
      src = src.paxcli_view(core.build_model(source_res).spec)
    else:
      src = formats.open_source(source, src.kind, step, target=target_res)
  if source_res is None:
    source_res = target_res
  target = core.build_model(target_res)
  if to == 'hf':
    written = hf.family_of(target.spec, family)   # before any array is read: one line when the model is of none
    if not family and not target.spec.family:
      log(f'The model records no family (MODEL_FAMILY): writing it as a {written.title} '
          f'({written.hf_architectures[0]}), the family its function places it in; --family names another.')
  source_model = core.build_model(source_res)
  src_arrays = src.arrays()
  has_opt = any(a.name.startswith('opt_state/') for a in src_arrays)
  if to != 'orbax':
    params_only = True
  elif not has_opt and not params_only:
    log('The source holds parameters only: writing a params-only checkpoint (pax train starts a fresh '
        'optimizer state from it).')
    params_only = True
  items = core.plan(src_arrays, target, params_only, dtype)
  total = sum(int(np.prod(i.shape, dtype=np.int64)) * formats.np_dtype(i.dtype).itemsize for i in items)
  stats = {'bytes_written': total, 'arrays': len(items)}

  def read(item, layer=None):
    if item.name == 'step' and item.source == 'step' and 'step' not in {a.name for a in src_arrays}:
      return np.int32(src.step)
    return core.read_item(src, item, layer)

  bar = Progress(TextColumn('{task.description}'), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                 console=Console(stderr=True), transient=True)
  verify = verify and certify.fits(sum(int(np.prod(x.shape, dtype=np.int64)) for n, x in target.abstract.items()
                                       if n.startswith('params/')), log)
  report = None
  with out as tmp:
    with bar:
      task = bar.add_task(f'converting to {to}', total=total)
      advance = lambda n: bar.advance(task, n)
      if to == 'orbax':
        _write_orbax(tmp, src, items, target, params_only, read, advance,
                     _made(src, target_res, exp, overrides))
      elif to == 'safetensors':
        _write_safetensors(tmp, src, items, target_res, read, advance, max_shard_bytes)
      else:
        hf.export(tmp, src, {i.name: i for i in items}, target.spec, read, dtype or 'float32',
                  max_shard_bytes, advance, max_positions=core.longest_context(src))
      _carry_files(src, tmp, to, recipe_text, own_experiment=exp is None)
    if verify:   # before the output takes its name: a failed check leaves nothing behind
      report = _certify(src, source_model, target, tmp, to,
                        kl_tolerance if kl_tolerance is not None else certify.default_tolerance(dtype), family)
      certify.check(report)
  stats['seconds'] = time.perf_counter() - t0
  result = {'source': storage.abspath(source), 'output': out.path, 'format': to, 'step': src.step,
            'params_only': params_only, 'dtype': dtype, 'experiment': target_res.name, **stats}
  if recipe_path:
    result['recipe'] = recipe_path
  if report:
    result['verify'] = report
  return result


def _convert_lora(src, out, to, exp, overrides, merge_lora, dtype, force, verify, kl_tolerance, max_shard_bytes,
                  log, t0, base_model: Optional[str] = None, family: Optional[str] = None) -> dict:
  """A LoRA run's checkpoint: its adapters in PEFT's format (--to peft), merged into a plain checkpoint
  (--merge-lora), or merged and then converted like any checkpoint (--to hf, safetensors, --dtype)."""
  lora.resolve_lora_target(to, merge_lora, src)
  result = {'source': storage.abspath(src.path), 'output': out.path, 'format': to, 'step': src.step,
            'params_only': True, 'dtype': dtype}
  if to == 'peft' or (to == 'orbax' and dtype is None):
    with out as tmp:
      if to == 'peft':
        result.update(lora.export_peft(src, tmp, exp, overrides, log, verify, kl_tolerance,
                                       base_model, family))
      else:
        result['verify'] = lora.merge_run(src, tmp, exp, overrides, verify, log)
        result['bytes_written'] = _bytes_under(tmp)
    result['seconds'] = time.perf_counter() - t0
    return result
  merged = tempfile.mkdtemp(prefix=os.path.basename(out.path) + '.merging-', dir=storage.local_dir_beside(out.path))
  try:
    lora.merge_run(src, merged, exp, overrides, verify, log)
    return convert(merged, out.path, to=to, dtype=dtype, force=force, verify=verify, kl_tolerance=kl_tolerance,
                   max_shard_bytes=max_shard_bytes, family=family, log=log)
  finally:
    shutil.rmtree(merged, ignore_errors=True)


def _bytes_under(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(directory) for f in names)


def _from_knobs(src, exp):
  return cfg.resolve(exp or 'default.StdlibDocsLm', [f'{k}={v!r}' for k, v in src.knobs().items()])


def _meta(src, target, params_only: bool) -> dict:
  flat = {k: repr(v) for k, v in target.resolved.flat().items()}
  shapes = {n: list(x.shape) for n, x in target.abstract.items()
            if not params_only or n == 'step' or n.startswith('params/')}
  meta = dict(getattr(src, 'meta', None) or {})
  meta.pop('checksums', None)   # the source's; the writer's own go in once the arrays are written
  meta.update({'step': src.step, 'state_shapes': shapes, 'config': flat, 'experiment': target.resolved.name,
               'converted_from': {'path': storage.abspath(src.path), 'format': src.kind}})
  meta.setdefault('batches_consumed', src.step)
  return meta


def _made(src, target_res, exp, overrides) -> invocation.Made:
  """How the converted job is made, for the commands that read it: the source job's own record with
  this conversion's --set after it when it keeps the source's experiment, else the target's experiment."""
  job = getattr(src, 'job_dir', None)
  own = invocation.read_made(job) if job and not exp else None
  if own is not None:
    return invocation.Made(own.experiment, own.overrides + tuple(overrides))
  return invocation.Made(target_res.name, tuple(overrides))


def _write_orbax(tmp: str, src, items, target, params_only: bool, read, advance, made: invocation.Made) -> None:
  def fill(state_dir):
    w = orbax_io.StateWriter(state_dir)
    for item in items:
      dtype = formats.np_dtype(item.dtype)
      if core.is_layered(item):
        w.create(item.name, item.shape, dtype, layered=True)
        for layer in range(item.shape[0]):
          x = read(item, layer)
          w.write_slice(item.name, layer, x)
          advance(x.size * dtype.itemsize)
      else:
        x = read(item)
        w.write(item.name, x, dtype)
        advance(x.size * dtype.itemsize)
      del x
    if not params_only:
      for name in target.placeholders:
        w.placeholder(name)
    w.finish()
    return w.checksums()

  orbax_io.write_step(tmp, src.step, _meta(src, target, params_only), fill)
  with open(layout.config(tmp), 'w', encoding='utf-8') as f:
    f.write(target.resolved.as_text())
  job_format.write_job(tmp)
  invocation.record_made(tmp, made)


def _write_safetensors(tmp, src, items, target_res, read, advance, max_shard_bytes) -> None:
  by_name = {i.name: i for i in items if i.name != 'step'}
  flat = {k: repr(v) for k, v in target_res.flat().items()}

  def fill(name, put):
    item = by_name[name]
    if core.is_layered(item):
      for layer in range(item.shape[0]):
        put(read(item, layer))
    else:
      put(read(item))

  safetensors_io.write(tmp, [(i.name, i.shape, i.dtype) for i in by_name.values()], fill,
                       {'format': 'paxcli', 'step': src.step, 'experiment': target_res.name,
                        'paxcli_config': json.dumps(flat)}, max_shard_bytes, advance)


def _carry_files(src, tmp: str, to: str, recipe_text: Optional[str], own_experiment: bool) -> None:
  """The tokenizer (a regular file inside the source's directory, files.member) with the
  tokenizer_config.json beside it (special tokens, chat template), and the recipe
  the experiment is read from (layout.RECIPE_COPY: written by this import, or the source's own
  when the output keeps the source's experiment)."""
  tok = src.extra_files().get('tokenizer')
  if to == 'orbax':
    core.carry_tokenizer(src, tmp)
  elif tok:   # under its Hugging Face name; an HF export writes its own config (hf_tokenizer.write)
    files.copy_member(tok, os.path.join(tmp, hf_tokenizer.EXPORT_NAMES[tokenizers.kind_of(tok)]))
  if to == 'hf':
    return
  config = tokenizers.folded_config_bytes(tok) if tok and to != 'orbax' else None
  if config is not None:   # special tokens and chat templates, beside the tokenizer as in a job
    files.atomic_write(os.path.join(tmp, tokenizers.CONFIG_NAME), config, 0o644)
  if recipe_text is None and own_experiment and getattr(src, 'config', None):
    copy = files.member(core.source_dir(src), layout.RECIPE_COPY, 'recipe')
    if os.path.isfile(copy):
      recipe_text = files.read_text(copy, 'recipe', 1 << 20)
  if recipe_text is not None:
    gencode.check_shape(recipe_text, layout.RECIPE_COPY)
    with open(os.path.join(tmp, layout.RECIPE_COPY), 'w', encoding='utf-8') as f:
      f.write(recipe_text)


def _recipe_class(src) -> str:
  if src.kind == 'paxml':
    return 'PaxLm'
  return 'Hf' + ''.join(c for c in getattr(src, 'hf', src).family.title if c.isalnum())   # HfLlama


def _write_recipe(src, recipe: Optional[str], output: str, force: bool, log) -> tuple[str, str, bool]:
  """The recipe of an imported model: its text, served in this process for its path (core.recipe_class);
  written (atomically) only to `recipe` (--recipe), or beside an output in a bucket; else the path is the
  output's own copy (layout.RECIPE_COPY). Returns (path, text, whether it is a new file).

  The text holds outside text (paths, config values) only as literals (gencode) and is checked
  for the generators' shape before it is written; the conversion reads it as data, never runs it.
  A recipe already there is replaced with --force, or when it is the same text (left by an
  interrupted run of the same import).
  """
  prefix, class_name = src.kind, _recipe_class(src)
  if src.kind == 'paxml':
    text = src.recipe_text(class_name)
  else:
    hf_src = getattr(src, 'hf', src)
    text = hf.recipe_text(class_name, dict(src.knobs()), src.path, getattr(hf_src, 'notes', []), hf_src.family.title)
  if recipe is None and storage.is_local(output):   # kept in the output only (_carry_files): no file beside it
    path = layout.recipe_copy(output)
    gencode.check_shape(text, path)
    core.recipe_class(path, class_name, text)
    return path, text, False
  path = os.path.abspath(recipe or os.path.join(storage.local_dir_beside(output),
                                                f'{prefix}_{os.path.basename(output)}.py'.replace('-', '_')))
  gencode.check_shape(text, path)   # a bug of ours, never outside text, could fail this
  # Read back as the job's experiment: a regular file, never a device, the source or a file in it.
  files.check_output(path, 'the recipe', force=True, inputs=[src.path], streams=False)
  if storage.inside(path, src.path):
    raise UserError(f'The recipe {path} would be inside the source {src.path}; the source is never modified. '
                    'Give --recipe another path.')
  if os.path.lexists(path) and not force:
    try:
      same = os.path.isfile(path) and not os.path.islink(path) and files_text(path) == text
    except (OSError, UnicodeDecodeError):
      same = False
    if not same:
      raise UserError(f'The recipe {path} exists; pass --force to replace it or --recipe PATH.')
    log(f'Replacing the recipe {path} left by an earlier run of this import (the same text).')
  core.recipe_class(path, class_name, text)
  created = not os.path.lexists(path)
  tmp = f'{path}.tmp-{os.getpid()}'
  try:
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(tmp, path)
  except OSError as e:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise UserError(f'Cannot write the recipe {path}: {e.strerror}.') from None
  return path, text, created


def files_text(path: str) -> str:
  with open(path, encoding='utf-8') as f:
    return f.read(1 << 20)


def _certify(src, source_model, target, written: str, to: str, tolerance: float, family=None) -> dict:
  """The source and the written result (directory `written`) on the fixed prompts (paxcli.convert.certify):
  a Hugging Face side runs in transformers where it is installed, every other side in paxcli."""
  hf_source = src.hf if isinstance(src, hf.PaxView) else None   # --from hf: the directory, under paxcli's names
  missing = f'transformers is not installed; {certify.INSTALL_HINT}'
  ids = certify.prompts(source_model.spec.vocab_size, min(source_model.spec.max_seq_len, target.spec.max_seq_len))
  if hf_source is not None and certify.have_transformers():
    reference = certify.transformers_side(hf_source.path, hf_source.family.hf_architectures[0], 'the source')
  else:
    what = 'paxcli on the source' + (f' ({hf_source.family.title} weights read by paxcli: {missing})'
                                     if hf_source is not None else '')
    reference = certify.paxcli_side(what, source_model.module, core.load_params(src, [a.name for a in src.arrays()]))
  if to == 'hf' and certify.have_transformers():
    result = certify.transformers_side(written, hf.family_of(target.spec, family).hf_architectures[0],
                                       'the written result')
  else:
    got = formats.open_source(written, to)
    if not got.paxcli_names:
      got = got.paxcli_view(target.spec)
    what = 'paxcli on the written result' + (f' (its Hugging Face files read by paxcli: {missing})' if to == 'hf'
                                             else '')
    result = certify.paxcli_side(what, target.module, core.load_params(got, [a.name for a in got.arrays()]))
  return certify.certify(reference, result, ids, tolerance)
