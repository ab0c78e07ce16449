"""Checks of option values: what the option dataclasses and the estimators' arguments accept.

Numbers may be Python's or NumPy's scalars (``np.float32(1e-3)``, ``np.int64(5)``), never a
``bool`` (``True`` is an ``int`` to Python, not a tolerance); messages say what was expected and
what came.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import fields
from typing import Any

__all__ = ["check_choice", "check_count", "check_positive", "is_bool", "plain_numbers"]


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"Expected `{name}` to be one of {choices}, but got {value!r}")


def check_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """``value`` as a float if it is a finite real number > 0 (>= 0 with ``allow_zero``).

    Raises:
        TypeError: ``value`` is not a real number (``bool`` included).
        ValueError: it is NaN, infinite, or not positive.
    """
    if is_bool(value) or not isinstance(value, numbers.Real):  # NumPy scalars are Real
        raise TypeError(f"Expected `{name}` to be a real number, but got {value!r}")
    value = float(value)
    bound = "> 0" if not allow_zero else ">= 0"
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"Expected `{name}` to be a finite number {bound}, but got {value!r}")
    return value


def check_count(name: str, value: Any, *, minimum: int = 0) -> int:
    """``value`` if it is an ``int`` (not ``bool``) >= ``minimum``.

    Raises:
        TypeError: not an int.
        ValueError: below ``minimum``.
    """
    if is_bool(value) or not isinstance(value, numbers.Integral):  # np.int64 is Integral
        raise TypeError(f"Expected `{name}` to be an int, but got {value!r}")
    if value < minimum:
        raise ValueError(f"Expected `{name}` >= {minimum}, but got {value}")
    return int(value)


def is_bool(value: Any) -> bool:
    """``True``/``False``, NumPy's included (not numbers, though ``bool`` is an ``int``)."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def plain_numbers(options: Any) -> None:
    """Store NumPy scalars of a frozen options dataclass as ``int``/``float`` (hparams, YAML)."""
    for f in fields(options):
        value = getattr(options, f.name)
        if isinstance(value, numbers.Integral) and not isinstance(value, int):
            object.__setattr__(options, f.name, int(value))
        elif isinstance(value, numbers.Real) and not isinstance(value, int | float):
            object.__setattr__(options, f.name, float(value))
