"""`pax import-maxtext`: placeholder until the MaxText importer lands."""

import typer


def register(app: typer.Typer) -> None:
  del app
