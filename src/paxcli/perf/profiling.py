"""jax.profiler traces of chosen steps, and profile-guided latency estimation (PGLE) on GPU.

`--profile-steps A-B` writes a trace of steps A..B to <job>/profile (TensorBoard's
profile plugin or XProf read it). PGLE feeds measured instruction latencies back into
XLA's GPU scheduler:
  --pgle auto          JAX's own: the first runs of each jitted function are profiled,
                       then it is recompiled with the profile (jax_enable_pgle).
  --pgle-profile PATH  Pax's manual workflow done for you: if PATH exists it is used; else
                       a few steps are profiled, the latencies extracted to PATH, and the
                       train step recompiled with
                       --xla_gpu_pgle_profile_file_or_directory_path=PATH.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Callable, Optional

import jax

from paxcli import files
from paxcli.errors import UserError
from paxcli.jobdir import layout, storage
from paxcli.jobdir.summaries import tensorboard_command

PGLE_OPTION = 'xla_gpu_pgle_profile_file_or_directory_path'
PGLE_PROFILE_STEPS = 3   # steps traced for --pgle-profile (after PGLE_WARMUP_STEPS)
PGLE_WARMUP_STEPS = 2
AUTO_PGLE_RUNS = 3


def parse_steps(text: Optional[str]) -> Optional[tuple[int, int]]:
  """'10-15' -> (10, 15); '7' -> (7, 7); None -> None."""
  if not text:
    return None
  match = re.fullmatch(r'\s*(\d+)\s*(?:-\s*(\d+))?\s*', text)
  if not match:
    raise UserError(f'--profile-steps {text!r} is not A-B (e.g. --profile-steps 10-15).')
  first, last = int(match.group(1)), int(match.group(2) or match.group(1))
  if first < 1 or last < first:
    raise UserError(f'--profile-steps {text!r}: need 1 <= A <= B.')
  return first, last


def check_pgle(pgle: Optional[str], pgle_profile: Optional[str]) -> None:
  """Validates the PGLE options for the current backend; enables JAX's auto PGLE."""
  if not pgle and not pgle_profile:
    return
  if pgle and pgle not in ('auto', 'off'):
    raise UserError(f'--pgle {pgle!r}: use --pgle auto, or --pgle-profile PATH for a saved profile.')
  if pgle == 'off' and not pgle_profile:
    return
  if pgle == 'auto' and pgle_profile:
    raise UserError('--pgle auto and --pgle-profile are two ways to the same thing; choose one.')
  backend = jax.default_backend()
  if backend != 'gpu':
    raise UserError(f'PGLE (profile-guided latency estimation) needs a GPU: it tunes XLA\'s GPU scheduler '
                    f'with measured latencies, and this run is on {backend} '
                    f'({jax.devices()[0].device_kind}). Drop --pgle/--pgle-profile here.')
  if pgle == 'auto':
    jax.config.update('jax_enable_pgle', True)
    jax.config.update('jax_pgle_profiling_runs', AUTO_PGLE_RUNS)


def pgle_compiler_options(path: str) -> dict:
  """XLA options that make the GPU scheduler use a PGLE profile (it needs the latency-hiding scheduler)."""
  return {PGLE_OPTION: storage.local_copy(path), 'xla_gpu_enable_latency_hiding_scheduler': True}  # XLA reads a local file


class StepProfiler:
  """Starts and stops jax.profiler around a range of steps; extracts a PGLE profile.

  `before(step)` ahead of the step's dispatch, `after(step, outputs)` once it is
  dispatched. After the PGLE range, `after` returns compiler options to rebuild the
  train step with (else None).
  """

  def __init__(self, job_dir: str, log: Callable[[str], None], profile_steps=None,
               pgle_profile: Optional[str] = None, start_step: int = 0):
    self.log = log
    self.ranges = []  # (first, last, directory, purpose)
    if profile_steps:
      self.ranges.append((profile_steps[0], profile_steps[1], layout.profile(job_dir), 'trace'))
    self.pgle_profile = pgle_profile
    self.pgle_options = None
    if pgle_profile:
      if storage.exists(pgle_profile):   # a profile to read (XLA reads it): a regular file, never a FIFO
        if storage.is_local(pgle_profile):
          files.check_regular_file(pgle_profile, '--pgle-profile')
        self.pgle_options = pgle_compiler_options(pgle_profile)
      else:
        first = start_step + PGLE_WARMUP_STEPS + 1
        self._pgle_dir = tempfile.mkdtemp(prefix='paxcli-pgle-')
        self.ranges.append((first, first + PGLE_PROFILE_STEPS - 1, self._pgle_dir, 'pgle'))
    self._active = None

  def before(self, step: int) -> None:
    for first, last, directory, purpose in self.ranges:
      if step == first and self._active is None:
        self._local = storage.working_dir(directory)   # the profiler writes local files only
        jax.profiler.start_trace(self._local)
        self._active = (first, last, directory, purpose)

  def after(self, step: int, outputs) -> Optional[dict]:
    if self._active is None or step != self._active[1]:
      return None
    first, last, directory, purpose = self._active
    jax.block_until_ready(outputs)
    jax.profiler.stop_trace()
    self._active = None
    if purpose == 'trace':
      storage.publish(self._local, directory)
      self.log(f'Profile of steps {first}-{last} written to {directory} ({tensorboard_command()} --logdir '
               f'{directory}).')
      return None
    return self._extract_pgle(self._local, first, last)

  def close(self) -> None:
    if self._active is not None:
      jax.profiler.stop_trace()
      if self._active[3] == 'trace':
        storage.publish(self._local, self._active[2])
      self._active = None

  def _extract_pgle(self, directory: str, first: int, last: int) -> Optional[dict]:
    from jax.experimental import profiler as exp_profiler
    runs = sorted(glob.glob(os.path.join(directory, 'plugins', 'profile', '*')))
    proto = exp_profiler.get_profiled_instructions_proto(runs[-1]) if runs else b''
    if not proto:
      self.log('PGLE: the profile held no GPU instruction latencies; continuing without PGLE.')
      return None
    if storage.is_local(self.pgle_profile):
      files.write_output(self.pgle_profile, proto, 'the PGLE profile')
    else:
      storage.write_bytes(self.pgle_profile, proto)
    shutil.rmtree(directory, ignore_errors=True)
    self.pgle_options = pgle_compiler_options(self.pgle_profile)
    self.log(f'PGLE: profiled steps {first}-{last}, wrote instruction latencies to {self.pgle_profile}; '
             'recompiling the train step with them.')
    return self.pgle_options
