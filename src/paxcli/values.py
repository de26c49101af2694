"""Parsing command-line values and checking them against declared types."""

from __future__ import annotations

import ast
import math
import types
import typing
from typing import Any, Literal, Union

from paxcli.errors import UserError, did_you_mean, shorten

_NONE = type(None)


def parse_value(raw: str) -> Any:
  """A Python literal if `raw` is one (2, 3e-4, [1, 4, 1], None, True), else the string."""
  text = raw.strip()
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, MemoryError, RecursionError):
    return text


def saved_literal(text: Any) -> Any:
  """A saved config's value (its repr, from checkpoint metadata) as a Python value; None where it is not a
  literal, or longer than any path's repr (the text is received: bounded before it is parsed)."""
  if not isinstance(text, str) or len(text) >= 4096:
    return None
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError, MemoryError, RecursionError):
    return None


def type_name(tp: Any) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return ' | '.join(repr(a) for a in typing.get_args(tp))
  if origin in (Union, types.UnionType):
    return ' | '.join(type_name(a) for a in typing.get_args(tp))
  if tp is _NONE:
    return 'None'
  if origin is not None:
    args = ', '.join(type_name(a) for a in typing.get_args(tp))
    return f'{getattr(origin, "__name__", str(origin))}[{args}]'
  return getattr(tp, '__name__', str(tp))


# No knob or config field holds an integer beyond a 64-bit one, nor a float that is not finite: NumPy and JAX
# cannot, and no count, size, seed or rate needs it. Such a value (a typo, or a record someone edited) is one
# line where it is parsed, before anything is built from it.
MAX_INT = 2**63 - 1


class _Mismatch(Exception):
  pass


class _OutOfRange(_Mismatch):
  """A value of the right type that no knob or field can hold; its message says why."""


def _coerce(value: Any, tp: Any) -> Any:
  if tp is Any or tp is object:
    return value
  origin = typing.get_origin(tp)
  args = typing.get_args(tp)
  if origin is Literal:
    if value in args:
      return value
    if isinstance(value, str):
      lowered = value.lower()
      for arg in args:
        if isinstance(arg, str) and arg.lower() == lowered:
          return arg
    raise _Mismatch()
  if origin in (Union, types.UnionType):
    if value is None and _NONE in args:
      return None
    out_of_range = None
    for arg in args:
      if arg is _NONE:
        continue
      try:
        return _coerce(value, arg)
      except _OutOfRange as e:   # said as such when no other member of the union takes the value
        out_of_range = out_of_range or e
      except _Mismatch:
        continue
    raise out_of_range or _Mismatch()
  if tp is _NONE:
    if value is None:
      return None
    raise _Mismatch()
  if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
    if not isinstance(value, (list, tuple)):
      raise _Mismatch()
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
      if len(args) != len(value):
        raise _Mismatch()
      items = [_coerce(v, a) for v, a in zip(value, args)]
    else:
      inner = args[0] if args else Any
      items = [_coerce(v, inner) for v in value]
    return tuple(items) if (origin is tuple or tp is tuple) else list(items)
  if origin is dict or tp is dict:
    if not isinstance(value, dict):
      raise _Mismatch()
    if args:
      return {_coerce(k, args[0]): _coerce(v, args[1]) for k, v in value.items()}
    return dict(value)
  if tp is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ('true', 'false', 'yes', 'no', 'on', 'off'):
      return value.lower() in ('true', 'yes', 'on')
    raise _Mismatch()
  if tp is int:
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if isinstance(value, int) and not isinstance(value, bool):
      return _bounded_int(value)
    raise _Mismatch()
  if tp is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return _finite_float(value)
    raise _Mismatch()
  if tp is str:
    if isinstance(value, str):
      return value
    raise _Mismatch()
  if isinstance(tp, type):
    if isinstance(value, tp):
      return value
    raise _Mismatch()
  return value  # an annotation we cannot check (a forward reference, a protocol)


def _bounded_int(value: int) -> int:
  if -MAX_INT - 1 <= value <= MAX_INT:
    return value
  digits = len(str(abs(value))) if value.bit_length() < 20_000 else f'over {value.bit_length() * 3 // 10:,}'
  raise _OutOfRange(f'is an integer of {digits} digits; a knob holds at most a 64-bit integer ({MAX_INT:,})')


def _finite_float(value) -> float:
  try:
    number = float(value)
  except OverflowError:   # an integer too large for any float
    number = float('inf')
  if math.isfinite(number):
    return number
  raise _OutOfRange(f'is {shorten(repr(value), 40)}; it must be a finite number')


def coerce(value: Any, tp: Any, name: str) -> Any:
  """Returns `value` converted to `tp` (int -> float, 'true' -> True, ...) or raises UserError."""
  try:
    return _coerce(value, tp)
  except _OutOfRange as e:
    raise UserError(f'{name} {e}.') from None
  except _Mismatch:
    hint = ''
    if typing.get_origin(tp) is Literal and isinstance(value, str):
      hint = did_you_mean(value, [a for a in typing.get_args(tp) if isinstance(a, str)])
    raise UserError(f'{name} must be {type_name(tp)}, got {shorten(repr(value))}.{hint}') from None


def parse_size(text: str, option: str = '--max-shard-size') -> int:
  """'5GB', '500MiB', '1024' -> bytes (at least 1); UserError for anything else (0, negative, inf, nan)."""
  given, text = text, text.strip().upper().replace('IB', 'B')
  number, mult = text, 1
  for unit, size in (('TB', 1 << 40), ('GB', 1 << 30), ('MB', 1 << 20), ('KB', 1 << 10), ('B', 1)):
    if text.endswith(unit):
      number, mult = text[:-len(unit)], size
      break
  try:
    value = float(number) * mult
  except ValueError:
    value = float('nan')
  if not (value >= 1 and value < 1 << 60):  # NaN fails both
    raise UserError(f'{option} {given!r}: give a positive size such as 5GB, 500MB or a number of bytes.')
  return int(value)
