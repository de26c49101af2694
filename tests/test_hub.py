"""Hub ids and Hugging Face datasets (issue 38, item 5), from a fresh shell: `--from hf Org/name` is
downloaded by huggingface_hub into the cache (HF_HOME) from a stand-in Hub on 127.0.0.1 (tests/hub_server.py:
huggingface_hub writes the cache itself), read back offline (HF_HUB_OFFLINE=1) with the Hub gone, one
line naming the cache when the cache lacks it, and a local directory of the name wins. TRAIN_DATA reads a
directory `datasets`' save_to_disk wrote and a cached Hub dataset, whose loading script is never fetched
nor run."""

import json
import os
import shutil

import pytest

import hf_models
from conftest import pax_main, run_pax
from hub_server import Hub

transformers = pytest.importorskip('transformers')
ROWS = [{'prompt': f'Q: What is {i} plus one?\nA:', 'completion': f' {i + 1}.'} for i in range(80)]
COMMON = ['--set', 'VOCAB_SIZE=512', '--set', 'MAX_SEQ_LEN=32', '--set', 'PERCORE_BATCH_SIZE=1', '--set',
          'ICI_MESH_SHAPE=[1,1,1]', '--num-batches', '1', '--json']


@pytest.fixture(scope='module')
def model_dir(tmp_path_factory):
  """A tiny Qwen2 and its tokenizer, both saved by transformers (save_pretrained), as a Hub repository holds them."""
  from test_chat_template_files import CHATML, save_tokenizer
  directory = tmp_path_factory.mktemp('repo')
  hf_models.save(hf_models.build(dict(hf_models.REFERENCES['qwen2'].config, vocab_size=400)), str(directory))
  save_tokenizer(directory, CHATML)
  (directory / 'modeling_evil.py').write_text('open("PWNED", "w")\n')   # code in the repository: never fetched
  return directory


@pytest.fixture(scope='module')
def dataset_dir(tmp_path_factory):
  """A dataset repository as the Hub holds them: a train and a test split in Parquet, and a loading script."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  repo = tmp_path_factory.mktemp('dataset')
  (repo / 'data').mkdir()
  pq.write_table(pa.Table.from_pylist(ROWS), repo / 'data' / 'train-00000-of-00001.parquet')
  pq.write_table(pa.Table.from_pylist([{'text': 'held out'}]), repo / 'data' / 'test-00000-of-00001.parquet')
  (repo / 'dataset.py').write_text('open("PWNED", "w")\n')   # a loading script: never fetched, never run
  return repo


@pytest.fixture(scope='module')
def home(tmp_path_factory, model_dir, dataset_dir):
  """A Hugging Face home whose cache huggingface_hub's own snapshot_download filled from the stand-in Hub,
  with paxcli's patterns (so only the files paxcli reads are there)."""
  import huggingface_hub
  from paxcli.inputs import hub as paxcli_hub
  home = tmp_path_factory.mktemp('hf_home')
  hub = Hub({('model', 'Org/tiny-qwen'): str(model_dir), ('dataset', 'Org/sums'): str(dataset_dir)})
  try:
    for repo, kind, patterns in (('Org/tiny-qwen', 'model', paxcli_hub.MODEL_FILES),
                                 ('Org/sums', 'dataset', paxcli_hub.DATA_FILES)):
      huggingface_hub.snapshot_download(repo, repo_type=kind, allow_patterns=list(patterns), endpoint=hub.endpoint,
                                        cache_dir=str(home / 'hub'))
  finally:
    hub.close()
  return home


def _run(tmp_path, *args, home=None, **env):
  """`pax ARGS` from a fresh shell in tmp_path, with its own Hugging Face home (the cache: HF_HOME/hub)."""
  clean = {'HF_HOME': str(home or tmp_path / 'hf_home'), 'HF_HUB_CACHE': None, 'HF_HUB_OFFLINE': None,
           'HF_ENDPOINT': None}
  return run_pax(*args, cwd=tmp_path, env={**clean, **env})


def test_a_cached_hub_id_is_read_offline_and_a_missing_one_is_one_line(home, tmp_path):
  done = _run(tmp_path, 'checkpoint', 'convert', '--from', 'hf', 'Org/tiny-qwen', 'qwen', '--no-verify', home=home,
              HF_HUB_OFFLINE='1')
  assert done.returncode == 0, done.stderr[-3000:]
  assert (tmp_path / 'qwen' / 'tokenizer' / 'tokenizer.json').is_file()
  assert json.load(open(tmp_path / 'qwen' / 'tokenizer' / 'tokenizer_config.json'))['chat_template']
  missing = _run(tmp_path, 'checkpoint', 'convert', '--from', 'hf', 'Org/absent', 'x', home=home, HF_HUB_OFFLINE='1')
  lines = missing.stderr.strip().splitlines()
  assert missing.returncode == 2 and len(lines) == 1 and 'Traceback' not in missing.stderr, missing.stderr
  assert f'Org/absent is no local directory and the Hugging Face cache ({home / "hub"}) does not hold the model' \
      in lines[0]
  assert 'HF_HUB_OFFLINE=1' in lines[0] and not (tmp_path / 'x').exists()


@pytest.mark.slow
def test_a_hub_id_is_fetched_into_the_cache_by_huggingface_hub_without_its_code(model_dir, tmp_path):
  import huggingface_hub
  hub = Hub({('model', 'Org/tiny-qwen'): str(model_dir)})
  try:
    done = _run(tmp_path, 'checkpoint', 'convert', '--from', 'hf', 'Org/tiny-qwen', 'qwen', HF_ENDPOINT=hub.endpoint)
  finally:
    hub.close()
  assert done.returncode == 0, done.stderr[-3000:]
  assert ': ok' in done.stdout + done.stderr   # certified against transformers on the cached snapshot
  assert (tmp_path / 'qwen' / 'tokenizer' / 'tokenizer.json').is_file() and not (tmp_path / 'PWNED').exists()
  repo = next(r for r in huggingface_hub.scan_cache_dir(tmp_path / 'hf_home' / 'hub').repos
              if r.repo_id == 'Org/tiny-qwen')
  assert set(repo.refs) == {'main'} and not any(f.file_name.endswith('.py') for r in repo.revisions for f in r.files)


def test_a_local_directory_of_the_name_wins_over_the_hub(model_dir, tmp_path):
  shutil.copytree(model_dir, tmp_path / 'Org' / 'tiny-qwen')
  done = _run(tmp_path, 'checkpoint', 'convert', '--from', 'hf', 'Org/tiny-qwen', 'qwen', '--no-verify',
              HF_HUB_OFFLINE='1')   # an empty cache, offline: only the directory can be read
  assert done.returncode == 0, done.stderr[-3000:]
  source = [line for line in open(tmp_path / 'qwen' / 'recipe.py') if line.startswith('SOURCE = ')]
  assert source == [f"SOURCE = {str(tmp_path / 'Org' / 'tiny-qwen')!r}\n"]


def _first_text(done) -> str:
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.splitlines()[0])['examples'][0]['text']


def test_train_data_reads_a_save_to_disk_directory_and_a_dataset_dicts_train_split(tmp_path, capsys):
  datasets = pytest.importorskip('datasets')
  datasets.disable_progress_bars()
  train = datasets.Dataset.from_list(ROWS)
  train.save_to_disk(str(tmp_path / 'saved'))
  datasets.DatasetDict({'train': train, 'test': datasets.Dataset.from_list([{'text': 'held out'}])}).save_to_disk(
      str(tmp_path / 'splits'))
  for name in ('saved', 'splits'):
    code, out, err = pax_main(['inspect-input', '--set', f'TRAIN_DATA={str(tmp_path / name)!r}', *COMMON], capsys)
    assert code == 0, err
    text = json.loads(out.splitlines()[0])['examples'][0]['text']
    assert 'plus one?' in text and 'held out' not in text
  (tmp_path / 'splits' / 'dataset_dict.json').write_text(json.dumps({'splits': ['test']}))
  code, _, err = pax_main(['inspect-input', '--set', f'TRAIN_DATA={str(tmp_path / "splits")!r}', *COMMON], capsys)
  assert code == 2 and 'its "train" split' in err and len(err.strip().splitlines()) == 1, err


def test_train_data_reads_a_cached_hub_dataset_and_never_its_loading_script(home, tmp_path):
  text = _first_text(_run(tmp_path, 'inspect-input', '--set', 'TRAIN_DATA=hf://datasets/Org/sums', *COMMON, home=home,
                          HF_HUB_OFFLINE='1'))
  assert 'plus one?' in text and 'held out' not in text and not (tmp_path / 'PWNED').exists()
  assert not list((home / 'hub').rglob('*.py'))
  missing = _run(tmp_path, 'inspect-input', '--set', 'TRAIN_DATA=hf://datasets/Org/other', *COMMON, home=home,
                 HF_HUB_OFFLINE='1')
  assert missing.returncode == 2 and 'does not hold the dataset' in missing.stderr, missing.stderr
  assert len(missing.stderr.strip().splitlines()) == 1
