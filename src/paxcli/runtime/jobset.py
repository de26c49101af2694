"""A JobSet manifest (Kubernetes, jobset.x-k8s.io/v1alpha2) that runs one pax command on a TPU slice on GKE.

`pax launch --k8s` writes it. One replicated job per slice (`replicas`: the number of slices), one pod
per TPU host (`parallelism` = `completions` = the slice's hosts), every pod running the same command, as
`gcloud compute tpus tpu-vm ssh --worker=all` does on TPU VMs. GKE gives each pod of a slice the
environment JAX reads there (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID: its webhook sets them for an indexed
job asking for google.com/tpu); across slices the manifest sets MEGASCALE_* from JobSet's own pod
annotations. The command needs no --coordinator: JAX detects the cluster (paxcli.runtime.distributed). The layout follows the
JobSet project's own TPU multislice example: exclusive placement of each slice on one node pool, host
networking, the slice's accelerator and topology as node selectors, `google.com/tpu` chips per host.

A failure of any pod fails the JobSet, which restarts every slice (`failurePolicy.maxRestarts`): a
synchronous training job cannot go on without one of its hosts, and `pax train` resumes from the newest
checkpoint. Pods get `termination_grace` seconds between SIGTERM and SIGKILL, for the save paxcli
makes on SIGTERM.
"""

from __future__ import annotations

import re
import shlex
from typing import Optional

import yaml

from paxcli.errors import UserError
from paxcli.runtime.topology import Slice

API_VERSION = 'jobset.x-k8s.io/v1alpha2'
# GKE's node label values for each generation (cloud.google.com/gke-tpu-accelerator).
GKE_ACCELERATOR = {'v4': 'tpu-v4-podslice', 'v5p': 'tpu-v5p-slice', 'v5e': 'tpu-v5-lite-podslice',
                   'v6e': 'tpu-v6e-slice'}
# Across slices, each process's MEGASCALE_* (what JAX and libtpu read to join the slices over DCN) from
# the annotations JobSet puts on every pod: the coordinator's address (spec.coordinator), the number of
# slices (the replicated job's replicas) and this pod's slice (its job's index).
MEGASCALE_FROM_JOBSET = (('MEGASCALE_COORDINATOR_ADDRESS', 'jobset.sigs.k8s.io/coordinator'),
                         ('MEGASCALE_NUM_SLICES', 'jobset.sigs.k8s.io/replicatedjob-replicas'),
                         ('MEGASCALE_SLICE_ID', 'jobset.sigs.k8s.io/job-index'))
NAME = re.compile(r'[a-z]([-a-z0-9]*[a-z0-9])?')
MAX_NAME = 40   # JobSet names its pods <name>-slice-<job>-<pod>-<5 random>: 63 characters at most


def chips_per_host(tpu: Slice) -> int:
  """Chips of one GKE TPU node: 4 (v4, v5p, and multi-host v5e/v6e), 8 for a single-host 2x4 v5e/v6e,
  1 for a 1x1 slice."""
  if tpu.chips == 1:
    return 1
  if len(tpu.shape) == 2 and tpu.chips == 8:
    return 8
  return 4


def default_name(command: list[str]) -> str:
  """'pax-<experiment>' from the command's --exp (lower case, other characters as '-'), else 'pax-<command>'."""
  exp = next((command[i + 1] for i, a in enumerate(command[:-1]) if a == '--exp'), None)
  exp = exp or next((a.split('=', 1)[1] for a in command if a.startswith('--exp=')), None)
  stem = re.sub(r'[^a-z0-9]+', '-', (exp or command[0]).lower()).strip('-')
  return ('pax-' + stem)[:MAX_NAME].rstrip('-')


def check_name(name: str) -> str:
  if not NAME.fullmatch(name) or len(name) > MAX_NAME:
    raise UserError(f'--name {name!r}: a JobSet name is lower-case letters, digits and "-", starting with a letter '
                    f'and ending with a letter or digit, at most {MAX_NAME} characters (JobSet adds its pod suffixes).')
  return name


def job_dir_note(command: list[str]) -> Optional[str]:
  """A line when the command's job directory is not in a bucket: pods share no disk, and a restarted pod
  may land on another node."""
  value = next((command[i + 1] for i, a in enumerate(command[:-1]) if a == '--job-log-dir'), None)
  value = value or next((a.split('=', 1)[1] for a in command if a.startswith('--job-log-dir=')), None)
  if value is None:
    return ('Note: the command names no --job-log-dir; each pod would write ./runs/... on its own disk, lost '
            'with the pod. Give --job-log-dir gs://BUCKET/PATH (Job directories in a bucket).')
  if '://' not in value:
    return (f'Note: --job-log-dir {value} is a path on each pod\'s own disk unless the image mounts shared storage '
            'there; a bucket (gs://BUCKET/PATH) is what every pod, and a restarted one, sees.')
  return None


def manifest(tpu: Slice, command: list[str], image: str, name: str, max_restarts: int = 0,
             termination_grace: int = 300, env: Optional[dict[str, str]] = None) -> dict:
  """The JobSet as a dict (written out as YAML by the caller). `command`: the pax arguments, e.g.
  ['train', '--exp', 'E', '--job-log-dir', 'gs://b/run']."""
  hosts, per_host = tpu.chips // chips_per_host(tpu), chips_per_host(tpu)
  container = {
      'name': 'pax',
      'image': image,
      'command': ['pax', *command],
      'securityContext': {'privileged': True},   # the TPU devices, on GKE versions before 1.28
      'resources': {'limits': {'google.com/tpu': per_host}},
  }
  variables = [{'name': k, 'value': v} for k, v in (env or {}).items()]
  if tpu.num_slices > 1:
    variables += [{'name': k, 'valueFrom': {'fieldRef': {'fieldPath': f"metadata.annotations['{a}']"}}}
                  for k, a in MEGASCALE_FROM_JOBSET]
  if variables:
    container['env'] = variables
  pod = {
      'restartPolicy': 'Never',   # a failed pod fails its job, and the JobSet restarts every slice
      'hostNetwork': True,
      'dnsPolicy': 'ClusterFirstWithHostNet',
      'terminationGracePeriodSeconds': termination_grace,
      'nodeSelector': {'cloud.google.com/gke-tpu-accelerator': GKE_ACCELERATOR[tpu.generation],
                       'cloud.google.com/gke-tpu-topology': 'x'.join(str(d) for d in tpu.shape)},
      'containers': [container],
  }
  job = {'parallelism': hosts, 'completions': hosts, 'backoffLimit': 0, 'template': {'spec': pod}}
  spec = {
      'failurePolicy': {'maxRestarts': max_restarts},
      'replicatedJobs': [{'name': 'slice', 'replicas': tpu.num_slices, 'template': {'spec': job}}],
  }
  if tpu.num_slices > 1:   # JobSet names the first pod of slice 0 in an annotation: the multislice coordinator
    spec['coordinator'] = {'replicatedJob': 'slice', 'jobIndex': 0, 'podIndex': 0}
  return {
      'apiVersion': API_VERSION,
      'kind': 'JobSet',
      'metadata': {'name': name,
                   'annotations': {'alpha.jobset.sigs.k8s.io/exclusive-topology': 'cloud.google.com/gke-nodepool'}},
      'spec': spec,
  }


def to_yaml(doc: dict, command: list[str], tpu: Slice) -> str:
  """The manifest as YAML, after a comment saying what it runs and how to start it."""
  shown = shlex.join(command).encode('unicode_escape').decode('ascii')  # one comment line, whatever it holds
  head = (f'# pax {shown}\n'
          f'# on {tpu.describe()}, one pod per TPU host ({chips_per_host(tpu)} chips each); written by '
          'pax launch --k8s.\n'
          '# Start: kubectl apply -f FILE   Watch: kubectl get jobset,pods   Stop: kubectl delete -f FILE\n')
  return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=False)
