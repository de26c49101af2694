"""Request files of `pax score` and prompt files of `pax decode` are data someone else wrote (issue 33):
deep nesting, a 5001-digit number, NaN and a lone surrogate are each one line naming the file and
line, before anything is scored or decoded, and nothing is written."""

import json
import math
import os

import pytest

from conftest import pax_main
from test_output_paths import EXP, SETS, data  # noqa: F401  (the module fixture: a job with a tokenizer)

BAD_LINES = {
    'nested': ('[' * 100_000, 'nested too deeply'),
    'digits': ('{"context_ids": [5], "continuation_ids": [6], "n": ' + '9' * 5001 + '}', 'an integer of 5,001 digits'),
    'nan': ('{"context": "a b", "continuation": " c", "weight": NaN}', 'NaN is not a JSON number'),
}
GOOD = '{"context_ids": [5, 6], "continuation_ids": [7]}'


def _fails(argv, capsys, *phrases):
  code, out, err = pax_main(argv, capsys)
  text = ' '.join(err.split())
  assert code == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, (code, err[-3000:])
  for phrase in phrases:
    assert phrase in text, (phrase, err)


def _nothing_written(job, tmp_path):
  assert not os.path.exists(os.path.join(job, 'scores')) and not os.path.exists(os.path.join(job, 'decoder_out'))
  assert not [n for n in os.listdir(tmp_path) if n.endswith('.tmp') or n.startswith('.tmp')]


@pytest.mark.parametrize('case', [*BAD_LINES, 'surrogate'])
def test_a_bad_request_line_is_one_line_naming_file_and_line(case, data, tmp_path, capsys):  # noqa: F811
  _, job = data
  bad, phrase = BAD_LINES.get(case, ('{"context": "a \\ud800", "continuation": " b"}', 'lone surrogate'))
  path = tmp_path / 'requests.jsonl'
  path.write_text(f'{GOOD}\n{bad}\n')
  _fails(['score', *EXP, *SETS, '--job-log-dir', job, '--no-checkpoint', str(path)], capsys,
         f'{path} line 2', phrase)
  _nothing_written(job, tmp_path)


@pytest.mark.parametrize('case', [*BAD_LINES, 'surrogate'])
def test_a_bad_prompt_line_is_one_line_naming_file_and_line(case, data, tmp_path, capsys):  # noqa: F811
  _, job = data
  bad, phrase = BAD_LINES.get(case, ('{"prompt": "x \\udfff"}', 'lone surrogate'))
  if case == 'digits':
    bad = '{"prompt_ids": [5], "n": ' + '9' * 5001 + '}'
  path = tmp_path / 'prompts.jsonl'
  path.write_text(f'{{"prompt_ids": [5, 6]}}\n{bad}\n')
  _fails(['decode', *EXP, *SETS, '--job-log-dir', job, '--no-checkpoint', '--prompts-file', str(path)], capsys,
         f'{path} line 2', phrase)
  _nothing_written(job, tmp_path)


def test_results_hold_no_nan_and_leave_no_temporary_file(tmp_path):
  """JSON has no NaN: a figure that is not finite is written as null, and the file is whole."""
  from paxcli.loops.decode.output import write_jsonl
  path = tmp_path / 'out.jsonl'
  write_jsonl(str(path), [{'x': float('nan'), 'ys': [1.0, float('inf')], 'id': 'a'}, {'x': 2.0}])
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  assert rows == [{'x': None, 'ys': [1.0, None], 'id': 'a'}, {'x': 2.0}]
  assert os.listdir(tmp_path) == ['out.jsonl'] and not math.isnan(rows[1]['x'])
