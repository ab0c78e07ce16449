"""What :func:`frolic_tta.lightning.cli.main` does around the CLI in every process (every DDP
rank runs it): keep the libraries quiet, and bring a user error raised on one rank to the user
as one line.

:func:`quiet_libraries` drops Lightning's advertising tips and the libraries' own deprecation
notices (a user cannot act on them).

Rank 0 creates a temporary folder and exports :data:`ERROR_DIR` before Lightning launches the
other processes (they inherit it). A rank with a user error leaves its message there
(:func:`leave_error`); rank 0, whose collective then fails because that rank left, reads it
(:func:`error_of_another_rank`) and prints it instead of the collective's error. Single node
only: the folder is local.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from frolic_tta.errors import write_error

__all__ = [
    "ERROR_DIR",
    "RUN",
    "error_folder",
    "error_of_another_rank",
    "leave_error",
    "quiet_libraries",
]

LIBRARIES = (
    r"(lightning|lightning_utilities|torch|torchvision|torchmetrics|open_clip|timm|jsonargparse)"
)
"""The libraries whose own deprecation notices a run does not show (a user cannot act on them)."""


UNWRITABLE = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}

RUN = {"world_size": 1}
"""The world size of the predict this process runs (set by ``FrolicCLI.before_predict``)."""

ERROR_DIR = "FROLIC_ERROR_DIR"
"""Environment variable naming the folder where a DDP rank leaves its user error for rank 0
(set by rank 0 before it launches the other processes, which inherit it)."""


def unwritable_message(error: BaseException) -> str | None:
    """One line for an output that could not be written (read-only, disk full), else ``None``."""
    if isinstance(error, OSError) and error.filename and error.errno in UNWRITABLE:
        return write_error(error.filename, error)
    return None


@contextmanager
def error_folder() -> Iterator[None]:
    """On rank 0 (and when no parent set one): a temporary :data:`ERROR_DIR`, removed after."""
    created = None
    if rank_zero_only.rank == 0 and ERROR_DIR not in os.environ:
        created = os.environ[ERROR_DIR] = tempfile.mkdtemp(prefix="frolic-errors-")
    try:
        yield
    finally:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
            os.environ.pop(ERROR_DIR, None)


def leave_error(message: str) -> None:
    """Leave this rank's user error in :data:`ERROR_DIR` (atomically) for rank 0."""
    folder = os.environ.get(ERROR_DIR)
    if folder and Path(folder).is_dir():
        target = Path(folder) / f"rank{rank_zero_only.rank}.txt"
        temporary = target.with_suffix(".tmp")
        temporary.write_text(message)
        temporary.replace(target)


def error_of_another_rank(wait_s: float = 5.0) -> str | None:
    """The user error another rank left (waiting up to ``wait_s`` for it), or ``None``."""
    folder = os.environ.get(ERROR_DIR)
    if not folder or RUN["world_size"] < 2:
        return None
    mine = f"rank{rank_zero_only.rank}.txt"
    deadline = time.monotonic() + wait_s
    while True:
        found = sorted(p for p in Path(folder).glob("rank*.txt") if p.name != mine)
        if found:
            return found[0].read_text()
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


class _NoTips(logging.Filter):
    """Drops Lightning's advertising tips (litlogger, litmodels) from its info log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("\N{ELECTRIC LIGHT BULB} Tip:")


def quiet_libraries() -> None:
    """What a successful run should not print: Lightning's tips and the libraries' own
    deprecation notices (``FutureWarning`` / ``DeprecationWarning`` raised in their code)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARIES + r"(\.|$)")
