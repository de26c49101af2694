"""TPU slices by name, and compile-only devices of them, for plans compiled by the TPU's own compiler.

`pax bench mfu --compile-only --topology v4-128` compiles the train step for a slice this machine
does not have: libtpu (the `paxcli[tpu]` extra, the version jax names in its own `tpu` extra) makes
compile-only devices of the slice through `jax.experimental.topologies.get_topology_desc`, as
MaxText's train_compile does, and XLA:TPU's memory and cost analyses then count what the slice
would hold and compute. No TPU is needed, and the host's own backend (CPU) stays the default.

Names are Cloud TPU's accelerator types, as `gcloud compute tpus tpu-vm create --accelerator-type`,
Pax's docs and MaxText take them: v4-N and v5p-N count TensorCores (two per chip, one megacore
device per chip: v4-8 is 4 devices), v5e-N (or v5litepod-N) and v6e-N count chips (one device
each). `--num-slices 2` joins two such slices over DCN (multislice), as MaxText's
compile_topology_num_slices and `pax import-maxtext --num-slices` do. The chip layout of each name is
Cloud TPU's: the powers of two below 64 chips, then multiples of the 4x4x4 cube with wraparound
links (v4, v5p); 1 to 256 chips as 2D meshes (v5e, v6e).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import math
import os
import re
from typing import Optional

from paxcli.errors import UserError, did_you_mean
from paxcli.runtime import platform

# jax is imported where the devices are made: `pax launch --k8s` reads slice names here in a launcher
# that never starts JAX.

GIB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Generation:
  topology: str          # libtpu's name in a topology string ('v5' for v5p)
  cores_per_chip: int    # in the accelerator type's count (v4-8: 8 TensorCores on 4 chips)
  megacore: bool         # a chip's two cores are one device
  hbm_gib: int           # memory per chip (per device)


GENERATIONS = {
    'v4': Generation('v4', 2, True, 32),
    'v5p': Generation('v5', 2, True, 95),
    'v5e': Generation('v5e', 1, False, 16),
    'v5litepod': Generation('v5e', 1, False, 16),   # the same chips under GCP's other name
    'v6e': Generation('v6e', 1, False, 32),
}
# Slices below the 4x4x4 cube (v4, v5p) and every 2D slice (v5e, v6e): chips -> chip layout.
SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
SLICES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}
NAME = re.compile(r'([a-z0-9]+)-(\d+)')


@dataclasses.dataclass(frozen=True)
class Slice:
  """A TPU slice (or `num_slices` of them) to compile for."""
  name: str                       # one slice's accelerator type, e.g. 'v4-128'
  generation: str                 # 'v4', 'v5p', 'v5e', 'v6e'
  shape: tuple[int, ...]          # chips along each axis of one slice
  wrap: tuple[bool, bool, bool]   # wraparound links along each axis
  num_slices: int = 1

  @property
  def chips(self) -> int:
    return math.prod(self.shape)

  @property
  def num_devices(self) -> int:
    return self.chips * self.num_slices

  @property
  def topology_name(self) -> str:
    return f'{GENERATIONS[self.generation].topology}:' + 'x'.join(str(d) for d in self.shape)

  @property
  def memory_bytes(self) -> int:
    return GENERATIONS[self.generation].hbm_gib * GIB

  def describe_option(self) -> str:
    return self.name + (f' --num-slices {self.num_slices}' if self.num_slices > 1 else '')

  def describe(self) -> str:
    slices = f'{self.num_slices} x ' if self.num_slices > 1 else ''
    return f'{slices}{self.name} ({"x".join(str(d) for d in self.shape)}, {self.num_devices} devices)'


def parse(name: str, num_slices: int = 1) -> Slice:
  """The slice a name stands for, or a UserError in one line naming the close valid names."""
  text = name.strip().lower()
  match = NAME.fullmatch(text)
  gen = GENERATIONS.get(match.group(1)) if match else None
  if gen is None:
    raise UserError(f'--topology {name!r} is not a TPU slice name (v4-N, v5p-N, v5e-N or v5litepod-N, '
                    f'v6e-N).{did_you_mean(text, example_names())}')
  if num_slices < 1:
    raise UserError(f'--num-slices must be at least 1, got {num_slices}.')
  generation, count = match.group(1), int(match.group(2))
  chips, rest = divmod(count, gen.cores_per_chip)
  shape = _layout(generation, chips) if not rest else None
  if shape is None:
    valid = [f'{generation}-{n}' for n in _valid_counts(generation, count)]
    nearest = f'the nearest are {valid[0]} and {valid[1]}' if len(valid) == 2 else f'the nearest is {valid[0]}'
    raise UserError(f'--topology {name!r}: {generation} slices come as {_sizes_text(generation)}; {nearest}.')
  return Slice(f'{generation}-{count}', 'v5e' if generation == 'v5litepod' else generation, shape, _wrap(shape),
               num_slices)


def _layout(generation: str, chips: int) -> Optional[tuple[int, ...]]:
  """Cloud TPU's chip layout of a slice of `chips` chips, None where there is no such slice."""
  if GENERATIONS[generation].cores_per_chip == 1:
    return SLICES_2D.get(chips)
  if chips in SMALL_3D:
    return SMALL_3D[chips]
  if chips < 64 or chips % 64:
    return None
  cubes = chips // 64     # the most even split into three factors: the smallest largest, then largest smallest
  best = min(((a, b, cubes // (a * b)) for a in range(1, cubes + 1) for b in range(a, cubes + 1)
              if cubes % (a * b) == 0 and cubes // (a * b) >= b), key=lambda t: (t[2], -t[0]))
  return tuple(4 * f for f in best)


def _wrap(shape: tuple[int, ...]) -> tuple[bool, bool, bool]:
  """Wraparound links: a v4/v5p axis of a full cube (4 chips or more, from 64 chips up); a 2D axis of 16."""
  if len(shape) == 3:
    return (math.prod(shape) >= 64,) * 3
  return (shape[0] == 16, shape[1] == 16, False)


def _valid_counts(generation: str, count: int) -> list[int]:
  """The one or two valid counts nearest `count` (in the name's unit: cores or chips)."""
  per_chip = GENERATIONS[generation].cores_per_chip
  if per_chip == 1:
    counts = sorted(SLICES_2D)
  else:
    counts = [c * per_chip for c in SMALL_3D] + [64 * k * per_chip for k in range(1, max(count // 128, 1) + 2)]
  below = [c for c in counts if c < count]
  above = [c for c in counts if c > count]
  return ([below[-1]] if below else []) + ([above[0]] if above else [])


def _sizes_text(generation: str) -> str:
  if GENERATIONS[generation].cores_per_chip == 1:
    return ', '.join(str(c) for c in SLICES_2D) + ' chips'
  return '8, 16, 32 or 64 TensorCores, then multiples of 128 (two per chip)'


def example_names() -> list[str]:
  """Names to suggest: every 2D slice and the common v4/v5p sizes."""
  names = [f'{g}-{c}' for g in ('v5e', 'v5litepod', 'v6e') for c in SLICES_2D]
  return names + [f'{g}-{c}' for g in ('v4', 'v5p') for c in (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)]


def check_mesh(tpu: Slice, ici, dcn) -> None:
  """ICI_MESH_SHAPE x DCN_MESH_SHAPE against the slice(s): one line where they do not fit it (a -1 in
  ICI_MESH_SHAPE fills what the slice has)."""
  slices = math.prod(dcn) if dcn else 1
  if slices != tpu.num_slices:
    fix = (f'add --num-slices {slices}' if slices > 1 else
           f'set DCN_MESH_SHAPE to {tpu.num_slices} slices (e.g. [{tpu.num_slices}, 1, 1])')
    raise UserError(f'DCN_MESH_SHAPE {list(dcn) if dcn else None} makes {slices} slice(s), but --topology '
                    f'{tpu.describe_option()} is {tpu.num_slices}: {fix}.')
  ici = list(ici) if ici is not None else [1, -1, 1]
  known = math.prod(s for s in ici if s != -1) * slices
  if (known != tpu.num_devices) if -1 not in ici else (tpu.num_devices % known):
    needs = f'needs {known}' if -1 not in ici else f'needs a multiple of {known}'
    raise UserError(f'The mesh ICI_MESH_SHAPE {ici} x DCN_MESH_SHAPE {list(dcn) if dcn else [1, 1, 1]} {needs} '
                    f'devices, but --topology {tpu.describe_option()} has {tpu.num_devices} ({tpu.describe()}): '
                    f'make them multiply to {tpu.num_devices}.')


def libtpu_env(platform_env: dict) -> dict[str, str]:
  """What an experiment's PLATFORM_ENV sets for TPUs that reaches the TPU compiler here: LIBTPU_INIT_ARGS
  (libtpu reads it when it loads). Its XLA_FLAGS would reach the host's CPU backend, which aborts on
  TPU flags, so they are left out."""
  value = ((platform_env or {}).get('tpu') or {}).get('LIBTPU_INIT_ARGS')
  return {'LIBTPU_INIT_ARGS': value} if value else {}


def libtpu_version() -> Optional[str]:
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return None


def libtpu_for_jax() -> Optional[str]:
  """The libtpu requirement of the installed jax's `tpu` extra, e.g. 'libtpu==0.0.42.*'."""
  for req in importlib.metadata.requires('jax') or []:
    spec = req.split(';', 1)[0].strip()
    if spec.startswith('libtpu') and 'extra == "tpu"' in req:
      return spec.replace(' ', '')
  return None


def check_libtpu(log) -> str:
  """'libtpu X' when installed; a UserError with the install line when not. A libtpu other than the
  one jax was released with is said in one line (its compiler may count differently, or not load)."""
  version, wanted = libtpu_version(), libtpu_for_jax()
  import jax
  if version is None:
    pin = f' ({wanted}, the one jax {jax.__version__} names)' if wanted else ''
    raise UserError(f"--topology compiles with the TPU's compiler, libtpu, which is not installed here: "
                    f"pip install 'paxcli[tpu]'{pin}.")
  if wanted and not _matches(version, wanted.split('==', 1)[-1]):
    log(f"Note: libtpu {version} is installed; jax {jax.__version__} was released with {wanted}. "
        f"If the compile fails or counts oddly: pip install '{wanted}'.")
  return f'libtpu {version}'


def _matches(version: str, pattern: str) -> bool:
  """'0.0.42.1' against '0.0.42.*' (or an exact version)."""
  if pattern.endswith('.*'):
    return version == pattern[:-2] or version.startswith(pattern[:-1])
  return version == pattern


@contextlib.contextmanager
def _libtpu_load_env(tpu: Slice):
  """The environment libtpu loads in, on a machine that is not a TPU VM, set for the load and restored
  after. libtpu asks it for the VM's accelerator type and workers and logs an error line for each it
  misses (they do not change a compile-only topology: named here as the slice planned and this host);
  and it takes a lock file (/tmp/libtpu_lockfile) that guards the chips of a TPU VM, which would stop a
  second plan running beside the first on the same machine (ALLOW_MULTIPLE_LIBTPU_LOAD lifts it; there
  are no chips to guard)."""
  given = {'TPU_ACCELERATOR_TYPE': tpu.name, 'TPU_WORKER_HOSTNAMES': 'localhost'}
  if not platform.tpu_attached():
    given['ALLOW_MULTIPLE_LIBTPU_LOAD'] = '1'
  added = [k for k in given if k not in os.environ]
  for k in added:
    os.environ[k] = given[k]
  try:
    yield
  finally:
    for k in added:
      os.environ.pop(k, None)


def compile_devices(tpu: Slice) -> list:
  """Compile-only devices of the slice (jax.experimental.topologies), in libtpu's order."""
  from jax.experimental import topologies
  bounds = (1, 1, 1) if tpu.chips == 1 else (2, 2, 1)   # chips per host, as Cloud TPU's VMs have them
  config = 'megacore' if GENERATIONS[tpu.generation].megacore else 'default'
  try:
    with _libtpu_load_env(tpu):
      topo = topologies.get_topology_desc(platform='tpu', topology_name=tpu.topology_name, chip_config_name=config,
                                          chips_per_host_bounds=bounds, num_slices=tpu.num_slices, wrap=tpu.wrap)
  except Exception as e:  # libtpu's own errors (a libtpu that cannot load, a topology it refuses)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(f'libtpu could not make the {tpu.describe()} topology: {first}') from None
  devices = list(topo.devices)
  if len(devices) != tpu.num_devices:
    raise UserError(f'libtpu made {len(devices)} devices for {tpu.describe()}, not {tpu.num_devices}.')
  return devices
