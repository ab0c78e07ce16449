"""The table of ``peers.py`` (used by ``report.py``): accuracy and cost of each method."""

from __future__ import annotations

from typing import Any

from common import fmt, markdown_table, read_result
from report_shift import machine_line

BALANCED = "InMaP balanced to π̃, alone"
"""The extra column: the proxies of "InMaP + Frolic" scored by themselves."""


def peers_result() -> dict[str, Any] | None:
    """The full run's ``peers.json`` if there is one, else the quick run's."""
    return read_result("peers") or read_result("peers_quick")


def _mean(entry: dict[str, Any] | None, key: str) -> Any:
    value = (entry or {}).get(key)
    return None if value is None else value.get("mean")


def _count(value: float | None) -> str:
    """Passes and steps: whole numbers (a mean over seeds keeps one decimal)."""
    if value is None:
        return "–"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"


def _run_line(p: dict[str, Any]) -> str:
    run = p.get("run")
    if run is None:
        return "Run: `python benchmarks/peers.py` (what it covered is not recorded)."
    return (
        f"Run: `{run['command']}`: the CLIP-like label-shift worlds of "
        f"`benchmarks/label_shift.py` ({run['clip']}, K = 50, d = 128; {run['seeds']} "
        f"seed{'s' if run['seeds'] > 1 else ''}; balanced, long-tailed with imbalance 10 and "
        "100, natural = i.i.d. labels) and the digits model of `benchmarks/digits_clip.py` "
        f"(N = 300 held-out digits, K = 10, {run['digits steps']} pre-training steps, "
        f"{run['digits seeds']} seed{'s' if run['digits seeds'] > 1 else ''})."
        + _parts_line(run.get("parts"))
    )


def _parts_line(parts: list[dict[str, Any]] | None) -> str:
    """Where the JSON joins runs of the same command's worlds (``--only``), when each ran."""
    if not parts:
        return ""
    text = "; ".join(
        f"{', '.join(part['worlds'])} at {part['date']}"
        + (f" ({part['why']})" if part.get("why") else "")
        for part in parts
    )
    return f" Its worlds ran in {len(parts)} parts on this machine and commit: {text}."


def _stop_line(p: dict[str, Any]) -> str:
    stop = p.get("stop") or {}
    relative = stop.get("relative_tolerance")
    rule = f"no proxy moves more than {stop.get('tolerance')} in a step"
    if relative is not None:
        rule += f", or ‖G‖ falls by less than {relative} of itself in a step"
    return (
        "Cost: wall seconds from features to logits, then InMaP passes over the features "
        "(Sinkhorn, labels, one per proxy step; Frolic's own few passes not counted) and, in "
        f"brackets, proxy steps. InMaP's convergence test: {rule}; the 2,000-step columns and "
        "the released preset (InMaP twice) run InMaP's fixed 2,000 steps."
    )


def _load_line(m: dict[str, Any]) -> str:
    busy = [m.get("cpu_busy_at_start"), m.get("cpu_busy_at_end")]
    shares = " / ".join("?" if b is None else f"{b:.0%}" for b in busy)
    if m.get("busy_at_start") or m.get("busy_at_end"):
        return (
            f"**Timed on a loaded, shared machine** (other processes used {shares} of the cores "
            "just before / after the run): the seconds are indicative only, the accuracies and "
            "passes are exact. For timings: `cd benchmarks && python peers.py --quick` on an "
            "idle machine, then `python report.py`."
        )
    return f"Idle machine (other processes: {shares} of the cores before / after)."


def peers_section(p: dict[str, Any] | None) -> str:
    """Top-1 per world and method (mean over seeds), then seconds, passes and steps."""
    if p is None:
        return "not measured yet: `python benchmarks/peers.py --quick`"
    methods, worlds = p["methods"], p["worlds"]
    at = methods.index("InMaP + Frolic") + 1
    columns = [*methods[:at], BALANCED, *methods[at:]]
    rows = []
    for name, w in worlds.items():
        accs = {m: _mean(w[m], "acc") for m in methods}
        accs[BALANCED] = _mean(w["InMaP + Frolic"], "proxies alone")
        best = max(a for a in accs.values() if a is not None)
        cells = [f"**{fmt(accs[c])}**" if accs[c] == best else fmt(accs[c]) for c in columns]
        rows.append([f"{name} ({w['seeds']})", fmt(_mean(w["zero-shot"], "acc")), *cells])
    costs = []
    for name, w in worlds.items():
        cells = []
        for m in methods:
            steps = _mean(w[m], "steps")
            cell = f"{fmt(_mean(w[m], 'seconds'))} s, {_count(_mean(w[m], 'passes'))}"
            cells.append(cell + (f" ({_count(steps)})" if steps is not None else ""))
        costs.append([name, *cells])
    return "\n".join(
        [
            _run_line(p),
            "",
            "Top-1 accuracy (mean over seeds; best in bold). "
            f"*{BALANCED}*: the proxies of InMaP + Frolic (labels balanced to the test prior π̃ "
            "Frolic estimates on the text prototypes) scored by themselves:",
            "",
            markdown_table(["world (seeds)", "zero-shot", *columns], rows),
            "",
            _stop_line(p),
            "",
            markdown_table(["world", *methods], costs),
            "",
            _load_line(p["machine"]),
            machine_line(p["machine"]),
        ]
    )
