"""`pax decode` through the CLI: option errors are one line, the text reads as the model wrote it,
EOS can be ignored, and rates leave compilation out. A tiny model, float32, fresh weights."""

import io
import json
import os
import random

import pytest

from conftest import pax_main

TINY = ['VOCAB_SIZE=64', 'MODEL_DIMS=32', 'HIDDEN_DIMS=64', 'NUM_HEADS=4', 'MAX_SEQ_LEN=32', 'PERCORE_BATCH_SIZE=1']
CLI = ['decode', '--exp', 'paxcli.models.LmExperiment'] + [a for s in TINY for a in ('--set', s)]


@pytest.mark.parametrize('args, message', [
    (['--temperature', 'nan'], '--temperature must be a finite number'),
    (['--temperature', 'inf'], '--temperature must be a finite number'),
    (['--temperature', '-0.5'], '--temperature must be a finite number at least 0'),
    (['--beam-size', '2', '--length-penalty', 'nan'], '--length-penalty must be a finite number'),
    (['--beam-size', '2', '--length-penalty', '-inf'], '--length-penalty must be a finite number'),
    (['--stop', ''], "--stop '' is empty"),
    (['--seed', str(10 ** 24)], '--seed must be between 0 and 4294967295'),
    (['--seed', str(2 ** 32 + 5)], '--seed must be between 0 and 4294967295'),  # would repeat --seed 5
    (['--seed', '-1'], '--seed must be between 0 and 4294967295'),
    (['--prompt', 'caf\udce9'], 'is not UTF-8 text (byte 0xe9'),       # argv bytes b'caf\xe9'
    (['--stop', '\udcff'], "--stop '\\udcff' is not UTF-8 text"),
    (['--prompts-file', '/dev/zero'], 'is a character device, not a regular file'),
    (['--prompts-file', '{tmp}/fifo'], 'is a FIFO (named pipe), not a regular file'),
    (['--top-k', '65'], '--top-k 65 is above the vocabulary size 64'),
    (['--beam-size', '65'], '--beam-size 65 is above the vocabulary size 64'),
    (['--output', '{tmp}/a_file/out.jsonl'], 'is not a directory'),
    (['--output', '{tmp}'], 'is a directory'),
    (['--min-length', '-1'], '--min-length must be at least 0'),
])
def test_bad_options_are_one_line_before_any_decoding(tmp_path, capsys, args, message):
  os.mkfifo(tmp_path / 'fifo')
  (tmp_path / 'a_file').write_text('x')
  args = [a.replace('{tmp}', str(tmp_path)) for a in args]
  prompt = [] if '--prompt' in args or '--prompts-file' in args else ['--prompt-ids', '1,2']
  code, out, err = pax_main(CLI + ['--no-checkpoint', '--job-log-dir', str(tmp_path / 'job')] + prompt + args,
                            capsys)
  assert code == 2, (out, err)
  assert message in ' '.join(err.split()), err
  assert 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
  assert 'Decoded' not in out and not (tmp_path / 'job' / 'decoder_out').exists()


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes anywhere')
def test_an_unwritable_output_directory_is_refused_before_decoding(tmp_path, capsys):
  locked = tmp_path / 'locked'
  locked.mkdir()
  locked.chmod(0o500)
  code, out, err = pax_main(CLI + ['--no-checkpoint', '--prompt-ids', '1', '--output', str(locked / 'o.jsonl')],
                            capsys)
  locked.chmod(0o700)
  assert code == 2 and 'is not writable' in err and 'Traceback' not in err


def _tokenizer(job):
  """A 40-piece sentencepiece model in the job directory, as `pax train` leaves it."""
  import sentencepiece as spm
  words = 'the cat sat on a mat and the dog ran to the park with some friends every day of the week'.split()
  rng = random.Random(0)
  lines = [' '.join(rng.choice(words) for _ in range(12)) for _ in range(300)]
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=40,
                                 model_type='unigram', pad_id=0, eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
  (job / 'tokenizer').mkdir(parents=True)
  (job / 'tokenizer' / 'spm.model').write_bytes(model.getvalue())
  return spm.SentencePieceProcessor(model_proto=model.getvalue())


def test_prompt_plus_decoded_reads_as_the_model_wrote_it_and_eos_can_be_ignored(tmp_path, capsys):
  job = tmp_path / 'job'
  sp = _tokenizer(job)
  args = CLI + ['--set', 'VOCAB_SIZE=40', '--no-checkpoint', '--job-log-dir', str(job), '--prompt', 'the cat',
                '--prompt', 'a dog ran', '--max-decode-steps', '6', '--num-samples', '4', '--temperature', '1',
                '--eos-id', '3', '--ignore-eos', '--output', str(tmp_path / 'out.jsonl')]
  code, out, err = pax_main(args, capsys)
  assert code == 0, err
  assert 'compilation' in err and 'not in the rates' in err and 'compile time included' not in err
  records = [json.loads(x) for x in open(tmp_path / 'out.jsonl')]
  assert len(records) == 8
  word_starts = 0
  for r in records:
    # --eos-id 3 ('▁the', frequent) with --ignore-eos: every row runs its six tokens
    assert r['num_decoded_tokens'] == 6 and r['stop_reason'] == 'max_steps'
    assert r['prompt'] + r['decoded'] == sp.decode(r['prompt_ids'] + r['decoded_ids'])
    word_starts += sp.id_to_piece(r['decoded_ids'][0]).startswith('▁')
  assert word_starts > 0  # the case sentencepiece decodes without its space when alone
  # --min-length: EOS does not stop a row before it
  code, out, err = pax_main(CLI + ['--set', 'VOCAB_SIZE=40', '--no-checkpoint', '--job-log-dir', str(job),
                                   '--prompt', 'the cat', '--max-decode-steps', '6', '--num-samples', '4',
                                   '--temperature', '1', '--eos-id', '3', '--min-length', '4', '--json'], capsys)
  assert code == 0, err
  rows = [json.loads(x) for x in out.splitlines()]
  assert all(r['num_decoded_tokens'] >= 4 for r in rows)
  assert all(3 not in r['decoded_ids'][3:-1] for r in rows)  # from the 4th token on, EOS stops the row


def test_a_model_that_does_not_generate_tokens_is_one_line(tmp_path, capsys):
  """The classifier has no decoding interface (init_cache, extend): one line, no traceback."""
  code, out, err = pax_main(['decode', '--exp', 'classify.StdlibDocsClassifier', '--no-checkpoint',
                             '--job-log-dir', str(tmp_path / 'job'), '--prompt-ids', '1,2'], capsys)
  assert code != 0
  assert 'does not generate tokens' in err and 'DecodingModel' in err, err
  assert 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
