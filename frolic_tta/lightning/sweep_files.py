"""What a sweep reads and starts, made safe to interrupt: its config (one line per problem),
the JSON files of finished runs (unreadable means not finished) and its child processes (they
stop with the sweep). Used by :mod:`frolic_tta.lightning.sweep`."""

from __future__ import annotations

import contextlib
import ctypes
import json
import signal
import subprocess
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "TYPES", "SweepError", "duration", "read_config", "read_json", "result_line", "run_child",
    "terminated",
]  # fmt: skip


class SweepError(ValueError):
    """A sweep config that cannot run (the message says what to change)."""


TYPES: dict[str, type | tuple[type, ...]] = {
    "output_dir": str, "config": (str, list), "args": dict, "feature_store": str,
    "feature_store_dtype": str, "runner": str, "launcher": str,
    "models": (dict, list), "datasets": (dict, list), "prompts": (dict, list),
    "options": (dict, list),
}  # fmt: skip
"""The type each sweep config key must have (``None`` is always allowed)."""


def read_config(
    file: Path, keys: Collection[str], types: dict[str, type | tuple[type, ...]]
) -> dict[str, Any]:
    """The YAML mapping in ``file``, its keys among ``keys`` and of the ``types`` given.

    Raises:
        SweepError: not YAML (with the line), not a mapping, an unknown key, a wrong type.
    """
    try:
        config = yaml.safe_load(file.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or type(error).__name__
        raise SweepError(f"Expected '{file}' to be YAML, but it is not{where}: {problem}") from None
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise SweepError(
            f"Expected '{file}' to hold a mapping of sweep config keys, but it holds a "
            f"{type(config).__name__}: {config!r:.60}"
        )
    unknown = sorted(map(str, set(config) - set(keys)))
    if unknown:
        raise SweepError(f"Expected sweep config keys among {sorted(keys)}, but got {unknown}")
    for key, kinds in types.items():
        if config.get(key) is not None and not isinstance(config[key], kinds):
            options = kinds if isinstance(kinds, tuple) else (kinds,)
            wanted = " or ".join(k.__name__ for k in options)
            raise SweepError(
                f"Expected `{key}` in '{file}' to be a {wanted}, but got "
                f"{type(config[key]).__name__} {config[key]!r:.60}"
            )
    return config


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or ``None`` if it is missing or not valid JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The child gets SIGTERM when the sweep process dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):  # elsewhere: the handler in run_child
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_child(command: list[str], log: Path) -> int:
    """Run ``command`` with its output in ``log``; its exit status. The child stops with the
    sweep: on an exception here (Ctrl-C, SIGTERM through :func:`terminated`) it is terminated,
    and on Linux it gets SIGTERM when the sweep process dies."""
    with log.open("w") as f:
        child = subprocess.Popen(
            command, stdout=f, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        try:
            return child.wait()
        except BaseException:
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
            raise


def terminated(signum: int, frame: Any) -> None:
    """SIGTERM handler of the sweep: exit through ``SystemExit`` so that a child is stopped."""
    raise SystemExit(128 + signum)


def result_line(metrics: Any, seconds: float | None = None) -> str:
    """What a finished run found, for the sweep's progress: ``f_c 82.0% → f_d 92.7% (12 s)``
    (``no labels`` without them; ``metrics.json unreadable`` if it cannot be read)."""
    took = "" if seconds is None else f" ({duration(seconds)})"
    if not isinstance(metrics, dict):
        return "metrics.json unreadable" + took
    accuracy = metrics.get("accuracy") or {}
    scores = [
        f"{row} {100 * value:.1f}%"
        for row in ("f_c", "f_d")
        if isinstance(value := _top1(accuracy.get(row)), int | float)
    ]
    return (" → ".join(scores) if scores else "no labels") + took


def _top1(value: Any) -> Any:
    return value.get("top1", value.get("accuracy")) if isinstance(value, dict) else value


def duration(seconds: float) -> str:
    """``12.3 s``, ``4 min 05 s``, ``2 h 03 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"
