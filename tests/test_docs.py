"""The docs site builds strictly, its generated pages hold every knob and command, and every code
block of the tutorials runs in a test or says why not."""

import os
import shutil
import subprocess
import sys

import pytest
import typer

from conftest import REPO
from docs_blocks import CODE, SHOWN, TUTORIALS, blocks

ENV = {**os.environ, 'NO_MKDOCS_2_WARNING': '1'}


def _build(root, site):
  return subprocess.run([sys.executable, '-m', 'mkdocs', 'build', '--strict', '-d', str(site)], cwd=root, env=ENV,
                        capture_output=True, text=True, timeout=300)


@pytest.fixture(scope='module')
def site(tmp_path_factory):
  site = tmp_path_factory.mktemp('site')
  done = _build(REPO, site)
  assert done.returncode == 0, done.stderr[-4000:]
  return site


def test_every_knob_is_in_the_knob_reference(site):
  from paxcli.families.classifier import ClassifierExperiment
  from paxcli.models import LmExperiment
  page = (site / 'reference' / 'knobs' / 'index.html').read_text()
  for cls in (LmExperiment, ClassifierExperiment):
    missing = [k for k in cls.knob_types() if f'<code>{k}</code>' not in page]
    assert not missing, (cls.__name__, missing)


def test_every_knob_of_the_reference_says_what_it_does():
  """Each row of the knob reference ends in a description: a comment beside or above the knob, or its
  knob table's doc (LEARNING_RATE once had none)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location('reference', REPO / 'docs' / 'hooks' / 'reference.py')
  reference = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(reference)
  rows = [line for line in reference.knobs_page().splitlines() if line.startswith('| `')]
  assert len(rows) > 100
  bare = [row.split('|')[1].strip() for row in rows if not row.rstrip().rstrip('|').rsplit('|', 1)[-1].strip()]
  assert not bare, bare


def test_every_command_and_option_is_in_the_command_reference(site):
  from paxcli.cli.app import app
  page = (site / 'reference' / 'commands' / 'index.html').read_text()
  root = typer.main.get_command(app)

  def leaves(group, path):
    context = group.context_class(group, info_name=path[-1])
    for name in group.list_commands(context):
      command = group.get_command(context, name)
      if hasattr(command, 'list_commands'):
        yield from leaves(command, [*path, name])
      else:
        yield ' '.join([*path, name]), command

  for name, command in leaves(root, ['pax']):
    assert f'<code>{name}</code>' in page, name
    for param in command.params:
      for opt in getattr(param, 'opts', []):
        if opt.startswith('--') and opt != '--help':
          assert opt in page, (name, opt)


def test_the_python_api_page_documents_the_functions(site):
  page = (site / 'reference' / 'api' / 'index.html').read_text()
  for name in ('train', 'evaluate', 'decode', 'score', 'describe', 'convert_checkpoint'):
    assert f'id="paxcli.api.{name}"' in page, name


def test_the_front_page_leads_to_the_newcomer_answers(site):
  """Install on a GPU, own data, fine-tuning and the job directory: one click from the front page."""
  page = (site / 'index.html').read_text()
  for target in ('install/', 'tutorials/own-data/', 'tutorials/fine-tune/', 'reference/job-directory/'):
    assert f'href="{target}"' in page, target
  assert 'id="nvidia-gpu"' in (site / 'install' / 'index.html').read_text()


def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path):
  for name in ('docs', 'src'):
    os.symlink(REPO / name, tmp_path / name) if name == 'src' else shutil.copytree(REPO / name, tmp_path / name)
  for name in ('mkdocs.yml', 'CHANGELOG.md'):
    shutil.copy(REPO / name, tmp_path / name)
  with open(tmp_path / 'docs' / 'index.md', 'a') as f:
    f.write('\nSee [the old page](no-such-page.md).\n')
  (tmp_path / 'docs' / 'orphan.md').write_text('# Not in the nav\n')
  done = _build(tmp_path, tmp_path / 'site')
  assert done.returncode != 0
  assert 'no-such-page.md' in done.stderr and 'orphan.md' in done.stderr


@pytest.mark.parametrize('page', TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_every_tutorial_block_runs_or_says_why_not(page):
  found = blocks(page)
  assert any(b.lang in CODE and b.not_run is None for b in found), 'a tutorial with nothing that runs'
  for block in found:
    assert block.lang in CODE + SHOWN, f'{block.where()}: a ```{block.lang} block: mark it bash, python or text'
    if block.lang in SHOWN:
      assert block.not_run is None, f'{block.where()}: a {block.lang} block is shown, not run: no marker needed'
    assert block.not_run is None or len(block.not_run) > 10, f'{block.where()}: say why it is not run'
