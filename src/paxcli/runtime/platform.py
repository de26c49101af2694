"""The platform JAX will run on, and the environment an experiment asks for on it.

Everything here runs before JAX starts a backend (XLA reads its flags once, at start-up),
so nothing here imports jax: the platform is read from JAX_PLATFORMS or the installed
plugins.
"""

from __future__ import annotations

import glob
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


# PCI device ids of TPU chips under Google's vendor id (0x1ae0), as JAX counts chips
# (jax._src.hardware_utils): v3, an unnamed one, v4, v5p, v5e, v6e, TPU7x. Other Google devices
# (the gVNIC network card of any Cloud VM) share the vendor id.
GOOGLE_PCI_VENDOR = '0x1ae0'
TPU_PCI_DEVICES = ('0x0027', '0x0056', '0x005e', '0x0062', '0x0063', '0x006f', '0x0076')


def detect_platform() -> str:
  """'cpu', 'gpu' or 'tpu' (or what JAX_PLATFORMS names first), without starting a backend. libtpu
  alone is not a TPU: it is also installed to compile for TPUs elsewhere (`pax bench mfu --topology`)."""
  explicit = os.environ.get('JAX_PLATFORMS', '').split(',')[0].strip().lower()
  if explicit:
    return 'gpu' if explicit in ('cuda', 'rocm', 'gpu') else explicit
  if tpu_vm():
    return 'tpu'
  if _has_gpu_plugin():
    return 'gpu'
  return 'cpu'


def tpu_vm() -> bool:
  """What JAX calls running in a Cloud TPU VM (jax._src.cloud_tpu_init): libtpu installed and a TPU attached.
  Only there does JAX read a TPU pod's environment (its cluster detection)."""
  return _has_libtpu() and tpu_attached()


def _has_libtpu() -> bool:
  return importlib.util.find_spec('libtpu') is not None


def _has_gpu_plugin() -> bool:
  for plugin in ('jax_cuda13_plugin', 'jax_cuda12_plugin', 'jax_plugins.xla_cuda12'):
    try:
      if importlib.util.find_spec(plugin) is not None:
        return True
    except ModuleNotFoundError:
      continue
  return False


def tpu_attached() -> bool:
  """A TPU chip on this machine: the device files libtpu opens (/dev/accel*, /dev/vfio/N), or a TPU
  among the PCI devices (a container may show one and not the other)."""
  if glob.glob('/dev/accel*') or any(name.isdigit() for name in _listdir('/dev/vfio')):
    return True
  for vendor in glob.glob('/sys/bus/pci/devices/*/vendor'):
    if _read(vendor) == GOOGLE_PCI_VENDOR and _read(os.path.join(os.path.dirname(vendor), 'device')) in TPU_PCI_DEVICES:
      return True
  return False


def _listdir(path: str) -> list[str]:
  try:
    return os.listdir(path)
  except OSError:
    return []


def _read(path: str) -> str:
  try:
    with open(path, encoding='ascii', errors='replace') as f:
      return f.read(64).strip()
  except OSError:
    return ''


def cpu_without_tpu() -> None:
  """JAX_PLATFORMS=cpu where libtpu is installed but the machine has no TPU (and no GPU plugin), unless
  JAX_PLATFORMS is set. JAX would load libtpu there only to find no chip, printing five lines of libtpu
  warnings, and then run on the CPU: this goes there directly. Runs before JAX starts a backend."""
  if os.environ.get('JAX_PLATFORMS') or not _has_libtpu() or _has_gpu_plugin() or tpu_attached():
    return
  os.environ['JAX_PLATFORMS'] = 'cpu'


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
