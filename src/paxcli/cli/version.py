"""`pax version` (and `pax --version`): paxcli's version; with the subcommand, JAX's too."""

from __future__ import annotations

import json

import typer

from paxcli import version as paxcli_version
from paxcli.cli import common

_PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'fiddle', 'tensorflow', 'seqio')


def version_callback(value: bool) -> None:
  """`pax --version`: one line, no JAX import (stays fast)."""
  if value:
    typer.echo(f'paxcli {paxcli_version.current()}')
    raise typer.Exit()


def version(json_out: bool = typer.Option(False, '--json', help='Print as JSON.')) -> None:
  """Print the versions of paxcli, JAX and its libraries, and the devices JAX sees."""
  versions = {'paxcli': paxcli_version.current(), **{name: paxcli_version.of(name) for name in _PACKAGES}}
  import jax  # the devices JAX sees: only this command starts it
  devices = jax.devices()
  info = {'versions': versions, 'backend': jax.default_backend(), 'process_count': jax.process_count(),
          'devices': [f'{d.device_kind} (id {d.id}, process {d.process_index})' for d in devices]}
  if json_out:
    typer.echo(json.dumps(info, indent=1))
    return
  console = common.console()
  for name, v in versions.items():
    console.print(f'{name:<18}{v or "not installed"}', highlight=False)
  kinds = sorted({d.device_kind for d in devices})
  console.print(f'{"devices":<18}{len(devices)} x {", ".join(kinds)} ({info["backend"]}), '
                f'{info["process_count"]} process(es)', highlight=False)


def register(app: typer.Typer) -> None:
  app.command('version', short_help='Versions of paxcli, JAX, libraries; devices.')(version)
