"""The files of a job directory, on a local disk or in a bucket (gs://): the one place that tells them apart.

Every module of paxcli that reads or writes a job directory goes through these functions with the
path layout.py made; none looks at the scheme itself. A local path is a path of this machine; a
path naming a scheme (`gs://bucket/run1`) is never resolved as a local one. Buckets are read and
written with gcsfs (fsspec), the client orbax itself uses for gs:// when etils.epath is told not
to use TensorFlow's (EPATH_USE_TF=false, set here); orbax's arrays go through tensorstore's own
gcs driver. Both find credentials the usual way (application default credentials,
GOOGLE_APPLICATION_CREDENTIALS, the metadata server of a Cloud VM) and honour an emulator
(STORAGE_EMULATOR_HOST for gcsfs, TENSORSTORE_GCS_HTTP_URL for tensorstore).

A bucket that stops answering costs bounded time (`save_timeout`, PAXCLI_BUCKET_SAVE_TIMEOUT_S, 600 s
by default): a checkpoint's save ends by then (orbax's async timeout, and tensorstore's retries of
one request bounded to about half of it), a stalled connection is dropped after a minute without a
byte (tensorstore's curl settings, gcsfs's request timeout), and a request gcsfs gives up on is one
line naming the bucket (BucketError). The user's own settings of those variables win.

What a local file system gives for free is made explicit for a bucket:
  - atomic replacement: an object upload is all or nothing (`write_bytes`);
  - create-if-absent: a precondition on the object's generation (`create_new`, ifGenerationMatch=0);
  - read-modify-write without a lost update: the rewrite is conditional on the generation that was
    read, and retried when another writer came between (`update`);
  - appending: a file is rewritten whole on flush (`Appender`), as TensorFlow's gfile does on GCS.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import io
import json
import logging
import math
import os
import posixpath
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

from paxcli import files
from paxcli.errors import UserError, shorten
from paxcli.inputs import bounds

SCHEMES = {'gs': 'Google Cloud Storage'}
_SCHEME_RE = re.compile(r'^([A-Za-z][A-Za-z0-9+.-]*)://')
# A known scheme misspelt (`gs:/b/run`, `gs:b/run`, `gs//b/run`, `gs:\\b`): never a local path.
_SCHEME_TYPO_RE = re.compile(r'^(?P<scheme>' + '|'.join(SCHEMES) + r')(?::/?(?!/)|//|:\\)', re.IGNORECASE)
# Other schemes meant as a bucket: said with a did-you-mean.
_LIKE = {'gcs': 'gs', 'gc': 'gs', 'g': 'gs', 'google': 'gs'}
# Characters a bucket path may not hold: a URL gives them meaning (`?` a query, `#` a fragment, `%` an
# escape tensorstore decodes, `|` tensorstore's URL pipeline), fsspec expands them as a glob in a
# recursive delete (`*`, `?`, `[`, `]`), or no object name holds them (control characters). With any of
# them, tensorstore (the arrays) and gcsfs (every other file) would put one job under two prefixes.
_URL_MEANING = '?#%|*[]'
# GCS bucket names: lowercase letters, digits, '-', '_' and '.', 3 to 222 characters, starting and ending
# with a letter or a digit.
_BUCKET_RE = re.compile(r'^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$')

# etils.epath (orbax's paths) picks TensorFlow's gfile for gs:// when TensorFlow is installed;
# paxcli's own reads and writes, its lock's preconditions and its tests' emulator need gcsfs: one
# client for both. Set before orbax looks at any gs:// path.
os.environ['EPATH_USE_TF'] = 'false'


def _reset_epath_backend_choice() -> None:
  gpath = sys.modules.get('etils.epath.gpath')   # not imported yet: it reads EPATH_USE_TF when it is
  if gpath is not None and hasattr(getattr(gpath, '_is_tf_installed', None), 'cache_clear'):
    gpath._is_tf_installed.cache_clear()   # chosen once per process


_reset_epath_backend_choice()

BUCKET_SAVE_TIMEOUT_S = 600.0   # PAXCLI_BUCKET_SAVE_TIMEOUT_S: a checkpoint's save to a bucket ends by then
STALL_S = 60.0                  # a bucket connection without a byte for this long is dropped (and retried)


def save_timeout() -> float:
  """Seconds a checkpoint's save to a bucket may take before the trainer stops (PAXCLI_BUCKET_SAVE_TIMEOUT_S)."""
  return float(bounds.positive_env('PAXCLI_BUCKET_SAVE_TIMEOUT_S', BUCKET_SAVE_TIMEOUT_S, float))


def request_retries() -> dict:
  """tensorstore's retries of one bucket request (its `gcs_request_retries` context), bounded to about half
  of the save timeout: its default (32 retries, up to 32 s apart) keeps an unreachable bucket's save going
  for a quarter of an hour."""
  budget, total, retries = save_timeout() / 2, 0.0, 0
  while retries < 32 and total + min(2.0 ** retries, 32.0) <= budget:
    total += min(2.0 ** retries, 32.0)
    retries += 1
  return {'max_retries': max(retries, 1), 'initial_delay': '1s', 'max_delay': '32s'}


def _bound_stalls() -> None:
  """tensorstore's HTTP transport drops a connection that has sent no byte for STALL_S (curl's low-speed
  limit; read once, when tensorstore first makes a request), and gives up a connect after 30 s."""
  os.environ.setdefault('TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS', str(int(STALL_S)))
  os.environ.setdefault('TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES', '1')
  os.environ.setdefault('TENSORSTORE_CURL_CONNECT_TIMEOUT_SECONDS', '30')


_bound_stalls()


def emulator_defaults() -> bool:
  """With STORAGE_EMULATOR_HOST set: an emulator serves no storage-control API (gcsfs's zonal-bucket
  lookup would go to Google's) and checks no credentials, so none are looked for, by paxcli's gcsfs
  client or orbax's (fsspec's defaults for 'gcs'). Returns whether one is set."""
  if not os.environ.get('STORAGE_EMULATOR_HOST'):
    return False
  os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')
  import fsspec
  fsspec.config.conf.setdefault('gcs', {}).setdefault('token', 'anon')
  return True


def bound_gcsfs() -> None:
  """orbax's gcsfs instance (a checkpoint's small files) gives up a request that has not answered in
  STALL_S, as paxcli's own does (fsspec's defaults for 'gcs'; called before orbax opens a bucket path)."""
  import fsspec
  fsspec.config.conf.setdefault('gcs', {}).setdefault('requests_timeout', STALL_S)


emulator_defaults()


# ---- paths ------------------------------------------------------------------------------------


def scheme(path: str) -> Optional[str]:
  match = _SCHEME_RE.match(path)
  return match.group(1).lower() if match else None


def is_local(path: str) -> bool:
  """True for a path of this machine's file system (flock, rename and devices exist there)."""
  return scheme(path) is None


def absolute(path: str, option: str = 'path') -> str:
  """`path` as every command holds it: a local one absolute with symlinks resolved; a bucket one
  normalised (`gs://bucket/a/b`, no trailing slash, no empty or `..` parts) and checked (`check_bucket_path`);
  another scheme, or a known one misspelt (`gs:/bucket`), refused in one line."""
  kind = scheme(path)
  if kind is None:
    check_scheme_typo(path, option)
    return os.path.realpath(path)
  if kind not in SCHEMES:
    known = ', '.join(f'{k}:// ({v})' for k, v in SCHEMES.items())
    like = f' Did you mean {_LIKE[kind]}://{path[len(kind) + 3:]}?' if kind in _LIKE else ''
    raise UserError(f'{option} {shorten(path, 200)}: paxcli cannot read or write {kind}:// paths; it reads and '
                    f'writes local paths and {known}.{like}')
  rest = path[len(kind) + 3:]
  parts = [p for p in rest.split('/') if p not in ('', '.')]
  if not parts:
    raise UserError(f'{option} {shorten(path, 200)} names no bucket; give {kind}://BUCKET/PATH.')
  normal = f'{kind}://' + '/'.join(parts)
  check_bucket_path(normal, path, option)
  return normal


def _named(option: str, path: str) -> str:
  """How a message names the path it is about: `--job-log-dir gs://b/x`, or a knob's `INIT_FROM=gs://b/x`."""
  shown = shorten(''.join(c if c.isprintable() else c.encode('unicode_escape').decode() for c in path), 200)
  return f'{option}={shown}' if option[:1].isalpha() and option.isupper() else f'{option} {shown}'


def check_scheme_typo(path: str, option: str = 'path') -> None:
  """One line for a local-looking path that is a bucket path misspelt (`gs:/bucket/run`: one slash),
  before any work: it would otherwise become a directory named `gs:` under the current one."""
  match = _SCHEME_TYPO_RE.match(path)
  if match:
    kind = match.group('scheme').lower()
    rest = path[match.end():].lstrip('/\\')
    raise UserError(f'{_named(option, path)} is a misspelt bucket path (a bucket path is '
                    f'{kind}://BUCKET/PATH, two slashes); did you mean {shorten(f"{kind}://{rest}", 200)}? '
                    f'(A local directory of that name: write ./{shorten(path, 160)}.)')


def check_bucket_path(normal: str, given: str, option: str) -> None:
  """A bucket path's name and characters: every object of a job must live under its one prefix, for
  tensorstore (which parses a gs:// path as a URL) and gcsfs alike, so the characters a URL gives meaning
  to are refused, as are `..` and control characters; the bucket's name follows GCS's rules."""
  shown = _named(option, given)
  bucket, _, key = normal.split('://', 1)[1].partition('/')
  if not _BUCKET_RE.match(bucket) or '..' in bucket:
    raise UserError(f'{shown}: {shorten(bucket, 80)!r} is not a bucket name (3 to 222 lowercase letters, '
                    "digits, '-', '_' and '.', starting and ending with a letter or a digit).")
  parts = key.split('/') if key else []
  if '..' in parts:
    raise UserError(f'{shown}: a bucket path has no `..` in it.')
  bad = sorted({c for c in key if c in _URL_MEANING or ord(c) < 0x20 or ord(c) == 0x7f})
  if bad:
    said = ' '.join(repr(c) for c in bad)
    raise UserError(f'{shown}: a bucket path cannot hold {said}: a URL gives them meaning (or no object '
                    'name holds them), and the arrays (tensorstore) and the other files (gcsfs) of the job would '
                    'land under different prefixes. Use letters, digits and - _ . = + , @ : ~ in its name.')


def abspath(path: str) -> str:
  """A local path made absolute (symlinks kept); a bucket path normalised."""
  return os.path.abspath(path) if is_local(path) else absolute(path)


def inside(path: str, other: str) -> bool:
  """Whether `path` is `other` or under it (or `other` under `path`): both local, symlinks resolved,
  or both in one bucket."""
  if is_local(path) != is_local(other):
    return False
  if is_local(path):
    a, b = os.path.realpath(path), os.path.realpath(other)
    return os.path.commonpath([a, b]) in (a, b)
  a, b = absolute(path) + '/', absolute(other) + '/'
  return a.startswith(b) or b.startswith(a)


def local_dir_beside(path: str) -> str:
  """Where files that sit beside `path` go on this machine: its parent; the current directory for a bucket path."""
  return os.path.dirname(os.path.abspath(path)) if is_local(path) else os.getcwd()


def bucket_of(path: str) -> str:
  """`gs://bucket` of a bucket path (what error lines name)."""
  kind = scheme(path)
  return f'{kind}://' + path[len(kind) + 3:].split('/', 1)[0]


def _key(path: str) -> tuple[str, str]:
  """(bucket, object name) of a bucket path."""
  rest = path.split('://', 1)[1]
  bucket, _, key = rest.partition('/')
  return bucket, key


def join(path: str, *names: str) -> str:
  return posixpath.join(path, *names) if not is_local(path) else os.path.join(path, *names)


def dirname(path: str) -> str:
  return posixpath.dirname(path) if not is_local(path) else os.path.dirname(path)


def basename(path: str) -> str:
  return posixpath.basename(path) if not is_local(path) else os.path.basename(path)


# ---- the bucket client ------------------------------------------------------------------------


_FS = None
_FS_LOCK = threading.Lock()


def _fs():
  """gcsfs's file system (one per process), listings never cached: several processes share a job."""
  global _FS
  with _FS_LOCK:
    if _FS is None:
      try:
        import gcsfs
      except ImportError:
        raise UserError('gs:// job directories need gcsfs, which is not installed: pip install '
                        "'paxcli[gcs]' (or pip install gcsfs).") from None
      for name in ('gcsfs', 'fsspec'):   # paxcli reports a failed request in one line, not gcsfs's traceback
        logging.getLogger(name).setLevel(logging.CRITICAL)
      token = 'anon' if emulator_defaults() else None
      _FS = gcsfs.GCSFileSystem(token=token, use_listings_cache=False, skip_instance_cache=True,
                                requests_timeout=STALL_S)
  return _FS


class BucketError(UserError):
  """A bucket that cannot be reached, does not exist or refuses paxcli: one line naming it."""
  exit_code = 1


def _explain(path: str, e: BaseException) -> str:
  text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  code = getattr(e, 'code', None)
  where = bucket_of(path)
  if isinstance(e, FileNotFoundError):
    return f'The bucket {where} does not exist (or its name is misspelt).'
  if code in (401, 403) or isinstance(e, PermissionError) or text.startswith('Forbidden'):
    return (f'The bucket {where} refuses access ({shorten(text, 160)}): the credentials paxcli found (application '
            'default credentials, GOOGLE_APPLICATION_CREDENTIALS or the VM\'s service account) may not read and '
            'write it.')
  if isinstance(e, TimeoutError) and text == type(e).__name__:   # fsspec's and asyncio's timeouts say nothing more
    text = f'no answer within {STALL_S:.0f} s'
  return f'Cannot reach the bucket {where} ({type(e).__name__}: {shorten(text, 160)}).'


def _once(method: str, url: str, *args, **params):
  """One request through gcsfs's session and credentials, without its retries (a probe must answer fast)."""
  fs = _fs()
  request = getattr(type(fs)._request, '__wrapped__', None)
  from fsspec.asyn import sync
  if request is None:
    return sync(fs.loop, fs._call, method, url, *args, json_out=True, **params)
  _, _, _, contents = sync(fs.loop, request, fs, method, url, *args, **params)
  return json.loads(contents) if contents else {}


def check_reachable(path: str, option: str = '--job-log-dir') -> None:
  """One line, before any work, for a bucket that cannot be reached, does not exist or refuses access.

  Listing one object under the path needs what every command needs (storage.objects.list); the
  bucket's own metadata (storage.buckets.get) is often not granted to those who may use it.
  """
  if is_local(path):
    return
  bucket, key = _key(path)
  try:
    _once('GET', 'b/{}/o', bucket, prefix=key + '/' if key else '', maxResults=1)
  except UserError:
    raise
  except Exception as e:
    raise BucketError(f'{option} {shorten(path, 200)}: {_explain(path, e)}') from None
  _start_tensorstore_auth(bucket)


TENSORSTORE_PROBE_S = 60


def _start_tensorstore_auth(bucket: str) -> None:
  """Has tensorstore (orbax's arrays) find its credentials now, with what its C++ logging prints meanwhile
  held back: its INFO line naming the credentials it chose ("Using credentials at ...", "Using
  GOOGLE_AUTH_TOKEN_FOR_TESTING") goes to the terminal before any log setting applies, once per process.
  Shown after all when tensorstore cannot reach the bucket (its words then say why), and orbax's own
  error follows at the first save or restore."""
  import tensorstore as ts
  with files.held_stderr() as held:
    try:
      ts.KvStore.open({'driver': 'gcs', 'bucket': bucket}).result().read('paxcli-credentials-probe').result(
          timeout=TENSORSTORE_PROBE_S)
      said = ''
    except Exception:  # noqa: BLE001 - orbax reports it where it matters; tensorstore's lines say why now
      said = held()
  sys.stderr.write(said)


_GIVEN_UP: dict[str, float] = {}   # bucket -> when this process gave up on it (time.monotonic)


def give_up(path: str) -> None:
  """The command ends because the bucket of `path` stopped answering (said in one line): its requests for the
  next STALL_S (the last metrics, the ledger's end, the lease's release) fail at once instead of each waiting
  out its retries and timeouts, so that the end takes seconds, not minutes."""
  if not is_local(path):
    _GIVEN_UP[bucket_of(path)] = time.monotonic()


def gave_up() -> bool:
  """Whether this process gave up on a bucket (the command ends: cli.common ends the process at once)."""
  return bool(_GIVEN_UP)


def _given_up(path: str) -> bool:
  return not is_local(path) and time.monotonic() - _GIVEN_UP.get(bucket_of(path), -math.inf) < STALL_S


@contextlib.contextmanager
def _reporting(path: str):
  """A failed bucket request as one line naming the bucket; local errors pass unchanged."""
  if _given_up(path):
    raise BucketError(f'{shorten(path, 200)}: not written; the bucket {bucket_of(path)} stopped answering.')
  try:
    yield
  except (FileNotFoundError, FileExistsError, UserError):
    raise
  except Exception as e:
    if is_local(path):
      raise
    import aiohttp
    from gcsfs.retry import HttpError
    if isinstance(e, (HttpError, aiohttp.ClientError, OSError, TimeoutError)):
      raise BucketError(f'{shorten(path, 200)}: {_explain(path, e)}') from None
    raise


# ---- reading ----------------------------------------------------------------------------------


def exists(path: str) -> bool:
  if is_local(path):
    return os.path.lexists(path)
  with _reporting(path):
    return _fs().exists(path)


def isdir(path: str) -> bool:
  """A local directory, or a bucket prefix holding at least one object."""
  if is_local(path):
    return os.path.isdir(path)
  with _reporting(path):
    bucket, key = _key(path)
    got = _fs().call('GET', 'b/{}/o', bucket, prefix=key.rstrip('/') + '/', maxResults=1, json_out=True)
    return bool(got.get('items') or got.get('prefixes'))


def isfile(path: str) -> bool:
  """A local regular file (or a link to one), or a bucket object."""
  if is_local(path):
    return os.path.isfile(path)
  return info(path) is not None


def info(path: str) -> Optional[dict]:
  """A bucket object's metadata ('generation', 'size', 'updated'...), or None when there is none."""
  bucket, key = _key(path)
  if not key:
    return None
  with _reporting(path):
    try:
      return _fs().call('GET', 'b/{}/o/{}', bucket, key, json_out=True)
    except FileNotFoundError:
      return None


def listdir(path: str) -> list[str]:
  """The names directly in a directory ([] when it is missing)."""
  if is_local(path):
    return os.listdir(path) if os.path.isdir(path) else []
  with _reporting(path):
    bucket, key = _key(path)
    prefix = key.rstrip('/') + '/' if key else ''
    names, token = set(), None
    while True:
      page = _fs().call('GET', 'b/{}/o', bucket, prefix=prefix, delimiter='/', pageToken=token, json_out=True)
      names.update(p[len(prefix):].rstrip('/') for p in page.get('prefixes', []))
      names.update(item['name'][len(prefix):] for item in page.get('items', []))
      token = page.get('nextPageToken')
      if not token:
        break
    names.discard('')
    return sorted(names)


def walk_files(path: str) -> list[str]:
  """Every file under a directory, as paths relative to it."""
  if is_local(path):
    return [os.path.relpath(os.path.join(d, n), path) for d, _, names in os.walk(path) for n in names]
  with _reporting(path):
    prefix = _key(path)[1].rstrip('/') + '/'
    return sorted(name.split('/', 1)[1][len(prefix):] for name in _fs().find(path)
                  if name.split('/', 1)[1].startswith(prefix))


def mtime(path: str) -> float:
  if is_local(path):
    return os.path.getmtime(path)
  got = info(path)
  if got and got.get('updated'):
    return _timestamp(got['updated'])
  children = listdir(path)
  return max((mtime(join(path, n)) for n in children), default=0.0)


def _timestamp(text: str) -> float:
  return datetime.datetime.fromisoformat(text.replace('Z', '+00:00')).timestamp()


def read_bytes(path: str, max_bytes: Optional[int] = None) -> bytes:
  """The bytes of a file (FileNotFoundError when missing); at most max_bytes + 1 are read."""
  if is_local(path):
    with files.open_regular(path) as f:   # a FIFO or a device in a job directory is refused, never waited on
      return f.read(-1 if max_bytes is None else max_bytes + 1)
  with _reporting(path):
    fs = _fs()
    if max_bytes is None:
      return fs.cat_file(path)
    return fs.cat_file(path, start=0, end=max_bytes + 1)


@contextlib.contextmanager
def open_binary(path: str):
  """A file object to read `path` from a piece at a time (a bucket's object is fetched in blocks, never
  whole): for files read line by line with files.bounded_lines."""
  if is_local(path):
    with open(path, 'rb') as f:
      yield f
    return
  with _reporting(path), _fs().open(path, 'rb', block_size=1 << 20, cache_type='readahead') as f:
    yield io.BufferedReader(f, 1 << 20)   # fsspec's readline takes no size: a bounded readline needs io's


def read_text(path: str, max_bytes: Optional[int] = None) -> str:
  return read_bytes(path, max_bytes).decode('utf-8', errors='replace')


def read_versioned(path: str) -> tuple[Optional[bytes], int, float]:
  """(bytes or None, generation, server time of the last write) of a bucket object; generation 0 is
  'absent', the precondition that creates it."""
  meta = info(path)
  if meta is None:
    return None, 0, 0.0
  generation = int(meta['generation'])
  bucket, key = _key(path)
  with _reporting(path):
    try:
      _, data = _fs().call('GET', 'b/{}/o/{}', bucket, key, alt='media', generation=generation)
    except FileNotFoundError:   # replaced meanwhile: the caller's precondition fails and it reads again
      data = b''
  return data, generation, _timestamp(meta['updated']) if meta.get('updated') else 0.0


def check_new_file(path: str, option: str) -> None:
  """UserError now, before any work, if file `path` cannot be written (its directory may be made later)."""
  shown = shorten(path, 200)
  if not is_local(path):
    check_reachable(path, option)
    if isdir(path):
      raise UserError(f'{option} {shown} is a directory; give a file name.')
    return
  files.check_output(path, option, force=True)   # a local file: the one output-path check


# ---- writing ----------------------------------------------------------------------------------


def makedirs(path: str) -> None:
  """A local directory and its parents; nothing in a bucket (a prefix exists once an object is under it)."""
  if is_local(path):
    os.makedirs(path, exist_ok=True)


def write_bytes(path: str, data: bytes) -> None:
  """Writes a whole file atomically: a reader sees the old bytes or the new, never half."""
  if is_local(path):
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix='.tmp-')
    try:
      with os.fdopen(fd, 'wb') as f:
        f.write(data)
      os.chmod(tmp, 0o644)
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(OSError):
        os.remove(tmp)
      raise
    return
  with _reporting(path):
    _fs().pipe_file(path, bytes(data))


def write_text(path: str, text: str) -> None:
  write_bytes(path, text.encode('utf-8'))


def write_if_generation(path: str, data: bytes, generation: int) -> Optional[int]:
  """Writes a bucket object only if its generation is still `generation` (0: only if absent).

  Returns the new generation, or None when another writer came first (GCS's ifGenerationMatch, on
  a multipart upload: the kind every GCS server checks preconditions on).
  """
  bucket, key = _key(path)
  fs = _fs()
  boundary = '==paxcli=='
  body = (f'--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({"name": key})}\r\n'
          f'--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n').encode() + bytes(data) + \
      f'\r\n--{boundary}--'.encode()
  with _reporting(path):
    try:
      got = fs.call('POST', f'{fs._location}/upload/storage/v1/b/{bucket}/o', uploadType='multipart',
                    ifGenerationMatch=str(generation), data=body, json_out=True,
                    headers={'Content-Type': f'multipart/related; boundary="{boundary}"'})
    except FileExistsError:   # 412 Precondition Failed
      return None
  return int(got['generation'])


def delete_if_generation(path: str, generation: int) -> bool:
  """Deletes a bucket object only if its generation is still `generation`; False when it is not (or gone)."""
  bucket, key = _key(path)
  with _reporting(path):
    try:
      _fs().call('DELETE', 'b/{}/o/{}', bucket, key, ifGenerationMatch=str(generation))
    except (FileExistsError, FileNotFoundError):
      return False
  return True


def create_new(path: str, data: bytes) -> bool:
  """Creates a file holding `data` only if none is there; False when one is (nothing is replaced).

  Local: O_CREAT | O_EXCL. Bucket: an upload conditional on the object being absent (generation 0).
  """
  if is_local(path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    return True
  return write_if_generation(path, data, 0) is not None


def update(path: str, change: Callable[[Optional[bytes]], Optional[bytes]], local_lock=None) -> None:
  """Rewrites a file as `change(old bytes or None)` says (None: leave it), never losing a concurrent writer's update.

  Local: under `local_lock` (a context manager: jobdir.lock's flock), then an atomic rewrite.
  Bucket: the rewrite is conditional on the generation read, and read again when it moved.
  """
  if is_local(path):
    with local_lock if local_lock is not None else contextlib.nullcontext():
      try:
        old = read_bytes(path)
      except FileNotFoundError:
        old = None
      new = change(old)
      if new is not None and new != old:
        write_bytes(path, new)
    return
  for attempt in range(100):
    old, generation, _ = read_versioned(path)
    new = change(old)
    if new is None or new == old:
      return
    if write_if_generation(path, new, generation) is not None:
      return
    time.sleep(min(0.05 * 2 ** attempt, 2.0))
  raise BucketError(f'{shorten(path, 200)}: could not update it; other writers kept changing it.')


def append_text(path: str, text: str) -> None:
  """Appends to a file (made if missing); in a bucket a rewrite conditional on the version read."""
  if is_local(path):
    with open(path, 'a', encoding='utf-8') as f:
      f.write(text)
    return
  update(path, lambda data: (data or b'') + text.encode('utf-8'))


def remove(path: str) -> None:
  """Removes a file if present."""
  if is_local(path):
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    return
  with _reporting(path), contextlib.suppress(FileNotFoundError):
    _fs().rm_file(path)


def rmtree(path: str) -> None:
  if is_local(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  with _reporting(path), contextlib.suppress(FileNotFoundError):
    _fs().rm(path, recursive=True)


def move_tree(source: str, target: str) -> None:
  """Moves a directory (FileNotFoundError when it is gone). In a bucket: every object copied, then the
  originals deleted, so that nothing is lost if it stops half-way (the copy and the original both stand)."""
  if is_local(source):
    shutil.move(source, target)
    return
  names = walk_files(source)
  if not names:
    raise FileNotFoundError(source)
  with _reporting(source):
    fs = _fs()
    for name in names:
      fs.copy(join(source, name), join(target, name))
    fs.rm([join(source, name) for name in names])


def upload_tree(local_dir: str, target: str, last: tuple[str, ...] = ()) -> None:
  """Copies a local directory into `target` (a bucket or local path); files named in `last` go last,
  so a reader that trusts them (orbax's commit markers) never sees a half-copied directory as whole."""
  names = sorted(walk_files(local_dir), key=lambda n: (os.path.basename(n) in last, n.count('/'), n))
  for name in names:
    with open(os.path.join(local_dir, name), 'rb') as f:
      write_bytes(join(target, *name.split(os.sep)), f.read())


def download_tree(source: str, local_dir: str, skip: Callable[[str], bool] = lambda name: False) -> None:
  """Copies the files of `source` (a bucket or local directory) under `local_dir`, except those `skip` names."""
  for name in walk_files(source):
    if skip(name):
      continue
    dest = os.path.join(local_dir, *name.split('/'))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    with open(dest, 'wb') as f:
      f.write(read_bytes(join(source, name)))


_LOCAL_COPIES: dict[str, str] = {}


def local_copy(path: str) -> str:
  """A path of this machine holding the file `path` (itself when local): for readers that need one
  (sentencepiece, tokenizers, XLA). A bucket file is downloaded once per process, with the files
  beside it in its directory (a tokenizer's config), into a private temporary directory."""
  if is_local(path):
    return path
  directory = dirname(path)
  if directory not in _LOCAL_COPIES:
    local = tempfile.mkdtemp(prefix='paxcli-' + hashlib.sha256(directory.encode()).hexdigest()[:12] + '-')
    for name in listdir(directory):
      if isfile(join(directory, name)):
        with open(os.path.join(local, name), 'wb') as f:
          f.write(read_bytes(join(directory, name)))
    _LOCAL_COPIES[directory] = local
  return os.path.join(_LOCAL_COPIES[directory], basename(path))


def local_files(directory: str) -> str:
  """A local directory holding the files directly in `directory` (itself, resolved, when local; a
  bucket's downloaded once per process, without its subdirectories)."""
  if is_local(directory):
    return os.path.realpath(directory)
  return dirname(local_copy(join(directory, '.')))


def local_tree(path: str) -> str:
  """A local directory holding the files of directory `path` (itself when local; a bucket's are
  downloaded once per process into a private temporary directory; an empty one when it is missing)."""
  if is_local(path):
    return path
  if path not in _LOCAL_COPIES:
    local = tempfile.mkdtemp(prefix='paxcli-' + hashlib.sha256(path.encode()).hexdigest()[:12] + '-')
    download_tree(path, local)
    _LOCAL_COPIES[path] = local
  return _LOCAL_COPIES[path]


def working_dir(target: str) -> str:
  """A local directory to write `target`'s files into (a tool that writes only local files: the
  profiler): `target` itself when it is local, else a new temporary directory; `publish` then."""
  if is_local(target):
    os.makedirs(target, exist_ok=True)
    return target
  return tempfile.mkdtemp(prefix='paxcli-upload-')


def publish(local: str, target: str) -> None:
  """Copies what a working_dir holds to its target (nothing when they are one), then removes it."""
  if local == target:
    return
  try:
    upload_tree(local, target)
  finally:
    shutil.rmtree(local, ignore_errors=True)


# ---- files written a little at a time --------------------------------------------------------


class Appender:
  """A binary file written a little at a time (TensorBoard events, JSONL rows), locally or in a bucket.

  Local: an ordinary file opened for appending (`truncate`: for writing). Bucket: the bytes are kept
  here and the object rewritten whole at each flush (and at close), as TensorFlow's gfile writes GCS
  files: a row flushed before a checkpoint is saved is in the bucket when the checkpoint is.
  `rewritten_whole` says so, for a writer that keeps its files small (TensorBoard's event files).
  """

  def __init__(self, path: str, truncate: bool = False, min_interval: float = 0.0):
    self.path, self.min_interval = path, min_interval
    self._local = is_local(path)
    self.rewritten_whole = not self._local
    if self._local:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      self._file = open(path, 'wb' if truncate else 'ab')
      return
    self._data = bytearray()
    if not truncate:
      with contextlib.suppress(FileNotFoundError):
        self._data += read_bytes(path)
    self._dirty, self._last = bool(truncate), 0.0

  def write(self, data: bytes) -> None:
    if self._local:
      self._file.write(data)
      return
    self._data += data
    self._dirty = True

  def size(self) -> int:
    return self._file.tell() if self._local else len(self._data)

  def flush(self, force: bool = False) -> None:
    if self._local:
      self._file.flush()
      return
    if self._dirty and (force or time.monotonic() - self._last >= self.min_interval):
      write_bytes(self.path, bytes(self._data))
      self._dirty, self._last = False, time.monotonic()

  def close(self) -> None:
    if self._local:
      self._file.close()
    else:
      self.flush(force=True)


def regular_file_size(path: str) -> Optional[int]:
  """The size of a regular file (None when it is not one: missing, a directory, a device...)."""
  if is_local(path):
    try:
      st = os.stat(path)
    except OSError:
      return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
  got = info(path)
  return int(got['size']) if got else None


def no_space(e: BaseException) -> bool:
  return getattr(e, 'errno', None) == errno.ENOSPC
