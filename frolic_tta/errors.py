"""The error a user fixes by an option or by the data (imports nothing).

:class:`FrolicInputError` is a ``ValueError``; :func:`frolic_tta.lightning.cli.main` prints it as
one ``error: ...`` line and exits with status 2, wherever it is raised (while the classes are
built or during ``trainer.predict``). Checks that raise it during ``predict`` are decided on the
same values on every rank (or on all-reduced ones), so a DDP job stops on every rank at once.
"""

from __future__ import annotations

__all__ = ["FrolicInputError"]


class FrolicInputError(ValueError):
    """A bad input or configuration, explained in one sentence that names the option to change."""
