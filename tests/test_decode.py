"""`pax decode`: the KV cache against full recomputation, strategies, stopping, the CLI and its errors.

Models are tiny and float32; each decoder is built once per module (compiles dominate).
"""

import json

import numpy as np
import pytest

from conftest import pax_main, pax_main_ok, run_pax
from paxcli import config
from paxcli.loops.decode.decoder import Decoder
from paxcli.loops.decode.options import DecodeOptions
from paxcli.loops.decode.prompts import Prompt
from paxcli.loops.decode.reference import full_recompute_greedy, teacher_forced_logprob, teacher_forced_logprobs
from paxcli.runtime import engine

TINY = ['VOCAB_SIZE=64', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'MAX_SEQ_LEN=32',
        'PERCORE_BATCH_SIZE=1']
VARIANTS = {
    'gqa_rotary_rmsnorm_unrolled': ['NUM_KV_HEADS=2', 'POSITION_EMBEDDING="rotary"', 'NORM_TYPE="rmsnorm"',
                                    'USE_BIAS=False', 'ICI_MESH_SHAPE=[1,4,2]'],
    'learned_layernorm_scanned_remat': ['USE_REPEATED_LAYER=True', 'CHECKPOINT_POLICY="save_dot_only"'],
    # praxis' norm_policy 'post' with QK norm after rotary (pax checkpoint convert --from paxml)
    'praxis_post_norm_qk_norm': ['POSITION_EMBEDDING="rotary"', 'PRE_NORMS=False', 'POST_NORMS=True',
                                 'USE_QK_NORM=True', 'QK_NORM_AFTER_ROTARY=True', 'USE_PER_DIM_SCALE=True'],
}
PROMPTS = [Prompt([1, 2, 3, 4, 5]), Prompt([7]), Prompt([9, 8, 7, 6, 5, 4, 3, 2, 1, 3, 40])]


def _decoder(sets, seed=0):
  resolved = config.resolve('paxcli.models.LmExperiment', TINY + sets)
  setup = engine.build(resolved)
  params = engine.init_state(setup, seed)['params']
  return Decoder(setup, params)


@pytest.fixture(scope='module', params=list(VARIANTS))
def variant(request):
  return _decoder(VARIANTS[request.param])


def test_cached_decoding_equals_full_recomputation(variant):
  """Greedy with the cache, prompts of 1, 5 and 11 tokens in one batch, token for token equal to
  re-running the model on the whole prefix; logprob equals the teacher-forced log-likelihood."""
  records, stats = variant.run(PROMPTS, DecodeOptions(max_decode_steps=10))
  assert [r['num_decoded_tokens'] for r in records] == [10, 10, 10]
  assert stats['decode_tokens'] == 30
  for prompt, r in zip(PROMPTS, records):
    assert r['decoded_ids'] == full_recompute_greedy(variant.model, variant.params, prompt.ids, 10)
    assert r['stop_reason'] == 'max_steps'
    tf = teacher_forced_logprob(variant.model, variant.params, prompt.ids, r['decoded_ids'])
    assert r['logprob'] == pytest.approx(tf, abs=1e-4)
    assert r['logprob'] == pytest.approx(sum(r['token_logprobs']))


def test_bfloat16_cached_decoding_matches_recomputation_within_tolerance():
  """bfloat16 activations: the cache holds bf16 keys/values, recomputation rounds differently, so
  the stated tolerance is per token: each generated token's cached log-probability is within
  0.05 nats of the teacher-forced one for the same tokens, and greedy tokens agree on >= 90%."""
  dec = _decoder(VARIANTS['gqa_rotary_rmsnorm_unrolled'] + ['FPROP_DTYPE="bfloat16"'], seed=2)
  records, _ = dec.run(PROMPTS, DecodeOptions(max_decode_steps=6))
  same = total = 0
  for prompt, r in zip(PROMPTS, records):
    full = full_recompute_greedy(dec.model, dec.params, prompt.ids, 6)
    same += sum(a == b for a, b in zip(full, r['decoded_ids']))
    total += len(full)
    tf = teacher_forced_logprobs(dec.model, dec.params, prompt.ids, r['decoded_ids'])   # float32 logits
    np.testing.assert_allclose(r['token_logprobs'], tf, atol=0.05)
  assert same / total >= 0.9


@pytest.fixture(scope='module')
def plain():
  return _decoder(['POSITION_EMBEDDING="rotary"', 'NUM_KV_HEADS=2'], seed=1)


def test_a_batch_equals_each_prompt_alone_and_budgets_stop_at_max_seq_len(plain):
  opts = DecodeOptions(max_decode_steps=25)
  together, _ = plain.run(PROMPTS, opts)
  for n, prompt in enumerate(PROMPTS):
    alone, _ = plain.run([prompt], opts)
    assert alone[0]['decoded_ids'] == together[n]['decoded_ids']
  # the 11-token prompt has room for 32 - 11 = 21 new tokens only
  assert [r['num_decoded_tokens'] for r in together] == [25, 25, 21]


def test_top_k_1_and_beam_1_equal_greedy_and_beams_beat_greedy(plain):
  prompts = PROMPTS + [Prompt([20, 21]), Prompt([33, 1, 60])]
  greedy, _ = plain.run(prompts, DecodeOptions(max_decode_steps=8))
  top1, _ = plain.run(prompts, DecodeOptions(max_decode_steps=8, top_k=1, seed=5))
  beam1, _ = plain.run(prompts, DecodeOptions(max_decode_steps=8, beam_size=1))
  beam4, _ = plain.run(prompts, DecodeOptions(max_decode_steps=8, beam_size=4))
  ids = lambda rs: [r['decoded_ids'] for r in rs]
  assert ids(top1) == ids(greedy)
  assert ids(beam1) == ids(greedy)
  assert len(beam4) == 4 * len(prompts)
  for n, g in enumerate(greedy):
    beams = [r for r in beam4 if r['prompt_index'] == n]
    assert [r['beam_rank'] for r in beams] == [0, 1, 2, 3]
    assert beams[0]['logprob'] >= g['logprob'] - 1e-5
    assert len({tuple(r['decoded_ids']) for r in beams}) == 4
    tf = teacher_forced_logprob(plain.model, plain.params, prompts[n].ids, beams[0]['decoded_ids'])
    assert beams[0]['logprob'] == pytest.approx(tf, abs=1e-4)


def test_samples_depend_only_on_seed_prompt_and_sample_index(plain):
  opts = dict(max_decode_steps=8, temperature=1.5, top_k=20, top_p=0.9, num_samples=3)
  a, _ = plain.run(PROMPTS, DecodeOptions(seed=3, **opts))
  b, _ = plain.run(PROMPTS, DecodeOptions(seed=3, batch_size=3, **opts))     # one prompt per batch
  c, _ = plain.run(PROMPTS[1:], DecodeOptions(seed=3, **opts), prompt_offset=1)
  d, _ = plain.run(PROMPTS, DecodeOptions(seed=4, **opts))
  ids = lambda rs: [r['decoded_ids'] for r in rs]
  assert ids(a) == ids(b)
  assert ids(a)[3:] == ids(c)
  assert ids(a) != ids(d)
  assert len({tuple(x) for x in ids(a)}) > 3  # samples differ from one another
  assert [(r['prompt_index'], r['sample_index']) for r in a][:4] == [(0, 0), (0, 1), (0, 2), (1, 0)]


class _CharTokenizer:
  """Id i is the character chr(ord('a') + i % 26): enough text to test stop strings."""
  eos_id = None

  def decode(self, ids):
    return ''.join(chr(ord('a') + i % 26) for i in ids)


def test_eos_and_stop_strings_stop_their_row_only(plain):
  greedy, _ = plain.run(PROMPTS, DecodeOptions(max_decode_steps=8))
  eos = greedy[0]['decoded_ids'][2]
  assert eos not in greedy[1]['decoded_ids'][:8] or eos not in greedy[2]['decoded_ids'][:8]
  stopped, _ = plain.run(PROMPTS, DecodeOptions(max_decode_steps=8, eos_ids=(eos,)))
  first = stopped[0]
  upto = greedy[0]['decoded_ids'].index(eos) + 1  # the first time the row writes that token
  assert first['stop_reason'] == 'eos' and first['decoded_ids'] == greedy[0]['decoded_ids'][:upto]
  for r, g in zip(stopped[1:], greedy[1:]):
    if eos in g['decoded_ids']:
      assert r['stop_reason'] == 'eos'
    else:
      assert r['decoded_ids'] == g['decoded_ids'] and r['stop_reason'] == 'max_steps'
  tok = _CharTokenizer()
  text = tok.decode(greedy[1]['decoded_ids'][2:4])
  by_text, _ = plain.run(PROMPTS, DecodeOptions(max_decode_steps=8, stop=(text,)), tokenizer=tok)
  assert by_text[1]['stop_reason'] == 'stop_string'
  assert text not in by_text[1]['decoded'] and len(by_text[1]['decoded_ids']) <= 4
  others = [r for n, r in enumerate(by_text) if text not in tok.decode(greedy[n]['decoded_ids'])]
  assert others and all(r['stop_reason'] == 'max_steps' and r['num_decoded_tokens'] == 8 for r in others)


def test_a_model_trained_on_counting_continues_a_count(tmp_path):
  """300 steps of the synthetic counting input, then greedy decoding counts on."""
  from paxcli.loops import train
  from paxcli.runtime import sharding
  resolved = config.resolve('paxcli.models.LmExperiment', ['VOCAB_SIZE=64', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64',
                                                       'NUM_HEADS=2', 'MAX_SEQ_LEN=16', 'PERCORE_BATCH_SIZE=2',
                                                       'LEARNING_RATE=1e-2'])
  setup, state, step, batch_sharding, inp = train.ready_step(resolved)
  for i in range(300):
    state, metrics = step(state, sharding.to_global(inp.get_next(), batch_sharding, setup.global_batch))
    if i % 50 == 49:
      metrics['loss'].block_until_ready()  # as the train loop does: a bounded queue of dispatched steps
  decoder = Decoder(setup, state['params'])
  prompts = [Prompt([5, 17, 2, 40, 10, 12, 14, 16]), Prompt([1, 1, 1, 1, 30, 31, 32]),
             Prompt([9, 3, 60, 2, 50, 53, 56, 59])]
  records, _ = decoder.run(prompts, DecodeOptions(max_decode_steps=4))
  assert records[0]['decoded_ids'] == [18, 20, 22, 24]
  assert records[1]['decoded_ids'] == [33, 34, 35, 36]
  assert records[2]['decoded_ids'] == [62, 1, 4, 7]  # mod VOCAB_SIZE


# ---- the CLI ------------------------------------------------------------------------------------------

CLI = ['decode', '--exp', 'paxcli.models.LmExperiment'] + [a for s in TINY for a in ('--set', s)]


def test_cli_writes_jsonl_and_prints_json(tmp_path, capsys):
  prompts = tmp_path / 'p.jsonl'
  prompts.write_text('{"prompt_ids": [1, 2, 3]}\n\n{"prompt_ids": [7]}\n')
  out_dir = tmp_path / 'job' / 'decoder_out' / 'prompts'
  out_dir.mkdir(parents=True)
  (out_dir / 'decode_step0.jsonl').write_text('the trainer\'s\n')      # never replaced by pax decode
  (out_dir / 'pax_decode_step0_1.jsonl').write_text('an earlier run\n')
  code, out, err = pax_main(CLI + ['--no-checkpoint', '--job-log-dir', str(tmp_path / 'job'), '--prompts-file',
                                   str(prompts), '--prompt-ids', '4,5', '--prompt-ids', '6', '--max-decode-steps',
                                   '5', '--json'], capsys)
  assert code == 0, err
  lines = [json.loads(x) for x in out.splitlines()]
  assert [r['prompt_ids'] for r in lines] == [[1, 2, 3], [7], [4, 5], [6]]  # --prompt-ids repeats
  fields = {'prompt', 'prompt_ids', 'decoded', 'decoded_ids', 'logprob', 'token_logprobs', 'num_decoded_tokens',
            'stop_reason', 'sample_index'}
  assert all(fields <= set(r) and r['num_decoded_tokens'] == 5 for r in lines)
  path = out_dir / 'pax_decode_step0_2.jsonl'
  assert [json.loads(x) for x in path.read_text().splitlines()] == lines
  assert (out_dir / 'decode_step0.jsonl').read_text() == 'the trainer\'s\n'
  assert (out_dir / 'pax_decode_step0_1.jsonl').read_text() == 'an earlier run\n'


def test_one_device_gives_the_tokens_of_eight(tmp_path, capsys):
  args = CLI + ['--no-checkpoint', '--prompt-ids', '3,4,5,6', '--max-decode-steps', '6', '--json',
                '--set', 'NUM_KV_HEADS=2', '--set', 'ICI_MESH_SHAPE=None']
  # one device needs a process of its own; the eight are this process's (conftest)
  one = run_pax(*args, '--output', str(tmp_path / 'one.jsonl'),
                env={'XLA_FLAGS': '--xla_force_host_platform_device_count=1'})
  assert one.returncode == 0, one.stderr[-2000:]
  pax_main_ok(args + ['--output', str(tmp_path / 'eight.jsonl')], capsys)
  ids = lambda p: [json.loads(x)['decoded_ids'] for x in open(p)]
  assert ids(tmp_path / 'one.jsonl') == ids(tmp_path / 'eight.jsonl')


@pytest.mark.parametrize('args, message', [
    (['--prompt-ids', '1,2'], 'No complete checkpoint'),
    (['--no-checkpoint', '--prompt', 'hello'], 'no tokenizer'),
    (['--no-checkpoint', '--prompt-ids', '1,64'], 'id 64 outside the vocabulary'),
    (['--no-checkpoint', '--prompt-ids', '1', '--top-p', '0'], '--top-p must be in (0, 1]'),
    (['--no-checkpoint', '--prompt-ids', '1', '--top-p', '1.5'], '--top-p must be in (0, 1]'),
    (['--no-checkpoint', '--prompt-ids', '1', '--top-k', '-1'], '--top-k must be at least 0'),
    (['--no-checkpoint', '--prompt-ids', '1', '--temperature', '-1'], '--temperature must be a finite number at least 0'),
    (['--no-checkpoint', '--prompt-ids', '1', '--beam-size', '2', '--top-k', '3'], 'cannot be combined'),
    (['--no-checkpoint', '--prompt-ids', '1', '--beam-size', '2', '--num-samples', '2'], 'cannot be combined'),
    (['--no-checkpoint'], 'No prompts'),
    (['--no-checkpoint', '--prompt-ids', ','.join(['1'] * 32)], 'leaves no room'),
])
def test_cli_errors(tmp_path, capsys, args, message):
  code, out, err = pax_main(CLI + ['--job-log-dir', str(tmp_path / 'job')] + args, capsys)
  assert code != 0
  assert message in ' '.join(err.split()), err
  assert 'Traceback' not in err


@pytest.mark.parametrize('content, message', [
    ('', 'is empty'),
    ('{"prompt_ids": [1]}\n{"prompt_ids": [1, \n', 'line 2: not valid JSON'),
    ('{"text": "x"}\n', 'line 1: expected an object with "prompt" or "prompt_ids"'),
])
def test_cli_prompt_file_errors(tmp_path, capsys, content, message):
  path = tmp_path / 'p.jsonl'
  path.write_text(content)
  code, out, err = pax_main(CLI + ['--no-checkpoint', '--prompts-file', str(path)], capsys)
  assert code != 0
  assert message in ' '.join(err.split()), err


@pytest.mark.slow  # a train run with checkpoints, then a CLI decode
def test_training_decodes_its_prompts_at_the_interval(tmp_path, capsys):
  job = tmp_path / 'job'
  sets = [a for s in TINY + ['NUM_TRAIN_STEPS=4', 'DECODE_INTERVAL_STEPS=2', 'DECODE_PROMPTS=[[1, 2, 3], [9]]',
                             'DECODE_MAX_STEPS=5', 'SAVE_INTERVAL_STEPS=4'] for a in ('--set', s)]
  code, out, err = pax_main(['train', '--exp', 'paxcli.models.LmExperiment', *sets, '--job-log-dir', str(job)], capsys)
  assert code == 0, err
  assert 'decode step 4:' in out + err
  for step in (2, 4):
    lines = (job / 'decoder_out' / 'prompts' / f'decode_step{step}.jsonl').read_text().splitlines()
    assert [json.loads(x)['prompt_ids'] for x in lines] == [[1, 2, 3], [9]]
  assert any(p.name.startswith('events') for p in (job / 'summaries' / 'decode').iterdir())
  # and `pax decode` reads that checkpoint and gives the same greedy tokens
  code, out, err = pax_main(CLI + ['--job-log-dir', str(job), '--prompt-ids', '1,2,3', '--max-decode-steps', '5',
                                   '--json'], capsys)
  assert code == 0, err
  trained = json.loads((job / 'decoder_out' / 'prompts' / 'decode_step4.jsonl').read_text().splitlines()[0])
  assert json.loads(out.splitlines()[0])['decoded_ids'] == trained['decoded_ids']


@pytest.mark.slow
def test_two_processes_write_the_file_of_one(tmp_path):
  args = CLI + ['--no-checkpoint', '--prompt-ids', '3,4,5,6', '--max-decode-steps', '6', '--num-samples', '3',
                '--temperature', '1.0', '--set', 'NUM_KV_HEADS=2']
  one = run_pax(*args, '--output', str(tmp_path / 'one.jsonl'))
  assert one.returncode == 0, one.stderr[-2000:]
  two = run_pax('launch', '--processes', '2', '--devices-per-process', '4', '--grace', '2', '--', *args,
                '--output', str(tmp_path / 'two.jsonl'), timeout=300)
  assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-2000:]
  one_r, two_r = ([json.loads(x) for x in open(tmp_path / n)] for n in ('one.jsonl', 'two.jsonl'))
  drop = lambda r: {k: v for k, v in r.items() if k not in ('logprob', 'token_logprobs')}
  assert [drop(r) for r in one_r] == [drop(r) for r in two_r]
  # float32 reductions run in another order across processes
  np.testing.assert_allclose([r['logprob'] for r in one_r], [r['logprob'] for r in two_r], rtol=1e-5)


def test_dataset_rows_are_prompts(tmp_path, capsys):
  code, out, err = pax_main(CLI + ['--no-checkpoint', '--job-log-dir', str(tmp_path / 'job'), '--dataset', 'eval',
                                   '--num-prompts', '3', '--max-decode-steps', '2', '--json'], capsys)
  assert code == 0, err
  lines = [json.loads(x) for x in out.splitlines()]
  assert len(lines) == 3 and all(len(r['prompt_ids']) == 30 and r['num_decoded_tokens'] == 2 for r in lines)
  assert (tmp_path / 'job' / 'decoder_out' / 'eval' / 'pax_decode_step0_1.jsonl').exists()
  code, out, err = pax_main(CLI + ['--no-checkpoint', '--dataset', 'evl'], capsys)
  assert code != 0 and "Did you mean 'eval'" in err


def _reference_stops(ids, eos_ids, stop, min_length, tok, prompt_ids):
  """(ids, stop_reason) of a row that decoded `ids` unstopped, by the rules `_stop` applies token by token."""
  from paxcli.loops.decode.decoder import continuation_text
  for i, t in enumerate(ids):
    if i + 1 < min_length:
      continue
    if t in eos_ids:
      return ids[:i + 1], 'eos'
    if any(s in continuation_text(tok, prompt_ids, ids[:i + 1]) for s in stop):
      return ids[:i + 1], 'stop_string'
  return ids, 'max_steps'


def test_the_device_loop_stops_rows_as_the_token_by_token_rules_do_past_the_first_look(plain):
  """Stop strings are looked for every STOP_CHECK_EVERY tokens: one reached after the first look still ends its
  row at the right token, EOS on the device and min_length hold with it, and the other rows run on."""
  from paxcli.loops.decode.decoder import STOP_CHECK_EVERY
  steps = 20
  assert steps > STOP_CHECK_EVERY + 2
  free, _ = plain.run(PROMPTS, DecodeOptions(max_decode_steps=steps))
  tok = _CharTokenizer()
  # a text that a row first writes after the first look (the tiny model repeats itself: widen until one is)
  row, text = next((n, tok.decode(r['decoded_ids'][j:j + w])) for w in range(2, 9) for n, r in enumerate(free)
                   for j in range(STOP_CHECK_EVERY, steps - w + 1)
                   if tok.decode(r['decoded_ids'][j:j + w]) not in tok.decode(r['decoded_ids'][:j + w - 1]))
  eos = free[(row + 1) % len(free)]['decoded_ids'][4]
  for min_length in (0, 6):
    opts = DecodeOptions(max_decode_steps=steps, stop=(text,), eos_ids=(eos,), min_length=min_length)
    got, _ = plain.run(PROMPTS, opts, tokenizer=tok)
    for prompt, f, g in zip(PROMPTS, free, got):
      want_ids, want_reason = _reference_stops(f['decoded_ids'], (eos,), (text,), min_length, tok, prompt.ids)
      assert (g['decoded_ids'], g['stop_reason']) == (want_ids, want_reason)
    reasons = {g['stop_reason'] for g in got}
    assert 'eos' in reasons and any(g['stop_reason'] == 'stop_string' and g['num_decoded_tokens'] > STOP_CHECK_EVERY
                                    for g in got)


def test_prompts_of_near_lengths_share_one_compiled_loop(plain):
  from paxcli.loops.decode.decoder import padded_length
  assert [padded_length(n, 100) for n in (1, 16, 17, 33, 90)] == [16, 16, 32, 64, 100]
  assert padded_length(40, 20) == 40   # no room to pad: the prompt's own length
  opts = DecodeOptions(max_decode_steps=4)
  plain.run([Prompt([3] * 9)], opts)
  before = len(plain._fns)
  plain.run([Prompt([3] * 12)], opts)
  assert len(plain._fns) == before


# ---- the decoding step's fast paths: each must decode the tokens of the plain one -----------------------------

def test_first_argmax_is_argmax_on_ties_nan_and_infinities():
  import jax.numpy as jnp
  from paxcli.loops.decode.decoder import first_argmax
  rows = np.array([[1.0, 3.0, 3.0, 2.0], [-np.inf] * 4, [0.0, np.nan, 5.0, np.nan], [2.0, 2.0, 2.0, 2.0],
                   [-1.0, -np.inf, np.inf, np.inf]], np.float32)
  rows = np.concatenate([rows, np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)])
  np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(rows))), np.argmax(rows, axis=-1))


@pytest.mark.parametrize('l, cap', [(1, 0.0), (1, 5.0), (6, 0.0)])
def test_heads_major_cached_attention_is_the_masked_reference(l, cap):
  """attention_ops.cached_attention (keys [B, K, E, S], values [B, K, S, E]) against masked_einsum_attention
  over the same cache laid out [B, S, K, E], one query (a step) and several (a prefill), capped or not."""
  import jax.numpy as jnp
  from paxcli.layers import attention_ops
  r = np.random.default_rng(l)
  b, s, h, k, e = 3, 20, 6, 2, 8
  q = jnp.asarray(r.standard_normal((b, l, h, e)), jnp.float32)
  keys, values = (jnp.asarray(r.standard_normal((b, s, k, e)), jnp.float32) for _ in range(2))
  mask = jnp.asarray(r.random((b, l, s)) < 0.6)
  want = attention_ops.masked_einsum_attention(q, keys, values, mask, cap, 0.3)
  got = attention_ops.cached_attention(q, keys.transpose(0, 2, 3, 1), values.transpose(0, 2, 1, 3), mask, cap, 0.3)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


GROWING = {
    'gqa_rotary_unrolled': ['NUM_KV_HEADS=2', 'POSITION_EMBEDDING="rotary"', 'NORM_TYPE="rmsnorm"', 'USE_BIAS=False'],
    'window_local_global_scanned': ['NUM_KV_HEADS=2', 'POSITION_EMBEDDING="rotary"', 'NUM_LAYERS=4',
                                    'USE_REPEATED_LAYER=True', "LAYER_PATTERN=('local', 'global')",
                                    "LAYER_KINDS={'local': {'SLIDING_WINDOW': 5}}"],
}


@pytest.mark.parametrize('sets', list(GROWING.values()), ids=list(GROWING))
def test_a_cache_grown_as_it_fills_decodes_the_tokens_of_one_allocated_whole(sets):
  """Prompts of 1, 5 and 11 tokens left-padded to 16 in one batch, 100 greedy tokens each: a decoder that starts
  with a 32-slot cache and grows it to 64 and 116 between runs of its device loop (first_cache 16) gives the
  tokens and log-probabilities of one whose cache holds all 116 slots from the start, and of re-running the
  model on every prefix. The windowed layers' rolling caches keep their size as the full ones grow."""
  from paxcli.loops.decode.decoder import cache_length
  assert [cache_length(n, 116, 16) for n in (17, 33, 64, 65, 116)] == [32, 64, 64, 116, 116]
  setup = engine.build(config.resolve('paxcli.models.LmExperiment', TINY + ['MAX_SEQ_LEN=128'] + sets))
  params = engine.init_state(setup, 3)['params']
  opts = DecodeOptions(max_decode_steps=100)
  whole, grown = Decoder(setup, params, first_cache=4096), Decoder(setup, params, first_cache=16)
  want, _ = whole.run(PROMPTS, opts)
  got, stats = grown.run(PROMPTS, opts)
  assert [sorted(fns['run_on']) for fns in whole._fns.values()] == [[(116,)]]
  assert [sorted(fns['run_on']) for fns in grown._fns.values()] == [[(32,), (64,), (116,)]]
  assert stats['decode_tokens'] == 300
  for prompt, w, g in zip(PROMPTS, want, got):
    assert g['decoded_ids'] == w['decoded_ids'] == full_recompute_greedy(grown.model, params, prompt.ids, 100)
    np.testing.assert_allclose(g['token_logprobs'], w['token_logprobs'], atol=1e-5)


def test_stop_strings_end_rows_across_a_growing_cache():
  """Stop strings looked for every STOP_CHECK_EVERY tokens while the cache grows under the loop (first_cache
  16: 32, 64 and 116 slots): each row ends where the token-by-token rules end it. Sampled rows (the same draws
  with and without stop strings), since a tiny model's greedy text soon repeats itself."""
  setup = engine.build(config.resolve('paxcli.models.LmExperiment', TINY + ['MAX_SEQ_LEN=128'] +
                                      GROWING['gqa_rotary_unrolled']))
  params = engine.init_state(setup, 4)['params']
  decoder = Decoder(setup, params, first_cache=16)
  steps = 100
  sampled = dict(max_decode_steps=steps, temperature=1.0, seed=7)
  free, _ = decoder.run(PROMPTS, DecodeOptions(**sampled))
  tok = _CharTokenizer()
  for start in (20, 52):   # a text a row first writes after the cache's first growth (token 16), its second (48)
    text = next(tok.decode(r['decoded_ids'][j:j + w]) for w in range(2, 12) for r in free
                for j in range(start, steps - w)
                if tok.decode(r['decoded_ids'][j:j + w]) not in tok.decode(r['decoded_ids'][:j + w - 1]))
    got, _ = decoder.run(PROMPTS, DecodeOptions(stop=(text,), **sampled), tokenizer=tok)
    for prompt, f, g in zip(PROMPTS, free, got):
      assert (g['decoded_ids'], g['stop_reason']) == _reference_stops(f['decoded_ids'], (), (text,), 0, tok, prompt.ids)
    assert any(g['stop_reason'] == 'stop_string' and g['num_decoded_tokens'] > start for g in got)


def _greedy_logits(model, params, prompt, steps):
  """Logits [steps, V] of greedy decoding one row with the model's cache (init_cache and extend, no Decoder)."""
  import jax
  import jax.numpy as jnp
  extend = jax.jit(model.extend, static_argnames='last_only')
  cache = model.init_cache(params, 1, len(prompt) + steps)
  logits, cache = extend(params, cache, jnp.asarray([prompt]), jnp.arange(len(prompt))[None], last_only=True)
  out = [np.asarray(logits[0, -1])]
  for t in range(steps - 1):
    tok = jnp.argmax(out[-1])[None, None]
    logits, cache = extend(params, cache, tok, jnp.asarray([[len(prompt) + t]]))
    out.append(np.asarray(logits[0, -1]))
  return np.stack(out)


def test_the_transposed_logits_table_decodes_as_the_tied_table(plain, monkeypatch):
  """On a CPU a cache holds the tied embedding table transposed (made once by init_cache, in the same form whatever
  its rows); decoding one row with it gives the logits of the product with the table itself (what accelerators
  and batches run)."""
  import jax
  from paxcli.models import lm
  cache = plain.model.init_cache(plain.params, 1, 8)
  table = np.asarray(jax.tree.leaves(plain.params['embedding'])[0])
  np.testing.assert_array_equal(np.asarray(cache[lm.LOGITS_TABLE].value), table.T)
  two_rows = plain.model.init_cache(plain.params, 2, 8)
  assert jax.tree.structure(two_rows) == jax.tree.structure(cache)   # a server's rows change; its cache's form not
  transposed = _greedy_logits(plain.model, plain.params, PROMPTS[0].ids, 12)
  monkeypatch.setattr(lm, 'logits_table_for_decoding', lambda: False)
  assert lm.LOGITS_TABLE not in plain.model.init_cache(plain.params, 1, 8)
  tied = _greedy_logits(plain.model, plain.params, PROMPTS[0].ids, 12)
  np.testing.assert_array_equal(transposed.argmax(-1), tied.argmax(-1))
  np.testing.assert_allclose(transposed, tied, atol=1e-5)


LLAMA_LIKE = ['NUM_KV_HEADS=2', 'POSITION_EMBEDDING="rotary"', 'NORM_TYPE="rmsnorm"', 'USE_GATED_ACTIVATION=True',
              'ACTIVATION="silu"', 'USE_BIAS=False']


@pytest.fixture(scope='module', params=['tied', 'untied'])
def llama_like(request):
  return _decoder(LLAMA_LIKE + (['SEPARATE_EMBEDDING=True'] if request.param == 'untied' else []))


def test_decoding_joins_products_and_decodes_the_tokens_of_the_separate_ones(llama_like):
  """On a CPU the decoder joins query/key/value and wi_0/wi_1 into one product each (fuse_for_decoding),
  and lays an untied output projection out as [V, D]; its tokens are those of recomputation with the
  checkpoint's separate kernels, its log-probabilities the teacher-forced ones."""
  import jax
  from paxcli.layers import transformer
  from paxcli.models import lm
  run = jax.tree_util.tree_flatten_with_path(llama_like._run_params)[0]
  names = {'/'.join(str(getattr(k, 'key', k)) for k in path) for path, _ in run}
  joined = [n for n in names if n.split('/')[-1].startswith((transformer.FUSED_QKV, transformer.FUSED_WI))]
  assert joined and not any(n.split('/')[-2] in ('query', 'key', 'value', 'wi_0', 'wi_1') for n in names)
  if llama_like.model.lm_tpl.separate_embedding:
    assert any(n.endswith('logits/' + lm.LOGITS_KERNEL_T) for n in names)
  records, _ = llama_like.run(PROMPTS, DecodeOptions(max_decode_steps=10))
  for prompt, r in zip(PROMPTS, records):
    assert r['decoded_ids'] == full_recompute_greedy(llama_like.model, llama_like.params, prompt.ids, 10)
    tf = teacher_forced_logprob(llama_like.model, llama_like.params, prompt.ids, r['decoded_ids'])
    assert r['logprob'] == pytest.approx(tf, abs=1e-4)


@pytest.mark.parametrize('transposed', [False, True], ids=['DxN', 'NxD'])
def test_joined_products_give_the_logits_of_the_separate_ones(llama_like, transposed):
  """Both layouts of the joined kernels (AVX2's [N, D], AVX-512's [D, N]; with [N, D] the attention's `out`
  and the MLP's `wo` after them are laid out so too) decode the logits of the separate kernels, step by step
  with the cache, within float32 rounding; the checkpoint's params are left as they were."""
  import jax
  from paxcli.layers.transformer import KERNEL_T, fuse_for_decoding
  params = llama_like.params
  before = jax.tree.map(np.asarray, params)
  fused, shardings = fuse_for_decoding(params, llama_like.setup.state_shardings['params'], transposed)
  assert jax.tree.structure(fused) == jax.tree.structure(shardings)
  keys = {str(getattr(k, 'key', k)) for path, _ in jax.tree_util.tree_flatten_with_path(fused)[0] for k in path}
  alone = keys & {'out' + KERNEL_T, 'wo' + KERNEL_T}
  assert alone == ({'out' + KERNEL_T, 'wo' + KERNEL_T} if transposed else set())
  separate = _greedy_logits(llama_like.model, params, PROMPTS[2].ids, 8)
  joined = _greedy_logits(llama_like.model, fused, PROMPTS[2].ids, 8)
  np.testing.assert_array_equal(separate.argmax(-1), joined.argmax(-1))
  np.testing.assert_allclose(separate, joined, atol=1e-5, rtol=1e-5)
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, params))
