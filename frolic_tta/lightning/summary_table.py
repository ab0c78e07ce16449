"""The terminal table a :class:`~frolic_tta.lightning.report.FrolicReport` prints after predict.

:func:`format_table` turns the ``metrics.json`` summary into plain text: the run, one line per
Table 3/4 row (top-1, top-5, recall, ECE, NLL), the temperatures, the test prior and the label
biases, and the notes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from frolic_tta.rows import ROWS


def short_name(value: Any) -> str:
    """A model name for titles: ``hf-hub:org/name`` as it is, ``local-dir:`` with the folder's
    name, the file name of a path, else the value."""
    text = str(value)
    if text.startswith("hf-hub:"):
        return text
    if text.startswith("local-dir:"):
        return "local-dir:" + Path(text[len("local-dir:") :]).name
    return Path(text).name if "/" in text else text


def _evidence(ratio: float) -> str:
    """Lambda as printed: below 0 (EM fit no better than balanced) it is no evidence, 0."""
    return f"{ratio:.4g}" if ratio > 0 else "0 (no better fit than balanced)"


def format_table(summary: dict[str, Any]) -> str:
    """The terminal table of a :class:`FrolicReport` summary (plain text)."""
    lines = [
        f"Frolic on {summary['dataset']} with {summary['model']}"
        + (f" ({short_name(summary['pretrained'])})" if summary.get("pretrained") else "")
        + ": "
        f"N={summary['num_samples']} samples, K={summary['num_classes']} classes",
    ]
    if summary.get("split"):
        lines.append(f"  split: {summary['split']}")
    if summary.get("features", "encoded") != "encoded":
        lines.append(f"  features: {summary['features']}")
    accuracy = summary["accuracy"]
    if accuracy:
        width = max(len(row) for row in accuracy)
        kinds = ("top5", "recall", "ece", "nll")
        top = f"top-{min(5, summary['num_classes'])}"  # top-K where K < 5, as it is computed
        header = "  ".join(f"{name:>7}" for name in ("top-1", top, "recall", "ECE", "NLL"))
        lines.append(f"  {'row':<{width}}  {header}  description")
        for row, value in accuracy.items():
            cells = [f"{100 * value:.2f}%"]
            for kind in kinds:
                v = summary.get(kind, {}).get(row)
                percent = kind in ("top5", "recall")
                cells.append("-" if v is None else f"{100 * v:.2f}%" if percent else f"{v:.3f}")
            text = "  ".join(f"{cell:>7}" for cell in cells)
            lines.append(f"  {row:<{width}}  {text}  {ROWS[row].label}")
    else:
        lines.append("  no labels: accuracy not computed")
    lines.append(f"  tau_c = {summary['tau_c']:.4g}, tau_g = {summary['tau_g']:.4g}")
    test = summary.get("test_prior", {})
    if test.get("estimated"):
        balanced = "treated as balanced" if test["shift_weight"] == 0 else "imbalanced"
        lines.append(
            f"  test prior pi: {balanced} (weight {test['shift_weight']:.3g}, likelihood ratio "
            f"{_evidence(test['likelihood_ratio'])}), max/min {test['max_over_min']:.3g}"
            + ("" if test.get("converged", True) else " (NOT converged: see the warning)")
        )
    for key, what in (
        ("zero_shot_beta", "pre-training prior of the zero-shot model"),
        ("beta", "label bias removed from f_f"),
    ):
        beta = summary.get(key)
        if beta is None:
            continue
        count = beta.get("undetermined")
        undetermined = f", {count} undetermined" if count else ""
        lines.append(f"  {key}: max/min {beta['max_over_min']:.3g}{undetermined} ({what})")
    if summary.get("online"):
        lines.append(_online_line(summary["online"]))
    lines += [f"  note: {note}" for note in summary.get("notes", [])]
    return "\n".join(lines)


def _online_line(online: dict[str, Any]) -> str:
    """Online mode's result (``metrics.json``'s ``online``): the accuracy of the answers as
    they were given, beside zero-shot's and the end of stream's, and the refits."""
    refits = [r["seen"] for r in online.get("refits", [])]
    at = f" (at n = {', '.join(map(str, refits))})" if refits else ""
    accuracy = online.get("accuracy")
    if not accuracy:
        return (
            f"  online: {online['seen']} answers in {online['steps']} steps, {len(refits)} "
            "refits (no labels: no accuracy)"
        )
    below = (
        ": below zero-shot (a stream whose early batches hold few classes?)"
        if accuracy["online"] < accuracy["zero_shot"]
        else ""
    )
    return (
        f"  online: {100 * accuracy['online']:.2f}% as answered (zero-shot "
        f"{100 * accuracy['zero_shot']:.2f}%, end of stream "
        f"{100 * accuracy['end_of_stream']:.2f}%), {len(refits)} refits{at}{below}"
    )


def format_outputs(folder: str | Path, files: list[str]) -> str:
    """The line that says where a run's outputs are: ``Outputs in <folder>/: a, b, c``."""
    return f"Outputs in {str(folder).rstrip('/')}/: {', '.join(files)}"
