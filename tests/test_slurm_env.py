"""SLURM's environment as paxcli reads it, and the sbatch script `pax launch --slurm` writes: no daemons here
(test_slurm.py runs the same on real ones), so these stay in the default suite."""

import os
import subprocess
import sys

import pytest

from conftest import pax_main
from paxcli.errors import UserError
from paxcli.jobdir import ledger
from paxcli.runtime import distributed
from paxcli.runtime import slurm

STEP = {'SLURM_JOB_ID': '4242', 'SLURM_STEP_ID': '0', 'SLURM_STEP_NODELIST': 'gpu[07-08]', 'SLURM_NTASKS': '2',
        'SLURM_PROCID': '0', 'SLURM_LOCALID': '0', 'SLURM_NODEID': '0', 'SLURM_STEP_TASKS_PER_NODE': '1(x2)'}
SALLOC = {'SLURM_JOB_ID': '4242', 'SLURM_NTASKS': '2', 'SLURM_JOB_NUM_NODES': '2', 'SLURM_NODELIST': 'gpu[07-08]'}


def test_steps_of_one_job_take_distinct_coordinator_ports_in_jaxs_range():
  ports = {slurm.coordinator_port(dict(STEP, SLURM_STEP_ID=str(step))) for step in range(slurm.STEPS_PER_JOB)}
  assert len(ports) == slurm.STEPS_PER_JOB and all(61440 <= p <= 65535 for p in ports)
  assert slurm.coordinator(STEP) == f'gpu07:{slurm.coordinator_port(STEP)}'
  assert slurm.coordinator_port(dict(STEP, SLURM_STEP_RESV_PORTS='12011-12012')) == 12011   # SLURM's own
  assert slurm.coordinator_port(dict(STEP, JAX_COORDINATOR_PORT='5555', SLURM_STEP_RESV_PORTS='12011')) == 5555


@pytest.mark.parametrize('nodelist, first', [('node1', 'node1'), ('node1,node2', 'node1'), ('gpu[07-08]', 'gpu07'),
                                             ('n[3,9-12],login1', 'n3'), ('a-b[001-004]', 'a-b001')])
def test_first_node_of_a_node_list(nodelist, first):
  assert slurm.first_node(nodelist) == first


def test_tasks_per_node():
  assert [slurm.tasks_per_node('4(x2),3', i) for i in range(4)] == [4, 4, 3, None]
  assert slurm.tasks_per_node('2', 0) == 2 and slurm.tasks_per_node('garbage', 0) is None


def test_devices_of_a_task():
  """A process per node drives every GPU it sees; tasks bound to their own GPUs (--gpus-per-task) every GPU they
  see; 8 GPUs visible to 4 tasks: 2 each; 8 visible to 8 tasks (a process per GPU): JAX's own choice."""
  per_node = dict(STEP, CUDA_VISIBLE_DEVICES='0,1,2,3,4,5,6,7')
  assert slurm.local_device_ids(per_node) == []
  per_gpu = dict(per_node, SLURM_STEP_TASKS_PER_NODE='8(x2)', SLURM_LOCALID='3')
  assert slurm.local_device_ids(per_gpu) is None
  assert slurm.local_device_ids(dict(per_gpu, SLURM_STEP_TASKS_PER_NODE='4(x2)')) == [6, 7]
  bound = dict(per_gpu, CUDA_VISIBLE_DEVICES='3', SLURM_GPUS_PER_TASK='1')
  assert slurm.local_device_ids(bound) == []


def test_partial_environments_are_one_line_or_refused_with_the_srun_line():
  assert slurm.partial_step({}, 'pax train') is None
  assert slurm.partial_step(STEP, 'pax train') is None
  with pytest.raises(UserError) as refused:
    slurm.partial_step(SALLOC, 'pax train --exp E')
  assert 'a shell in SLURM job 4242 (salloc)' in str(refused.value)
  assert 'SLURM_NTASKS=2 on 2 node(s)' in str(refused.value)
  assert 'srun pax train --exp E' in str(refused.value)
  batch = dict(SALLOC, SLURM_NTASKS='1', SLURM_PROCID='0', SLURM_LOCALID='0')
  assert slurm.partial_step(batch, 'pax train') == (
      'Note: the batch script of SLURM job 4242 has 1 task and no job step (no SLURM_STEP_NODELIST): running as '
      'one process; srun starts one per task.')


def test_pax_train_in_an_salloc_shell_is_refused_before_anything_is_made(capsys, monkeypatch, tmp_path):
  for key, value in SALLOC.items():
    monkeypatch.setenv(key, value)
  monkeypatch.chdir(tmp_path)
  code, _, err = pax_main(['train', '--set', 'NUM_LAYERS=1'], capsys)
  assert code == 2
  assert 'srun pax train --set NUM_LAYERS=1' in err and 'Traceback' not in err
  assert os.listdir(tmp_path) == []
  said = []   # --num-processes 1: one process on purpose, nothing said
  assert distributed.start(distributed.settings_from(num_processes=1), log=said.append, command='pax train') is False
  assert said == []


def test_heartbeat_timeout_from_the_environment_is_checked():
  assert distributed.settings_from(environ={'PAX_HEARTBEAT_TIMEOUT': '12.5'}).heartbeat_timeout == 12.5
  assert distributed.settings_from(heartbeat_timeout=30, environ={'PAX_HEARTBEAT_TIMEOUT': '5'}).heartbeat_timeout == 30
  with pytest.raises(UserError, match='PAX_HEARTBEAT_TIMEOUT=.soon. is not a number of seconds'):
    distributed.settings_from(environ={'PAX_HEARTBEAT_TIMEOUT': 'soon'})
  env = distributed.child_environment({}, '127.0.0.1:1', 2, 1, heartbeat_timeout=20)
  assert env['PAX_HEARTBEAT_TIMEOUT'] == '20'


def test_the_ledger_records_slurms_job_and_requeue(monkeypatch):
  monkeypatch.setenv('SLURM_JOB_ID', '77')
  monkeypatch.setenv('SLURM_RESTART_COUNT', '2')
  fields = ledger.start_fields(1.0, 0, 2)
  assert fields['slurm_job'] == '77' and fields['requeue'] == 2
  [inc] = ledger.incarnations([{'kind': 'start', 'inc': 'a', **fields}])
  assert inc.slurm == ('77', 2)


# ---- pax launch --slurm ------------------------------------------------------------------------------


def test_dry_run_prints_the_script_and_writes_nothing(capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  code, out, err = pax_main(['launch', '--slurm', '--nodes', '4', '--gpus-per-node', '8', '--time', '4:00:00',
                             '--partition', 'gpu', '--sbatch-option=--qos=high', '--env', 'NCCL_DEBUG=WARN',
                             '--max-restarts', '2', '--dry-run', '--', 'train', '--exp', 'lm_cloud.LmCloudSpmdTest',
                             '--job_log_dir', 'runs/a b'], capsys)
  assert code == 2   # a path with a space cannot go on an #SBATCH line
  assert 'cannot hold spaces' in err
  code, out, err = pax_main(['launch', '--slurm', '--nodes', '4', '--gpus-per-node', '8', '--time', '4:00:00',
                             '--partition', 'gpu', '--sbatch-option=--qos=high', '--env', 'NCCL_DEBUG=WARN',
                             '--max-restarts', '2', '--dry-run', '--', 'train', '--exp', 'lm_cloud.LmCloudSpmdTest',
                             '--job_log_dir', 'runs/a'], capsys)
  assert code == 0, err
  job = os.path.realpath(tmp_path / 'runs' / 'a')
  for line in ('#SBATCH --nodes=4', '#SBATCH --ntasks-per-node=1', '#SBATCH --gpus-per-node=8',
               '#SBATCH --time=4:00:00', '#SBATCH --partition=gpu', f'#SBATCH --chdir={os.path.realpath(tmp_path)}',
               f'#SBATCH --output={job}/slurm/%x-%j.out', '#SBATCH --requeue', '#SBATCH --signal=USR1@120',
               '#SBATCH --qos=high', 'export NCCL_DEBUG=WARN'):
    assert line + '\n' in out, line
  assert (f'srun --export=ALL {sys.executable} -m paxcli.cli.app train --exp lm_cloud.LmCloudSpmdTest '
          f'--job-log-dir {job}\n') in out
  assert 'if [ $failed -gt 2 ]; then' in out and '138|143)' in out and '2|3|130)' in out
  assert not (tmp_path / 'runs').exists()
  script = tmp_path / 's.sh'
  script.write_text(out)
  assert subprocess.run(['bash', '-n', str(script)], capture_output=True).returncode == 0


def test_the_script_is_written_into_the_job_directory_with_the_default_experiment(capsys, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  code, out, err = pax_main(['launch', '--slurm', '--nodes', '2', '--devices-per-process', '4', '--heartbeat-timeout',
                             '30', '--', 'train'], capsys)
  assert code == 0, err
  path = tmp_path / 'runs' / 'default.StdlibDocsLm' / 'slurm' / 'pax-train.sbatch'
  assert f'Wrote {os.path.realpath(path)}' in out and os.access(path, os.X_OK)
  text = path.read_text()
  assert 'export XLA_FLAGS=--xla_force_host_platform_device_count=4\n' in text
  assert 'export PAX_HEARTBEAT_TIMEOUT=30\n' in text
  monkeypatch.setenv('PATH', str(tmp_path))   # no sbatch here
  code, _, err = pax_main(['launch', '--slurm', '--nodes', '2', '--submit', '--', 'train'], capsys)
  assert code == 2 and 'sbatch is not on PATH here' in err


@pytest.mark.parametrize('argv, message', [
    (['--slurm', '--', 'train'], '--slurm needs --nodes N'),
    (['--slurm', '--nodes', '2', '--processes', '2', '--', 'train'], '--processes does not go with this launch'),
    (['--slurm', '--nodes', '2', '--port', '9', '--grace', '1', '--exit-wait', '5', '--', 'train'],
     '--port, --grace, --exit-wait do not go'),
    (['--processes', '2', '--nodes', '2', '--', 'train'], '--nodes does not go with this launch: those options go '
                                                          'with --slurm'),
    (['--', 'train'], 'Give --processes N (local processes), or --slurm --nodes N'),
    (['--slurm', '--nodes', '2', '--partition', 'a;b', '--', 'train'], "--partition 'a;b'"),
    (['--slurm', '--nodes', '2', '--time', 'soon', '--', 'train'], "--time 'soon' is not a SLURM time limit"),
    (['--slurm', '--nodes', '2', '--env', 'A', '--', 'train'], "--env 'A': give KEY=VALUE"),
    (['--slurm', '--nodes', '2', '--sbatch-option', '--x\n#SBATCH --y', '--', 'train'], 'one sbatch option on one'),
    (['--slurm', '--nodes', '2', '--gpus-per-node', '8', '--devices-per-process', '2', '--', 'train'],
     '--devices-per-process sets fake CPU devices'),
    (['--slurm', '--nodes', '2', '--', 'describe'], '`pax describe` cannot run as several processes'),
])
def test_launch_refusals_are_one_line(capsys, argv, message):
  code, _, err = pax_main(['launch', *argv], capsys)
  assert code == 2 and message in ' '.join(err.split()), err
