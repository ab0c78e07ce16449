"""The error a user fixes by an option or by the data, and how the package warns (imports
nothing beyond the standard library).

:class:`FrolicInputError` is a ``ValueError``; :func:`frolic_tta.lightning.cli.main` prints it as
one ``error: ...`` line and exits with status 2, wherever it is raised (while the classes are
built or during ``trainer.predict``). Checks that raise it during ``predict`` are decided on the
same values on every rank (or on all-reduced ones), so a DDP job stops on every rank at once.

:func:`warn` is how the package warns: attributed to the line of ``frolic_tta`` that warns (not
to a decorator such as ``torch.no_grad``'s ``_contextlib.py``), shown once per process for the
same text, and, for a fact about the whole dataset (decided on all-reduced values), by rank 0
only. :func:`write_error` is the one sentence for an output that could not be written.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["FrolicInputError", "warn", "write_error"]

_REGISTRY: dict = {}
"""Which (text, category, line) were shown: the ``__warningregistry__`` of :func:`warn`."""


class FrolicInputError(ValueError):
    """A bad input or configuration, explained in one sentence that names the option to change."""


def _rank() -> int:
    """This process's rank in an initialised ``torch.distributed`` group, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def warn(message: str, *, per_rank: bool = False, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message``, attributed to the ``frolic_tta`` line that calls this.

    Args:
        message: what happened and what it means for the result.
        per_rank: ``True`` for a fact about this rank's shard (e.g. a skipped sample); ``False``
            (default) for one decided on all-reduced values, which rank 0 alone reports.
        category: the warning class.
    """
    if not per_rank and _rank() != 0:
        return
    frame = sys._getframe(1)
    warnings.warn_explicit(
        message,
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=frame.f_globals.get("__name__", "frolic_tta"),
        registry=_REGISTRY,
        module_globals=frame.f_globals,
    )


def write_error(path: object, error: BaseException) -> str:
    """One sentence for an output that could not be written (disk full, read-only folder)."""
    text = str(error).splitlines()[0] if str(error) else ""
    reason = getattr(error, "strerror", None) or text or type(error).__name__
    return f"could not write '{path}': {reason}; free space or choose a writable --output_dir"
