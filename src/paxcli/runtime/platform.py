"""The platform JAX will run on, and the environment an experiment asks for on it.

Everything here runs before JAX starts a backend (XLA reads its flags once, at start-up),
so nothing here imports jax: the platform is read from JAX_PLATFORMS or the installed
plugins.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from paxcli.errors import UserError

# XLA flags for GPUs as NVIDIA's JAX-Toolbox images and MaxText's GPU scripts set them: the
# latency-hiding scheduler (overlaps collectives with compute; PGLE needs it) and a
# high-priority stream for async collectives. Each applies only where XLA_FLAGS does not
# name that flag already.
GPU_XLA_FLAGS = ('--xla_gpu_enable_latency_hiding_scheduler=true',
                 '--xla_gpu_enable_highest_priority_async_stream=true')


def apply_platform_env(knob_env: dict[str, dict[str, str]], log=print) -> None:
  """Sets PLATFORM_ENV variables for the platform jax will use, before jax starts.

  The platform is read without starting a backend: JAX_PLATFORMS if set, else the
  installed plugins (libtpu, CUDA). Flags for another platform are never applied:
  TPU flags in XLA_FLAGS abort jax on CPU.
  """
  platform = detect_platform()
  for key, value in ((knob_env or {}).get(platform) or {}).items():
    if key == 'XLA_FLAGS' and os.environ.get('XLA_FLAGS'):
      value = os.environ['XLA_FLAGS'] + ' ' + value
    os.environ[key] = value
    log(f'Set {key} for platform {platform}.')
  if platform == 'gpu':
    _default_xla_flags(GPU_XLA_FLAGS, log)


def _default_xla_flags(flags, log) -> None:
  current = os.environ.get('XLA_FLAGS', '')
  named = {f.split('=', 1)[0] for f in current.split()}
  added = [f for f in flags if f.split('=', 1)[0] not in named]
  if added:
    os.environ['XLA_FLAGS'] = ' '.join([current] + added).strip()
    log(f'XLA_FLAGS: added GPU defaults {" ".join(added)}')


def detect_platform() -> str:
  """'cpu', 'gpu' or 'tpu' (or what JAX_PLATFORMS names first), without starting a backend."""
  explicit = os.environ.get('JAX_PLATFORMS', '').split(',')[0].strip().lower()
  if explicit:
    return 'gpu' if explicit in ('cuda', 'rocm', 'gpu') else explicit
  if importlib.util.find_spec('libtpu') is not None:
    return 'tpu'
  for plugin in ('jax_cuda13_plugin', 'jax_cuda12_plugin', 'jax_plugins.xla_cuda12'):
    try:
      if importlib.util.find_spec(plugin) is not None:
        return 'gpu'
    except ModuleNotFoundError:
      continue
  return 'cpu'


def host_memory_bytes() -> int | None:
  """This machine's physical memory in bytes (None where the system does not say)."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return None


def check_supported(experiment) -> None:
  """Refuses an experiment that lists UNSUPPORTED_FEATURES: training it would train another model."""
  unsupported = getattr(experiment, 'UNSUPPORTED_FEATURES', None) or {}
  if unsupported:
    items = '; '.join(f'{k}: {v}' for k, v in unsupported.items())
    raise UserError(f'{type(experiment).__name__} needs features paxcli cannot honour ({items}). '
                    'Training it would train a different model. To accept that, run with '
                    '--set UNSUPPORTED_FEATURES={}.')


def fake_cpu_devices(n: int, option: str = '--num-devices') -> None:
  """N fake CPU devices for this process (XLA_FLAGS, JAX_PLATFORMS=cpu), before jax starts a backend.

  A backend already started with n CPU devices is accepted; any other refused. jax is looked
  at only when something imported it already: importing it here would cost its start-up.
  """
  jax = sys.modules.get('jax')
  if jax is not None:
    if jax._src.xla_bridge.backends_are_initialized():
      if len(jax.devices()) == n and jax.default_backend() == 'cpu':
        return
      raise UserError(f'{option} {n}: jax already started with {len(jax.devices())} devices in this process.')
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split()
           if not f.startswith('--xla_force_host_platform_device_count')]
  os.environ['XLA_FLAGS'] = ' '.join(flags + [f'--xla_force_host_platform_device_count={n}'])
  os.environ['JAX_PLATFORMS'] = 'cpu'


def device_memory_bytes(device=None) -> tuple[int | None, str]:
  """(bytes a device can hold, where that figure comes from)."""
  import jax  # here, not at the top: this module sets the environment before XLA starts
  device = device or jax.devices()[0]
  try:
    stats = device.memory_stats() or {}
  except Exception:
    stats = {}
  if stats.get('bytes_limit'):
    return int(stats['bytes_limit']), 'memory_stats bytes_limit'
  if device.platform == 'cpu':
    total = host_memory_bytes()
    if total is None:
      return None, 'unknown'
    n = len(jax.local_devices())
    return total // n, f'host RAM / {n} devices' if n > 1 else 'host RAM'
  return None, 'unknown'
