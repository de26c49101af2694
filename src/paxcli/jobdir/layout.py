"""Every path inside a job directory, named in this one module.

  config.txt                the resolved config of the latest invocation
  format.json               the newest format written into it (jobdir/format.py)
  recipe.py                 a generated recipe (knobs only) the job's experiment is read from, as data
  invocations.txt           one line per invocation: UTC time, paxcli version, command line
  experiment.jsonl          one JSON line per `pax train` start or resume: the experiment and its --set
                            overrides, which the commands reading the job use (jobdir/invocation.py)
  train.lock                the running trainer's lock (jobdir/lock.py)
  tokenizer/spm.model       the train input's sentencepiece model (decode and conversion read it)
  tokenizer/tokenizer.json  ... or its Hugging Face tokenizer, and beside either the
  tokenizer/tokenizer_config.json  it was shipped with (special tokens, chat template: data)
  checkpoints/<step>/       orbax checkpoints: state/ (the arrays) and meta/metadata (JSON)
  checkpoints_unfinished/   saves a kill interrupted, set aside at the next start (never deleted)
  checkpoints_damaged/      checkpoints that failed to restore, set aside by the trainer
  summaries/<name>/         TensorBoard events: train, eval (eval_<input>), decode
  train_metrics.jsonl       the train summaries, one JSON object per summary step
  eval_metrics.jsonl        eval metrics, one row per step (eval_<input>_metrics.jsonl for others)
  eval_done.jsonl           the steps `pax eval` and its followers have evaluated
  decoder_out/<input>/      decodes: decode_step<k>.jsonl (the trainer's), pax_decode_step<k>_<n>.jsonl
  scores/                   `pax score`'s results: pax_score_step<k>_<n>.jsonl
  profile/                  jax.profiler traces (--profile-steps)
  eval_claims/<step>        in a bucket: the step a `pax eval --follow` is evaluating (a lease; jobdir/lock.py)
  trackers/<name>.json      the W&B / MLflow run this job logs to (jobdir/trackers.py); a resume continues it
  trackers/wandb/           W&B's own files of the run (offline runs wait here for `wandb sync`; for a job
                            in a bucket, ./wandb on this machine)
  lm_eval/                  `pax lm-eval`'s results: results_step<k>_<n>.json (+ ..._samples_<task>.jsonl)
  slurm/                    `pax launch --slurm`'s sbatch script (<name>.sbatch), SLURM's output of each job
                            (<name>-<job id>.out, every requeue appended) and its failure counts
  goodput/                  where the run's time went (jobdir/ledger.py; `pax goodput`): append-only
    process_<i>.jsonl       ledgers, one per process and one of `pax launch`, and job.json, the job's
    launch.jsonl            identity (a fast checkpoint tier holds it, so a remade job is told apart);
    job.json                in a bucket, process_<i>.<run>.jsonl: each run of a process its own object
  summaries/goodput/        the same, over time, for TensorBoard

Outside the job directory, on each host: the fast checkpoint tier (LOCAL_CHECKPOINT_DIR;
jobdir/fast_tier.py), named here too:
  <local>/owner.json              the job that owns it (its path and identity)
  <local>/process_<i>-of-<n>/<step>/  one process's own shards of a step (orbax, per process)
  <local>/process_<i>-of-<n>/paxcli-tier.json  the mark of a directory the tier made: the job, the steps written

Every function takes the job directory as a command holds it: made absolute, symlinks resolved,
by `absolute` once where the command starts (orbax refuses relative paths, and a path resolved
once means the same thing in every process and after any change of directory). A job directory
in a bucket (`gs://bucket/run1`) is kept as that URL, never resolved as a local path; storage.py
reads and writes both kinds.

A job directory, a tier, a bucket prefix is received data (copied, synced, restored by others):
every path made here is checked to stay inside the directory it names a file of (`_at`, the
member check of files.member that data and model directories go through): a part of the job
that is a symlink leading out (`goodput -> <another job>/goodput`, `train.lock -> ~/.bashrc`)
is one line naming it, before anything reads or writes there. A symlink to a place inside is
followed. A bucket has no links: its paths are only joined. Beyond that check the functions
only join names, except `tokenizer`, `split`, `metrics_files`, `eval_paths` and `first_unused`,
which look at what the directory already holds.

Plain functions of a `str`, not a `JobDir` object: the job directory travels through every
command, loop and test as a string, and a path made here is the same string whoever asks.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

from paxcli import files
from paxcli.jobdir import storage

# orbax's names of a checkpoint's two items (CheckpointManager item_names): directories of a step.
STATE, META = 'state', 'meta'
# orbax's markers of a finished save, written last (in a bucket, what finalises a step)
COMMIT_MARKERS = ('commit_success.txt', '_CHECKPOINT_METADATA')
INPUT = 'input'  # the train input's position, one small JSON file per process (a Grain input's)
METRICS_SUFFIX = '_metrics.jsonl'
RECIPE_COPY = 'recipe.py'  # the recipe a conversion keeps in the job it writes: read as data, never run


def absolute(path: str, option: str = 'path') -> str:
  """`path` absolute, with symlinks resolved (a bucket URL normalised; another scheme refused in one
  line): what every command makes of each path it is given."""
  return storage.absolute(path, option)


def _at(root: str, *names: str, what: str = 'job file') -> str:
  """`root`/`names`, after checking (on this machine) that it stays inside `root`: no name climbs out
  and no symlink on the way leads out (files.member). The joined path is returned, as named."""
  path = os.path.join(root, *names)
  if storage.is_local(root):
    files.member(root, os.path.join(*names), what)
  return path


def entry(directory: str, name: str) -> str:
  """`directory`/`name` for a name found by listing a directory of a job or tier (a step, a set-aside save,
  an item of a checkpoint), checked as every path made here (`_at`)."""
  return _at(directory, name, what='entry')


def config(job_dir: str) -> str:
  return _at(job_dir, 'config.txt')


def format_file(job_dir: str) -> str:
  return _at(job_dir, 'format.json')


def invocations(job_dir: str) -> str:
  return _at(job_dir, 'invocations.txt')


def made(job_dir: str) -> str:
  """How the job was made: experiment.jsonl (paxcli.jobdir.invocation.record_made)."""
  return _at(job_dir, 'experiment.jsonl')


def recipe_copy(job_dir: str) -> str:
  """The recipe the job's experiment was read from, kept as data (RECIPE_COPY): a conversion's, or a
  generated recipe a run trained with (jobdir.invocation.record_made)."""
  return _at(job_dir, RECIPE_COPY)


def lock(job_dir: str) -> str:
  return _at(job_dir, 'train.lock')


TOKENIZER_FILES = {'sentencepiece': 'spm.model', 'hf': 'tokenizer.json'}  # by paxcli.inputs.tokenizers.kind_of


def tokenizer(job_dir: str, kind: Optional[str] = None) -> str:
  """The run's tokenizer file: of `kind`, else the one present (spm.model when neither is)."""
  if kind is None:
    kind = next((k for k, name in TOKENIZER_FILES.items()
                 if storage.isfile(_at(job_dir, 'tokenizer', name))), 'sentencepiece')
  return _at(job_dir, 'tokenizer', TOKENIZER_FILES[kind])


def tokenizer_config(job_dir: str) -> str:
  """The tokenizer_config.json shipped with the run's tokenizer (paxcli.inputs.tokenizers.config_beside
  finds it beside the tokenizer file, by this name)."""
  return _at(job_dir, 'tokenizer', 'tokenizer_config.json')


def checkpoints(job_dir: str) -> str:
  return _at(job_dir, 'checkpoints')


def step_dir(job_dir: str, step: int) -> str:
  """One checkpoint's directory: checkpoints/<step>, the name orbax's CheckpointManager gives it."""
  return _at(job_dir, 'checkpoints', str(int(step)))


def state_dir(checkpoint: str) -> str:
  """The arrays of the checkpoint in directory `checkpoint` (an orbax PyTree directory)."""
  return _at(checkpoint, STATE, what='checkpoint file')


def meta_file(checkpoint: str) -> str:
  """The JSON metadata of the checkpoint in directory `checkpoint`."""
  return _at(checkpoint, META, 'metadata', what='checkpoint file')


def input_dir(checkpoint: str) -> str:
  """The input item of the checkpoint in directory `checkpoint`: process_<i>-of-<n>.json files."""
  return _at(checkpoint, INPUT, what='checkpoint file')


def unfinished(job_dir: str) -> str:
  return _at(job_dir, 'checkpoints_unfinished')


def damaged(job_dir: str) -> str:
  return _at(job_dir, 'checkpoints_damaged')


def split(path: str) -> tuple[str, Optional[int]]:
  """(job dir, step or None) for a job directory, its checkpoints/, or one checkpoint's directory.

  A step directory is a numeric one holding a state/ item; a checkpoints/ directory is taken as
  such unless it holds a checkpoints/ of its own (then it is a job directory named so).
  """
  storage.check_scheme_typo(path)
  path = storage.absolute(path) if not storage.is_local(path) else os.path.abspath(path)
  if os.path.basename(path).isdigit() and storage.isdir(state_dir(path)):
    return os.path.dirname(os.path.dirname(path)), int(os.path.basename(path))
  if os.path.basename(path) == 'checkpoints' and not storage.isdir(checkpoints(path)):
    return os.path.dirname(path), None
  return path, None


def job_dir_of(path: str) -> str:
  """The job directory `path` names by its form alone: <job>/checkpoints/<step> or <job>/checkpoints give
  <job>; any other path is itself."""
  parts = path.split(os.sep)
  if len(parts) > 2 and parts[-2] == 'checkpoints' and parts[-1].isdigit():
    return os.path.dirname(os.path.dirname(path))
  if parts[-1] == 'checkpoints':
    return os.path.dirname(path)
  return path


def summaries(job_dir: str, name: Optional[str] = None) -> str:
  """The TensorBoard directory of one writer (train, decode, eval...), or the parent of them all."""
  return _at(job_dir, 'summaries', name) if name else _at(job_dir, 'summaries')


def train_metrics(job_dir: str) -> str:
  return _at(job_dir, 'train' + METRICS_SUFFIX)


def eval_paths(job_dir: str, name: str) -> tuple[str, str]:
  """(TensorBoard directory, metrics .jsonl) of one eval input in a job directory.

  The usual single eval input, named `eval`, writes `summaries/eval/` and
  `eval_metrics.jsonl`; another name N writes `summaries/eval_N/` and
  `eval_N_metrics.jsonl`. A job directory that already holds the older
  `eval_eval...` files keeps writing them, so its history stays in one place.
  """
  legacy = (summaries(job_dir, f'eval_{name}'), _at(job_dir, f'eval_{name}{METRICS_SUFFIX}'))
  if name != 'eval' or storage.exists(legacy[1]) or storage.isdir(legacy[0]):
    return legacy
  return summaries(job_dir, 'eval'), _at(job_dir, 'eval' + METRICS_SUFFIX)


def metrics_files(job_dir: str) -> list[str]:
  """Every `*_metrics.jsonl` the job directory holds (train and eval), sorted by name."""
  names = [n for n in storage.listdir(job_dir) if n.endswith(METRICS_SUFFIX)]
  return [_at(job_dir, n) for n in sorted(names)]


def eval_done(job_dir: str) -> str:
  return _at(job_dir, 'eval_done.jsonl')


def decoder_out(job_dir: str, dataset: Optional[str] = None) -> str:
  """The decodes of one input (`prompts`: the prompts given on the command line or to the trainer)."""
  return _at(job_dir, 'decoder_out', dataset or 'prompts')


def train_decodes(job_dir: str, dataset: Optional[str], step: int) -> str:
  """The trainer's decodes at `step` (task.train.decode_interval_steps)."""
  return _at(decoder_out(job_dir, dataset), f'decode_step{int(step)}.jsonl')


def cli_decodes(job_dir: str, dataset: Optional[str], step: int, n: int) -> str:
  """The n-th `pax decode` of checkpoint `step`, beside the trainer's decodes of that step."""
  return _at(decoder_out(job_dir, dataset), f'pax_decode_step{int(step)}_{int(n)}.jsonl')


def first_unused(path_of: Callable[[int], str]) -> str:
  """path_of(n) for the first n from 1 naming nothing yet: a command's numbered output never replaces an
  earlier one (`pax decode`, `pax score`, `pax lm-eval`)."""
  n = 1
  while storage.exists(path_of(n)):
    n += 1
  return path_of(n)


def scores(job_dir: str, step: int, n: int) -> str:
  """The n-th `pax score` of checkpoint `step`."""
  return _at(job_dir, 'scores', f'pax_score_step{int(step)}_{int(n)}.jsonl')


def profile(job_dir: str) -> str:
  return _at(job_dir, 'profile')


def tracker_dir(job_dir: str) -> str:
  """Where trackers keep their run records and W&B its local files."""
  return _at(job_dir, 'trackers')


def tracker_run(job_dir: str, name: str) -> str:
  """The run tracker `name` (wandb, mlflow) logs this job to: its id, project or store."""
  return _at(job_dir, 'trackers', f'{name}.json')


def lm_eval_results(job_dir: str, step: int, n: int) -> str:
  """The n-th `pax lm-eval` of checkpoint `step`: the harness's results as JSON."""
  return _at(job_dir, 'lm_eval', f'results_step{int(step)}_{int(n)}.json')


def lm_eval_samples(results: str, task: str) -> str:
  """The per-document records of one task, beside its results file (--log-samples)."""
  return _at(os.path.dirname(results), f'{os.path.basename(results)[:-len(".json")]}_samples_{task}.jsonl')


def eval_claim(job_dir: str, step: int) -> str:
  """In a bucket, the claim of the follower evaluating `step` (a local job directory flocks the step instead)."""
  return _at(job_dir, 'eval_claims', str(int(step)))


def slurm(job_dir: str) -> str:
  return storage.join(job_dir, 'slurm')


def goodput(job_dir: str) -> str:
  """The goodput ledgers' directory (jobdir/ledger.py)."""
  return _at(job_dir, 'goodput')


def goodput_ledger(job_dir: str, process: int) -> str:
  """Process `process`'s append-only ledger of where its wall time went."""
  return _at(job_dir, 'goodput', f'process_{int(process)}.jsonl')


def goodput_ledger_part(job_dir: str, process: int, incarnation: str) -> str:
  """In a bucket, where an object cannot be appended to: one object for each `pax train` process's run
  (incarnation), beside the process's own ledger, so that a write never rewrites earlier runs' lines."""
  return os.path.join(goodput(job_dir), f'process_{int(process)}.{incarnation}.jsonl')


_GOODPUT_PROCESS = re.compile(r'process_(\d{1,9})(?:\.[0-9a-f]{1,32})?\.jsonl')


def goodput_process(name: str) -> Optional[int]:
  """The process whose ledger (or ledger part) a file of goodput/ is, from its name; None for another file."""
  m = _GOODPUT_PROCESS.fullmatch(name)
  return int(m.group(1)) if m else None


def launch_ledger(job_dir: str) -> str:
  """`pax launch`'s ledger of this job: its start and end, each failure it saw and each restart."""
  return _at(job_dir, 'goodput', 'launch.jsonl')


def job_identity(job_dir: str) -> str:
  """The job's identity (a random id made at its first start), which its fast tier records."""
  return _at(job_dir, 'goodput', 'job.json')


def local_tier_owner(local_dir: str) -> str:
  """The fast tier's record of the job it belongs to."""
  return _at(local_dir, 'owner.json', what='fast tier file')


def local_tier_process(local_dir: str, process: int, count: int) -> str:
  """One process's fast-tier checkpoints (orbax step directories) under LOCAL_CHECKPOINT_DIR."""
  return _at(local_dir, f'process_{int(process)}-of-{int(count)}', what='fast tier directory')


def local_tier_marker(process_dir: str) -> str:
  """The mark that makes a process's fast-tier directory the tier's own: the job it was made for, and
  every step the tier wrote there (what it may delete; jobdir/fast_tier.py)."""
  return _at(process_dir, 'paxcli-tier.json', what='fast tier file')


def local_tier_step(process_dir: str, step: int) -> str:
  """One fast step of one process (an orbax step directory)."""
  return _at(process_dir, str(int(step)), what='fast tier directory')
