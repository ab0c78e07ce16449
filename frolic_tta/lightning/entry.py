"""What :func:`frolic_tta.lightning.cli.main` does around the CLI in every process (every DDP
rank runs it): keep the libraries quiet, and bring a user error raised on one rank to the user
as one line.

:func:`quiet_libraries` drops Lightning's advertising tips and the libraries' own deprecation
notices (a user cannot act on them); :func:`short_warnings` prints the package's own warnings
as their message.

Rank 0 creates a temporary folder and exports :data:`ERROR_DIR` before Lightning launches the
other processes (they inherit it). A rank with a user error leaves its message there
(:func:`leave_error`); rank 0, whose collective then fails because that rank left, reads it
(:func:`error_of_another_rank`) and prints it instead of the collective's error. Single node
only: the folder is local.

Rank 0 does not wait for its next collective to learn of it, though: Lightning's launcher in
rank 0 checks its child processes every few seconds and kills every process, rank 0 included,
once one has exited with an error, so a rank 0 still encoding its share would die without a
word (found in ``tests/test_reuse_cli.py``: "terminated with code 2", no error line, exit
-9). A thread of rank 0 (:func:`error_folder`) watches the folder, prints the first message
left there, acknowledges it and exits with status 2; the rank that left it waits for that
acknowledgement (:func:`wait_for_report`, bounded) before it exits, so it is alive while rank 0
prints. :data:`REPORTING` and :data:`REPORTED` let only one thread of rank 0 print.

A run that ends well closes its process group (:func:`close_process_group`) while the
interpreter is still whole.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from frolic_tta.errors import write_error

__all__ = [
    "ERROR_DIR",
    "REPORTING",
    "RUN",
    "error_folder",
    "error_of_another_rank",
    "leave_error",
    "quiet_libraries",
    "report_error",
    "short_warnings",
    "wait_for_report",
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


REPORTING = threading.Lock()
"""Taken by the thread of rank 0 that prints a user error; ``REPORTED`` says one was printed."""

REPORTED = {"error": False}
"""Whether this run (:func:`error_folder`) printed its user error line already."""

ACKNOWLEDGED = "reported"
"""The file rank 0 writes in :data:`ERROR_DIR` once it has printed another rank's error."""


@contextmanager
def error_folder(poll_s: float = 0.05) -> Iterator[None]:
    """On rank 0 (and when no parent set one): a temporary :data:`ERROR_DIR`, removed after,
    watched every ``poll_s`` seconds for another rank's error (module docstring)."""
    created, REPORTED["error"] = None, False
    if rank_zero_only.rank == 0 and ERROR_DIR not in os.environ:
        created = os.environ[ERROR_DIR] = tempfile.mkdtemp(prefix="frolic-errors-")
        done = threading.Event()
        watch = threading.Thread(
            target=_report_left_error, args=(Path(created), done, poll_s), daemon=True
        )
        watch.start()
    try:
        yield
    finally:
        if created is not None:
            done.set()
            watch.join()
            shutil.rmtree(created, ignore_errors=True)
            os.environ.pop(ERROR_DIR, None)


def _report_left_error(folder: Path, done: threading.Event, poll_s: float) -> None:
    """Rank 0's watch: print the first error another rank left, acknowledge it, exit with 2."""
    while not done.wait(poll_s):
        found = sorted(p for p in folder.glob("rank*.txt") if p.name != "rank0.txt")
        if not found:
            continue
        with REPORTING:
            if REPORTED["error"]:  # the main thread printed the run's error line
                return
            print(f"error: {found[0].read_text()}", file=sys.stderr, flush=True)
            (folder / ACKNOWLEDGED).touch()
            shutil.rmtree(folder, ignore_errors=True)
            os._exit(2)  # the main thread may be deep in a collective or an encoder batch


def wait_for_report(timeout_s: float = 10.0) -> None:
    """On a rank that left its error: wait until rank 0 has printed it (at most ``timeout_s``),
    so that Lightning's launcher does not kill rank 0 first."""
    folder = os.environ.get(ERROR_DIR)
    if not folder or rank_zero_only.rank == 0:
        return
    deadline = time.monotonic() + timeout_s
    while Path(folder).is_dir() and not (Path(folder) / ACKNOWLEDGED).exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)


def leave_error(message: str) -> None:
    """Leave this rank's user error in :data:`ERROR_DIR` (atomically) for rank 0; on another
    rank, wait until rank 0 has printed it (:func:`wait_for_report`)."""
    folder = os.environ.get(ERROR_DIR)
    if folder and Path(folder).is_dir():
        target = Path(folder) / f"rank{rank_zero_only.rank}.txt"
        temporary = target.with_suffix(".tmp")
        temporary.write_text(message)
        temporary.replace(target)
        wait_for_report()


def report_error(message: str) -> None:
    """On rank 0: print ``message`` as the run's one ``error:`` line (:data:`REPORTING`: the
    folder's watch may be printing another rank's)."""
    if rank_zero_only.rank == 0:
        with REPORTING:
            REPORTED["error"] = True
            print(f"error: {message}", file=sys.stderr, flush=True)


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


_PACKAGE = f"{os.sep}frolic_tta{os.sep}"


def close_process_group() -> None:
    """Destroy the default process group of a DDP run, if there is one, at the end of a run.

    Lightning's strategies leave it open. Then Gloo's worker threads still hold work objects
    when the interpreter finalises, and one of the processes can abort at exit
    ("terminate called without an active exception", SIGABRT): measured in 1 to 2 of 8
    two-process runs of ``tests/ddp_predict.py`` (the same before issue 37), and the reason
    ``tests/test_online_module.py``'s two-process test failed in CI. Every rank calls it
    after its last collective; without a process group it does nothing.
    """
    import torch.distributed as dist  # the CLI's own teardown, not the module's: one place

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def short_warnings() -> None:
    """On the command line, a warning of the package is ``warning: <message>``: a user reads
    what happened, not the source line that said so (``.../samples.py:124: UserWarning: ...``).
    Other libraries' warnings keep Python's format (where they come from is the point)."""
    if getattr(warnings.formatwarning, "frolic", False):
        return
    plain = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):  # type: ignore[no-untyped-def]
        if _PACKAGE in str(filename):
            return f"warning: {message}\n"
        return plain(message, category, filename, lineno, line)

    formatwarning.frolic = True  # type: ignore[attr-defined]
    warnings.formatwarning = formatwarning


def quiet_libraries() -> None:
    """What a successful run should not print: Lightning's tips and the libraries' own
    deprecation notices (``FutureWarning`` / ``DeprecationWarning`` raised in their code)."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTips) for f in logger.filters):
            logger.addFilter(_NoTips())
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=LIBRARIES + r"(\.|$)")
