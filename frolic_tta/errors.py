"""The error a user fixes by an option or by the data (imports nothing).

:class:`FrolicInputError` is a ``ValueError``; :func:`frolic_tta.lightning.cli.main` prints it as
one ``error: ...`` line and exits with status 2, wherever it is raised (while the classes are
built or during ``trainer.predict``). Checks that raise it during ``predict`` are decided on the
same values on every rank (or on all-reduced ones), so a DDP job stops on every rank at once.
"""

from __future__ import annotations

__all__ = ["FrolicInputError", "write_error"]


class FrolicInputError(ValueError):
    """A bad input or configuration, explained in one sentence that names the option to change."""


def write_error(path: object, error: BaseException) -> str:
    """One sentence for an output that could not be written (disk full, read-only folder)."""
    text = str(error).splitlines()[0] if str(error) else ""
    reason = getattr(error, "strerror", None) or text or type(error).__name__
    return f"could not write '{path}': {reason}; free space or choose a writable --output_dir"
