"""The prompts GRPO samples from (paxcli.loops.rollout): JSONL records, each a prompt and the fields its
reward functions read.

  {"prompt": "What is two plus three?", "answer": "five"}
  {"prompt": [{"role": "user", "content": "What is two plus three?"}], "answer": "five"}

A text prompt is read as it is (the tokenizer's BOS first where it puts one); a list of messages (TRL's
conversational format) through the tokenizer's own chat template with the generation prompt, or paxcli's own
format (paxcli.inputs.sft) for a tokenizer paxcli trained or CHAT_TEMPLATE='paxcli'. Every other field is kept
as it is (any JSON value) and handed to the reward functions by name.

Every record is read and checked when the input is made, before anything compiles: a line that is not a JSON
object, a missing or empty prompt, a field a reward function needs that is missing, and a prompt that leaves
no room for a completion in MAX_SEQ_LEN are each one line naming the file and line. Prompts are small: the
files are read whole (each at most MAX_PROMPT_FILE_BYTES).

The order: epoch e is a permutation of all records drawn from (seed, e); `take(n)` gives the next n, the same on
every process (each process decodes the whole rollout batch); `position` is how many were taken, which a resume
restores.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.inputs import chat_template, documents, sft, tokenizers
from paxcli.inputs.base import BaseInput

MAX_PROMPT_FILE_BYTES = 256 << 20
PROMPT_FIELD = 'prompt'
_ORDER = 3   # the random stream of the epochs' order (seeded [seed, _ORDER, epoch])


class PromptRow(NamedTuple):
  ids: list            # the prompt's token ids
  text: str            # the prompt as text (a chat: as the template rendered it)
  record: dict         # the record's other fields
  where: str           # file:line


@dataclasses.dataclass
class RolloutPromptsInput(BaseInput):
  """Prompts and their fields from JSONL files (module docstring); `seq_len` is MAX_SEQ_LEN and
  `completion_room` the completion tokens each prompt must leave room for."""
  data: str = ''
  tokenizer: Optional[str] = None
  chat_template: str = ''
  seq_len: int = 128
  completion_room: int = 1
  required_fields: tuple = ()
  vocab_size: int = 0

  def __post_init__(self):
    super().__post_init__()
    if not self.tokenizer:
      raise UserError('GRPO reads its prompts with the model\'s tokenizer: set BASE (an imported model) or '
                      'TOKENIZER (a tokenizer.json or sentencepiece .model).')
    self._tok = tokenizers.load_for_documents(self.tokenizer)
    note = tokenizers.check_fits(self._tok.vocab_size, self.vocab_size, self._tok.path)
    self.notes = [note] if note else []
    self._chat = None
    self.rows = self._read_all()
    self.position = 0
    self._epoch = None   # (epoch, its permutation of the rows)

  # ---- the contract -------------------------------------------------------------------------

  def tokenizer_file(self) -> Optional[str]:
    return self._tok.path

  @property
  def tok(self):
    return self._tok

  def take(self, n: int) -> list[tuple[int, PromptRow]]:
    """The next n prompts, each with its place in the whole order (its index among all prompts taken)."""
    out = [(self.position + i, self.rows[self._order(self.position + i)]) for i in range(n)]
    self.position += n
    return out

  def get_next(self) -> dict:
    raise UserError('This input holds GRPO prompts: the train loop samples completions of them '
                    '(paxcli.loops.rollout); it gives no LM batches.')

  # ---- reading --------------------------------------------------------------------------------

  def _order(self, k: int) -> int:
    epoch, at = divmod(k, len(self.rows))
    if self._epoch is None or self._epoch[0] != epoch:
      self._epoch = (epoch, np.random.default_rng([self.seed, _ORDER, epoch]).permutation(len(self.rows)))
    return int(self._epoch[1][at])

  def _read_all(self) -> list[PromptRow]:
    rows = []
    for path in documents.expand(self.data):
      if not path.endswith('.jsonl'):
        raise UserError(f'GRPO prompts are JSONL files ({{"prompt": ..., "answer": ...}} a line); {path} is not '
                        'one (.jsonl).')
      text = files.read_text(path, 'the prompts file', MAX_PROMPT_FILE_BYTES)
      for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
          rows.append(self._row(line, f'{path}:{n}'))
    if not rows:
      raise UserError(f'No prompts in {shorten(self.data, 200)}: write one JSON object a line, '
                      '{"prompt": ..., "answer": ...}.')
    return rows

  def _row(self, line: str, where: str) -> PromptRow:
    obj = files.parse_json(line, where)
    if not isinstance(obj, dict):
      raise UserError(f'{where}: expected a JSON object with "prompt", got {shorten(line, 80)!r}.')
    prompt = obj.get(PROMPT_FIELD)
    missing = [f for f in self.required_fields if f not in obj]
    if missing:
      raise UserError(f'{where}: no {missing[0]!r} field, which the reward function reads; its fields are '
                      f'{shorten(", ".join(map(repr, obj)), 160)}.')
    if isinstance(prompt, str) and prompt.strip():
      ids, text = self._text_prompt(prompt, where), prompt
    elif isinstance(prompt, list) and prompt:
      ids, text = self._chat_prompt(prompt, where)
    else:
      raise UserError(f'{where}: "prompt" must be a non-empty string or a list of {{"role", "content"}} messages, '
                      f'got {shorten(repr(prompt), 80)}.')
    room = self.seq_len - self.completion_room
    if len(ids) > room:
      raise UserError(f'{where}: the prompt has {len(ids)} tokens; rows of MAX_SEQ_LEN={self.seq_len} leave room '
                      f'for {room} beside MAX_COMPLETION_LENGTH={self.completion_room}. Shorten it, raise '
                      'MAX_SEQ_LEN or lower MAX_COMPLETION_LENGTH.')
    return PromptRow(ids, text, {k: v for k, v in obj.items() if k != PROMPT_FIELD}, where)

  def _text_prompt(self, prompt: str, where: str) -> list:
    files.check_unicode(prompt, where)
    bos = [self._tok.bos_id] if self._tok.bos_first else []
    return bos + self._tok.encode(prompt)

  def _chat_prompt(self, messages: list, where: str) -> tuple[list, str]:
    """A conversation with the generation prompt after it: the tokenizer's template, else paxcli's own."""
    own = self.chat_template == chat_template.OWN
    if not own and self._chat is None:
      self._chat = chat_template.of_tokenizer(self._tok, self.chat_template)
      if self._chat is None and not self._tok.trained_here():
        raise chat_template.no_template(where, self._tok, f'CHAT_TEMPLATE={chat_template.OWN}')
    if self._chat is not None and not own:
      text = self._chat.render(_checked_messages(messages, where), True, where)
      return self._tok.encode_rendered(text)[0], text
    chunks = sft.generation_prompt(messages, where)
    text = ''.join(c.text for c in chunks)
    bos = [self._tok.bos_id] if self._tok.bos_first else []
    return bos + [i for c in chunks for i in self._tok.encode(c.text)], text


def _checked_messages(messages: Sequence[Any], where: str) -> list:
  sft.chat(messages, where)   # the same checks as a chat record's (role, content)
  return list(messages)
