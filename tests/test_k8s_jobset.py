"""`pax launch --k8s`: the JobSet it prints is valid by the JobSet CRD's own published schema.

The schema is the CRD kubernetes-sigs/jobset v0.12.0 publishes (tests/fixtures/jobset, SOURCE.md says
where from), checked with jsonschema the way `kubectl apply` (strict field validation, its default)
checks a custom resource: by the CRD's openAPIV3Schema, where a field the schema does not name is an
error. Nothing here runs on a cluster.
"""

import copy
import functools
import json
import pathlib

import jsonschema
import pytest
import yaml

from conftest import pax_main

CRD = pathlib.Path(__file__).parent / 'fixtures' / 'jobset' / 'jobset.x-k8s.io_jobsets.yaml'


@functools.cache
def jobset_schema() -> dict:
  """v1alpha2's openAPIV3Schema, with unknown fields refused where Kubernetes refuses them: an object
  schema that lists its properties and neither allows others nor preserves unknown fields."""
  crd = yaml.safe_load(CRD.read_text())
  version = next(v for v in crd['spec']['versions'] if v['name'] == 'v1alpha2')
  return _strict(copy.deepcopy(version['schema']['openAPIV3Schema']))


def _strict(schema):
  if isinstance(schema, dict):
    if ('properties' in schema and 'additionalProperties' not in schema
        and not schema.get('x-kubernetes-preserve-unknown-fields')):
      schema['additionalProperties'] = False
    for value in schema.values():
      _strict(value)
  elif isinstance(schema, list):
    for value in schema:
      _strict(value)
  return schema


def errors(doc: dict) -> list[str]:
  validator = jsonschema.Draft7Validator(jobset_schema())
  return [f'{"/".join(str(p) for p in e.absolute_path)}: {e.message}' for e in validator.iter_errors(doc)]


def launch_k8s(capsys, *args, command=('train', '--exp', 'c4.C4Spmd22BAdam2xv4_128', '--job-log-dir', 'gs://b/run')):
  code, out, err = pax_main(['launch', '--k8s', *args, '--', *command], capsys)
  return code, out, err


def test_the_schema_check_catches_what_the_api_server_refuses():
  """A test that cannot fail proves nothing: a misspelt field, a wrong type and a missing required field
  are each caught by the check the manifests below pass."""
  good = {'apiVersion': 'jobset.x-k8s.io/v1alpha2', 'kind': 'JobSet', 'metadata': {'name': 'x'},
          'spec': {'replicatedJobs': [{'name': 'slice', 'replicas': 1, 'template': {'spec': {'template': {
              'spec': {'containers': [{'name': 'pax', 'image': 'i'}]}}}}}]}}
  assert errors(good) == []
  typo = copy.deepcopy(good)
  typo['spec']['replicatedJobs'][0]['template']['spec']['template']['spec']['nodeSelecter'] = {'a': 'b'}
  assert any('nodeSelecter' in e for e in errors(typo))
  wrong = copy.deepcopy(good)
  wrong['spec']['replicatedJobs'][0]['replicas'] = 'two'
  assert any('replicas' in e for e in errors(wrong))
  missing = copy.deepcopy(good)
  del missing['spec']['replicatedJobs'][0]['template']['spec']['template']['spec']['containers'][0]['name']
  assert any("'name' is a required property" in e for e in errors(missing))


@pytest.mark.parametrize('topology, slices, hosts, chips, accelerator, shape', [
    ('v4-128', 1, 16, 4, 'tpu-v4-podslice', '4x4x4'),
    ('v5p-128', 2, 16, 4, 'tpu-v5p-slice', '4x4x4'),
    ('v5litepod-16', 1, 4, 4, 'tpu-v5-lite-podslice', '4x4'),
    ('v6e-8', 1, 1, 8, 'tpu-v6e-slice', '2x4'),
    ('v4-8', 1, 1, 4, 'tpu-v4-podslice', '2x2x1'),
])
def test_jobset_is_valid_by_the_crd_schema(capsys, topology, slices, hosts, chips, accelerator, shape):
  code, out, err = launch_k8s(capsys, '--topology', topology, '--num-slices', str(slices), '--image', 'repo/pax:1',
                              '--max-restarts', '3', '--env', 'LIBTPU_INIT_ARGS=--xla_tpu_enable_async_all_gather=true')
  assert code == 0, err
  assert out.startswith('# pax train --exp c4.C4Spmd22BAdam2xv4_128 --job-log-dir gs://b/run\n')
  doc = yaml.safe_load(out)
  assert errors(doc) == []
  assert doc['kind'] == 'JobSet' and doc['metadata']['name'] == 'pax-c4-c4spmd22badam2xv4-128'
  job = doc['spec']['replicatedJobs'][0]
  assert job['replicas'] == slices and doc['spec']['failurePolicy']['maxRestarts'] == 3
  assert job['template']['spec']['parallelism'] == job['template']['spec']['completions'] == hosts
  pod = job['template']['spec']['template']['spec']
  assert pod['nodeSelector'] == {'cloud.google.com/gke-tpu-accelerator': accelerator,
                                 'cloud.google.com/gke-tpu-topology': shape}
  container = pod['containers'][0]
  assert container['command'] == ['pax', 'train', '--exp', 'c4.C4Spmd22BAdam2xv4_128', '--job-log-dir', 'gs://b/run']
  assert container['resources']['limits']['google.com/tpu'] == chips
  env = {e['name']: e for e in container['env']}
  assert env['LIBTPU_INIT_ARGS']['value'] == '--xla_tpu_enable_async_all_gather=true'
  if slices > 1:   # MEGASCALE_* from JobSet's pod annotations; the coordinator is slice 0's first pod
    assert doc['spec']['coordinator'] == {'replicatedJob': 'slice', 'jobIndex': 0, 'podIndex': 0}
    assert (env['MEGASCALE_SLICE_ID']['valueFrom']['fieldRef']['fieldPath']
            == "metadata.annotations['jobset.sigs.k8s.io/job-index']")
    assert {'MEGASCALE_COORDINATOR_ADDRESS', 'MEGASCALE_NUM_SLICES'} <= set(env)
  else:
    assert 'coordinator' not in doc['spec'] and not any(k.startswith('MEGASCALE') for k in env)
  assert err == ''


def test_a_local_job_directory_is_a_note_and_a_newline_cannot_leave_the_comment(capsys):
  code, out, err = launch_k8s(capsys, '--topology', 'v4-8', '--image', 'i', '--name', 'my-run',
                              command=('train', '--exp', 'E', '--set', 'A=1\nkind: Pod', '--job-log-dir', '/tmp/run'))
  assert code == 0, err
  assert 'is a path on each pod' in err and 'gs://BUCKET/PATH' in err
  doc = yaml.safe_load(out)
  assert doc['kind'] == 'JobSet' and doc['metadata']['name'] == 'my-run' and errors(doc) == []
  assert doc['spec']['replicatedJobs'][0]['template']['spec']['template']['spec']['containers'][0]['command'][5] \
      == 'A=1\nkind: Pod'
  assert json.dumps(out.splitlines()[0]).count('\\n') == 1   # the newline is shown escaped in the comment


@pytest.mark.parametrize('args, message', [
    (['--topology', 'v4-100', '--image', 'i'], 'the nearest are v4-64 and v4-128'),
    (['--topology', 'tpu-v4-8', '--image', 'i'], "Did you mean 'v4-8'"),
    (['--image', 'i'], '--k8s needs --topology'),
    (['--topology', 'v4-8', '--image', 'i', '--name', 'My_Run'], 'a JobSet name is lower-case'),
    (['--topology', 'v4-8', '--image', 'i', '--env', 'NOEQUALS'], 'is not KEY=VALUE'),
])
def test_bad_input_is_one_line(capsys, args, message):
  code, out, err = launch_k8s(capsys, *args)
  assert code == 2 and out == '' and message in err and len(err.strip().splitlines()) == 1, err


def test_flags_the_pods_environment_sets_and_options_without_k8s_are_refused(capsys):
  code, _, err = launch_k8s(capsys, '--topology', 'v4-8', '--image', 'i',
                            command=('train', '--exp', 'E', '--num-processes', '4'))
  assert code == 2 and 'TPU_WORKER_ID' in err
  code, _, err = pax_main(['launch', '--processes', '2', '--topology', 'v4-8', '--', 'train'], capsys)
  assert code == 2 and 'add --k8s' in err
  code, _, err = pax_main(['launch', '--', 'train', '--exp', 'E'], capsys)
  assert code == 2 and 'Give --processes N' in err
