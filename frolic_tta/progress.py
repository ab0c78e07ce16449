"""Progress for people at a terminal and for log files alike.

:func:`progress` gives a tqdm bar when stderr is a terminal and otherwise a few plain lines
(``desc: 50% (150/300)``) without carriage returns or escape codes, so a log file stays readable.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol


class Progress(Protocol):
    """What the callers use of a tqdm bar."""

    def update(self, n: int = 1) -> Any: ...

    def close(self) -> None: ...


class LineProgress:
    """Plain-text progress: one line at each quarter of ``total`` and one at the end.

    Args:
        total: the number of units expected (> 0 to print anything).
        desc: what is being done, e.g. ``"Encoding prompts"``.
        unit: the name of one unit, e.g. ``"prompt"``.
        stream: where the lines go (default ``sys.stderr``).
    """

    STEPS = 4

    def __init__(self, total: int, desc: str, unit: str, stream: Any = None) -> None:
        self.total, self.desc, self.unit = int(total), desc, unit
        self.stream = sys.stderr if stream is None else stream
        self.n, self._shown = 0, 0

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.total <= 0:
            return
        step = min(self.STEPS, self.n * self.STEPS // self.total)
        if step > self._shown and step < self.STEPS:
            self._shown = step
            self._line()

    def close(self) -> None:
        if self.total > 0 and self._shown < self.STEPS:
            self._shown = self.STEPS
            self._line()

    def _line(self) -> None:
        percent = 100 * self.n // self.total
        units = self.unit + ("es" if self.unit.endswith(("ch", "s")) else "s")
        print(f"{self.desc}: {percent}% ({self.n}/{self.total} {units})", file=self.stream,
              flush=True)  # fmt: skip


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, unit: str = "it", enabled: bool = True) -> Progress:
    """A progress bar over ``total`` units: tqdm at a terminal, plain lines elsewhere.

    Args:
        total: the number of units expected.
        desc: what is being done.
        unit: the name of one unit.
        enabled: ``False`` gives a bar that shows nothing (e.g. on ranks other than 0).
    """
    if not enabled:
        return _Silent()
    if sys.stderr.isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit)
    return LineProgress(total, desc, unit)
