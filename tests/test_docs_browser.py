"""The built docs site in headless Chromium: pages render, the front page leads to the newcomer's
answers, search finds them (benchmarks/docs_site.py). Slow; skipped where Chromium is not installed
(CI's clean machine has none: `apt-get install chromium` brings it)."""

import importlib.util
import shutil

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location('docs_site', REPO / 'benchmarks' / 'docs_site.py')
docs_site = importlib.util.module_from_spec(spec)
spec.loader.exec_module(docs_site)


@pytest.mark.slow
@pytest.mark.skipif(docs_site.chromium() is None, reason='no Chromium here (apt-get install chromium)')
def test_the_site_works_in_a_browser(tmp_path):
  site = tmp_path / 'site'
  docs_site.build(site)
  rows = docs_site.check(site, tmp_path / 'shots', docs_site.Browser(docs_site.chromium()))
  failed = [(name, detail) for name, ok, detail in rows if not ok]
  assert not failed, failed
  assert len(rows) >= 8
  for png in ('front.png', 'search.png', 'install.png'):
    assert (tmp_path / 'shots' / png).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
