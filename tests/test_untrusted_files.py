"""Files from others (scripts, model directories, checkpoints) are data: they never run code,
never reach outside their directory, and a broken one is one clear line (issue 17, 2-4).

Every payload here writes a file when it runs; each test asserts that the file is not there.
"""

import ast
import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, pax_main, run_pax

# A tiny Llama: GQA (4 heads, 2 kv heads), tied embeddings.
CONFIG = {'architectures': ['LlamaForCausalLM'], 'model_type': 'llama', 'vocab_size': 64, 'hidden_size': 32,
          'intermediate_size': 64, 'num_hidden_layers': 2, 'num_attention_heads': 4, 'num_key_value_heads': 2,
          'head_dim': 8, 'max_position_embeddings': 16, 'rms_norm_eps': 1e-6, 'rope_theta': 10000.0,
          'tie_word_embeddings': True, 'hidden_act': 'silu'}


def llama_weights(cfg=CONFIG, seed=0) -> dict:
  d, f, v = cfg['hidden_size'], cfg['intermediate_size'], cfg['vocab_size']
  h, k, e = cfg['num_attention_heads'], cfg['num_key_value_heads'], cfg['head_dim']
  shapes = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,)}
  for i in range(cfg['num_hidden_layers']):
    p = f'model.layers.{i}.'
    shapes.update({p + 'input_layernorm.weight': (d,), p + 'post_attention_layernorm.weight': (d,),
                   p + 'self_attn.q_proj.weight': (h * e, d), p + 'self_attn.k_proj.weight': (k * e, d),
                   p + 'self_attn.v_proj.weight': (k * e, d), p + 'self_attn.o_proj.weight': (d, h * e),
                   p + 'mlp.gate_proj.weight': (f, d), p + 'mlp.up_proj.weight': (f, d),
                   p + 'mlp.down_proj.weight': (d, f)})
  rng = np.random.default_rng(seed)
  return {n: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.2 * rng.standard_normal(s)).astype(np.float32)
          for n, s in shapes.items()}


def safetensors_bytes(tensors: dict, metadata=None, entries=None) -> bytes:
  """A safetensors file written by hand (8-byte length, JSON header, data); `entries` replaces
  header entries (to make broken files)."""
  header, offset = {}, 0
  for name, x in tensors.items():
    header[name] = {'dtype': 'F32', 'shape': list(x.shape), 'data_offsets': [offset, offset + x.nbytes]}
    offset += x.nbytes
  header.update(entries or {})
  if metadata is not None:
    header['__metadata__'] = metadata
  raw = json.dumps(header).encode()
  raw += b' ' * (-len(raw) % 8)
  return struct.pack('<Q', len(raw)) + raw + b''.join(np.ascontiguousarray(x).tobytes() for x in tensors.values())


def make_hf(path, cfg=CONFIG, weights=None) -> str:
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump(cfg, f)
  with open(os.path.join(path, 'model.safetensors'), 'wb') as f:
    f.write(safetensors_bytes(weights if weights is not None else llama_weights()))
  return str(path)


def _fails(argv, capsys, *phrases):
  """Runs pax; asserts exit 2, one message without a traceback holding every phrase; returns it."""
  code, out, err = pax_main(argv, capsys)
  assert code == 2 and 'Traceback' not in err and 'Traceback' not in out, (code, out[-2000:], err[-3000:])
  text = ' '.join(err.split())
  for phrase in phrases:
    assert phrase in text, (phrase, err)
  return text


def _ok(argv, capsys):
  code, out, err = pax_main(argv, capsys)
  assert code == 0, err[-3000:]
  return out, err


# ---- 2. code never runs from data files -----------------------------------------------------------

MAXTEXT_PAYLOADS = ['base.yml"""; import os; open("PWNED","w"); """',
                    '"""+__import__("os").system("touch PWNED")+"""']


@pytest.mark.parametrize('payload', MAXTEXT_PAYLOADS)
def test_import_maxtext_keeps_script_text_out_of_the_code(payload, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  script = tmp_path / 'evil.sh'
  script.write_text(f"python3 MaxText/train.py '{payload}' run_name=x steps=10\n")
  _ok(['import-maxtext', str(script), '--lenient', '-o', 'recipe.py'], capsys)
  _ok(['describe', '--exp', 'recipe.py:MaxTextEvil'], capsys)
  assert not (tmp_path / 'PWNED').exists()
  source = (tmp_path / 'recipe.py').read_text()
  doc = ast.get_docstring(ast.parse(source), clean=False)
  assert repr(f'MaxText/train.py {payload}') in doc      # the script's text, as a literal


def test_hf_import_from_a_directory_named_with_code(tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  src = make_hf(tmp_path / 'p"""\nimport os; open("PWNED","w")\n"""')
  _ok(['checkpoint', 'convert', src, 'out', '--from', 'hf', '--no-verify'], capsys)
  _ok(['describe', '--exp', 'out/recipe.py:HfLlama'], capsys)
  assert not (tmp_path / 'PWNED').exists()
  tree = ast.parse((tmp_path / 'out' / 'recipe.py').read_text())
  assert [ast.literal_eval(s.value) for s in tree.body if isinstance(s, ast.Assign)] == [src]   # SOURCE = '...'


def test_paxml_import_from_a_path_named_with_code(tmp_path, monkeypatch, capsys):
  import shutil
  monkeypatch.chdir(tmp_path)
  job = tmp_path / 'j"""+__import__("os").system("touch PWNED")+"""'
  shutil.copytree(REPO / 'tests' / 'fixtures' / 'paxml' / 'gpt3', job)
  _ok(['checkpoint', 'convert', str(job), 'px', '--from', 'paxml', '--no-verify'], capsys)
  _ok(['describe', '--exp', 'px/recipe.py:PaxLm'], capsys)
  assert not (tmp_path / 'PWNED').exists()
  consts = {s.targets[0].id: ast.literal_eval(s.value) for s in ast.parse((tmp_path / 'px' / 'recipe.py').read_text()).body
            if isinstance(s, ast.Assign)}
  assert consts['SOURCE'] == str(job)


def _paxcli_safetensors(directory, experiment: str) -> str:
  """A safetensors checkpoint in paxcli's format whose metadata names `experiment`."""
  os.makedirs(directory, exist_ok=True)
  meta = {'format': 'paxcli', 'step': '0', 'experiment': experiment,
          'paxcli_config': json.dumps({'knobs.NUM_LAYERS': '2'})}
  with open(os.path.join(directory, 'model.safetensors'), 'wb') as f:
    f.write(safetensors_bytes({'params/final_norm/scale': np.ones(4, np.float32)}, meta))
  return str(directory)


EVIL = 'import os\nopen(os.path.join(os.getcwd(), "PWNED"), "w")\nX = 1\n'


@pytest.mark.parametrize('named', ['model/evil.py:X', '{model}/evil.py:X'])
def test_checkpoint_metadata_naming_a_file_runs_nothing(named, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  model = tmp_path / 'model'
  _paxcli_safetensors(model, named.format(model=model))
  (model / 'evil.py').write_text(EVIL)
  _fails(['checkpoint', 'convert', str(model), 'out'], capsys, 'never imports code a checkpoint names',
         'pass --exp')
  assert not (tmp_path / 'PWNED').exists() and not (tmp_path / 'out').exists()


def test_checkpoint_metadata_naming_a_module_in_the_cwd_runs_nothing(tmp_path):
  _paxcli_safetensors(tmp_path / 'model', 'evilmod.X')
  (tmp_path / 'evilmod.py').write_text(EVIL)
  r = run_pax('checkpoint', 'convert', 'model', 'out', cwd=str(tmp_path), timeout=300)
  assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
  assert "names the experiment 'evilmod.X'" in ' '.join(r.stderr.split())
  assert not (tmp_path / 'PWNED').exists()


@pytest.fixture(scope='module')
def hf_job(tmp_path_factory):
  """A tiny HF Llama imported into an orbax job (its recipe beside it, a copy inside)."""
  base = tmp_path_factory.mktemp('hfjob')
  src = make_hf(base / 'hf')
  from paxcli.cli.app import main
  try:
    main(['checkpoint', 'convert', src, str(base / 'job'), '--from', 'hf', '--no-verify'])
  except SystemExit as e:
    assert not e.code
  return base


def test_the_recipe_a_conversion_wrote_is_read_as_data_from_the_job(hf_job, tmp_path, monkeypatch, capsys):
  """A converted job converts on without --exp; its experiment comes from the recipe copy in the
  job (read, not run): the recipe beside it, named by the metadata, is never run."""
  import shutil
  monkeypatch.chdir(tmp_path)
  job = tmp_path / 'job'
  shutil.copytree(hf_job / 'job', job)
  meta_path = job / 'checkpoints' / '0' / 'meta' / 'metadata'
  meta = json.loads(meta_path.read_text())
  assert meta['experiment'] == f'{hf_job / "job" / "recipe.py"}:HfLlama' and (job / 'recipe.py').is_file()
  beside = tmp_path / 'beside.py'
  beside.write_text((hf_job / 'job' / 'recipe.py').read_text() + EVIL)
  meta['experiment'] = f'{beside}:HfLlama'
  meta_path.write_text(json.dumps(meta))
  out, _ = _ok(['checkpoint', 'convert', str(job), 'scan', '--set', 'USE_REPEATED_LAYER=True', '--json'], capsys)
  assert json.loads(out)['verify']['ok'] and (tmp_path / 'scan' / 'recipe.py').is_file()
  # and on through safetensors, which keeps the copy too
  _ok(['checkpoint', 'convert', 'scan', 'st', '--to', 'safetensors', '--no-verify'], capsys)
  out, _ = _ok(['checkpoint', 'convert', 'st', 'back', '--no-verify', '--json'], capsys)
  assert json.loads(out)['experiment'] == f'{beside}:HfLlama' and (tmp_path / 'back' / 'recipe.py').is_file()
  assert not (tmp_path / 'PWNED').exists()
  # A copy that is more than knobs is refused, not run.
  (job / 'recipe.py').write_text((job / 'recipe.py').read_text() + EVIL)
  _fails(['checkpoint', 'convert', str(job), 'scan2'], capsys, 'recipe.py, line', 'not a recipe as paxcli writes',
         'pass --exp')
  assert not (tmp_path / 'PWNED').exists() and not (tmp_path / 'scan2').exists()


def test_orbax_metadata_naming_a_file_or_module_runs_nothing(hf_job, tmp_path, monkeypatch, capsys):
  import shutil
  monkeypatch.chdir(tmp_path)
  job = tmp_path / 'job'
  shutil.copytree(hf_job / 'job', job)
  os.remove(job / 'recipe.py')
  (job / 'evil.py').write_text(EVIL)
  meta_path = job / 'checkpoints' / '0' / 'meta' / 'metadata'
  meta = json.loads(meta_path.read_text())
  meta['experiment'] = 'job/evil.py:X'
  meta_path.write_text(json.dumps(meta))
  _fails(['checkpoint', 'convert', str(job), 'out'], capsys, "names the experiment 'job/evil.py:X'",
         'never imports code')
  assert not (tmp_path / 'PWNED').exists()


# ---- 3. symlinks: the source is never replaced; files stay in their directory ----------------------


def test_a_symlink_to_the_source_is_the_source(tmp_path, capsys):
  src = make_hf(tmp_path / 'hf')
  (tmp_path / 'link').symlink_to(src)
  (tmp_path / 'parent_link').symlink_to(tmp_path)
  before = sorted(os.listdir(src))
  _fails(['checkpoint', 'convert', str(tmp_path / 'link'), src, '--force', '--from', 'hf', '--no-verify'], capsys,
         'inside or over the source', 'symlinks resolved')
  _fails(['checkpoint', 'convert', src, str(tmp_path / 'link' / 'sub'), '--from', 'hf'], capsys,
         'inside or over the source')
  _fails(['checkpoint', 'convert', src, str(tmp_path / 'parent_link'), '--force', '--from', 'hf'], capsys,
         'inside or over the source')
  assert sorted(os.listdir(src)) == before


def test_a_tokenizer_symlinked_outside_is_refused(tmp_path, capsys):
  secret = tmp_path / 'secret'
  secret.write_text('root:$6$hash:19000:0:99999:7:::\n')
  secret.chmod(0o600)
  src = make_hf(tmp_path / 'hf')
  (tmp_path / 'hf' / 'tokenizer.model').symlink_to(secret)
  _fails(['checkpoint', 'convert', src, str(tmp_path / 'out'), '--from', 'hf', '--no-verify'], capsys,
         "tokenizer 'tokenizer.model' (a symlink) resolves to", 'outside the directory')
  assert not (tmp_path / 'out').exists() and not list(tmp_path.glob('*.py'))


def test_a_tokenizer_symlinked_inside_is_copied_no_more_open(tmp_path, capsys):
  src = make_hf(tmp_path / 'hf')
  os.makedirs(tmp_path / 'hf' / 'files')
  real = tmp_path / 'hf' / 'files' / 'tok.model'
  real.write_bytes(b'not read here')
  real.chmod(0o600)
  (tmp_path / 'hf' / 'tokenizer.model').symlink_to(os.path.join('files', 'tok.model'))
  _ok(['checkpoint', 'convert', src, str(tmp_path / 'out'), '--from', 'hf', '--no-verify'], capsys)
  copied = tmp_path / 'out' / 'tokenizer' / 'spm.model'
  assert copied.read_bytes() == b'not read here' and not copied.is_symlink()
  assert (copied.stat().st_mode & 0o777) == 0o600


def test_an_orbax_tokenizer_symlinked_outside_is_refused(hf_job, tmp_path, capsys):
  import shutil
  job = tmp_path / 'job'
  shutil.copytree(hf_job / 'job', job)
  secret = tmp_path / 'secret'
  secret.write_text('secret')
  os.makedirs(job / 'tokenizer', exist_ok=True)
  (job / 'tokenizer' / 'spm.model').symlink_to(secret)
  _fails(['checkpoint', 'convert', str(job), str(tmp_path / 'out'), '--to', 'safetensors', '--no-verify'], capsys,
         'outside the directory')
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize('where', ['../outside.safetensors', '{tmp}/outside.safetensors'])
def test_an_index_naming_files_outside_is_refused(where, tmp_path, capsys):
  (tmp_path / 'outside.safetensors').write_bytes(safetensors_bytes(llama_weights()))
  src = make_hf(tmp_path / 'hf')
  os.remove(tmp_path / 'hf' / 'model.safetensors')
  name = where.format(tmp=tmp_path)
  (tmp_path / 'hf' / 'model.safetensors.index.json').write_text(
      json.dumps({'weight_map': {n: name for n in llama_weights()}}))
  _fails(['checkpoint', 'inspect', src, '--from', 'hf'], capsys, f"{name!r}", 'index.json')


# ---- 4. broken safetensors files and configs: one line naming the file ------------------------------


def _broken(tmp_path, data: bytes) -> str:
  path = tmp_path / 'bad.safetensors'
  path.write_bytes(data)
  return str(path)


x = np.arange(4, dtype=np.float32)
good = safetensors_bytes({'a': x})
BROKEN = {
    'overlap': (safetensors_bytes({'a': x, 'b': x}, entries={'b': {'dtype': 'F32', 'shape': [4],
                                                                  'data_offsets': [8, 24]}}), 'overlap'),
    'not json': (struct.pack('<Q', 8) + b'{"a": [1', 'the header is not JSON'),
    'a list': (struct.pack('<Q', 8) + b'[1, 2]  ', 'the header is a JSON list'),
    'length beyond': (struct.pack('<Q', 1 << 20) + b'{}', 'the header length 1,048,576 is beyond the file'),
    'short': (b'\x01\x02', 'shorter than the 8-byte header length'),
    'truncated': (good[:-4], 'the file is truncated?'),
    'size': (safetensors_bytes({'a': x}, entries={'a': {'dtype': 'F32', 'shape': [5], 'data_offsets': [0, 16]}}),
             "'a' is F32 [5] (20 bytes) but its data_offsets span 16 bytes"),
    'end before begin': (safetensors_bytes({'a': x}, entries={'a': {'dtype': 'F32', 'shape': [0],
                                                                    'data_offsets': [16, 0]}}),
                         'data_offsets [16, 0] that end before they begin'),
    'entry': (safetensors_bytes({'a': x}, entries={'a': {'dtype': 'F32', 'shape': 4}}),
              "the entry of 'a' is not {dtype, shape, data_offsets"),
    'negative': (safetensors_bytes({'a': x}, entries={'a': {'dtype': 'F32', 'shape': [-4],
                                                            'data_offsets': [0, 16]}}), 'not non-negative integers'),
}


@pytest.mark.parametrize('case', sorted(BROKEN))
def test_a_broken_safetensors_file_is_one_line(case, tmp_path, capsys):
  data, phrase = BROKEN[case]
  path = _broken(tmp_path, data)
  _fails(['checkpoint', 'inspect', path], capsys, f'{path} is not a valid safetensors file', phrase)


@pytest.mark.parametrize('index,phrase', [('{"weight_map": ', 'is not valid JSON'),
                                          ('{"metadata": {}}', 'no "weight_map" object'),
                                          ('{"weight_map": {"a": "missing.safetensors"}}',
                                           "names the shard 'missing.safetensors', which is not a file")])
def test_a_broken_index_is_one_line(index, phrase, tmp_path, capsys):
  (tmp_path / 'st').mkdir()
  (tmp_path / 'st' / 'model.safetensors.index.json').write_text(index)
  _fails(['checkpoint', 'inspect', str(tmp_path / 'st'), '--from', 'safetensors'], capsys,
         'model.safetensors.index.json', phrase)


@pytest.mark.parametrize('change,phrase', [
    ({'num_attention_heads': None}, 'num_attention_heads is missing'),
    ({'rope_theta': '10000'}, 'rope_theta is "10000"; it must be a positive number'),
    ({'hidden_size': 0}, 'hidden_size is 0; it must be a positive integer'),
    ({'tie_word_embeddings': 'yes'}, 'tie_word_embeddings is "yes"; it must be true or false'),
    ({'num_key_value_heads': 3}, 'not a multiple of num_key_value_heads 3'),
    ({'intermediate_size': 65}, 'model.layers.0.mlp.gate_proj.weight: [64, 32], expected [65, 32]'),
])
def test_a_bad_hf_config_is_one_line(change, phrase, tmp_path, capsys):
  cfg = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
  src = make_hf(tmp_path / 'hf', cfg)
  _fails(['checkpoint', 'convert', src, str(tmp_path / 'out'), '--from', 'hf'], capsys, 'config.json', phrase)
  assert not (tmp_path / 'out').exists() and not list(tmp_path.glob('*.py'))


def test_a_million_layers_in_the_config_is_refused_before_building(tmp_path):
  # Under the bound on a count in a config (65,536; a million is refused as it is read: test_received_job),
  # the layers are counted against the weights' before 9 names a layer are listed.
  src = make_hf(tmp_path / 'hf', {**CONFIG, 'num_hidden_layers': 60000})
  r = run_pax('checkpoint', 'convert', src, str(tmp_path / 'out'), '--from', 'hf', timeout=600)  # a hang guard
  assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-3000:]
  assert 'config.json says num_hidden_layers 60000; the weights hold 2 layers' in ' '.join(r.stderr.split())
  assert not (tmp_path / 'out').exists()   # refused from the config and the weights' names: nothing was built


def test_an_interrupted_import_does_not_block_the_rerun(tmp_path):
  src = make_hf(tmp_path / 'hf')
  recipe = tmp_path / 'hf_out.py'
  argv = [sys.executable, '-m', 'paxcli.cli.app', 'checkpoint', 'convert', src, str(tmp_path / 'out'),
          '--from', 'hf', '--no-verify', '--recipe', str(recipe)]   # a recipe file of its own: written first
  p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 120
  while not recipe.exists() and p.poll() is None and time.time() < deadline:
    time.sleep(0.02)
  p.send_signal(signal.SIGKILL)
  p.wait()
  assert recipe.exists() and not (tmp_path / 'out').exists()
  r = run_pax(*argv[3:], timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert 'left by an earlier run of this import' in ' '.join(r.stderr.split())
  # a different recipe at that path is never replaced without --force
  recipe.write_text('# mine\n')
  r = run_pax(*argv[3:6], str(tmp_path / 'out2'), '--from', 'hf', '--no-verify', '--recipe', str(recipe), timeout=300)
  assert r.returncode == 2 and 'exists; pass --force' in r.stderr and recipe.read_text() == '# mine\n'


def test_a_truncated_hf_model_is_one_line(tmp_path, capsys):
  src = make_hf(tmp_path / 'hf')
  path = tmp_path / 'hf' / 'model.safetensors'
  path.write_bytes(path.read_bytes()[:-100])
  _fails(['checkpoint', 'convert', src, str(tmp_path / 'out'), '--from', 'hf'], capsys,
         f'{path} is not a valid safetensors file', 'the file is truncated?')
