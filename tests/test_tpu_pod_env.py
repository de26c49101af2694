"""The environment JAX reads on a TPU pod (GKE's TPU_WORKER_HOSTNAMES / TPU_WORKER_ID, multislice's
MEGASCALE_*): a partial one is one line, before JAX reads it (paxcli.runtime.distributed).

Where it names several hosts or slices but not this process's place, the command is refused (JAX would
fail on it, or the slices would wait for each other forever); on a machine without a TPU, where JAX reads
none of it, the command says so and runs as one process. A TPU VM is what JAX tests for (libtpu and a
TPU attached): the refusals are checked with that test answered yes, since this machine has no TPU.
"""

import pytest

from conftest import pax_main
from paxcli.errors import UserError
from paxcli.runtime import distributed
from paxcli.runtime import platform

TINY_TRAIN = ['train', '--exp', 'bench.LlamaTiny', '--set', 'NUM_LAYERS=1', '--set', 'MODEL_DIMS=32', '--set',
              'HIDDEN_DIMS=64', '--set', 'NUM_HEADS=2', '--set', 'DIMS_PER_HEAD=16', '--set', 'VOCAB_SIZE=64',
              '--set', 'MAX_SEQ_LEN=16', '--set', 'NUM_TRAIN_STEPS=1', '--set', 'PERCORE_BATCH_SIZE=1']
GKE = {'TPU_WORKER_HOSTNAMES': 'h0,h1,h2,h3', 'TPU_WORKER_ID': '2'}
SLICES = {'MEGASCALE_COORDINATOR_ADDRESS': 'h0', 'MEGASCALE_NUM_SLICES': '2', 'MEGASCALE_SLICE_ID': '1'}


@pytest.mark.parametrize('env', [
    {},
    GKE,
    {'TPU_PROCESS_ADDRESSES': 'h0:8476,h1:8476', 'TPU_WORKER_ID': '1'},
    {**GKE, **SLICES},
    {**GKE, 'MEGASCALE_NUM_SLICES': '1'},
    {'MEGASCALE_NUM_SLICES': '2'},      # a TPU VM's metadata holds the rest (JAX reads it there)
])
def test_complete_environments_pass(env):
  distributed.check_tpu_environment(env, on_tpu=True, log=pytest.fail)


@pytest.mark.parametrize('env, message', [
    ({'TPU_WORKER_HOSTNAMES': 'h0,h1,h2,h3'},
     'TPU_WORKER_HOSTNAMES lists 4 host(s) but TPU_WORKER_ID is not set, so this process cannot tell which one it '
     'is (GKE sets both for every pod of a TPU slice): set TPU_WORKER_ID (0 to 3) on every host.'),
    ({**GKE, 'TPU_WORKER_ID': '4'}, 'TPU_WORKER_ID=4 is out of range: TPU_WORKER_HOSTNAMES lists 4 host(s), so it '
                                    'runs from 0 to 3.'),
    ({**GKE, 'TPU_WORKER_ID': 'two'}, "TPU_WORKER_ID='two' is not a whole number."),
    ({**GKE, **SLICES, 'MEGASCALE_SLICE_ID': ''}, 'MEGASCALE_NUM_SLICES is 2 but MEGASCALE_SLICE_ID is not set'),
    ({**GKE, **SLICES, 'MEGASCALE_SLICE_ID': '2'}, 'MEGASCALE_SLICE_ID=2 is out of range'),
    ({**GKE, **SLICES, 'MEGASCALE_COORDINATOR_ADDRESS': ''},
     'MEGASCALE_NUM_SLICES is 2 but MEGASCALE_COORDINATOR_ADDRESS is not set: each slice would start its own'),
    ({**GKE, 'MEGASCALE_SLICE_ID': '1'}, 'MEGASCALE_SLICE_ID set without MEGASCALE_NUM_SLICES'),
    ({'MEGASCALE_NUM_SLICES': '0'}, "MEGASCALE_NUM_SLICES='0' must be 1 or more"),
])
def test_partial_environments_are_refused_in_one_line(env, message):
  with pytest.raises(UserError) as e:
    distributed.check_tpu_environment(env, on_tpu=True, log=pytest.fail)
  assert message in str(e.value) and '\n' not in str(e.value)


def test_without_a_tpu_the_pod_environment_is_one_line_and_the_run_is_one_process(capsys, monkeypatch, tmp_path):
  for key, value in {**GKE, 'MEGASCALE_NUM_SLICES': '2'}.items():
    monkeypatch.setenv(key, value)
  code, out, err = pax_main([*TINY_TRAIN, '--job-log-dir', str(tmp_path / 'job')], capsys)
  assert code == 0, err
  notes = [line for line in (out + err).splitlines() if 'TPU_WORKER_HOSTNAMES' in line]
  assert notes == ['Note: TPU_WORKER_HOSTNAMES, TPU_WORKER_ID, MEGASCALE_NUM_SLICES are set, but this machine has '
                   'no TPU, so JAX does not read them: running as one process (several processes on CPU or GPU: '
                   '--coordinator, --num-processes and --process-id, or pax launch).']
  assert (tmp_path / 'job').is_dir()


def test_on_a_tpu_vm_a_partial_environment_stops_the_command_before_jax_reads_it(capsys, monkeypatch, tmp_path):
  monkeypatch.setattr(platform, 'tpu_vm', lambda: True)   # JAX's own test for a Cloud TPU VM, answered yes
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'h0,h1')
  monkeypatch.delenv('TPU_WORKER_ID', raising=False)
  code, out, err = pax_main([*TINY_TRAIN, '--job-log-dir', str(tmp_path / 'job')], capsys)
  assert code == 2 and 'TPU_WORKER_HOSTNAMES lists 2 host(s) but TPU_WORKER_ID is not set' in err
  assert len(err.strip().splitlines()) == 1 and not (tmp_path / 'job').exists()


def test_one_process_asked_for_leaves_the_pod_environment_alone(monkeypatch):
  """--num-processes 1 decides: the pod's variables are neither read nor checked."""
  monkeypatch.setattr(platform, 'tpu_vm', lambda: True)
  monkeypatch.setenv('TPU_WORKER_HOSTNAMES', 'h0,h1')
  monkeypatch.delenv('TPU_WORKER_ID', raising=False)
  assert distributed.start(distributed.settings_from(num_processes=1)) is False
