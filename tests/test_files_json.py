"""paxcli.files.parse_json: the one reader of JSON that someone else wrote (bounded, strict)."""

import pytest

from paxcli import files
from paxcli.errors import UserError


@pytest.mark.parametrize('text,words', [
    ('[' * 100_000, 'nested too deeply'),
    ('[[[[[1]]]]]', 'deeper than 4 levels'),
    ('1' * 5001, '5,001 digits'),
    ('{"a": NaN}', 'NaN is not a JSON number'),
    ('[Infinity]', 'Infinity is not a JSON number'),
    ('1e999', 'too large'),
    ('{"a": 1,\n "b":', 'line 2'),
])
def test_bad_json_is_one_line(text, words):
  with pytest.raises(UserError) as e:
    files.parse_json(text, 'x.json', max_depth=4)
  assert words in str(e.value) and str(e.value).startswith('x.json: ')
  assert '\n' not in str(e.value)


def test_good_json_reads_as_json():
  assert files.parse_json('{"a": [1, -2.5e3, "x", null, true]}', 'x') == {'a': [1, -2500.0, 'x', None, True]}
  assert files.parse_json('[[[[1]]]]', 'x', max_depth=4) == [[[[1]]]]


def test_read_json_bounds_the_file(tmp_path):
  path = tmp_path / 'c.json'
  path.write_text('{"k": "' + 'v' * 100 + '"}')
  assert files.read_json(str(path), 'config', max_bytes=1000)['k'] == 'v' * 100
  with pytest.raises(UserError, match='at most 50 bytes'):
    files.read_json(str(path), 'config', max_bytes=50)
