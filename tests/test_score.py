"""`pax score`: log-likelihoods of continuations against `pax decode`, the model's own forward pass,
lm-evaluation-harness' tokenization of text pairs, batching, another mesh, and bad request lines.

Text requests go through a real tokenizer: a sentencepiece model made by paxcli's own trainer,
put in the job directory (fresh weights, --no-checkpoint); the harness' split is recomputed here
with the sentencepiece library itself. A real checkpoint is scored from tests/fixtures/old_lm.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from conftest import REPO, pax_main, run_pax
from paxcli import api, config
from paxcli.inputs.tokenizers import train_sentencepiece
from paxcli.jobdir import layout
from paxcli.loops.score.requests import Pair, rolling_windows
from paxcli.loops.score.scorer import Scorer
from paxcli.runtime import engine

EXP = 'paxcli.models.LmExperiment'
TINY = ['VOCAB_SIZE=320', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'NUM_LAYERS=2', 'MAX_SEQ_LEN=32',
        'PERCORE_BATCH_SIZE=1']
SETS = [a for s in TINY for a in ('--set', s)]
CORPUS = ['The cat sat on the mat.', 'A dog ran in the park.', 'The bird sang a song.',
          'Return the number of items in the list.', 'Create a new file and write the text.'] * 40
# A checkpoint `pax train` wrote (tests/test_old_checkpoint.py says how), scored with its own knobs.
OLD_EXP = 'lm_cloud.LmCloudSpmdTest'
OLD = ['NUM_LAYERS=1', 'MODEL_DIMS=16', 'HIDDEN_DIMS=32', 'NUM_HEADS=2', 'DIMS_PER_HEAD=8', 'VOCAB_SIZE=64',
       'MAX_SEQ_LEN=16', 'PERCORE_BATCH_SIZE=2', 'NUM_TRAIN_STEPS=2', 'SAVE_INTERVAL_STEPS=2',
       'SUMMARY_INTERVAL_STEPS=1']


@pytest.fixture(scope='module')
def job(tmp_path_factory):
  """A job directory holding only a sentencepiece tokenizer (pad 0, eos 1, unk 2, no bos)."""
  path = str(tmp_path_factory.mktemp('score') / 'job')
  spm = layout.tokenizer(path, 'sentencepiece')
  os.makedirs(os.path.dirname(spm))
  train_sentencepiece(CORPUS, 300, spm)
  return path


@pytest.fixture(scope='module')
def sp(job):
  import sentencepiece
  return sentencepiece.SentencePieceProcessor(model_file=layout.tokenizer(job, 'sentencepiece'))


def _quiet():
  from rich.console import Console
  return Console(quiet=True)


def _score(job, tmp_path, lines, **kw):
  path = tmp_path / f'requests{len(os.listdir(tmp_path))}.jsonl'
  path.write_text(''.join(json.dumps(x) + '\n' for x in lines))
  return api.score(str(path), EXP, overrides=TINY, job_dir=job, no_checkpoint=True, console=_quiet(), **kw)


def test_scores_equal_decodes_token_logprobs_and_greedy_continuations_are_greedy(job, tmp_path):
  decoded = api.decode(EXP, overrides=TINY, job_dir=job, prompt=['The cat', 'Return the number of'],
                       max_decode_steps=6, ignore_eos=True, no_checkpoint=True, output=str(tmp_path / 'd.jsonl'),
                       console=_quiet())
  requests = [{'context_ids': d['prompt_ids'], 'continuation_ids': d['decoded_ids'], 'id': n}
              for n, d in enumerate(decoded)]
  changed = dict(requests[0], continuation_ids=requests[0]['continuation_ids'][:-1] + [
      (requests[0]['continuation_ids'][-1] + 1) % 300])
  scored = _score(job, tmp_path, requests + [changed])
  for d, s in zip(decoded, scored):
    np.testing.assert_allclose(s['token_logprobs'], d['token_logprobs'], atol=1e-5)
    assert abs(s['logprob'] - d['logprob']) < 1e-4
    assert s['is_greedy'] and s['num_tokens'] == 6
  assert [s['id'] for s in scored] == [0, 1, 0]  # other fields pass through, in file order
  assert not scored[2]['is_greedy']
  assert scored[2]['token_logprobs'][:5] == pytest.approx(scored[0]['token_logprobs'][:5], abs=1e-6)


def test_text_pairs_split_as_the_harness_does(job, tmp_path, sp):
  """The context's trailing space moves to the continuation; the continuation's tokens are those of
  the whole text after the context's own tokens; an empty context is the EOS token (no BOS)."""
  scored = _score(job, tmp_path, [{'context': 'The cat', 'continuation': ' sat on the mat.'},
                                  {'context': 'The cat ', 'continuation': 'sat on the mat.'},
                                  {'context': '', 'continuation': 'The cat'}])
  head = sp.encode('The cat')
  whole = sp.encode('The cat sat on the mat.')
  ids = [{'context_ids': head, 'continuation_ids': whole[len(head):]},
         {'context_ids': [sp.eos_id()], 'continuation_ids': sp.encode('The cat')}]
  by_ids = _score(job, tmp_path, ids)
  assert scored[0]['num_tokens'] == len(whole) - len(head) == by_ids[0]['num_tokens']
  assert scored[0]['token_logprobs'] == scored[1]['token_logprobs'] == by_ids[0]['token_logprobs']
  assert scored[2]['token_logprobs'] == by_ids[1]['token_logprobs']


@pytest.fixture(scope='module')
def scorer():
  resolved = config.resolve(EXP, TINY)
  setup = engine.build(resolved)
  return Scorer(setup, engine.init_state(setup, 0)['params'])


def test_a_pair_scores_the_same_alone_and_in_any_batch_as_in_the_plain_forward_pass(scorer):
  rng = np.random.default_rng(0)
  pairs = [Pair(i, [int(t) for t in rng.integers(3, 320, n)], s) for i, (n, s) in
           enumerate([(5, 2), (33, 20), (12, 1), (2, 1), (20, 7), (9, 8)])]
  forward = jax.jit(lambda p, x: jax.nn.log_softmax(scorer.model.apply({'params': p}, x), axis=-1))
  together, _ = scorer.run(pairs)
  in_twos, _ = scorer.run(pairs, batch_size=2)
  for pair, (lps, _), (lps2, _) in zip(pairs, together, in_twos):
    alone, _ = scorer.run([pair])[0][0]
    np.testing.assert_allclose(lps, alone, atol=1e-5)
    np.testing.assert_allclose(lps2, alone, atol=1e-5)
    ids = np.zeros((1, 32), np.int32)  # right-padded: attention is causal, so padding after a token
    ids[0, :len(pair.tokens) - 1] = pair.tokens[:-1]  # leaves its logits alone
    logp = np.asarray(forward(scorer.params, ids))[0]
    reference = [logp[i, t] for i, t in enumerate(pair.tokens[1:])][-pair.scored:]
    np.testing.assert_allclose(alone, reference, atol=1e-5)


def test_rolling_windows_predict_every_token_once_with_a_full_window():
  windows = rolling_windows(list(range(10, 20)), prefix=1, window=4)
  # Each window reads 4 tokens (context + continuation minus its last); the last one reads a full window.
  assert windows == [([1], [10, 11, 12, 13]), ([13], [14, 15, 16, 17]), ([15, 16, 17], [18, 19])]
  assert [t for _, cont in windows for t in cont] == list(range(10, 20))


def test_long_texts_roll_and_long_contexts_are_cut_from_the_left(job, tmp_path, sp):
  text = ' '.join(CORPUS[:8])
  ids = sp.encode(text)
  assert len(ids) > 64  # three windows of MAX_SEQ_LEN 32
  scored = _score(job, tmp_path, [{'text': text}, {'context_ids': ids[:-3], 'continuation_ids': ids[-3:]},
                                  {'context_ids': ids[-33:-3], 'continuation_ids': ids[-3:]}])
  assert scored[0]['num_tokens'] == len(ids) and scored[0]['num_windows'] == -(-len(ids) // 32)
  # The text's last token is read after the same 32 tokens as the cut pair's last token.
  assert scored[0]['token_logprobs'][-1] == pytest.approx(scored[1]['token_logprobs'][-1], abs=1e-5)
  assert scored[1]['truncated'] == len(ids) - 33 and scored[2]['truncated'] == 0
  assert scored[1]['token_logprobs'] == pytest.approx(scored[2]['token_logprobs'], abs=1e-6)


def test_a_checkpoint_scores_the_same_on_a_two_device_tensor_parallel_mesh_as_on_eight(tmp_path):
  job = tmp_path / 'job'
  shutil.copytree(REPO / 'tests' / 'fixtures' / 'old_lm' / 'plain', job)
  requests = tmp_path / 'r.jsonl'
  long = list(range(3, 40))  # 37 tokens: the context loses its first 23 to fit MAX_SEQ_LEN 16 + 1
  requests.write_text('{"context_ids": [5, 6, 7], "continuation_ids": [8, 9], "q": 7}\n\n'
                      f'{{"context_ids": {long}, "continuation_ids": [8, 9, 10]}}\n'
                      '{"context_ids": [5], "continuation_ids": [6]}\n')
  eight = api.score(str(requests), OLD_EXP, overrides=OLD, job_dir=str(job), console=_quiet())
  out = tmp_path / 'two.jsonl'
  two = run_pax('score', str(requests), '--exp', OLD_EXP, *[a for s in OLD for a in ('--set', s)],
                '--set', 'ICI_MESH_SHAPE=[1,1,2]', '--job-log-dir', str(job), '-o', str(out), '--json',
                env={'XLA_FLAGS': '--xla_force_host_platform_device_count=2'})
  assert two.returncode == 0, two.stderr[-2000:]
  rows = [json.loads(x) for x in two.stdout.splitlines()]
  assert rows == [json.loads(x) for x in out.read_text().splitlines()]
  assert [r['line'] for r in rows] == [1, 3, 4] and rows[0]['q'] == 7
  assert [r["truncated"] for r in rows] == [0, 23, 0] and 'truncated' in two.stderr
  assert 'requests/s' in two.stderr and 'at step 2' in two.stderr
  for a, b in zip(rows, eight):
    assert a['is_greedy'] == b['is_greedy'] and a['num_tokens'] == b['num_tokens']
    np.testing.assert_allclose(a['token_logprobs'], b['token_logprobs'], atol=1e-5)
  assert eight.step == 2 and os.path.dirname(eight.path) == os.path.join(job, 'scores')


@pytest.mark.parametrize('content, message', [
    ('', 'is empty'),
    ('{"context": "a", "continuation": "b"}\n{"context": "a", \n', 'line 2: not valid JSON'),
    ('[1, 2]\n', 'line 1: expected a JSON object'),
    ('{"prompt": "x"}\n', 'line 1: a request has'),
    ('{"context": "a", "continuation": "b", "text": "c"}\n', 'fields of several forms'),
    ('{"context": "a"}\n', 'line 1: "continuation" is missing'),
    ('\n{"context": "a", "continuation": ""}\n', 'line 2: "continuation" is empty'),
    ('{"context_ids": [1, "2"], "continuation_ids": [3]}\n', '"context_ids" must be a list of integers'),
    ('{"context": 3, "continuation": "b"}\n', '"context" must be a string'),
    ('{"context_ids": [1], "continuation_ids": [320]}\n', 'line 1: id 320 is outside the vocabulary'),
    ('{"context_ids": [1], "continuation_ids": [' + ','.join(['3'] * 33) + ']}\n',
     'more than the model reads at once'),
])
def test_bad_lines_are_one_line_naming_file_and_line(job, tmp_path, capsys, content, message):
  requests = tmp_path / 'bad.jsonl'
  requests.write_text(content)
  code, out, err = pax_main(['score', str(requests), '--exp', EXP, *SETS, '--job-log-dir', job, '--no-checkpoint'],
                            capsys)
  assert code != 0 and not out
  text = ' '.join(err.split())
  assert message in text and str(requests) in text, err
  assert 'Traceback' not in err


def test_text_needs_a_tokenizer_and_a_job_needs_a_checkpoint(tmp_path, capsys):
  requests = tmp_path / 'r.jsonl'
  requests.write_text('{"context": "a", "continuation": " b"}\n')
  cli = ['score', str(requests), '--exp', EXP, *SETS, '--job-log-dir', str(tmp_path / 'none')]
  code, _, err = pax_main(cli, capsys)
  assert code != 0 and 'No complete checkpoint' in err
  code, _, err = pax_main(cli + ['--no-checkpoint'], capsys)
  assert code != 0 and 'line 1: this model has no tokenizer' in ' '.join(err.split())


@pytest.mark.slow
@pytest.mark.alone  # two jax.distributed processes
def test_two_processes_write_the_scores_of_one(tmp_path):
  job = tmp_path / 'job'
  shutil.copytree(REPO / 'tests' / 'fixtures' / 'old_lm' / 'plain', job)
  requests = tmp_path / 'r.jsonl'
  requests.write_text(''.join(json.dumps({'context_ids': list(range(3, 3 + n)), 'continuation_ids': [8, 9], 'n': n})
                              + '\n' for n in range(1, 20, 2)))
  args = ['score', str(requests), '--exp', OLD_EXP, *[a for s in OLD for a in ('--set', s)], '--job-log-dir', str(job)]
  one = run_pax(*args, '--output', str(tmp_path / 'one.jsonl'))
  assert one.returncode == 0, one.stderr[-2000:]
  two = run_pax('launch', '--processes', '2', '--devices-per-process', '4', '--grace', '2', '--', *args,
                '--output', str(tmp_path / 'two.jsonl'), timeout=300)
  assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
  one_r, two_r = ([json.loads(x) for x in open(tmp_path / n)] for n in ('one.jsonl', 'two.jsonl'))
  assert [r['n'] for r in two_r] == [r['n'] for r in one_r] == list(range(1, 20, 2))
  for a, b in zip(one_r, two_r):
    assert a['is_greedy'] == b['is_greedy']
    np.testing.assert_allclose(a['token_logprobs'], b['token_logprobs'], atol=1e-5)


def test_the_command_prints_a_table_of_the_scores_and_their_total_then_the_file(job, tmp_path, capsys):
  """`pax score` (issue 38, item 10): a rich table of the first requests and a total row (summed
  log-likelihood, per token and its perplexity, greedy share), then the file for the rest."""
  requests = tmp_path / 'table.jsonl'
  lines = [{'context': 'The cat', 'continuation': ' sat on the mat.'}] * 3 + [{'text': CORPUS[1]}]
  requests.write_text(''.join(json.dumps(x) + '\n' for x in lines))
  out_file = tmp_path / 'scores.jsonl'
  code, out, err = pax_main(['score', str(requests), '--exp', EXP, *SETS, '--job-log-dir', job, '--no-checkpoint',
                             '-o', str(out_file)], capsys)
  assert code == 0, err
  records = [json.loads(x) for x in out_file.read_text().splitlines()]
  total = sum(r['logprob'] for r in records)
  tokens = sum(r['num_tokens'] for r in records)
  for shown in ('pax score', 'continuation', ' sat on the mat.', '(whole text)', '4 requests', f'{total:.4f}',
                f'{total / tokens:.4f}/token', 'perplexity'):
    assert shown in out, (shown, out)
  assert f'Wrote 4 results to {out_file}' in ' '.join(err.split())
  code, out, err = pax_main(['score', str(requests), '--exp', EXP, *SETS, '--job-log-dir', job, '--no-checkpoint',
                             '-o', str(tmp_path / 'again.jsonl'), '--json'], capsys)
  assert code == 0 and [json.loads(x)['logprob'] for x in out.splitlines()] == [r['logprob'] for r in records]
  assert 'perplexity' in err   # with --json the table goes to stderr: stdout stays the records
