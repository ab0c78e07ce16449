"""README tables of ``label_shift.py`` and ``pretrained_bias.py`` (used by ``report.py``)."""

from __future__ import annotations

from typing import Any

from common import fmt, markdown_table


def _mean(entry: dict[str, Any] | None) -> float | None:
    return None if entry is None else entry.get("mean")


def _pt(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f}"


def _ratio(value: float | None) -> str:
    """A max/min ratio: plain up to 1e6, then as a power of ten."""
    return fmt(value) if value is None or value < 1e6 else f"{value:.1e}"


def machine_line(m: dict[str, Any]) -> str:
    """One line about the machine a result was measured on."""
    return (
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores; torch {m.get('torch', '?')}; "
        f"{m.get('date', '?')}, commit {m.get('commit', '?')}."
    )


def label_shift_section(p: dict[str, Any] | None) -> str:
    """Accuracy of the default against the previous default, the candidates and a method that
    knows the test prior, per world; then the priors it estimated."""
    if p is None:
        return "not measured yet: `python benchmarks/label_shift.py`"
    worlds = p["worlds"]
    previous = p.get("previous", "balanced (previous default)")
    candidates = [c for c in p["candidates"] if c not in ("default", previous)]
    headers = ["world", "f_c", "f_f", "f_c − ln β̂", previous, "**default f_d**"]
    headers += ["known prior (oracle)", "f_d − max(f_c, f_f)", "f_d − max(f_c, f_c − ln β̂, f_f)"]
    headers += [*candidates, "supervised LDA"]
    rows = []
    for name, w in worlds.items():
        r = w["rows"]
        rows.append(
            [
                f"{name} ({w['seeds']} seed{'s' if w['seeds'] > 1 else ''})",
                fmt(_mean(r["f_c"])),
                fmt(_mean(r["f_f"])),
                fmt(_mean(r.get("f_c - ln beta"))),
                fmt(_mean(w["f_d"][previous])),
                f"**{fmt(_mean(r['f_d']))}**",
                fmt(_mean(r.get("oracle"))),
                _pt(_mean(w["margin"])) + " pt",
                _pt(_mean(w.get("fusion_margin"))) + " pt" if "fusion_margin" in w else "–",
                *[fmt(_mean(w["f_d"][c])) for c in candidates],
                fmt(_mean(w["lda"])),
            ]
        )
    accuracy = markdown_table(headers, rows)
    headers = ["world", "test prior: shift weight w", "L1(π̃, truth)", "L1(mixture π̂, truth)"]
    headers += ["zero-shot β̂ max/min", "undetermined classes", "L1(zero-shot β̂, β*)"]
    headers += ["L1(fused β̂, β*)", "default s", "previous default s"]
    rows = []
    for name, w in worlds.items():
        rows.append(
            [
                name,
                fmt(_mean(w["shift_weight"])),
                fmt(_mean(w["test_prior_l1"])),
                fmt(_mean(w["raw_test_prior_l1"])),
                _ratio(_mean(w["zero_shot_beta_max_over_min"])),
                fmt(_mean(w["undetermined"])),
                fmt(_mean(w.get("zero_shot_beta_l1"))),
                fmt(_mean(w.get("beta_l1"))),
                fmt(_mean(w["seconds"]["default"])),
                fmt(_mean(w["seconds"][previous])),
            ]
        )
    priors = markdown_table(headers, rows)
    worst = min(_mean(w["margin"]) for w in worlds.values())
    fusion = [_mean(w["fusion_margin"]) for w in worlds.values() if "fusion_margin" in w]
    fused = f" Over max(f_c, f_c − ln β̂, f_f): {_pt(min(fusion))} pt." if fusion else ""
    return "\n".join(
        [
            accuracy,
            "",
            f"Smallest margin of the default over max(f_c, f_f): {_pt(worst)} pt.{fused}",
            "",
            priors,
            "",
            machine_line(p["machine"]),
        ]
    )


def pretrained_section(p: dict[str, Any] | None) -> str:
    """Table 3 rows and the rank correlation of the estimated priors with the pre-training
    frequencies, per seed of the tiny digits CLIP."""
    if p is None:
        return "not measured yet: `python benchmarks/pretrained_bias.py`"
    runs = p["runs"]
    rows_keys = p["rows"]
    headers = ["seed", "options", "τ_c", *rows_keys, "ρ(zero-shot β̂, freq)", "ρ(fused β̂, freq)"]
    headers += ["zero-shot β̂ max/min", "fused β̂ max/min", "undetermined"]
    rows = []
    for run in runs:
        rows.append(
            [
                run["seed"],
                run["options"],
                fmt(run["tau_c"]),
                *[fmt(run["accuracy"].get(key)) for key in rows_keys],
                fmt(run["spearman_zero_shot_beta"]),
                fmt(run["spearman_beta"]),
                _ratio(run["zero_shot_beta_max_over_min"]),
                _ratio(run["beta_max_over_min"]),
                run["undetermined"],
            ]
        )
    return "\n".join([markdown_table(headers, rows), "", machine_line(p["machine"])])
