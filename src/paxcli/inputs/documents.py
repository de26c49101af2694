"""Documents from the user's files: globs, formats, the eval split and per-process sharding.

Formats, by file name (a trailing `.gz` is read through gzip for .txt and .jsonl):
  .txt                  one document per block of lines between blank lines: blank lines are
                        the one separator plain text has, and a single .txt file (a book, a
                        dump) then still gives many documents for the eval split and for the
                        processes to share. Keep a file whole by writing it as one JSONL record.
  .jsonl, .ndjson       one JSON object per line (paxcli.inputs.sft: TEXT_FIELD, prompt and
                        completion, or chat messages)
  .parquet              one row per record, the same fields as JSONL (pyarrow)
  .arrow                one row per record, the same fields: Arrow IPC files as Hugging Face
                        `datasets` writes them (save_to_disk, its cache), memory-mapped, each
                        row checked against the document bound before it is read
  .tfrecord(s)          tf.train.Example records, the same fields as bytes features
  .array_record         tf.train.Example records in ArrayRecord files (local files only)
Sharded names (`train.tfrecord-00001-of-00064`) count by the part before the dash. Paths
with a scheme (`gs://bucket/x/*.jsonl`) are globbed and read through tf.io.gfile.

Hugging Face datasets, beside these: a directory `datasets`' save_to_disk wrote is read as its
state.json lists its .arrow files (a DatasetDict's: its train split); `hf://datasets/Org/name`
is a dataset of the Hub, from the local Hugging Face cache (downloaded there when missing and
online: paxcli.inputs.hub), its train split's files (`hf://datasets/Org/name/GLOB` picks others).
Only the data files are read: a dataset's loading script is never fetched nor run.

The eval split: when the experiment gives no EVAL_DATA, a document belongs to the eval side
when the SHA-1 of its text falls in 1 bucket of EVAL_BUCKETS (1 in 20); the train side
keeps the rest. The split depends on the text alone (not the file's path or order), so it
is the same on every machine and in every run, the two sides never share a document, and
a document repeated in the data is on one side only.

Bad input stops with one line naming the file and line (or row, or record); a reader given an
`errors` list instead collects those lines and reads on (`pax data prepare` checks all at once).
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import hashlib
import importlib.util
import io
import itertools
import os
import re
from typing import Iterator, Optional, Sequence

from paxcli.errors import UserError, shorten
from paxcli.files import check_regular_file, member, parse_json, read_json, rest_of_line
from paxcli.inputs import bounds, hub, sft
from paxcli.inputs.prepared import array_records
from paxcli.inputs.tfrecord import import_tf

EVAL_BUCKETS = 20
FORMATS = {'.txt': 'text', '.jsonl': 'jsonl', '.ndjson': 'jsonl', '.parquet': 'parquet', '.arrow': 'arrow',
           '.tfrecord': 'tfrecord', '.tfrecords': 'tfrecord', '.array_record': 'array_record'}
_TRAIN_SPLIT = re.compile(r'(^|[/_.-])train([/_.-]|$)')   # datasets' names of a train split's files
_SHARD_SUFFIX = re.compile(r'-\d+-of-\d+$')


@dataclasses.dataclass(frozen=True)
class Document:
  chunks: tuple[sft.Chunk, ...]
  where: str  # 'file line N' (or row, record): where errors point
  messages: Optional[list] = None  # a chat's, for a model's own template (paxcli.inputs.chat_template)

  def text(self) -> str:
    return ''.join(c.text for c in self.chunks)


def record_document(record: dict, text_field: str, where: str) -> Document:
  """The document of a record (paxcli.inputs.sft), keeping a chat's messages; a record of more
  text than bounds.max_line_bytes() characters (a Parquet cell, a tf.train.Example) is a UserError."""
  chat = sft.kind_of(record, text_field) == 'chat'
  doc = Document(sft.from_record(record, text_field, where), where, record['messages'] if chat else None)
  size, limit = sum(len(c.text) for c in doc.chunks), bounds.max_line_bytes()
  if size > limit:
    raise UserError(f'{where}: a document of {size:,} characters; paxcli reads documents of at most {limit:,} '
                    '(PAXCLI_MAX_LINE_BYTES raises the bound).')
  return doc


def is_remote(path: str) -> bool:
  return '://' in path


def format_of(path: str) -> str:
  """The format a file is read as, from its name; UserError for a name paxcli cannot read."""
  name = os.path.basename(path)
  if name.endswith('.gz'):
    name = name[:-3]
    allowed = ('.txt', '.jsonl', '.ndjson')
  else:
    allowed = tuple(FORMATS)
  name = _SHARD_SUFFIX.sub('', name)
  ext = os.path.splitext(name)[1]
  if ext not in allowed:
    raise UserError(f'{shorten(path, 200)}: paxcli reads {", ".join(FORMATS)} files (and .txt.gz, .jsonl.gz); '
                    f'this name ends in {ext or "no extension"!r}.')
  return FORMATS[ext]


def expand(pattern: str) -> list[str]:
  """Sorted files of a glob (`**` for any depth), or the readable files under a directory.

  UserError when none matches, or when a glob matches a file of an unknown format. The files
  of a directory, or of a glob's directory (the part before its first wildcard), stay in it: a
  symlink among them that resolves outside it (`shadow.txt -> /etc/shadow`) is a UserError,
  never read. A file named whole (no wildcard) is read wherever it is.
  """
  cached = hub.dataset_pattern(pattern)   # hf://datasets/Org/name: its files in the Hugging Face cache
  if cached is not None:
    files, base = _hub_dataset_files(cached, pattern), cached if os.path.isdir(cached) else _glob_base(cached)
  elif is_remote(pattern):
    gfile = import_tf().io.gfile
    files, base = [p for p in gfile.glob(pattern) if not gfile.isdir(p)], None
  elif os.path.isdir(os.path.expanduser(pattern)):
    base = os.path.expanduser(pattern)
    files = _saved_dataset(base)
    if files is None:
      files = [p for p in _walk(base) if os.path.isfile(p) and _readable_name(p)]
  else:
    path = os.path.expanduser(pattern)
    files = [p for p in glob.glob(path, recursive=True) if not os.path.isdir(p)]
    base = _glob_base(path) if glob.has_magic(path) else None
  if not files:
    raise UserError(f'No file matches {shorten(repr(pattern), 200)}.')
  files = sorted(files)
  for path in files:
    format_of(path)
    if base is not None:
      member(base, os.path.relpath(path, base), 'data file')
  return files


def _saved_dataset(directory: str) -> Optional[list[str]]:
  """The .arrow files of a directory `datasets`' save_to_disk wrote, in its state.json's order (a
  DatasetDict's: its train split's); None for another directory."""
  if os.path.isfile(os.path.join(directory, 'dataset_dict.json')):
    splits = _json_file(directory, 'dataset_dict.json').get('splits')
    if not isinstance(splits, list) or 'train' not in splits:
      raise UserError(f'{directory} is a saved DatasetDict of the splits {shorten(repr(splits), 100)}; paxcli trains on '
                      'its "train" split: name the split\'s directory (TRAIN_DATA=DIR/SPLIT).')
    directory = member(directory, 'train', 'split')
  if not os.path.isfile(os.path.join(directory, 'state.json')):
    return None
  listed = _json_file(directory, 'state.json').get('_data_files')
  if not isinstance(listed, list) or not all(isinstance(f, dict) and isinstance(f.get('filename'), str) for f in listed):
    raise UserError(f'{directory}/state.json: _data_files must list {{"filename": ...}} entries, as save_to_disk '
                    'writes them.')
  return [member(directory, f['filename'], 'data file') for f in listed]


def _json_file(directory: str, name: str) -> dict:
  value = read_json(member(directory, name, 'dataset file'), name, 16 << 20)
  if not isinstance(value, dict):
    raise UserError(f'{directory}/{name}: a JSON object is needed.')
  return value


def _hub_dataset_files(local: str, pattern: str) -> list[str]:
  """The readable files of a Hub dataset's snapshot (`local`: the directory, or a glob in it): with no glob
  given, its train split's when its files name splits (data/train-00000-of-00001.parquet), else all."""
  if not os.path.isdir(local):
    return [p for p in glob.glob(local, recursive=True) if not os.path.isdir(p)]
  files = [p for p in _walk(local) if _readable_name(p)]
  train = [p for p in files if _TRAIN_SPLIT.search(os.path.relpath(p, local))]
  if not files:
    raise UserError(f'{shorten(pattern, 200)}: the dataset holds no file paxcli reads ({", ".join(FORMATS)}); '
                    'paxcli never runs a dataset\'s loading script.')
  return train or files


def _walk(directory: str) -> Iterator[str]:
  """The files under `directory`, at any depth, hidden ones (.name) left out as a glob leaves them;
  a symlinked directory is not entered (a symlinked file is listed, and checked by the caller)."""
  for parent, dirs, names in os.walk(directory):
    dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
    yield from (os.path.join(parent, n) for n in names if not n.startswith('.'))


def _glob_base(pattern: str) -> str:
  """The directory of a glob: its leading components without a wildcard ('.' for none)."""
  parts = pattern.split(os.sep)
  literal = list(itertools.takewhile(lambda part: not glob.has_magic(part), parts[:-1]))
  return os.sep.join(literal) or (os.sep if pattern.startswith(os.sep) else '.')


def _readable_name(path: str) -> bool:
  try:
    format_of(path)
  except UserError:
    return False
  return True


def file_stamp(path: str) -> tuple[int, int]:
  """(size, modification time in ns): what tells a changed file from the one a cache was made of."""
  if is_remote(path):
    st = import_tf().io.gfile.stat(path)
    return int(st.length), int(st.mtime_nsec)
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns


def in_eval_split(doc: Document) -> bool:
  sha1 = hashlib.sha1()
  for chunk in doc.chunks:  # a slice at a time: a 100 MB document is not copied whole to be hashed
    for start in range(0, len(chunk.text), 1 << 20):
      sha1.update(chunk.text[start:start + (1 << 20)].encode('utf-8', 'surrogatepass'))
  return int.from_bytes(sha1.digest()[:8], 'big') % EVAL_BUCKETS == 0


def read(path: str, text_field: str, errors: Optional[list[str]] = None) -> Iterator[Document]:
  """The documents of one file, in file order. With `errors`, a bad line, row or record is
  appended to it (its one line) and skipped; a file that cannot be read at all still raises."""
  return _READERS[format_of(path)](path, text_field, errors)


def read_split(path: str, text_field: str, split: str) -> Iterator[Document]:
  """The documents of one file on one side of the eval split ('train', 'eval') or all ('all')."""
  for doc in read(path, text_field):
    if split == 'all' or in_eval_split(doc) == (split == 'eval'):
      yield doc


# ---- per-process sharding ----------------------------------------------------------------------


def host_share(files: Sequence[str], num_hosts: int, host: int) -> tuple[list[str], Optional[tuple[int, int]]]:
  """(files this process reads, (n, i) when it keeps only documents i, i+n, ... of them).

  With at least as many files as processes each reads whole files (files[i::n]); with fewer,
  every process reads every file and keeps every n-th document. Either way no two processes
  see one document, and together they see them all.
  """
  if num_hosts <= 1:
    return list(files), None
  if len(files) >= num_hosts:
    return list(files[host::num_hosts]), None
  return list(files), (num_hosts, host)


def keep_share(docs: Iterator[Document], share: Optional[tuple[int, int]]) -> Iterator[Document]:
  if share is None:
    yield from docs
    return
  n, i = share
  for k, doc in enumerate(docs):
    if k % n == i:
      yield doc


# ---- readers, one per format ---------------------------------------------------------------------


def _open(path: str):
  """A buffered binary file object (readline takes a bound): local files are checked to be regular
  files first (never a FIFO)."""
  if is_remote(path):
    return io.BufferedReader(_RemoteFile(import_tf().io.gfile.GFile(path, 'rb')), 1 << 20)
  check_regular_file(path, 'data file')
  return open(path, 'rb')


class _RemoteFile(io.RawIOBase):
  """tf.io.gfile's GFile as a raw file, for io.BufferedReader (GFile's own readline has no bound)."""

  def __init__(self, gfile):
    super().__init__()
    self._gfile = gfile

  def readable(self) -> bool:
    return True

  def readinto(self, buffer) -> int:
    data = self._gfile.read(len(buffer))
    buffer[:len(data)] = data
    return len(data)

  def close(self) -> None:
    self._gfile.close()
    super().close()


def _document(make, errors: Optional[list[str]]) -> Optional[Document]:
  """make() (a record_document); with `errors`, None and the UserError's line kept instead of raised."""
  try:
    return make()
  except UserError as e:
    if errors is None:
      raise
    errors.append(str(e))
    return None


def _lines(path: str, errors: Optional[list[str]] = None) -> Iterator[tuple[int, list[str]]]:
  """(line number, [text]) of a text file, gzip-decompressed by name; UserError for non-UTF-8 or a
  line over bounds.max_line_bytes() (after gunzip: a small .gz never expands into one huge line in
  memory); with `errors` the line's message is kept there and the line skipped. The text comes in a
  list for the reader to pop: a generator's variable would hold a long line while its document is
  tokenized."""
  limit = bounds.max_line_bytes()
  with _open(path) as raw:
    f = gzip.GzipFile(fileobj=raw) if path.endswith('.gz') else raw
    try:
      n = 0
      while True:
        line = f.readline(limit + 1)  # bounded read: never more than the limit in memory
        if not line:
          return
        n += 1
        if len(line) > limit and not line.endswith(b'\n'):
          del line
          rest_of_line(f)
          _bad(errors, f'{path} line {n}: a line of more than {limit:,} bytes{" (after gunzip)" if f is not raw else ""}; '
                       f'paxcli reads lines of at most that (PAXCLI_MAX_LINE_BYTES raises the bound).')
          continue
        try:
          text = line.decode('utf-8')
        except UnicodeDecodeError as e:
          _bad(errors, f'{path} line {n}: not UTF-8 text (byte {e.start + 1} of the line).')
          continue
        del line  # the bytes go before the text is used: a long line is held once, not twice
        box = [text]
        del text
        yield n, box
    except (OSError, EOFError) as e:  # a truncated or corrupt .gz
      raise UserError(f'{path}: cannot read it ({e}).') from None


def _bad(errors: Optional[list[str]], message: str) -> None:
  """Raises `message` as a UserError, or keeps it in `errors` (the caller then skips the input)."""
  if errors is None:
    raise UserError(message)
  errors.append(message)


def _read_text(path: str, text_field: str, errors: Optional[list[str]] = None) -> Iterator[Document]:
  """Blocks of lines between blank lines; a block over bounds.max_line_bytes() characters is one
  error (its first line named), as a line over it is."""
  del text_field
  limit = bounds.max_line_bytes()
  block, first, size = [], 0, 0
  for n, box in _lines(path, errors):
    line = box.pop()
    if line.strip():
      first = first or n
      size += len(line)
      if size <= limit:
        block.append(line)
      elif block:
        block = []
        _bad(errors, f'{path} line {first}: a block of text (a document: the lines up to a blank one) of more than '
                     f'{limit:,} characters; paxcli reads documents of at most that (PAXCLI_MAX_LINE_BYTES raises '
                     'the bound).')
    else:
      if block:
        yield Document(sft.text_document(''.join(block).rstrip()), f'{path} line {first}')
      block, first, size = [], 0, 0
  if block:
    yield Document(sft.text_document(''.join(block).rstrip()), f'{path} line {first}')


def _read_jsonl(path: str, text_field: str, errors: Optional[list[str]] = None) -> Iterator[Document]:
  for n, box in _lines(path, errors):
    if not box[0] or box[0].isspace():
      continue
    where = f'{path} line {n}'  # the line's text goes once parsed: a long line is not held beside its record
    doc = _document(lambda: record_document(_json_object(box.pop(), where, text_field), text_field, where),
                    errors)
    if doc is not None:
      yield doc


def json_records(path: str) -> Iterator[tuple[str, dict]]:
  """('file line N', the JSON object) of each non-blank line of a .jsonl file (gzipped by name), with the
  bounds and messages documents get: for readers of records that are not documents (preference pairs)."""
  if format_of(path) != 'jsonl':
    raise UserError(f'{path}: preference pairs are read from JSONL files (.jsonl, .jsonl.gz), one JSON object a '
                    'line.')
  for n, box in _lines(path):
    if box[0] and not box[0].isspace():
      where = f'{path} line {n}'
      yield where, _json_object(box.pop(), where, 'prompt')


def _json_object(line: str, where: str, text_field: str) -> dict:
  """The JSON object of a line (files.parse_json: bounded depth and numbers, no NaN)."""
  try:
    record = parse_json(line, where)
  except UserError as e:
    raise UserError(str(e).replace(f'{where}: not valid JSON (', f'{where}: not JSON (', 1)) from None
  if not isinstance(record, dict):
    raise UserError(f'{where}: a JSON object ({{"{text_field}": ...}}) per line is needed; this line holds '
                    f'a {type(record).__name__}.')
  return record


def _pyarrow():
  """pyarrow, with its ipc and parquet modules: slow to import (0.3 s), so only for Parquet and Arrow files."""
  import pyarrow, pyarrow.ipc, pyarrow.parquet  # noqa: E401 - one import, three modules
  return pyarrow


def _read_parquet(path: str, text_field: str, errors: Optional[list[str]] = None) -> Iterator[Document]:
  pq = _pyarrow().parquet
  with _open(path) as f:
    try:
      parquet = pq.ParquetFile(io.BytesIO(f.read()) if is_remote(path) else f)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid and ArrowIOError
      raise UserError(f'{path}: not a Parquet file ({e}).') from None
    names = parquet.schema_arrow.names
    wanted = [c for c in (text_field, 'prompt', 'completion', 'messages') if c in names]
    if not wanted:
      raise UserError(f'{path}: no column {text_field!r} (nor "prompt" and "completion", nor "messages"); its '
                      f'columns are {shorten(", ".join(names), 160)}. Set TEXT_FIELD to the column of the text.')
    row = 0
    for batch in parquet.iter_batches(batch_size=1024, columns=wanted):
      for record in batch.to_pylist():
        where = f'{path} row {row}'
        row += 1
        doc = _document(lambda: record_document({k: v for k, v in record.items() if v is not None},
                                                text_field, where), errors)
        if doc is not None:
          yield doc


def _example_record(data: bytes, where: str) -> dict:
  """A serialized tf.train.Example as {feature: first value}, bytes features only."""
  tf = import_tf()
  example = tf.train.Example()
  try:
    example.ParseFromString(data)
  except Exception:  # noqa: BLE001 - protobuf's DecodeError
    raise UserError(f'{where}: not a tf.train.Example.') from None
  return {name: feature.bytes_list.value[0] for name, feature in example.features.feature.items()
          if feature.WhichOneof('kind') == 'bytes_list' and feature.bytes_list.value}


def _read_tfrecord(path: str, text_field: str, errors: Optional[list[str]] = None) -> Iterator[Document]:
  if not is_remote(path):
    check_regular_file(path, 'data file')
  tf = import_tf()
  try:
    for n, data in enumerate(tf.data.TFRecordDataset(path).as_numpy_iterator()):
      where = f'{path} record {n}'
      doc = _document(lambda: record_document(_example_record(data, where), text_field, where), errors)
      if doc is not None:
        yield doc
  except tf.errors.DataLossError:
    raise UserError(f'{path}: not a TFRecord file (or a corrupted one).') from None


def _read_array_record(path: str, text_field: str, errors: Optional[list[str]] = None) -> Iterator[Document]:
  if is_remote(path):
    raise UserError(f'{path}: ArrayRecord files are read from local disks only; copy them first.')
  check_regular_file(path, 'data file')
  if importlib.util.find_spec('array_record') is None:  # optional: array-record has wheels for Linux and macOS only
    raise UserError('Reading ArrayRecord files needs the array-record package (pip install array-record).')
  with array_records(path) as reader:
    total = reader.num_records()
    for start in range(0, total, 1024):
      for n, data in enumerate(reader.read(start, min(start + 1024, total)), start=start):
        where = f'{path} record {n}'
        doc = _document(lambda: record_document(_example_record(data, where), text_field, where), errors)
        if doc is not None:
          yield doc


def _read_arrow(path: str, text_field: str, errors: Optional[list[str]] = None) -> Iterator[Document]:
  """An Arrow IPC file (the stream format `datasets` writes, or the file format), memory-mapped: a row is
  read into Python only once its bytes are known to be within the document bound."""
  pa = _pyarrow()
  if is_remote(path):
    raise UserError(f'{path}: Arrow files are read from local disks only; copy them first.')
  check_regular_file(path, 'data file')
  limit = bounds.max_line_bytes()
  with pa.memory_map(path) as source:
    batches, names = _arrow_batches(pa, source, path)
    wanted = [c for c in (text_field, 'prompt', 'completion', 'messages') if c in names]
    if not wanted:
      raise UserError(f'{path}: no column {text_field!r} (nor "prompt" and "completion", nor "messages"); its '
                      f'columns are {shorten(", ".join(names), 160)}. Set TEXT_FIELD to the column of the text.')
    row = 0
    for batch in batches:
      try:
        batch = batch.select(wanted)
        batch.validate(full=True)   # offsets inside their buffers, UTF-8 strings: before any value is read
      except pa.ArrowException as e:
        raise UserError(f'{path}: a damaged Arrow file ({shorten(str(e), 200)}).') from None
      for i in range(batch.num_rows):
        where, one = f'{path} row {row}', batch.slice(i, 1)
        row += 1
        if one.nbytes > limit:
          _bad(errors, f'{where}: a row of {one.nbytes:,} bytes; paxcli reads documents of at most {limit:,} '
                       '(PAXCLI_MAX_LINE_BYTES raises the bound).')
          continue
        record = one.to_pylist()[0]
        doc = _document(lambda: record_document({k: v for k, v in record.items() if v is not None}, text_field,
                                                where), errors)
        if doc is not None:
          yield doc


def _arrow_batches(pa, source, path: str):
  """(the record batches, the column names) of an Arrow IPC stream or file."""
  try:
    reader = pa.ipc.open_stream(source)
    return iter(reader), reader.schema.names
  except pa.ArrowInvalid:
    source.seek(0)
  try:
    reader = pa.ipc.open_file(source)
  except pa.ArrowInvalid as e:
    raise UserError(f'{path}: not an Arrow file ({shorten(str(e), 160)}).') from None
  return (reader.get_batch(i) for i in range(reader.num_record_batches)), reader.schema.names


_READERS = {'text': _read_text, 'jsonl': _read_jsonl, 'parquet': _read_parquet, 'arrow': _read_arrow,
            'tfrecord': _read_tfrecord, 'array_record': _read_array_record}
