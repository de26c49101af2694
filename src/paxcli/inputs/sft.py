"""Records to documents: plain text, prompt/completion pairs and chat messages.

A document is a sequence of chunks of text, each trained on or not, some followed by the
end-of-text token (EOS). A record (a JSONL line, a Parquet row, a tf.train.Example) becomes:

  {TEXT_FIELD: text}                     one trained chunk, then EOS
  {"prompt": p, "completion": c}         p (weight 0), then c and EOS (weight 1)
  {"messages": [{"role", "content"}...]} the chat template below: only the assistant's
                                         contents and the EOS after each are trained on

The chat template, one message after another:

  <|system|>\\n{content}\\n        (and any other role but the assistant's, the same way)
  <|user|>\\n{content}\\n
  <|assistant|>\\n{content}<EOS>   (the content and EOS weigh 1; the marker line weighs 0)

so that a prompt written as "<|user|>\\nWhat is...\\n<|assistant|>\\n" decodes an answer that ends
with EOS. Chunks are tokenized apart, so no token straddles a prompt and its completion.

A model that ships its own chat template (tokenizer_config.json) gets that one instead:
paxcli.inputs.chat_template renders the messages a chat document keeps (Document.messages).
"""

from __future__ import annotations

import re
from typing import NamedTuple, Optional

from paxcli.errors import UserError, shorten

_ROLE = re.compile(r'^[a-z_]{1,32}$')
TRAINED_ROLE = 'assistant'


class Chunk(NamedTuple):
  text: str
  trained: bool    # loss weight 1 on its tokens (else 0)
  eos: bool = False  # the end-of-text token follows (with the chunk's weight)


def text_document(text: str) -> tuple[Chunk, ...]:
  return (Chunk(text, True, eos=True),)


def from_record(record: dict, text_field: str, where: str) -> tuple[Chunk, ...]:
  """The chunks of one record; UserError naming `where` when it has none of the known fields."""
  kind = kind_of(record, text_field)
  if kind == 'text':
    return text_document(_string(record, text_field, where))
  if kind == 'pair':
    return (Chunk(_string(record, 'prompt', where), False),
            Chunk(_string(record, 'completion', where), True, eos=True))
  if kind == 'chat':
    return chat(record['messages'], where)
  fields = ', '.join(repr(k) for k in list(record)[:8]) or 'none'
  raise UserError(f'{where}: no {text_field!r} field (nor "prompt" and "completion", nor "messages"); '
                  f'its fields are {shorten(fields, 160)}. Set TEXT_FIELD to the field that holds the text.')


def kind_of(record: dict, text_field: str) -> Optional[str]:
  """'text', 'pair' (prompt and completion) or 'chat' (messages), the first a record has; else None."""
  if text_field in record:
    return 'text'
  if 'prompt' in record and 'completion' in record:
    return 'pair'
  return 'chat' if 'messages' in record else None


def chat(messages, where: str) -> tuple[Chunk, ...]:
  """The chat template (module docstring) of a list of {"role", "content"} messages."""
  if not isinstance(messages, (list, tuple)) or not messages:
    raise UserError(f'{where}: "messages" must be a non-empty list of {{"role": ..., "content": ...}}.')
  chunks = []
  for n, message in enumerate(messages):
    if not isinstance(message, dict) or not isinstance(message.get('role'), str) or 'content' not in message:
      raise UserError(f'{where}: messages[{n}] must be {{"role": ..., "content": ...}}.')
    role = message['role']
    if not _ROLE.match(role):
      raise UserError(f'{where}: messages[{n}] has role {shorten(repr(role), 40)}; roles are lowercase words '
                      '(system, user, assistant).')
    content = _string(message, 'content', f'{where}: messages[{n}]')
    if role == TRAINED_ROLE:
      chunks += [Chunk(f'<|{role}|>\n', False), Chunk(content, True, eos=True)]
    else:
      chunks.append(Chunk(f'<|{role}|>\n{content}\n', False))
  if not chunks[-1].eos:  # every document ends with EOS; after a user's turn it trains nothing
    chunks[-1] = chunks[-1]._replace(eos=True)
  return tuple(chunks)


def generation_prompt(messages, where: str) -> tuple[Chunk, ...]:
  """The chat template's chunks of a conversation (as `chat`, without an EOS after a last turn that is not the
  assistant's), then the assistant's marker line: what a model trained on the template answers (`pax serve`)."""
  chunks = list(chat(messages, where))
  if messages[-1].get('role') != TRAINED_ROLE:
    chunks[-1] = chunks[-1]._replace(eos=False)
  return tuple(chunks) + (Chunk(f'<|{TRAINED_ROLE}|>\n', False),)


def _string(record: dict, field: str, where: str) -> str:
  value = record[field]
  if isinstance(value, bytes):
    try:
      return value.decode('utf-8')
    except UnicodeDecodeError as e:
      raise UserError(f'{where}: field {field!r} is not UTF-8 text (byte {e.start}).') from None
  if not isinstance(value, str):
    raise UserError(f'{where}: field {field!r} must be a string, got {type(value).__name__}.')
  return value
