"""A sweep's results as one CSV and as Markdown tables in the layout of the paper's Tables 1-4.

:func:`write_results` reads the ``metrics.json`` of every finished run of a sweep and writes

* ``results.csv``: one line per run and row (every key of ``metrics.json``'s ``accuracy``:
  the rows of :data:`frolic_tta.rows.ROWS` the run reported, zero-shot ``f_c`` included), with
  the values exactly as ``metrics.json`` holds them (top-1 as a fraction; a row whose value is
  a dict of metrics gets one column per metric);
* ``tables.md``: per setting (model, prompts, options), the paper's Tables 1-4 (per-dataset
  columns, the 10-dataset average, ImageNet and the ImageNet-variants averages) with our top-1
  in %, the paper's published number (:mod:`frolic_tta.data.paper_results`, its table cited)
  and the difference, then every row on every dataset of the sweep. An average is shown only
  when every dataset it averages was run.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from frolic_tta.data.paper_results import paper_results
from frolic_tta.rows import ROWS

__all__ = ["AVERAGES", "RunResult", "average_members", "markdown_tables", "write_results"]

TOP1 = "top1"


def _table(number: int) -> tuple[str, dict[str, Any]]:
    for label, content in paper_results()["tables"].items():
        if content["number"] == number:
            return label, content
    raise KeyError(number)


def average_members() -> dict[str, list[str]]:
    """The datasets of each ``avg_*`` column, read from the paper's own tables."""
    t1, t2, t4 = (list(_table(n)[1]["columns"]) for n in (1, 2, 4))
    return {
        "avg_10_datasets": [c for c in t1 if not c.startswith("avg_")],
        "avg_imagenet_and_variants": [c for c in t2 if not c.startswith("avg_")],
        "avg_in_variants": [c for c in t2 if not c.startswith("avg_") and c != "imagenet"],
        "avg_11_datasets": [c for c in t4 if not c.startswith("avg_")],
    }


AVERAGES = average_members()
"""``avg_*`` column -> the dataset keys it averages (Tables 1-4)."""


@dataclass(frozen=True)
class RunResult:
    """One finished run of a sweep.

    Attributes:
        model: the sweep's model name; ``backbone``: the paper's (``"ViT-B/16"``) or ``None``.
        dataset: the column key (a dataset key of the paper where it is one).
        prompts, options: the sweep's names of the prompt set and the option set.
        descriptions: whether class descriptions (``prompts_file``) were used.
        metrics: the run's ``metrics.json``; ``run_dir``: its folder.
        details: the option values and model arguments, for headings.
    """

    model: str
    backbone: str | None
    dataset: str
    prompts: str
    options: str
    descriptions: bool
    metrics: dict[str, Any]
    run_dir: Path
    details: dict[str, Any] = field(default_factory=dict)

    def values(self, row: str) -> dict[str, float]:
        """The metrics of ``row`` (``{"top1": ...}`` for a plain accuracy)."""
        value = self.metrics.get("accuracy", {}).get(row)
        if value is None:
            return {}
        return dict(value) if isinstance(value, dict) else {TOP1: float(value)}


def _row_keys(results: Iterable[RunResult]) -> list[str]:
    seen: dict[str, None] = {}
    for result in results:
        seen.update(dict.fromkeys(result.metrics.get("accuracy", {})))
    return [k for k in ROWS if k in seen] + [k for k in seen if k not in ROWS]


def write_atomically(path: str | Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``: a reader
    (or a killed writer) sees the old file or the new one, never a truncated one."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, target)


def write_csv(path: Path, results: Sequence[RunResult]) -> None:
    """``results.csv``: one line per (run, row), metric values as ``metrics.json`` has them."""
    metrics: dict[str, None] = {}
    for result in results:
        for row in _row_keys([result]):
            metrics.update(dict.fromkeys(result.values(row)))
    head = ["model", "model_name", "pretrained", "backbone", "dataset", "prompts", "options"]
    tail = ["num_samples", "num_classes", "split", "features", "images_encoded", "run_dir"]
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow([*head, "row", *metrics, *tail])
    for r in results:
        m = r.metrics
        for row in _row_keys([r]):
            values = r.values(row)
            writer.writerow(
                [r.model, m.get("model_name"), m.get("pretrained"), r.backbone or "",
                 r.dataset, r.prompts, r.options, row,
                 *[repr(values[k]) if k in values else "" for k in metrics],
                 *[m.get(k, "") for k in tail[:-1]], str(r.run_dir)]
            )  # fmt: skip
    write_atomically(path, buffer.getvalue())


# ------------------------------------------------------------------ markdown
def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _ours(by_dataset: dict[str, RunResult], row: str, column: str) -> float | None:
    members = AVERAGES.get(column, [column])
    values = [by_dataset[d].values(row).get(TOP1) if d in by_dataset else None for d in members]
    if any(v is None for v in values):
        return None
    return sum(values) / len(values)  # type: ignore[arg-type]


def paper_method(label: str, backbone: str | None, row: str, descriptions: bool) -> str | None:
    """The paper's method in table ``label`` that our ``row`` is compared with, or ``None``.

    Tables 3-4 are keyed by our row keys; in Tables 1-2 the first method mapped to ``row``
    whose prompts match (``f_c``: "CLIP" with templates, "CuPL-CLIP" with descriptions;
    ``f_d``: "Frolic").
    """
    rows = paper_results()["tables"][label]["rows"].get(backbone or "", {})
    if row in rows:
        return row
    kind = "descriptions" if descriptions else "templates"
    for name, entry in rows.items():
        if entry.get("row") == row and entry.get("prompts", kind) == kind:
            return name
    return None


def _table_rows(content: dict[str, Any], number: int, reported: list[str]) -> list[str]:
    mapped = {m for rows in content["rows"].values() for m in rows}
    mapped |= {e.get("row") for rows in content["rows"].values() for e in rows.values()}
    return [r for r in reported if r in mapped or (r in ROWS and ROWS[r].table == str(number))]


def paper_table(number: int, results: Sequence[RunResult]) -> str | None:
    """Table ``number`` of the paper for one setting's runs, or ``None`` if none of our cells
    can be filled (an average needs all of its datasets)."""
    label, content = _table(number)
    columns = list(content["columns"])
    by_dataset = {r.dataset: r for r in results}
    covered = {c for c in columns for d in AVERAGES.get(c, [c]) if d in by_dataset}
    rows = _table_rows(content, number, _row_keys(results))
    if not any(_ours(by_dataset, row, c) is not None for row in rows for c in columns):
        return None
    first = results[0]
    backbone, descriptions = first.backbone, any(r.descriptions for r in results)
    lines = [
        f"#### Table {number} ({label}): {content['title']}",
        "",
        "| row | | " + " | ".join(content["columns"].values()) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for row in rows:
        name = f"{row}: {ROWS[row].label}" if row in ROWS else row
        ours = [_ours(by_dataset, row, c) for c in columns]
        lines.append(f"| {name} | ours | " + " | ".join(_pct(v) for v in ours) + " |")
        method = paper_method(label, backbone, row, descriptions)
        if method is None:
            continue
        entry = content["rows"][backbone][method]
        paper = [entry["values"].get(c) for c in columns]
        cells = ["–" if p is None else f"{p:.1f}" for p in paper]
        delta = [
            "–" if o is None or p is None else f"{100 * o - p:+.1f}"
            for o, p in zip(ours, paper, strict=True)
        ]
        lines.append(f"| | paper, Table {number}: {entry['label']} | " + " | ".join(cells) + " |")
        lines.append("| | Δ | " + " | ".join(delta) + " |")
    missing = {
        c: [d for d in AVERAGES[c] if d not in by_dataset]
        for c in columns
        if c in AVERAGES and c in covered
    }
    notes = [f"{c} needs {', '.join(m)}" for c, m in missing.items() if m]
    if notes:
        lines += ["", "Averages not shown: " + "; ".join(notes) + "."]
    return "\n".join(lines)


def all_rows_table(results: Sequence[RunResult]) -> str:
    """Every reported row on every dataset of one setting (top-1, %)."""
    datasets = list(dict.fromkeys(r.dataset for r in results))
    by_dataset = {r.dataset: r for r in results}
    lines = ["| row | " + " | ".join(datasets) + " |", "|---|" + "---|" * len(datasets)]
    for row in _row_keys(results):
        cells = [_pct(by_dataset[d].values(row).get(TOP1)) for d in datasets]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _name(value: Any) -> str:
    return Path(str(value)).name if "/" in str(value) else str(value)


def _settings(results: Sequence[RunResult]) -> dict[tuple[str, str, str], list[RunResult]]:
    groups: dict[tuple[str, str, str], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.model, result.prompts, result.options), []).append(result)
    return groups


def markdown_tables(results: Sequence[RunResult], title: str = "Frolic sweep") -> str:
    """``tables.md``: per setting, the paper's Tables 1-4 that its datasets fill, then all rows."""
    lines = [
        f"# {title}",
        "",
        "Top-1 accuracy (%). *ours*: this sweep's runs (zero-shot `f_c` from the same runs); "
        "*paper*: the published number (frolic_tta/data/paper_results.json), table cited; "
        "Δ = ours − paper. Exact values: results.csv.",
    ]
    for (model, prompts, options), group in _settings(results).items():
        first = group[0]
        option_text = json.dumps(first.details.get("options", {}))
        lines += [
            "",
            f"## {model} ({first.metrics.get('model')}, {_name(first.metrics.get('pretrained'))}) "
            f"· prompts: {prompts} · options: {options} {option_text}",
            "",
            f"Paper backbone: {first.backbone or 'none (no published numbers)'}; datasets: "
            f"{', '.join(r.dataset for r in group)}.",
        ]
        for number in (1, 2, 3, 4):
            table = paper_table(number, group)
            if table:
                lines += ["", table]
        lines += ["", "#### Every row, every dataset", "", all_rows_table(group)]
    return "\n".join(lines) + "\n"


def write_results(output_dir: str | Path, results: Sequence[RunResult]) -> tuple[Path, Path]:
    """Write ``results.csv`` and ``tables.md`` into ``output_dir``; return their paths."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = folder / "results.csv", folder / "tables.md"
    write_csv(csv_path, results)
    write_atomically(md_path, markdown_tables(results, f"Frolic sweep: {folder}"))
    return csv_path, md_path
