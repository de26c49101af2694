"""`pax`: one Typer app; each subcommand lives in its own module and registers itself.

Nothing heavy (jax, flax, tensorflow, seqio) is imported here: `pax --help` stays fast.
Subcommand modules import the engine inside their command functions.
"""

from __future__ import annotations

import sys

import typer

from paxcli.cli import common

app = typer.Typer(
    name='pax',
    help='Pax-style experiments on JAX: train, eval, inspect inputs, import MaxText scripts.',
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={'help_option_names': ['-h', '--help']},
)


def _register_all() -> None:
  from paxcli.cli import bench as bench_cmd
  from paxcli.cli import eval as eval_cmd
  from paxcli.cli import experiments as experiments_cmd
  from paxcli.cli import inspect_input as inspect_input_cmd
  from paxcli.cli import import_maxtext as import_maxtext_cmd
  from paxcli.cli import launch as launch_cmd
  from paxcli.cli import train as train_cmd
  for module in (train_cmd, eval_cmd, inspect_input_cmd, launch_cmd, experiments_cmd, import_maxtext_cmd,
                 bench_cmd):
    module.register(app)


_register_all()


def main(argv: list[str] | None = None) -> None:
  """Console entry point: runs the app, turning UserError into one red line and exit 2."""
  argv = common.normalize_argv(list(sys.argv[1:] if argv is None else argv))
  common.run_app(app, argv)


if __name__ == '__main__':
  main()
