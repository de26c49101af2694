"""paxcli from Python: every `pax` command as a function with the command's options as arguments.

    import paxcli
    summary = paxcli.train('default.StdlibDocsLm', job_dir='runs/docs', overrides=['NUM_TRAIN_STEPS=20'])
    metrics = paxcli.evaluate('default.StdlibDocsLm', job_dir='runs/docs')
    records = paxcli.decode('default.StdlibDocsLm', job_dir='runs/docs', prompt=['def parse('])
    scores = paxcli.score('requests.jsonl', 'default.StdlibDocsLm', job_dir='runs/docs')
    results = paxcli.lm_eval(['hellaswag'], 'default.StdlibDocsLm', job_dir='runs/docs')
    paxcli.serve('default.StdlibDocsLm', job_dir='runs/docs', port=8000)   # until SIGTERM

Arguments are named as the command-line options, in snake_case (`--max-decode-steps` is
`max_decode_steps`; `--set` is `overrides`, a list of KEY=VALUE strings), with two names
Python needs: `job_dir` is `--job-log-dir`, and `fmt` is `--from`. Functions return data
(dicts and lists, as the commands' `--json` prints them) and print nothing on stdout:
progress and log lines go to `console` (a rich Console; default: one on stderr), warnings
to stderr. A user's mistake raises paxcli.errors.UserError with the one line `pax` prints.

A JAX process starts its backend once: settings that must come before it (PLATFORM_ENV,
--num-devices, several processes) take effect in the first call of a Python process only.

Every command that starts a backend opens its run with `open_run` (processes, resolved
config, platform environment, job directory), then runs its loop. The CLI (paxcli.cli) is
a layer over these functions that parses options and prints. Heavy modules (JAX, fiddle,
the loops) are imported inside the functions that use them: `pax import-maxtext` and
`pax --help` never pay for JAX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import logging
import os
import re
import shlex
import time
import warnings
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from rich.console import Console
from rich.markup import escape

from paxcli import experiment, files
from paxcli.errors import UserError, printable, shorten
from paxcli.jobdir import invocation, layout, storage
from paxcli.maxtext import recipe as maxtext_recipe
from paxcli.maxtext.shell import read_script
from paxcli.maxtext.translate import Options, Translation, translate
from paxcli.runtime import distributed, platform
from paxcli.runtime import topology as tpu_topology
from paxcli.inputs import hub
from paxcli.loops.decode.options import DecodeOptions, check_text  # no JAX: options fail before start-up
from paxcli.loops.decode.output import check_output  # no JAX
from paxcli.loops.score import requests  # no JAX: a bad file is one line before start-up
from paxcli.loops.serve.options import ServeOptions  # no JAX: options fail before start-up
from paxcli.values import parse_size, parse_value

if TYPE_CHECKING:  # fiddle, for a type only
  from paxcli.config import Resolved

# Fake CPU devices: XLA's CPU backend refuses to compile for 4,096 of them ("Multiprocess computations
# aren't implemented on the CPU backend"); 2,048 compile a tiny model in about 16 s on 2 cores.
MAX_FAKE_DEVICES = 2048
DECODE_DTYPES = ('float32', 'bfloat16', 'float16')


@dataclasses.dataclass(frozen=True)
class Run:
  """What a command opens before its loop: the resolved config and its job directory."""
  resolved: Resolved
  job_dir: Optional[str]   # absolute, symlinks resolved; None for a command without one
  made: Optional[invocation.Made] = None   # how the job was made, as its directory records it


def open_run(exp: Optional[str], overrides: Sequence[str] = (), job_dir: Optional[str] = None, *,
             with_job_dir: bool = True, processes: bool = True, coordinator: Optional[str] = None,
             num_processes: Optional[int] = None, process_id: Optional[int] = None,
             heartbeat_timeout: Optional[float] = None,
             log: Callable[[str], None] = print, remembered: bool = True, timed: bool = False) -> Run:
  """Joins the run's processes, resolves the config, sets its PLATFORM_ENV and names its job directory.

  The order is JAX's: jax.distributed starts before any backend (experiments may ask jax
  for device counts while resolving), and PLATFORM_ENV's XLA flags are set before the
  command's loop starts the backend. `processes`: the command runs on several processes
  (--coordinator ...; else a detected cluster), each watching the others (--heartbeat-timeout). The
  job directory (`job_dir`, else ./runs/<experiment>, or ./runs/<experiment>_on_<data> for --set
  TRAIN_DATA=...) is made absolute once, here: orbax refuses relative paths and the rest of paxcli
  joins names onto it.
  `remembered` (every command but train): the experiment and --set overrides the job was trained
  with (jobdir.invocation.read_made) come first, `exp` and `overrides` given here on top, in one
  line on `log`. A job directory with a checkpoint keeps its tokenizer (jobdir.tokenizer.keep_trained);
  a run from INIT_FROM reads with the base's (jobdir.tokenizer.adopt_base).
  FP8 on a device without fp8 units: one warning line (the products are emulated), or, for a command
  that times the step (`timed`), a refusal in one line.
  """
  if processes:
    distributed.start(distributed.settings_from(coordinator, num_processes, process_id, heartbeat_timeout),
                      log=log, command=invocation.command_line())
  directory = made = None
  if with_job_dir:
    directory = path_arg(job_dir or default_job_dir(exp, overrides), '--job-log-dir')
    storage.check_reachable(directory)   # a bucket that cannot be used: one line, before any compile
    if remembered:
      exp, overrides, made = as_made(directory, exp, overrides, log)
  resolved = resolve(exp, overrides)
  platform.apply_platform_env(resolved.experiment.PLATFORM_ENV, log=log)
  check_fp8(resolved, timed)
  if with_job_dir:
    from paxcli.jobdir import tokenizer  # orbax and fiddle: for commands that open a job directory
    tokenizer.keep_trained(resolved.datasets, directory)
    tokenizer.adopt_base(resolved.datasets, resolved.task.train)
  return Run(resolved, directory, made)


def as_made(directory: str, exp: Optional[str], overrides: Sequence[str],
            log: Callable[[str], None]) -> tuple[Optional[str], list[str], Optional[invocation.Made]]:
  """(experiment, overrides, record) a command reading job `directory` runs with: the job's own experiment
  and --set overrides with `overrides` after them (they win), said in one line; `exp` and `overrides` as
  given when the job records none, or when `exp` names another experiment (said too)."""
  made = invocation.read_made(directory) or invocation.made_by_config(directory)
  if made is None:
    return exp, list(overrides), None
  job = _shown(directory)
  if exp and experiment.canonical_name(exp) != made.experiment:
    log(printable(f'Note: {job} was trained with {shorten(made.command(), 2000)}; using --exp {exp} as given, without '
                  'those settings.'))
    return exp, list(overrides), made
  if not exp and not _trusted(directory, made.experiment):
    raise UserError(f'{job} was trained with the experiment {printable(made.experiment)}, code that paxcli imports '
                    f'only when you name it: add --exp {printable(shlex.quote(made.experiment))} (the job\'s --set '
                    'settings then apply).')
  made, refused = made.replayable(experiment.lookup(made.experiment).replayable)
  try:   # each knob it sets, parsed and checked now: a bad value is one line naming the record
    experiment.instantiate(made.experiment, list(made.overrides))
  except UserError as e:
    raise UserError(f'{_shown(layout.made(directory))} (the job\'s record): {e}') from None
  given = ' '.join(f'--set {shlex.quote(o)}' for o in overrides)
  laid_out = {invocation.key_of(o) for o in overrides} & set(invocation.LAYOUT_KNOBS)
  used = made.without_layout() if laid_out else made   # a mesh given here replaces the job's whole layout
  left_out = ', without its mesh and pipeline settings' if used != made else ''
  log(printable(f'{job}: {shorten(used.command(), 2000)} (as trained{left_out})'
                + (f'; given here, on top: {given}' if given else '') + '.'))
  if refused:
    log(_refused_note(job, refused))
  return made.experiment, [*used.overrides, *overrides], made


def _refused_note(job: str, keys: Sequence[str]) -> str:
  """The one line that says which settings of a job's record were left out, and why."""
  names = ', '.join(printable(shorten(k, 60)) for k in keys[:8]) + (f' and {len(keys) - 8} more' if len(keys) > 8 else '')
  return (f'Note: {job}\'s record also sets {names}; paxcli takes settings of the process or the machine (environment, '
          'paths outside the job, endpoints, trackers) only from your own command line, so not these (add --set to '
          'use one).')


def _trusted(directory: str, name: str) -> bool:
  """Whether the experiment a job records may be resolved on its word (convert.core.trusted_in)."""
  from paxcli.convert import core  # fiddle
  return core.trusted_in(directory, name, None) is not None


def _shown(path: str) -> str:
  """A path as the user would type it here: relative when under the working directory."""
  if not storage.is_local(path):
    return path
  relative = os.path.relpath(path)
  return path if relative.startswith('..') else relative


def resolve(exp: Optional[str], overrides: Sequence[str] = ()):
  """config.resolve, its warnings (e.g. a knob the experiment's code overrides) printed on stderr."""
  from paxcli import config  # fiddle: not for commands that never build a config
  resolved = config.resolve(exp, list(overrides))
  for message in resolved.warnings:
    warn(message)
  return resolved


def check_fp8(resolved, timed: bool) -> None:
  """FP8 where the device has no fp8 units: one warning line, or a UserError when `timed` (a speed
  figure of emulated fp8 would mislead)."""
  from paxcli.layers import fp8  # JAX
  for mode in fp8.modes_of(resolved.flat()):
    if timed and fp8.refusal(mode):
      raise UserError(fp8.refusal(mode))
    if fp8.emulation_note(mode):
      warn(fp8.emulation_note(mode))


def warn(message: str) -> None:
  """One `warning:` line on stderr, whatever the command's console: stdout stays the command's output."""
  Console(stderr=True, highlight=False, soft_wrap=True).print(f'[bold yellow]warning:[/] {escape(message)}',
                                                              markup=True)


def default_job_dir(exp: Optional[str], overrides: Sequence[str] = ()) -> str:
  """./runs/<experiment>, or ./runs/<experiment>_on_<data> when --set TRAIN_DATA=... names the data
  (own-data runs of one experiment keep apart, and from its built-in run)."""
  name = experiment.lookup(exp).registered_name().replace(':', '_').replace('/', '_')
  data = next((o.split('=', 1)[1] for o in reversed(overrides) if invocation.key_of(o) == 'TRAIN_DATA'), None)
  return os.path.join('runs', f'{name}_on_{data_name(data)}' if data else name)


def data_name(raw: str) -> str:
  """A short name for the data a --set TRAIN_DATA=... value names: `my/*.jsonl` -> my, `sft.jsonl` ->
  sft, `data/train-*.parquet` -> train, a {glob: weight} mixture -> its names joined by +."""
  value = parse_value(raw)
  globs = list(value)[:3] if isinstance(value, dict) else [value]
  names = [_glob_name(str(g)) for g in globs]
  joined = '+'.join(n for n in names if n) or 'data'
  return re.sub(r'[^A-Za-z0-9._+-]', '_', joined)[:60]


def _glob_name(pattern: str) -> str:
  for part in reversed([p for p in pattern.replace('\\', '/').split('/') if p not in ('', '.', '..', '~')]):
    stem = re.sub(r'[*?\[\]{}]', '', part)
    stem = re.sub(r'(\.(jsonl|json|txt|text|parquet|tfrecords?|array_?record|gz|zst|bz2|xz|zip))+$', '', stem,
                  flags=re.IGNORECASE).strip('-_.')
    if stem:
      return stem
  return ''


def path_arg(path: Optional[str], option: str) -> Optional[str]:
  """A path the user gave (None stays None), made absolute with symlinks resolved; '' is refused."""
  if path is None:
    return None
  if not path:
    raise UserError(f'{option} is empty; give a path.')
  return layout.absolute(path, option)


def output_arg(path: Optional[str], option: str, buckets: bool = False) -> Optional[str]:
  """A file the user names for a command to write (None stays None): as path_arg, except that a FIFO,
  a character device or /dev/stdout keeps its name, to be written into (files.output_path). A bucket
  path (gs://) only where the command writes there (`buckets`)."""
  if path is None:
    return None
  if not path:
    raise UserError(f'{option} is empty; give a path.')
  if not storage.is_local(path):
    if not buckets:
      raise UserError(f'{option} {path}: this file is written on this machine; give a local path.')
    return layout.absolute(path, option)
  return files.output_path(path)


def _check_output(output: Optional[str], force: bool, inputs: Sequence[Optional[str]]) -> None:
  """Before start-up: an --output that cannot take the results is one line now, not after the work."""
  if output:
    check_output(output, force, inputs=[p for p in inputs if p])


def positive_finite(value: Optional[float], option: str, unit: str) -> Optional[float]:
  """`value` of a numeric option, or one line: NaN, infinity, zero and negatives are refused."""
  if value is not None and not (value > 0 and value != float('inf')):  # NaN fails `> 0`
    raise UserError(f'{option} must be a positive number ({unit}, finite), got {value}.')
  return value


def _console(console) -> Console:
  return console if console is not None else Console(stderr=True)


def _printer(console: Console) -> Callable[[str], None]:
  """Plain log lines on `console`: no markup, no highlighting, never cut."""
  return lambda message: console.print(message, highlight=False, markup=False, soft_wrap=True)


# ---- train, eval, decode ---------------------------------------------------------------------


def train(exp: Optional[str] = None, *, overrides: Sequence[str] = (), job_dir: Optional[str] = None,
          verbose: bool = False, profile_steps: Optional[str] = None, pgle: Optional[str] = None,
          pgle_profile: Optional[str] = None, force_resume: bool = False, coordinator: Optional[str] = None,
          num_processes: Optional[int] = None, process_id: Optional[int] = None,
          heartbeat_timeout: Optional[float] = None, console=None) -> dict:
  """`pax train`: trains (or resumes) `exp` in `job_dir`; returns the last summary (step, loss, rates).

  profile_steps: 'A-B' traces steps A to B with jax.profiler into <job_dir>/profile. The job
  directory records `exp` and `overrides` (experiment.jsonl) for the commands that read it. A job
  directory whose run was trained on other data or another tokenizer is refused unless force_resume.
  """
  from paxcli.loops import train as train_loop
  from paxcli.perf import profiling
  steps = profiling.parse_steps(profile_steps)
  pgle_profile = path_arg(pgle_profile, '--pgle-profile')
  console = _console(console)
  run = open_run(exp, overrides, job_dir, coordinator=coordinator, num_processes=num_processes,
                 process_id=process_id, heartbeat_timeout=heartbeat_timeout, log=_printer(console),
                 remembered=False)
  if job_dir is None and any(invocation.key_of(o) == 'TRAIN_DATA' for o in overrides):
    _printer(console)(f'Job directory {_shown(run.job_dir)}, named after TRAIN_DATA (--job-log-dir picks another).')
  made = invocation.Made(experiment.canonical_name(exp),
                         invocation.portable_overrides(overrides, invocation.strings_in(run.resolved.flat())))
  return train_loop.train(run.resolved, run.job_dir, console, verbose=verbose, profile_steps=steps, pgle=pgle,
                          pgle_profile=pgle_profile, made=made, force_resume=force_resume)


def evaluate(exp: Optional[str] = None, *, overrides: Sequence[str] = (), job_dir: Optional[str] = None,
             step: Optional[int] = None, follow: bool = False, timeout: Optional[float] = None,
             poll: float = 10.0, no_checkpoint: bool = False, coordinator: Optional[str] = None,
             num_processes: Optional[int] = None, process_id: Optional[int] = None, console=None,
             on_result: Optional[Callable[[dict], None]] = None):
  """`pax eval`: {'step', 'results': {input: metrics}} of the latest checkpoint (or `step`, or fresh
  weights with no_checkpoint). With follow: a list of them, one per new checkpoint evaluated beside
  a running trainer, each also passed to on_result as it comes."""
  if follow and (step is not None or no_checkpoint):
    raise UserError('--follow evaluates every new checkpoint; it does not go with --step or --no-checkpoint.')
  if timeout is not None and not follow:
    raise UserError('--timeout goes with --follow.')
  if step is not None and no_checkpoint:
    raise UserError('--step N picks a checkpoint; --no-checkpoint evaluates fresh weights. Give one of them.')
  from paxcli.jobdir import restore
  from paxcli.loops import evaluate as eval_loop
  console = _console(console)
  if follow and not exp:
    _await_trainer(path_arg(job_dir or default_job_dir(exp, overrides), '--job-log-dir'), timeout, poll,
                   eval_loop.TRAINER_START_GRACE_S, _printer(console))
  run = open_run(exp, overrides, job_dir, coordinator=coordinator, num_processes=num_processes,
                 process_id=process_id, log=_printer(console))
  record = None
  if distributed.first_process() and not no_checkpoint:
    record = lambda: invocation.record(run.job_dir)
  if record and storage.isdir(run.job_dir):  # never made here: a follower records at its first evaluation
    record()
    record = None
  with _naming_the_job(run):
    if follow:
      return eval_loop.follow(run.resolved, run.job_dir, console, timeout=timeout, poll_seconds=poll,
                              on_result=on_result, on_first=record)
    if not no_checkpoint:  # a mistyped job directory is refused before any work
      restore.choose_step(run.job_dir, step=step, purpose='evaluate')
    return eval_loop.evaluate(run.resolved, run.job_dir, console, use_checkpoint=not no_checkpoint, step=step)


def _await_trainer(directory: str, timeout: Optional[float], poll: float, grace: float, log) -> None:
  """A follower started before its trainer: waits until the job records its experiment (or has a complete
  checkpoint: a job trained before records were kept; or `timeout` / `grace` seconds pass), so that it
  evaluates what the trainer trains."""
  from paxcli.jobdir import checkpoint as ckpt  # orbax
  deadline = time.monotonic() + (timeout if timeout is not None else grace)
  said = False
  while not storage.isfile(layout.made(directory)) and not ckpt.complete_steps(layout.checkpoints(directory)):
    if time.monotonic() >= deadline:
      return
    if not said:
      log(f'Waiting for a trainer to start in {_shown(directory)} (it records the experiment to evaluate).')
      said = True
    time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


@contextlib.contextmanager
def _naming_the_job(run: Run):
  """A checkpoint this command's config cannot read (other shapes): the error's first line says how the
  job was made, the experiment and settings that do read it."""
  from paxcli.jobdir import restore  # orbax
  try:
    yield
  except restore.ShapeMismatch as e:
    if run.made is None:
      raise
    raise UserError(f'{_shown(run.job_dir)} was trained with {run.made.command()}; {e}') from None


def decode(exp: Optional[str] = None, *, overrides: Sequence[str] = (), job_dir: Optional[str] = None,
           prompt: Sequence[str] = (), prompts_file: Optional[str] = None, prompt_ids: Sequence[str] = (),
           dataset: Optional[str] = None, num_prompts: int = 8, max_decode_steps: int = 64,
           temperature: Optional[float] = None, top_k: Optional[int] = None, top_p: Optional[float] = None,
           num_samples: int = 1, seed: int = 0, beam_size: int = 0, length_penalty: float = 0.0,
           eos_id: Sequence[int] = (), ignore_eos: bool = False, min_length: int = 0, stop: Sequence[str] = (),
           batch_size: int = 0, step: Optional[int] = None, no_checkpoint: bool = False,
           dtype: Optional[str] = None, output: Optional[str] = None, coordinator: Optional[str] = None,
           num_processes: Optional[int] = None, process_id: Optional[int] = None, console=None,
           progress=None, force: bool = False) -> list[dict]:
  """`pax decode`: one record per prompt and sample (prompt, decoded text and ids, logprobs, stop
  reason), also written as JSONL to `output` (default: under <job_dir>/decoder_out/), as `pax decode`
  writes them. prompt_ids: prompts as token ids, '12,15,18'. The list returned also carries
  `.stats` (decode rates), `.step` (the checkpoint decoded) and `.path` (the file written; None on
  processes other than 0). progress: a factory `progress(total)` of context managers yielding
  `advance(n)`, or None."""
  opts = DecodeOptions(
      max_decode_steps=max_decode_steps, temperature=temperature, top_k=top_k, top_p=top_p,
      num_samples=num_samples, seed=seed, beam_size=beam_size, length_penalty=length_penalty,
      eos_ids=tuple(eos_id), stop=tuple(stop), batch_size=batch_size, ignore_eos=ignore_eos, min_length=min_length)
  opts.check()
  for text in prompt:
    check_text(text, '--prompt')
  for text in stop:
    check_text(text, '--stop')
  if dtype is not None and dtype not in DECODE_DTYPES:
    raise UserError(f'--dtype must be one of {", ".join(DECODE_DTYPES)}; got {dtype!r}.')
  if not (prompt or prompts_file or prompt_ids or dataset):
    raise UserError('No prompts: give --prompt TEXT, --prompts-file FILE, --prompt-ids 1,2,3 or --dataset NAME.')
  prompts_file, output = path_arg(prompts_file, '--prompts-file'), output_arg(output, '--output', buckets=True)
  _check_output(output, force, [prompts_file])
  log = _printer(_console(console))
  run = open_run(exp, overrides, job_dir, coordinator=coordinator, num_processes=num_processes,
                 process_id=process_id, log=log)
  from paxcli.loops.decode import command  # JAX
  with _naming_the_job(run):
    return command.decode(run.resolved, run.job_dir, opts, texts=list(prompt), prompts_file=prompts_file,
                          prompt_ids=list(prompt_ids), dataset=dataset, num_prompts=num_prompts, step=step,
                          use_checkpoint=not no_checkpoint, dtype=dtype, output=output, log=log, progress=progress,
                          force=force)


def score(requests_file: str, exp: Optional[str] = None, *, overrides: Sequence[str] = (),
          job_dir: Optional[str] = None, batch_size: int = 0, step: Optional[int] = None,
          no_checkpoint: bool = False, dtype: Optional[str] = None, output: Optional[str] = None,
          coordinator: Optional[str] = None, num_processes: Optional[int] = None,
          process_id: Optional[int] = None, console=None, progress=None, force: bool = False) -> list[dict]:
  """`pax score`: the log-likelihood of each request of a JSONL file (context and continuation, their
  ids, or a whole text), one record per request in file order: its own fields with `logprob`,
  `is_greedy`, `num_tokens`, `token_logprobs`, `line`, `truncated`; also written as JSONL to `output`
  (default: <job_dir>/scores/). The list returned also carries `.stats` (tokens, seconds,
  compile_s), `.step` and `.path` (None on processes other than 0). progress: as for decode."""
  if dtype is not None and dtype not in DECODE_DTYPES:
    raise UserError(f'--dtype must be one of {", ".join(DECODE_DTYPES)}; got {dtype!r}.')
  if batch_size < 0:
    raise UserError(f'--batch-size must be at least 0 (0: automatic), got {batch_size}.')
  if step is not None and no_checkpoint:
    raise UserError('--step N picks a checkpoint; --no-checkpoint scores fresh weights. Give one of them.')
  requests_file, output = path_arg(requests_file, 'REQUESTS'), output_arg(output, '--output', buckets=True)
  _check_output(output, force, [requests_file])
  read = requests.read_requests(requests_file)
  log = _printer(_console(console))
  run = open_run(exp, overrides, job_dir, coordinator=coordinator, num_processes=num_processes,
                 process_id=process_id, log=log)
  from paxcli.loops.score import command  # JAX
  with _naming_the_job(run):
    return command.score(run.resolved, run.job_dir, read, requests_file, step=step,
                         use_checkpoint=not no_checkpoint, dtype=dtype, batch_size=batch_size, output=output,
                         log=log, progress=progress, force=force)


def lm_eval(tasks: Sequence[str], exp: Optional[str] = None, *, overrides: Sequence[str] = (),
            job_dir: Optional[str] = None, include_path: Sequence[str] = (), num_fewshot: Optional[int] = None,
            limit: Optional[float] = None, batch_size: int = 0, step: Optional[int] = None,
            dtype: Optional[str] = None, gen_kwargs: Optional[str] = None, log_samples: bool = False, seed: int = 0,
            output: Optional[str] = None, coordinator: Optional[str] = None, num_processes: Optional[int] = None,
            process_id: Optional[int] = None, console=None, progress=None) -> dict:
  """`pax lm-eval`: lm-evaluation-harness' own evaluator (`simple_evaluate`) on `tasks` (names, groups,
  tags, patterns or task YAML paths; include_path adds task directories) with checkpoint `step` of
  `job_dir` (default the latest): the harness' results dict, also written as JSON to `output` (default
  <job_dir>/lm_eval/results_step<k>_<n>.json). The dict returned also carries `.tables` (the harness'
  printed tables), `.path` and `.stats` (requests, seconds, requests_per_sec). progress: a factory
  `progress(label, total)` of context managers yielding `advance(n)`, or None."""
  if importlib.util.find_spec('lm_eval') is None:
    raise UserError("pax lm-eval runs lm-evaluation-harness, which is not installed: pip install 'paxcli[eval]' "
                    '(or pip install lm-eval).')
  tasks = [t for t in tasks if t]
  if not tasks:
    raise UserError('Give the tasks to evaluate: --tasks hellaswag,arc_easy (`lm-eval ls tasks` lists them).')
  if dtype is not None and dtype not in DECODE_DTYPES:
    raise UserError(f'--dtype must be one of {", ".join(DECODE_DTYPES)}; got {dtype!r}.')
  if batch_size < 0:
    raise UserError(f'--batch-size must be at least 0 (0: automatic), got {batch_size}.')
  if num_fewshot is not None and num_fewshot < 0:
    raise UserError(f'--num-fewshot must be at least 0, got {num_fewshot}.')
  if limit is not None and not (limit > 0 and limit != float('inf')):
    raise UserError(f'--limit must be a positive number (documents per task, or a fraction below 1), got {limit}.')
  include_path = [path_arg(p, '--include-path') for p in include_path]
  tasks = [path_arg(t, '--tasks') if t.endswith(('.yaml', '.yml')) else t for t in tasks]
  output = path_arg(output, '--output')
  log = _printer(_console(console))
  run = open_run(exp, overrides, job_dir, coordinator=coordinator, num_processes=num_processes,
                 process_id=process_id, log=log)
  from paxcli.loops.harness import command  # JAX and lm_eval
  with _naming_the_job(run):
    return command.lm_eval_run(run.resolved, run.job_dir, tasks, include_path=include_path,
                               num_fewshot=num_fewshot, limit=limit, batch_size=batch_size, step=step, dtype=dtype,
                               gen_kwargs=gen_kwargs, log_samples=log_samples, seed=seed, output=output, log=log,
                               progress=progress)


def serve(exp: Optional[str] = None, *, overrides: Sequence[str] = (), job_dir: Optional[str] = None,
          host: str = '127.0.0.1', port: int = 8000, served_model_name: Optional[str] = None,
          lora: Sequence[str] = (), slots: int = 16, max_queue: int = 256, max_n: int = 16,
          prefill_chunk: int = 256, steps: int = 8, drain_timeout: float = 60.0, step: Optional[int] = None,
          dtype: Optional[str] = None, access_log: bool = False, console=None,
          ready: Optional[Callable[[str], None]] = None) -> None:
  """`pax serve`: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /health,
  /metrics) of the job's latest checkpoint (or `step`), with continuous batching, until SIGTERM or Ctrl-C (which
  drain the running requests first). lora: more LoRA runs of the same base, 'NAME=DIR' or 'DIR', each served under
  its name. `ready(url)` is called once the server answers (default: a line on `console`)."""
  if importlib.util.find_spec('fastapi') is None or importlib.util.find_spec('uvicorn') is None:
    raise UserError("pax serve runs FastAPI on uvicorn, which are not installed: pip install 'paxcli[serve]'.")
  if dtype is not None and dtype not in DECODE_DTYPES:
    raise UserError(f'--dtype must be one of {", ".join(DECODE_DTYPES)}; got {dtype!r}.')
  opts = ServeOptions(host=host, port=port, slots=slots, max_queue=max_queue, max_n=max_n,
                      prefill_chunk=prefill_chunk, steps=steps, drain_timeout=drain_timeout, name=served_model_name,
                      loras=tuple(_lora_arg(a) for a in lora), step=step, dtype=dtype, access_log=access_log)
  opts.check()
  log = _printer(_console(console))
  run = open_run(exp, overrides, job_dir, processes=False, log=log)
  used_exp, used_overrides, _ = as_made(run.job_dir, exp, overrides, lambda _: None)
  from paxcli.loops.serve import command  # JAX, FastAPI
  with _naming_the_job(run):
    command.serve(run.resolved, run.job_dir, opts, lambda more: resolve(used_exp, [*used_overrides, *more]),
                  log=log, ready=ready)


def _lora_arg(text: str) -> tuple[Optional[str], str]:
  """--lora NAME=DIR or DIR -> (NAME or None, DIR made absolute)."""
  name, eq, directory = text.partition('=')
  if not eq or os.sep in name or not name:
    name, directory = None, text
  if not directory:
    raise UserError(f'--lora takes NAME=DIR or DIR (a LoRA run\'s job directory), got {text!r}.')
  return name, path_arg(directory, '--lora')


# ---- describe, bench, inputs -----------------------------------------------------------------


def describe(exp: Optional[str] = None, *, overrides: Sequence[str] = ()) -> dict:
  """`pax describe`: {'experiment', 'config': {'knobs.X' / 'task.…' / 'datasets.…': value},
  'summary': {parameters, flops_per_token, global_batch, devices, ...; '<name>_note' where a figure
  cannot be known}, 'pipeline': the schedule and bubble of a pipelined model, else None,
  'text': the config as `pax describe` prints it}."""
  from paxcli.runtime import engine
  resolved = resolve(exp, overrides)
  return {'experiment': resolved.name, 'config': resolved.flat(), 'summary': engine.summary(resolved),
          'pipeline': engine.pipeline_note(resolved), 'text': resolved.as_text()}


def bench_mfu(exp: Optional[str] = None, *, overrides: Sequence[str] = (), job_dir: Optional[str] = None,
              sweep: Sequence[str] = (),
              steps: int = 10, warmup: int = 2, compile_only: bool = False, num_devices: Optional[int] = None,
              peak_tflops: Optional[float] = None, device_memory: Optional[str] = None,
              plot: Optional[str] = None, pgle: Optional[str] = None, pgle_profile: Optional[str] = None,
              console=None, force: bool = False, topology: Optional[str] = None, num_slices: int = 1) -> list[dict]:
  """`pax bench mfu`: one row per sweep combination (step time, tokens/s, TFLOP/s per device, MFU, HFU,
  memory). sweep: 'KNOB=a,b,c' strings; plot: a PNG of the rows, written after they all ran (over an
  existing file only with force). job_dir: the experiment and --set overrides that job was trained with
  (`exp` and `overrides` on top). topology (with compile_only): a TPU slice name such as 'v4-128'
  (`num_slices` of them), compiled for by libtpu without a TPU (paxcli.runtime.topology)."""
  from paxcli.loops import bench
  plot, pgle_profile = output_arg(plot, '--plot'), path_arg(pgle_profile, '--pgle-profile')
  memory_bytes = parse_size(device_memory, '--device-memory') if device_memory is not None else None
  positive_finite(peak_tflops, '--peak-tflops', 'TFLOP/s per device')
  tpu = None
  if topology is not None or num_slices != 1:
    if topology is None:
      raise UserError('--num-slices counts slices of a --topology: give the slice too, e.g. --topology v4-128.')
    if not compile_only:
      raise UserError(f'--topology {topology} plans for TPUs this machine does not have, so no step can run: '
                      'add --compile-only.')
    if num_devices:
      raise UserError('--topology and --num-devices both choose the devices to compile for: give one.')
    tpu = tpu_topology.parse(topology, num_slices)
  if plot:
    bench.check_plot_path(plot, force)
  if num_devices:
    if num_devices > MAX_FAKE_DEVICES:
      raise UserError(f'--num-devices {num_devices:,} is more than {MAX_FAKE_DEVICES:,}, the most fake CPU devices '
                      'paxcli makes: XLA\'s CPU backend fails from 4,096 fake devices, and compiling a step for '
                      f'{MAX_FAKE_DEVICES:,} already takes tens of seconds. Check a smaller mesh of the same shape '
                      '(memory per device depends on the sharded axes, not on the replica count).')
    platform.fake_cpu_devices(num_devices, '--num-devices')
  console = _console(console)
  log = _printer(console)
  if job_dir is not None:   # the job's experiment and settings, with `exp` and `overrides` on top
    exp, overrides, _ = as_made(path_arg(job_dir, '--job-log-dir'), exp, overrides, log)
  first = [f'{k}={v}' for k, v in bench.sweep_combinations(list(sweep))[0]]
  open_run(exp, list(overrides) + first, with_job_dir=False, processes=False, log=log, timed=not compile_only)
  with _progress(console) as progress:
    rows = bench.run_all(exp, list(overrides), list(sweep), steps=steps, warmup=warmup, compile_only=compile_only,
                         peak_tflops=peak_tflops, pgle=pgle, pgle_profile=pgle_profile, progress=progress,
                         log=log, device_memory=memory_bytes, tpu=tpu)
  if plot:
    bench.plot(rows, plot)
    log(f'Plot written to {plot}.')
  return rows


def _progress(console: Console):
  """A transient progress bar on `console`, shown only on a terminal."""
  bars = _rich_progress()
  return bars.Progress(bars.TextColumn('[bold]{task.description}'), bars.BarColumn(), bars.MofNCompleteColumn(),
                       bars.TimeElapsedColumn(), console=console, transient=True, disable=not console.is_terminal)


def _rich_progress():
  """rich's progress bars, imported by the commands that draw one."""
  import rich.progress
  return rich.progress


def inspect_input(exp: Optional[str] = None, *, path: Optional[str] = None, overrides: Sequence[str] = (),
                  job_dir: Optional[str] = None, split: str = 'train', num_batches: int = 3, num_examples: int = 2,
                  host_index: int = 0, num_hosts: int = 1, check_sharding: bool = False, console=None,
                  on_batch: Optional[Callable[[str, dict], None]] = None) -> dict:
  """`pax inspect-input`: batches of an experiment's input as one host of `num_hosts` reads them.

  Returns {'input': name, 'batches': [{'batch', 'host', 'num_hosts', 'features': stats, 'examples'}],
  'throughput': {...}}; on_batch(input name, batch) is called with each batch as it is read.
  With check_sharding: the report of every host's examples (report['ok'] is False when hosts
  overlap). With `job_dir`: the input of that job, with the experiment, --set overrides and
  tokenizer it was trained with (`exp` and `overrides` on top). With `path` (a TFRecord file or
  glob), no experiment: the file's features and first records. (A path as the first argument, as
  before, still works, with a DeprecationWarning.)
  """
  from paxcli.loops import inspect_input as ii
  if exp is not None and path is None and _names_a_file(exp):
    warnings.warn('paxcli.inspect_input(PATH) is deprecated: its first argument is the experiment, as in every '
                  'paxcli function; pass the file as path=PATH.', DeprecationWarning, stacklevel=2)
    exp, path = None, exp
  if path is not None:
    return ii.inspect_file(path, max(num_examples, 1))
  run = open_run(exp, overrides, job_dir, with_job_dir=job_dir is not None, processes=False,
                 log=_printer(_console(console)))
  cfg = ii.select_dataset(run.resolved, split)
  batch_size = ii.host_batch_size(run.resolved)
  if check_sharding:
    return ii.check_sharding(cfg, batch_size, num_hosts, num_batches)
  inp = ii.build(cfg, batch_size, num_hosts, host_index)
  for note in getattr(inp, 'notes', ()):   # what the input chose that the user should hear (VOCAB_SIZE)
    _printer(_console(console))(note)
  batches, seconds, rows = [], 0.0, 0
  for i, batch, took in ii.read_batches(inp, num_batches):
    seconds += took
    rows += len(next(iter(batch.values())))
    record = {'batch': i, 'host': host_index, 'num_hosts': num_hosts, 'features': ii.feature_stats(batch),
              'examples': ii.examples(inp, batch, num_examples)}
    batches.append(record)
    if on_batch:
      on_batch(cfg.name, record)
  rate = {'batches': len(batches), 'batches_per_sec': len(batches) / max(seconds, 1e-9),
          'examples_per_sec': rows / max(seconds, 1e-9),
          'input_ended': len(batches) < num_batches}  # read_batches stops early only at a finite input's end
  return {'input': cfg.name, 'batches': batches, 'throughput': rate}


def _names_a_file(name: str) -> bool:
  """Whether inspect_input's first argument, given the old way, is a file (or glob) and not an experiment
  (`name`, `module.Class` or `path/file.py:Class`)."""
  return ':' not in name and ('/' in name or os.path.exists(name) or glob.has_magic(name)
                              or name.lower().endswith(('.tfrecord', '.tfrecords', '.tfr')))


# ---- prepared data ---------------------------------------------------------------------------


def data_prepare(sources: Sequence[str], output: str, *, tokenizer: Optional[str] = None, vocab_size: int = 2048,
                 text_field: str = 'text', num_shards: Optional[int] = None, eval_split: bool = True,
                 workers: Optional[int] = None, chat_template: str = '', console=None) -> dict:
  """`pax data prepare`: `sources` (globs) tokenized into ArrayRecord shards in `output`
  (paxcli.loops.prepare); returns the summary (documents, records, tokens and shards per split,
  documents/s and tokens/s of the tokenizing). Run again after a kill: it resumes."""
  from paxcli.loops import prepare
  if not sources:
    raise UserError('Give the files to prepare (globs), then the output directory.')
  if num_shards is not None and num_shards < 1:
    raise UserError(f'--num-shards must be at least 1, got {num_shards}.')
  console = _console(console)
  options = prepare.Options(tuple(sources), path_arg(output, 'OUT'), path_arg(tokenizer, '--tokenizer'),
                            vocab_size, text_field, num_shards, eval_split, max(1, workers or _cpus()),
                            chat_template)
  with _DataProgress(console) as bars:
    return prepare.prepare(options, bars, _printer(console))


def data_show(path: str) -> dict:
  """`pax data show`: a prepared directory's manifest (tokenizer, shards, records, tokens)."""
  from paxcli.loops import prepare
  return prepare.show(path_arg(path, 'PATH'))


def _cpus() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else (os.cpu_count() or 1)


class _DataProgress:
  """rich progress bars for `prepare.Progress`: one per phase, documents counted and tokens/s."""

  def __init__(self, console: Console):
    bars = _rich_progress()
    self._progress = bars.Progress(bars.TextColumn('[bold]{task.description}'), bars.BarColumn(),
                                   bars.MofNCompleteColumn(), bars.TextColumn('{task.fields[rate]}'),
                                   bars.TimeElapsedColumn(), console=console, transient=True,
                                   disable=not console.is_terminal)

  def __enter__(self):
    self._progress.__enter__()
    return self

  def __exit__(self, *exc):
    return self._progress.__exit__(*exc)

  def __call__(self, phase: str, total: Optional[int]) -> Callable[[int, int], None]:
    task = self._progress.add_task(phase, total=total, rate='')
    start, tokens = time.perf_counter(), [0]

    def advance(done: int, new_tokens: int) -> None:
      tokens[0] += new_tokens
      rate = f'{tokens[0] / max(time.perf_counter() - start, 1e-9):,.0f} tokens/s' if tokens[0] else ''
      self._progress.update(task, advance=done, rate=rate)
    return advance


# ---- checkpoints and MaxText -----------------------------------------------------------------


def goodput(job_dir: str) -> dict:
  """`pax goodput`: where the job's wall time went, across its processes and restarts (jobdir/ledger.py)."""
  from paxcli.jobdir import ledger
  directory = path_arg(job_dir, 'JOB')
  if not storage.isdir(directory):
    raise UserError(f'{job_dir} is not a directory; give the job directory of a `pax train` run.')
  return ledger.summarize(layout.job_dir_of(directory))


def inspect_checkpoint(path: str, *, step: Optional[int] = None, fmt: Optional[str] = None) -> dict:
  """`pax checkpoint inspect`: a checkpoint's metadata, no array read: arrays (name, shape, dtype,
  bytes, sharding), totals and saved config. fmt: orbax, safetensors, hf, paxml (default: detected)."""
  from paxcli.convert import run as convert_run
  _quiet_absl()
  path = path_arg(_hub_model(path, fmt), 'PATH')
  storage.check_reachable(path, 'PATH')   # a bucket that cannot be used: one line, before anything is read
  return convert_run.inspect(path, fmt, step)


def convert_checkpoint(source: str, output: str, *, fmt: Optional[str] = None, to: str = 'orbax',
                       exp: Optional[str] = None, overrides: Sequence[str] = (), step: Optional[int] = None,
                       params_only: bool = False, dtype: Optional[str] = None, force: bool = False,
                       verify: bool = True, kl_tolerance: Optional[float] = None, max_shard_size: str = '5GB',
                       recipe: Optional[str] = None, merge_lora: bool = False, base_model: Optional[str] = None,
                       family: Optional[str] = None, console=None) -> dict:
  """`pax checkpoint convert`: writes `source` (never modified) as `to` at `output`; returns what was
  written. With verify the conversion certifies itself (paxcli.convert.certify): result['verify'] holds
  what ran the source and the result (transformers or PEFT for Hugging Face files where installed, else
  paxcli), max |Δ logit|, KL and top-1 agreement on fixed prompts; beyond kl_tolerance it is a UserError
  and nothing is written. base_model (to='peft'): the Hugging Face id or directory written as
  base_model_name_or_path. family (to='hf' or 'peft'): the model family written, for a model that records none
  (MODEL_FAMILY) or another; checked against what the model computes."""
  from paxcli.convert import run as convert_run
  positive_finite(kl_tolerance, '--kl-tolerance', 'a KL in nats')
  max_shard_bytes = parse_size(max_shard_size)  # before any work
  source, output = path_arg(_hub_model(source, fmt), 'SOURCE'), path_arg(output, 'OUTPUT')
  recipe = path_arg(recipe, '--recipe')
  storage.check_reachable(source, 'SOURCE')
  _quiet_absl()
  return convert_run.convert(source, output, fmt=fmt, to=to, exp=exp, overrides=list(overrides),
                             params_only=params_only, dtype=dtype, step=step, force=force, verify=verify,
                             kl_tolerance=kl_tolerance, max_shard_bytes=max_shard_bytes, recipe=recipe,
                             merge_lora=merge_lora, base_model=base_model, family=family,
                             log=_printer(_console(console)))


def _hub_model(source: str, fmt: Optional[str]) -> str:
  """A Hugging Face source as transformers reads it: a local path as it is, else a Hub id (Org/name) from
  the local cache, downloaded there when missing (paxcli.inputs.hub)."""
  if fmt not in (None, 'hf') or not source:
    return source
  return hub.model_dir(source)


def _quiet_absl() -> None:
  """orbax logs a warning for each step directory without its own metadata file; not the user's concern."""
  logging.getLogger('absl').setLevel(logging.ERROR)


@dataclasses.dataclass(frozen=True)
class MaxTextImport:
  """What `import_maxtext` made: the translation, and the recipe written (None: none was)."""
  translation: Translation
  recipe: Optional[str]
  class_name: str

  def to_json(self) -> dict:
    """As `pax import-maxtext --json` prints it."""
    return {**self.translation.to_json(), 'output': self.recipe, 'class_name': self.class_name}


def import_maxtext(script: str, args: Sequence[str] = (), *, output: Optional[str] = None,
                   class_name: Optional[str] = None, force: bool = False, dry_run: bool = False,
                   lenient: bool = False, strict: bool = False, maxtext_era: Optional[str] = None,
                   maxtext_date: Optional[str] = None, base_config: Optional[str] = None,
                   model_config: Optional[str] = None, num_devices: Optional[int] = None,
                   topology: Optional[str] = None, num_slices: Optional[int] = None) -> MaxTextImport:
  """`pax import-maxtext`: translates a MaxText run script (read as text, never run) into a recipe.

  args: the script's own KEY=VALUE arguments. A key MaxText's base.yml does not define is refused
  (UserError) unless lenient; with strict, such keys and mesh axes paxcli lacks write no recipe
  (translation.strict_warnings lists them).
  """
  path = output_arg(output, '--output') or maxtext_recipe.default_output(script)
  if not dry_run:  # before any reading: the recipe never replaces the script or a user's file unasked
    files.check_output(path, 'the recipe', force=force, inputs=[script, base_config or '', model_config or ''])
  info = read_script(script, list(args))
  options = Options(era=maxtext_era, date=maxtext_date, base_config=base_config, model_config=model_config,
                    num_devices=num_devices, topology=topology, num_slices=num_slices)
  result = translate(info, options)
  if result.unknown_keys and not lenient and not strict:  # --strict refuses them by writing nothing
    era_name = f"the {result.era} era's" if result.era != 'current' else "today's"
    raise UserError(f"{len(result.unknown_keys)} key(s) that {era_name} MaxText base.yml does not define, so MaxText "
                    f"would refuse the script: {'; '.join(result.unknown_keys)} No recipe written; fix the "
                    'key, or pass --lenient to translate without it.')
  name = maxtext_recipe.check_class_name(class_name or maxtext_recipe.default_class_name(script))
  write = not dry_run and not (strict and result.strict_warnings)
  if write:
    maxtext_recipe.write(result, name, path, force)
  return MaxTextImport(result, path if write else None, name)
