"""A sweep's results as one CSV and as Markdown tables in the layout of the paper's Tables 1-4.

:func:`write_results` reads the ``metrics.json`` of every finished run of a sweep and writes

* ``results.csv``: one line per run and row (every key of ``metrics.json``'s ``accuracy``:
  the rows of :data:`frolic_tta.rows.ROWS` the run reported, zero-shot ``f_c`` included) with
  every metric of ``metrics.json``, named as there and valued exactly as there: the row's
  ``accuracy``, ``top5``, ``recall``, ``ece``, ``nll`` (any per-row mapping), then the run's
  own numbers (``tau_c``, ``tau_g``, ``test_prior/likelihood_ratio``, ``beta/max_over_min``,
  ``options/bias``, ...: every value outside a list, nested keys joined by ``/`` as in
  :func:`frolic_tta.metrics.metric_key`);
* ``tables.md``: per model and prompts (``##``), the paper's Tables 1-4 (``###``; per-dataset
  columns, the 10-dataset average, ImageNet and the ImageNet-variants averages) with our top-1
  in % for every option set of the sweep side by side (one line each), the difference to the
  paper's published number in parentheses and that number below
  (:mod:`frolic_tta.data.paper_results`, its table cited); then every row on every dataset.
  An average is shown only when every dataset it averages was run.
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

import yaml

from frolic_tta.data.datasets import canonical_dataset_name
from frolic_tta.data.paper_results import paper_results
from frolic_tta.lightning.sweep_files import read_json
from frolic_tta.rows import ROWS

__all__ = [
    "AVERAGES", "RunResult", "average_members", "collect_results", "markdown_tables",
    "write_results",
]  # fmt: skip

TOP1 = "accuracy"
"""Top-1 as ``metrics.json`` names it (``{"f_d": {"top1": ...}}`` of older files is read too)."""


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

    def values(self, row: str) -> dict[str, Any]:
        """Every metric of ``row``: ``{"accuracy": ..., "top5": ..., ...}`` as in ``metrics.json``
        (a metric that did not score ``row``, e.g. a stored head's, is left out)."""
        value = self.metrics.get("accuracy", {}).get(row)
        if value is None:
            return {}
        if isinstance(value, dict):  # an older layout: {"top1": ..., "top5": ...} per row
            values = {TOP1 if k == "top1" else k: v for k, v in value.items()}
        else:
            values = {TOP1: value}
        for key in _row_metric_keys(self.metrics):
            if row in self.metrics[key] and key not in values:
                values[key] = self.metrics[key][row]
        return values

    def run_values(self) -> dict[str, Any]:
        """The run's own numbers: every value of ``metrics.json`` outside the per-row metrics
        and outside lists, nested keys joined by ``/`` (``test_prior/likelihood_ratio``)."""
        rows = _row_metric_keys(self.metrics)
        return _flat({k: v for k, v in self.metrics.items() if k not in rows and k != "accuracy"})


def _row_metric_keys(metrics: dict[str, Any]) -> list[str]:
    """The keys of ``metrics.json`` that hold one number per row (``top5``, ``ece``, ...)."""
    rows = set(metrics.get("accuracy") or {})
    return [
        key
        for key, value in metrics.items()
        if key != "accuracy" and isinstance(value, dict) and value and set(value) <= rows
        and all(isinstance(v, int | float | type(None)) for v in value.values())
    ]  # fmt: skip


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}/"))
        elif not isinstance(value, list):
            flat[f"{prefix}{key}"] = value
    return flat


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


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


NAMES = ("model", "model_name", "pretrained", "backbone", "dataset", "prompts", "options")


def write_csv(path: Path, results: Sequence[RunResult]) -> None:
    """``results.csv``: one line per (run, row); every metric of the run's ``metrics.json``
    under its own name (per row, then the run's), values as ``metrics.json`` has them."""
    metrics: dict[str, None] = {}
    run_keys: dict[str, None] = {}
    for result in results:
        for row in _row_keys([result]):
            metrics.update(dict.fromkeys(result.values(row)))
        run_keys.update(dict.fromkeys(k for k in result.run_values() if k not in NAMES))
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer)
    writer.writerow([*NAMES, "row", *metrics, *run_keys, "run_dir"])
    for r in results:
        m, own = r.metrics, r.run_values()
        for row in _row_keys([r]):
            values = r.values(row)
            writer.writerow(
                [r.model, m.get("model_name"), m.get("pretrained"), r.backbone or "",
                 r.dataset, r.prompts, r.options, row,
                 *[_cell(values.get(k)) for k in metrics],
                 *[_cell(own.get(k)) for k in run_keys], str(r.run_dir)]
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


def _by_options(results: Sequence[RunResult]) -> dict[str, dict[str, RunResult]]:
    """Option set -> dataset -> its run, in the sweep's order."""
    grouped: dict[str, dict[str, RunResult]] = {}
    for result in results:
        grouped.setdefault(result.options, {})[result.dataset] = result
    return grouped


def _with_delta(ours: float | None, paper: float | None) -> str:
    if ours is None or paper is None:
        return _pct(ours)
    return f"{_pct(ours)} ({100 * ours - paper:+.1f})"


def paper_table(number: int, results: Sequence[RunResult]) -> str | None:
    """Table ``number`` of the paper for the runs of one model and prompts: datasets as
    columns, every option set of the sweep a line under each row, or ``None`` if none of our
    cells can be filled (an average needs all of its datasets)."""
    label, content = _table(number)
    columns = list(content["columns"])
    grouped = _by_options(results)
    datasets = {r.dataset for r in results}
    rows = _table_rows(content, number, _row_keys(results))
    if not any(
        _ours(by_dataset, row, c) is not None
        for by_dataset in grouped.values() for row in rows for c in columns
    ):  # fmt: skip
        return None
    backbone, descriptions = results[0].backbone, any(r.descriptions for r in results)
    lines = [
        f"### Table {number} ({label}): {content['title']}",
        "",
        "| row | options | " + " | ".join(content["columns"].values()) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for row in rows:
        method = paper_method(label, backbone, row, descriptions)
        entry = content["rows"][backbone][method] if method is not None else None
        paper = [entry["values"].get(c) if entry else None for c in columns]
        name = f"{row}: {ROWS[row].label}" if row in ROWS else row
        for options, by_dataset in grouped.items():
            ours = [_ours(by_dataset, row, c) for c in columns]
            cells = [_with_delta(o, p) for o, p in zip(ours, paper, strict=True)]
            lines.append(f"| {name} | {options} | " + " | ".join(cells) + " |")
            name = ""
        if entry is not None:
            cells = ["–" if p is None else f"{p:.1f}" for p in paper]
            cited = f"paper, Table {number}: {entry['label']}"
            lines.append(f"| | {cited} | " + " | ".join(cells) + " |")
    missing = {
        c: [d for d in AVERAGES[c] if d not in datasets]
        for c in columns
        if c in AVERAGES and any(d in datasets for d in AVERAGES[c])
    }
    notes = [f"{c} needs {', '.join(m)}" for c, m in missing.items() if m]
    if notes:
        lines += ["", "Averages not shown: " + "; ".join(notes) + "."]
    return "\n".join(lines)


def all_rows_table(results: Sequence[RunResult]) -> str:
    """Every reported row on every dataset of one model and prompts, a line per option set."""
    datasets = list(dict.fromkeys(r.dataset for r in results))
    grouped = _by_options(results)
    lines = ["| row | options | " + " | ".join(datasets) + " |"]
    lines.append("|---|---|" + "---|" * len(datasets))
    for row in _row_keys(results):
        name = row
        for options, by_dataset in grouped.items():
            cells = [_pct(by_dataset[d].values(row).get(TOP1)) if d in by_dataset else "–"
                     for d in datasets]  # fmt: skip
            lines.append(f"| {name} | {options} | " + " | ".join(cells) + " |")
            name = ""
    return "\n".join(lines)


def _name(value: Any) -> str:
    return Path(str(value)).name if "/" in str(value) else str(value)


def markdown_tables(results: Sequence[RunResult], title: str = "Frolic sweep") -> str:
    """``tables.md``: per model and prompts, the paper's Tables 1-4 that its datasets fill, the
    option sets side by side, then all rows."""
    lines = [
        f"# {title}",
        "",
        "Top-1 accuracy (%) of this sweep's runs, one line per option set (zero-shot `f_c` from "
        "the same runs); in parentheses the difference to the paper's published number, which "
        "follows as *paper* (frolic_tta/data/paper_results.json, table cited). Exact values "
        "and every other metric: results.csv.",
    ]
    groups: dict[tuple[str, str], list[RunResult]] = {}
    for result in results:
        groups.setdefault((result.model, result.prompts), []).append(result)
    for (model, prompts), group in groups.items():
        first = group[0]
        option_sets = {r.options: json.dumps(r.details.get("options", {})) for r in group}
        lines += [
            "",
            f"## {model} ({first.metrics.get('model')}, {_name(first.metrics.get('pretrained'))}) "
            f"· prompts: {prompts}",
            "",
            f"Paper backbone: {first.backbone or 'none (no published numbers)'}; datasets: "
            f"{', '.join(dict.fromkeys(r.dataset for r in group))}; options: "
            + "; ".join(f"{name} {text}" for name, text in option_sets.items()) + ".",
        ]  # fmt: skip
        for number in (1, 2, 3, 4):
            table = paper_table(number, group)
            if table:
                lines += ["", table]
        lines += ["", "### Every row, every dataset", "", all_rows_table(group)]
    return "\n".join(lines) + "\n"


def collect_results(runs: Iterable[Any]) -> list[RunResult]:
    """The finished runs' ``metrics.json`` (``runs``: :class:`frolic_tta.lightning.sweep.Run`),
    in grid order."""
    results = []
    for run in runs:
        if not run.done():
            continue
        saved = run.run_dir / "config.yaml"  # the run's full config, saved by the CLI
        try:
            config = yaml.safe_load(saved.read_text()) if saved.is_file() else None
        except (OSError, yaml.YAMLError):
            config = None
        config = config if isinstance(config, dict) else {}
        prompts_file = (config.get("model") or run.details["model"]).get("prompts_file")
        try:
            column = canonical_dataset_name(run.dataset)
        except ValueError:
            column = run.dataset
        results.append(
            RunResult(run.model, run.backbone, column, run.prompts, run.options,
                      prompts_file is not None, read_json(run.metrics_file),
                      run.run_dir, run.details)
        )  # fmt: skip
    return results


def write_results(output_dir: str | Path, results: Sequence[RunResult]) -> tuple[Path, Path]:
    """Write ``results.csv`` and ``tables.md`` into ``output_dir``; return their paths."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = folder / "results.csv", folder / "tables.md"
    write_csv(csv_path, results)
    write_atomically(md_path, markdown_tables(results, f"Frolic sweep: {folder}"))
    return csv_path, md_path
