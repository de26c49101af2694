"""Hugging Face Hub ids, resolved as transformers and datasets resolve them.

`pax checkpoint convert --from hf Qwen/Qwen2.5-0.5B` and `TRAIN_DATA=hf://datasets/Org/name` name a
repository of the Hub. As in transformers, a local directory of that name wins; otherwise the files
come from the local Hugging Face cache (HF_HOME, HF_HUB_CACHE: `models--Org--name/snapshots/<commit>/`,
the commit `refs/main` names), downloaded into it by huggingface_hub's own `snapshot_download` when
the Hub is reachable and the cache lacks them. With HF_HUB_OFFLINE=1 nothing is downloaded: a
repository the cache does not hold is one line naming the cache.

Only data files are fetched (ALLOWED: weights as safetensors, configs, tokenizers, chat templates;
a dataset's .parquet, .jsonl, .arrow, .txt files). A repository's Python files (modelling code,
a dataset's loading script) are never downloaded, let alone run. A snapshot's files are symlinks
into its repository's `blobs/` (huggingface_hub writes them so): paxcli.files.member accepts a
link that stays inside the repository's cache directory, and nothing further.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Optional

from paxcli.errors import UserError, shorten

# Org/name as the Hub spells repository ids (huggingface_hub's validate_repo_id): no '..', no '--'.
_REPO_ID = re.compile(r'^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$')
DATASET_SCHEME = 'hf://datasets/'
MODEL_FILES = ('config.json', 'generation_config.json', '*.safetensors', '*.safetensors.index.json',
               'tokenizer.json', 'tokenizer.model', 'tokenizer_config.json', 'special_tokens_map.json',
               'chat_template.jinja', 'additional_chat_templates/*.jinja')
DATA_FILES = ('*.parquet', '*.jsonl', '*.jsonl.gz', '*.ndjson', '*.arrow', '*.txt', '*.txt.gz')


def is_repo_id(text: str) -> bool:
  """Whether `text` is spelled as a Hub repository id (Org/name), as a relative path can be too."""
  return bool(_REPO_ID.match(text)) and '..' not in text and '--' not in text and not text.endswith('.')


def model_dir(source: str) -> str:
  """`source` as transformers' from_pretrained reads it: a local directory of that name (or any
  existing path) as it is; else a Hub id's snapshot directory in the local cache (downloaded there
  first when online and missing)."""
  if os.path.exists(os.path.expanduser(source)) or not is_repo_id(source):
    return source
  return snapshot(source, 'model', MODEL_FILES)


def dataset_pattern(data: str) -> Optional[str]:
  """For TRAIN_DATA `hf://datasets/Org/name[/glob]`: the local glob (or directory) of its files in the
  cache; None for anything else."""
  if not data.startswith(DATASET_SCHEME):
    return None
  rest = data[len(DATASET_SCHEME):].split('/')
  repo, inside = '/'.join(rest[:2]), '/'.join(rest[2:])
  if not is_repo_id(repo) or '..' in rest:
    raise UserError(f'{shorten(data, 200)}: give a dataset of the Hub as hf://datasets/Org/name, or '
                    'hf://datasets/Org/name/GLOB for some of its files.')
  return os.path.join(snapshot(repo, 'dataset', DATA_FILES), inside) if inside else snapshot(repo, 'dataset',
                                                                                             DATA_FILES)


@functools.lru_cache(maxsize=None)
def snapshot(repo_id: str, repo_type: str, patterns: tuple) -> str:
  """The cache's snapshot directory of a repository (its `refs/main`), fetched with huggingface_hub
  when it is missing and the Hub may be reached (once per process and repository)."""
  import huggingface_hub   # a dependency of tokenizers; imported only for a Hub id
  from huggingface_hub import constants, errors
  offline = bool(constants.HF_HUB_OFFLINE)   # HF_HUB_OFFLINE=1, read when huggingface_hub is imported
  what = 'dataset' if repo_type == 'dataset' else 'model'
  try:
    return huggingface_hub.snapshot_download(repo_id, repo_type=repo_type, allow_patterns=list(patterns),
                                             local_files_only=offline)
  except errors.LocalEntryNotFoundError:
    cache = constants.HF_HUB_CACHE
    if offline:
      raise UserError(f'{repo_id} is no local directory and the Hugging Face cache ({cache}) does not hold the '
                      f'{what}, which HF_HUB_OFFLINE=1 forbids downloading: fetch it where the Hub is reachable '
                      f'(`hf download {"--repo-type dataset " if repo_type == "dataset" else ""}{repo_id}`, the same '
                      f'HF_HOME) or give a local directory.') from None
    raise UserError(f'{repo_id} is no local directory, the Hugging Face cache ({cache}) does not hold the {what}, and '
                    'the Hub could not be reached to download it: check the network (or HF_ENDPOINT), or give a local '
                    'directory.') from None
  except errors.GatedRepoError:
    raise UserError(f'{repo_id} is a gated {what} on the Hub: accept its terms on its page, then log in (`hf auth '
                    'login`, or HF_TOKEN) and run this again.') from None
  except errors.RepositoryNotFoundError:
    raise UserError(f'{repo_id} is neither a local directory nor a {what} on the Hub (or a private one: log in '
                    'with `hf auth login` or HF_TOKEN).') from None
  except errors.HfHubHTTPError as e:
    raise UserError(f'{repo_id}: the Hub answered {shorten(str(e).splitlines()[0], 200)}.') from None

