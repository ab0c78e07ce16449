"""The README's Python snippets run as written (those that need downloaded weights or a finished
run's output files are marked ``<!-- not run: why -->`` just above the block)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\n)?```python\n(.*?)```", re.DOTALL)
SNIPPETS = [(m.group(2), m.group(1) is None) for m in BLOCK.finditer(README.read_text())]


def test_every_block_is_run_or_says_why_not():
    assert SNIPPETS, "no python blocks found"
    assert any(run for _, run in SNIPPETS)


@pytest.mark.parametrize(
    "code", [code for code, run in SNIPPETS if run], ids=lambda code: code.splitlines()[0]
)
def test_readme_snippet_runs(code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
