"""The table of ``peers.py`` (used by ``report.py``): accuracy and cost of each method."""

from __future__ import annotations

from typing import Any

from common import fmt, markdown_table
from report_shift import machine_line


def _cell(entry: dict[str, Any], key: str) -> Any:
    value = entry.get(key)
    return None if value is None else value.get("mean")


def peers_section(p: dict[str, Any] | None) -> str:
    """Top-1 per world and method (mean over seeds), then seconds and InMaP passes."""
    if p is None:
        return "not measured yet: `python benchmarks/peers.py`"
    methods, worlds = p["methods"], p["worlds"]
    headers = ["world (seeds)", "zero-shot", *methods]
    rows = []
    for name, w in worlds.items():
        accs = [_cell(w[m], "acc") for m in methods]
        best = max(a for a in accs if a is not None)
        cells = [f"**{fmt(a)}**" if a == best else fmt(a) for a in accs]
        rows.append([f"{name} ({w['seeds']})", fmt(_cell(w["zero-shot"], "acc")), *cells])
    costs = []
    for name, w in worlds.items():
        cells = [f"{fmt(_cell(w[m], 'seconds'))} s, {fmt(_cell(w[m], 'passes'))}" for m in methods]
        costs.append([name, *cells])
    tolerance = p.get("tolerance")
    return "\n".join(
        [
            "Top-1 accuracy (mean over seeds; best in bold):",
            "",
            markdown_table(headers, rows),
            "",
            "Cost: wall seconds from features to logits, and InMaP passes over the features "
            f"(convergence test: no proxy moves more than {tolerance} in a step; the released "
            "preset runs InMaP twice for 2,000 steps):",
            "",
            markdown_table(["world", *methods], costs),
            "",
            machine_line(p["machine"]),
        ]
    )
