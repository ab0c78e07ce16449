"""Write the stored ``train.py predict --help`` page (:data:`~.cli_help.STORED_HELP`) from the
parser itself: ``python -m frolic_tta.lightning.help_file`` after a change to an option or its
help, and ``tests/test_cli_help.py`` fails while the stored page is stale. Its own module so
that the help formatter (:mod:`.cli_help`, imported by the CLI) never imports the CLI back."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from frolic_tta.lightning.cli import main
from frolic_tta.lightning.cli_help import STORED_HELP


def write_help(path: Path = STORED_HELP) -> str:
    """Write the parser's ``predict --help`` (80 columns wide) to ``path`` and return it."""
    out, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            main(["predict", "--help"])
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    path.write_text(out.getvalue(), encoding="utf-8")
    return out.getvalue()


if __name__ == "__main__":  # python -m frolic_tta.lightning.help_file: refresh STORED_HELP
    write_help()
    print(f"wrote {STORED_HELP}")
