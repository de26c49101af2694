"""`pax`: one Typer app; each subcommand lives in its own module and registers itself.

Nothing heavy (jax, flax, tensorflow, seqio, rich) is imported here: `pax --help` stays fast.
Subcommand modules call paxcli.api, importing it inside their command functions.
"""

from __future__ import annotations

import sys

import typer

from paxcli.cli import bench as bench_cmd
from paxcli.cli import checkpoint as checkpoint_cmd
from paxcli.cli import common
from paxcli.cli import data as data_cmd
from paxcli.cli import decode as decode_cmd
from paxcli.cli import eval as eval_cmd
from paxcli.cli import goodput as goodput_cmd
from paxcli.cli import experiments as experiments_cmd
from paxcli.cli import import_maxtext as import_maxtext_cmd
from paxcli.cli import inspect_input as inspect_input_cmd
from paxcli.cli import launch as launch_cmd
from paxcli.cli import lm_eval as lm_eval_cmd
from paxcli.cli import score as score_cmd
from paxcli.cli import serve as serve_cmd
from paxcli.cli import tokenizer as tokenizer_cmd
from paxcli.cli import train as train_cmd
from paxcli.cli import version as version_cmd
from paxcli.jobdir import invocation
from paxcli.jobdir import ledger
from paxcli.runtime import platform

app = typer.Typer(
    name='pax',
    help='Pax-style experiments on JAX: train, eval, inspect inputs, import MaxText scripts.',
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Click's plain help: option names are never cut, whatever the terminal width
    # (rich's help tables cut them at 80 columns), and metavars read the same everywhere.
    rich_markup_mode=None,
    context_settings={'help_option_names': ['-h', '--help']},
)


def _register_all() -> None:
  for module in (train_cmd, eval_cmd, decode_cmd, inspect_input_cmd, launch_cmd, experiments_cmd,
                 import_maxtext_cmd, checkpoint_cmd, version_cmd, bench_cmd, tokenizer_cmd, data_cmd,
                 score_cmd, lm_eval_cmd, serve_cmd, goodput_cmd):
    module.register(app)


@app.callback()
def _root(version: bool = typer.Option(False, '--version', is_eager=True, help='Print paxcli\'s version and exit.',
                                       callback=version_cmd.version_callback)) -> None:
  """Pax-style experiments on JAX: train, eval, inspect inputs, import MaxText scripts."""


_register_all()


def main(argv: list[str] | None = None) -> None:
  """Console entry point: runs the app, turning UserError into one red line and exit 2."""
  whole_process = argv is None
  ledger.mark_command_start(whole_process=whole_process)  # goodput: the wall time starts here (or at the process start)
  argv = list(sys.argv[1:] if argv is None else argv)
  invocation.set_argv(argv)  # as the user typed it, for the job directory's invocations.txt
  argv = common.normalize_argv(argv)
  platform.cpu_without_tpu()  # libtpu installed to plan for TPUs, on a machine without one
  common.run_app(app, argv, whole_process=whole_process)


if __name__ == '__main__':
  main()
