"""`pax serve`: an OpenAI-compatible HTTP server of a job's model, with continuous batching."""

from __future__ import annotations

from typing import List, Optional

import typer

import paxcli  # its functions load on first use (paxcli.api): pax --help stays light
from paxcli.cli import common

_L = 'Limits'


def serve_command(
    exp: Optional[str] = common.exp_option(),
    overrides: List[str] = common.set_option(),
    job_log_dir: Optional[str] = common.job_dir_option(),
    host: str = typer.Option('127.0.0.1', '--host', help='Address to listen on (0.0.0.0: every interface).'),
    port: int = typer.Option(8000, '--port', help='Port to listen on (0: any free port, printed).'),
    served_model_name: Optional[str] = typer.Option(
        None, '--served-model-name', metavar='NAME', help="The model's name in requests and /v1/models (default: "
        "the job directory's name)."),
    lora: List[str] = typer.Option([], '--lora', metavar='[NAME=]DIR', help='Also serve the adapters of this LoRA '
                                   'run of the same base, named NAME (default: its directory\'s name); repeatable.'),
    slots: int = typer.Option(16, '--slots', help='Rows of the KV cache: choices decoded at once.', rich_help_panel=_L),
    max_queue: int = typer.Option(256, '--max-queue', help='Requests that may wait for a row; more get 429.',
                                  rich_help_panel=_L),
    max_n: int = typer.Option(16, '--max-n', help='Choices (`n`) one request may ask for.', rich_help_panel=_L),
    prefill_chunk: int = typer.Option(256, '--prefill-chunk', help='Prompt tokens fed at once (a power of two): a '
                                      'long prompt is fed in chunks between decoding steps.', rich_help_panel=_L),
    steps: int = typer.Option(8, '--steps', help='Decoding steps between two looks of the host (new requests join, '
                              'tokens are streamed).', rich_help_panel=_L),
    drain_timeout: float = typer.Option(60.0, '--drain-timeout', help='Seconds SIGTERM waits for running requests.',
                                        rich_help_panel=_L),
    step: Optional[int] = typer.Option(None, '--step', help='Checkpoint step (default: the latest).'),
    dtype: Optional[str] = typer.Option(None, '--dtype', help='Activation dtype (default: FPROP_DTYPE).'),
    access_log: bool = typer.Option(False, '--access-log', help="Print uvicorn's line for every request."),
) -> None:
  """Serve a job's model over OpenAI's API (completions, chat, streaming), batching requests continuously."""
  paxcli.serve(exp, overrides=overrides, job_dir=job_log_dir, host=host, port=port,
               served_model_name=served_model_name, lora=lora, slots=slots, max_queue=max_queue, max_n=max_n,
               prefill_chunk=prefill_chunk, steps=steps, drain_timeout=drain_timeout, step=step, dtype=dtype,
               access_log=access_log, console=common.console(stderr=True))


def register(app: typer.Typer) -> None:
  app.command('serve')(serve_command)
