"""Reading MaxText run scripts as text: quoting, variables, loops, nesting, and no side effects."""

import os
import pathlib

import pytest

from paxcli.errors import UserError
from paxcli.maxtext.shell import lex, read_script

FIXTURES = pathlib.Path(__file__).parent / 'fixtures' / 'maxtext'


def _overrides(info):
  return {o.key: o.value for o in info.overrides}


def _script(tmp_path, text, name='run.sh'):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_lexer_joins_continuations_and_drops_comments_and_redirects():
  commands = lex('a=1 # comment\npython3 x.py \\\n  k="v w" \'q r\' 2>&1 > out.log | tee x\n')
  words = [[''.join(p.text for p in w) for w in c.words] for c in commands]
  assert words == [['a=1'], ['python3', 'x.py', 'k=v w', 'q r'], ['tee', 'x']]
  assert commands[1].line == 2


def test_expansions_with_defaults(tmp_path):
  path = _script(tmp_path, '\n'.join([
      'A=set',
      'E=',
      'python3 MaxText/train.py base.yml a=${A:-no} b=${B:-dflt} c=${E:-empty} d=${E-kept}'
      ' e=${C:=assigned} f=$C g=${A:+alt} h=${B:+alt} i="$A"x j=\'$A\' k=\\$A',
  ]))
  got = _overrides(read_script(path))
  assert got == {'a': 'set', 'b': 'dflt', 'c': 'empty', 'd': '', 'e': 'assigned', 'f': 'assigned',
                 'g': 'alt', 'h': '', 'i': 'setx', 'j': '$A', 'k': '$A'}


def test_argument_loop_exports_key_value_arguments():
  info = read_script(str(FIXTURES / 'gqa-current.sh'), ['STEPS=7', 'RUN_NAME=a=b'])
  got = _overrides(info)
  # The loop reads KEY VALUE with IFS='=': the value keeps any later '='.
  assert got['steps'] == '7' and got['run_name'] == 'a=b'
  assert got['checkpoint_period'] == '50'  # ${CHECKPOINT_PERIOD:-50}
  assert info.entry == '-m maxtext.trainers.pre_train.train'
  assert info.config_path == 'src/maxtext/configs/base.yml'  # "${MAXTEXT_PKG_DIR:-src/maxtext}"/...
  assert got['mlp_activations'] == '["silu","linear"]'
  assert info.env['LIBTPU_INIT_ARGS'].startswith('--xla_tpu_enable_async_collective_fusion')
  assert any('preflight.sh' in s for s in info.skipped)


def test_script_defaults_apply_without_arguments():
  got = _overrides(read_script(str(FIXTURES / 'gqa-current.sh')))
  assert got['steps'] == '100'
  assert got['run_name'] == 'gqa-$(date +%Y-%m-%d-%H-%M)'  # command substitution kept as text


def test_arguments_fill_variables_without_a_loop():
  got = _overrides(read_script(str(FIXTURES / 'gps-explicit.sh'), ['SCALE=4', 'SCALE_KEY=scale']))
  assert got['scale'] == '4' and 'global_parameter_scale' not in got


def test_trainer_nested_in_quoted_command_and_heredoc_skipped():
  info = read_script(str(FIXTURES / 'quoting-and-nesting.sh'))
  assert info.entry == 'MaxText/train.py'
  assert _overrides(info) == {
      'run_name': 'quoted run', 'ici_fsdp_parallelism': '32', 'ici_tensor_parallelism': '2',
      'scale': '2', 'base_emb_dim': '1024', 'base_num_heads': '8', 'base_mlp_dim': '4096',
      'base_num_decoder_layers': '8', 'max_target_length': '512', 'vocab_size': '32000',
      'dropout_rate': '0.1', 'per_device_batch_size': '8'}
  assert info.line == 9  # the gcloud command holding the trainer call


def test_env_overrides_and_pipe():
  info = read_script(str(FIXTURES / 'llama2-7b-v5p.sh'))
  got = _overrides(info)
  assert got['steps'] == '7'  # export M_STEPS=7: MaxText reads M_<KEY> variables
  assert info.overrides[0].origin == 'env M_STEPS'
  assert '2' not in got and 'tee' not in str(got)  # `2>&1 | tee` is not part of the call


def test_side_effects_never_happen(tmp_path):
  out = tmp_path / 'out'
  out.mkdir()
  (out / 'keep_me').write_text('still here')
  before = sorted(os.listdir(out))
  info = read_script(str(FIXTURES / 'side-effects.sh'), [f'OUT={out}'])
  assert _overrides(info) == {'run_name': 'side', 'steps': '3'}
  assert sorted(os.listdir(out)) == before == ['keep_me']
  assert (out / 'keep_me').read_text() == 'still here'
  for path in ('/tmp/never_written_by_pax.log', '/tmp/should_not_exist_heredoc.txt'):
    existed = os.path.exists(path)
    read_script(str(FIXTURES / 'gqa-current.sh'))
    read_script(str(FIXTURES / 'quoting-and-nesting.sh'))
    assert os.path.exists(path) == existed


def test_no_trainer_is_an_error():
  with pytest.raises(UserError, match='no MaxText trainer invocation.*It runs setup.sh'):
    read_script(str(FIXTURES / 'no-trainer.sh'))


def test_branches_are_read_in_order(tmp_path):
  path = _script(tmp_path, 'if [ -z "$STEPS" ]; then\n  STEPS=5\nelse\n  STEPS=9\nfi\n'
                           'python3 MaxText/train.py base.yml steps=$STEPS\n')
  info = read_script(path)
  assert _overrides(info) == {'steps': '9'} and any('not evaluated' in n for n in info.notes)


def test_unreadable_and_badly_quoted_scripts(tmp_path):
  with pytest.raises(UserError, match='Cannot read MaxText script'):
    read_script(str(tmp_path / 'missing.sh'))
  (tmp_path / 'bin.sh').write_bytes(b'\xff\xfe\x00python3')
  with pytest.raises(UserError, match='Cannot read'):
    read_script(str(tmp_path / 'bin.sh'))
  with pytest.raises(UserError, match='unterminated double quote'):
    read_script(_script(tmp_path, 'python3 MaxText/train.py base.yml run_name="x\n'))


def test_last_of_several_invocations_wins(tmp_path):
  path = _script(tmp_path, 'python3 MaxText/train.py a.yml steps=1\n'
                           'python3 MaxText/train.py b.yml steps=2\n')
  info = read_script(path)
  assert info.config_path == 'b.yml' and _overrides(info) == {'steps': '2'}
  assert any('2 trainer invocations' in n for n in info.notes)
