"""The paper's published accuracies (Tables 1-4), to print beside measured ones.

``paper_results.json`` (next to this file) holds every number of the paper's Tables 1-4 as
printed (top-1 accuracy in %), keyed by table label (``"tab:cross_data"``), backbone
(``"ViT-B/16"``, ``"ViT-L/14"``), method and column:

* methods: our row keys (:data:`frolic_tta.rows.ROWS`: ``"f_c"`` ... ``"oracle"``) in Tables 3
  and 4; the paper's method names in Tables 1 and 2 (``"CLIP"``, ``"CuPL-CLIP"``, ``"Frolic"``,
  ``"InMaP + Frolic"``, ...), each with the ``row`` of ours it corresponds to where there is one
  (CLIP with templates and CuPL-CLIP with descriptions are both ``f_c``; Frolic is ``f_d``);
* columns: our dataset keys, and ``avg_10_datasets`` (Tables 1, 3), ``avg_imagenet_and_variants``
  (Table 2: ImageNet and its 5 variants), ``avg_in_variants`` (Table 3: the 5 variants) and
  ``avg_11_datasets`` (Table 4: the 10 datasets and ImageNet).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from frolic_tta.rows import ROWS

__all__ = ["PaperNumber", "backbone_name", "paper_number", "paper_numbers", "paper_results"]

_FILE = Path(__file__).with_name("paper_results.json")


@lru_cache(maxsize=1)
def paper_results() -> dict[str, Any]:
    """The parsed ``paper_results.json`` (shared; do not modify)."""
    with _FILE.open(encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class PaperNumber:
    """One published accuracy.

    Attributes:
        value: Top-1 accuracy in %, as printed.
        table: The table's LaTeX label, e.g. ``"tab:cross_data"``.
        number: The table's number in the paper (1-4).
        backbone: ``"ViT-B/16"`` or ``"ViT-L/14"``.
        method: Our row key or the paper's method name.
        label: The method as the paper prints it.
        column: Our dataset key or an ``avg_*`` column.
        row: Our row key this method corresponds to, if any.
    """

    value: float
    table: str
    number: int
    backbone: str
    method: str
    label: str
    column: str
    row: str | None = None

    @property
    def citation(self) -> str:
        """``"Table 1 (tab:cross_data)"``."""
        return f"Table {self.number} ({self.table})"


def _table_label(table: str | int) -> str:
    tables = paper_results()["tables"]
    for label, content in tables.items():
        if table in (label, content["number"], str(content["number"])):
            return label
    raise ValueError(
        f"Expected `table` to be one of {list(tables)} or 1-{len(tables)}, but got {table!r}"
    )


def backbone_name(model_name: str) -> str | None:
    """The paper's name of an open_clip backbone: ``"ViT-B-16-quickgelu"`` -> ``"ViT-B/16"``.

    Returns ``None`` for backbones the paper does not report.
    """
    match = re.fullmatch(r"vit-([bl])[-/](\d+)(-quickgelu)?", str(model_name).strip().lower())
    name = f"ViT-{match.group(1).upper()}/{match.group(2)}" if match else None
    return name if name in ("ViT-B/16", "ViT-L/14") else None


def paper_numbers(
    table: str | int | None = None,
    backbone: str | None = None,
    method: str | None = None,
    column: str | None = None,
) -> list[PaperNumber]:
    """Every published number matching the given filters, in the paper's order.

    Args:
        table: Label (``"tab:debias_cmp"``) or number (``4``); all tables by default.
        backbone: ``"ViT-B/16"``, ``"ViT-L/14"`` or an open_clip name (``"ViT-L-14"``).
        method: A row key (``"f_d"``) or the paper's method name (``"CuPL-CLIP"``).
        column: A dataset key or ``avg_*`` column.

    Raises:
        ValueError: An unknown table.
    """
    tables = paper_results()["tables"]
    labels = [_table_label(table)] if table is not None else list(tables)
    wanted = (backbone_name(backbone) or backbone) if backbone is not None else None
    found = []
    for label in labels:
        content = tables[label]
        for name, rows in content["rows"].items():
            if wanted is not None and name != wanted:
                continue
            for key, entry in rows.items():
                if method is not None and key != method:
                    continue
                for col, value in entry["values"].items():
                    if column is None or col == column:
                        found.append(
                            PaperNumber(
                                float(value),
                                label,
                                int(content["number"]),
                                name,
                                key,
                                entry["label"],
                                col,
                                entry.get("row", key if key in ROWS else None),
                            )
                        )
    return found


def paper_number(table: str | int, backbone: str, method: str, column: str) -> PaperNumber | None:
    """The one published number at (table, backbone, method, column), or ``None`` if the paper
    has none there.

    >>> number = paper_number(1, "ViT-B-16-quickgelu", "Frolic", "avg_10_datasets")
    >>> number.value, number.citation, number.row
    (71.1, 'Table 1 (tab:cross_data)', 'f_d')
    """
    hits = paper_numbers(table, backbone, method, column)
    return hits[0] if hits else None
