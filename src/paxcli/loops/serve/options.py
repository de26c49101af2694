"""What `pax serve` asks for: ServeOptions, checked before any start-up.

Light on purpose (no JAX, no FastAPI): `pax serve` checks its options with these before it starts a backend.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from paxcli.errors import UserError


@dataclasses.dataclass
class ServeOptions:
  host: str = '127.0.0.1'
  port: int = 8000
  slots: int = 16                # rows of the KV cache: choices decoded together
  max_queue: int = 256           # requests waiting for a row before 429
  max_n: int = 16                # choices of one request
  prefill_chunk: int = 256       # prompt tokens fed at once
  steps: int = 8                 # decoding steps between the host's looks (streamed together)
  drain_timeout: float = 60.0    # seconds SIGTERM waits for running requests
  name: Optional[str] = None     # the served model's name (default: the job directory's)
  loras: tuple = ()              # (name or None, LoRA run directory) of more adapters
  step: Optional[int] = None
  dtype: Optional[str] = None
  access_log: bool = False

  def check(self) -> None:
    for name, value, low in (('--slots', self.slots, 1), ('--max-queue', self.max_queue, 1), ('--max-n', self.max_n, 1),
                             ('--steps', self.steps, 1)):
      if value < low:
        raise UserError(f'{name} must be at least {low}, got {value}.')
    if not 0 <= self.port <= 65535:
      raise UserError(f'--port must be between 0 (any free port) and 65535, got {self.port}.')
    if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
      raise UserError(f'--prefill-chunk must be a power of two of at least 16, got {self.prefill_chunk}.')
    if not self.drain_timeout >= 0:
      raise UserError(f'--drain-timeout must be at least 0 seconds, got {self.drain_timeout}.')
