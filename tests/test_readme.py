"""The Python snippets of README.md and docs/*.md run as written (those that need downloaded
weights or a finished run's output files are marked ``<!-- not run: why -->`` just above the
block), and the links between the pages lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- not run: [^>]*-->\n)?```python\n(.*?)```", re.DOTALL)
SNIPPETS = [
    (page, code, m.group(1) is None)
    for page in PAGES
    for m in BLOCK.finditer(page.read_text())
    for code in [m.group(2)]
]
LINK = re.compile(r"\]\(((?!https?:)[^)#\s]*)(#[^)\s]*)?\)")


def test_every_block_is_run_or_says_why_not():
    assert SNIPPETS, "no python blocks found"
    assert any(run for _, _, run in SNIPPETS)
    assert {page.name for page, _, run in SNIPPETS if run} >= {"README.md", "cli.md", "method.md"}


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return "#" + text.replace(" ", "-")


def test_links_between_pages_lead_to_a_file_and_heading():
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text()):
            path = (page.parent / target).resolve() if target else page
            assert path.is_file(), f"{page.name}: link to missing {target}"
            if anchor and path.suffix == ".md":
                headings = re.findall(r"^#+ (.*)$", path.read_text(), re.MULTILINE)
                anchors = {_anchor(h) for h in headings}
                assert anchor in anchors, f"{page.name}: {target}{anchor} not among {anchors}"


@pytest.mark.parametrize(
    "page, code",
    [(page, code) for page, code, run in SNIPPETS if run],
    ids=[f"{page.name}:{code.splitlines()[0]}" for page, code, run in SNIPPETS if run],
)
def test_snippet_runs(page, code, tmp_path, monkeypatch):
    if re.search(r"^(from|import) transformers\b", code, re.MULTILINE):  # the hf extra
        pytest.importorskip(
            "transformers", reason="transformers is not installed: pip install -e '.[hf]'"
        )
    monkeypatch.chdir(tmp_path)
    exec(compile(code, str(page), "exec"), {"__name__": "__readme__"})


def test_generated_benchmark_tables_are_up_to_date():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
