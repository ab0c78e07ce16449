"""What a successful run's stderr must not hold (issue 17): shared by the CLI and demo tests."""

from __future__ import annotations

import re
from collections import Counter

NOISE = {
    "a Lightning tip": re.compile(r"Tip:|litlogger|litmodels"),
    "a deprecation notice": re.compile(r"deprecat", re.IGNORECASE),
    "an escape code or carriage return": re.compile(r"[\x1b\r]"),
    "a warning attributed to a decorator": re.compile(r"_contextlib\.py"),
}


def assert_quiet(stderr: str) -> None:
    """Fail with the offending line if ``stderr`` holds noise, or one of our warnings twice.

    Our warnings must come from ``frolic_tta`` code: on the command line they are printed as
    ``warning: <message>`` (issue 38), elsewhere as ``.../frolic_tta/...py:LINE: UserWarning``.
    """
    for what, pattern in NOISE.items():
        found = [line for line in stderr.splitlines() if pattern.search(line)]
        assert not found, f"{what} in stderr: {found[0]!r}"
    warned = [line for line in stderr.splitlines() if re.search(r"Warning: ", line)]
    for line in warned:  # Python's format: a warning of another library (ours: "warning: ...")
        assert "/frolic_tta/" in line, f"a warning not attributed to frolic_tta: {line!r}"
    warned += [line for line in stderr.splitlines() if line.startswith("warning: ")]
    twice = [line for line, n in Counter(warned).items() if n > 1]
    assert not twice, f"warned more than once: {twice[0]!r}"
