"""The paper's published numbers: spot checks, structure, and every value against the tex."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from frolic_tta.data import DATASETS
from frolic_tta.data.paper_results import (
    backbone_name,
    paper_number,
    paper_numbers,
    paper_results,
)
from frolic_tta.rows import ROWS

TEX = Path("/work/shared/paper/frolic-neurips2024.tex")
TEN = {k for k in DATASETS if not k.startswith("imagenet") and k != "objectnet"}
SHIFTS = {"imagenet", "imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r", "objectnet"}


@pytest.mark.parametrize(
    ("table", "backbone", "method", "column", "value"),
    [
        (1, "ViT-B/16", "CLIP", "avg_10_datasets", 64.9),
        (1, "ViT-B/16", "CuPL-CLIP", "avg_10_datasets", 68.6),
        (1, "ViT-B/16", "Frolic", "avg_10_datasets", 71.1),
        (1, "ViT-L/14", "InMaP + Frolic", "fgvc_aircraft", 42.1),
        (1, "ViT-B/16", "SuS-X-SD", "eurosat", 57.4),
        (2, "ViT-B/16", "Frolic", "imagenet", 70.9),
        (2, "ViT-L/14", "TDA", "imagenet_a", 77.9),
        (2, "ViT-L/14", "InMaP", "objectnet", 71.0),
        (3, "ViT-B/16", "f_c", "avg_10_datasets", 65.1),
        (3, "ViT-L/14", "f_c - ln beta", "avg_in_variants", 73.4),
        (3, "ViT-L/14", "f_f", "imagenet", 76.9),
        (4, "ViT-B/16", "tde", "eurosat", 55.3),
        (4, "ViT-B/16", "oracle", "imagenet", 71.5),
        (4, "ViT-B/16", "implicit", "avg_11_datasets", 69.3),
    ],
)
def test_spot_checks(table, backbone, method, column, value) -> None:
    number = paper_number(table, backbone, method, column)
    assert number is not None and number.value == value
    label = ["tab:cross_data", "tab:imagenet_shift", "tab:lda_ensemble_debias", "tab:debias_cmp"]
    assert number.citation == f"Table {table} ({label[table - 1]})"


def test_keys_are_ours() -> None:
    tables = paper_results()["tables"]
    columns = {label: set(t["columns"]) for label, t in tables.items()}
    assert columns["tab:cross_data"] == TEN | {"avg_10_datasets"}
    assert columns["tab:imagenet_shift"] == SHIFTS | {"avg_imagenet_and_variants"}
    assert columns["tab:lda_ensemble_debias"] == {"avg_10_datasets", "imagenet", "avg_in_variants"}
    assert columns["tab:debias_cmp"] == TEN | {"imagenet", "avg_11_datasets"}
    for label in ("tab:lda_ensemble_debias", "tab:debias_cmp"):
        for rows in tables[label]["rows"].values():
            assert set(rows) <= set(ROWS), label
    assert set(tables["tab:debias_cmp"]["rows"]["ViT-B/16"]) == {
        "f_c",
        "tde",
        "implicit",
        "f_d",
        "oracle",
    }
    for number in paper_numbers():
        assert number.row is None or number.row in ROWS
        assert number.column in columns[number.table]
    assert {n.method for n in paper_numbers(1, "ViT-B/16") if n.row == "f_d"} == {
        "Frolic",
        "InMaP + Frolic",
    }
    assert len(paper_numbers()) == 10 * 11 + 8 * 11 + 2 * 8 * 7 + 2 * 6 * 3 + 5 * 12


def test_averages_are_the_means_of_the_printed_columns() -> None:
    """Each average is the mean of its row within rounding; the one exception is the paper's."""
    for label in ("tab:cross_data", "tab:imagenet_shift", "tab:debias_cmp"):
        for backbone, rows in paper_results()["tables"][label]["rows"].items():
            for method, entry in rows.items():
                values = dict(entry["values"])
                average = values.pop(next(c for c in values if c.startswith("avg_")))
                mean = sum(values.values()) / len(values)
                if (label, method) == ("tab:debias_cmp", "f_d"):  # printed 70.9, mean 71.08
                    assert (average, round(mean, 2)) == (70.9, 71.08)
                    continue
                assert abs(mean - average) <= 0.1, (label, backbone, method, mean, average)


def test_filters_and_unknown_table() -> None:
    assert backbone_name("ViT-B-16-quickgelu") == "ViT-B/16"
    assert backbone_name("ViT-L-14") == "ViT-L/14" and backbone_name("RN50") is None
    assert backbone_name("ViT-B-32") is None
    by_open_clip = paper_numbers("tab:imagenet_shift", "ViT-L-14-quickgelu", "CLIP")
    assert [n.value for n in by_open_clip] == [75.9, 70.2, 59.7, 70.9, 87.9, 65.5, 71.6]
    assert paper_number(4, "ViT-L/14", "f_d", "dtd") is None  # Table 4 is ViT-B/16 only
    with pytest.raises(ValueError, match=r"Expected `table` to be one of \['tab:cross_data'"):
        paper_numbers("tab:nope")


def _tex_rows(tex: str, label: str) -> list[list[float]]:
    """The numeric rows of a table in the tex, as printed (an independent reading)."""
    start = tex.index(rf"\label{{{label}}}")
    body = tex[tex.index(r"\midrule", start) : tex.index(r"\end{tabular}", start)]
    rows = []
    for line in body.split(r"\\"):
        tokens = re.sub(r"\\[a-zA-Z]+|[{}$&~]", " ", line).split()
        numbers = [float(t) for t in tokens if re.fullmatch(r"\d+\.\d", t)]
        if numbers:
            rows.append(numbers)
    return rows


@pytest.mark.skipif(not TEX.is_file(), reason="the paper's tex is not on this machine")
def test_every_number_matches_the_tex() -> None:
    tex = TEX.read_text(encoding="utf-8")
    for label, table in paper_results()["tables"].items():
        ours = [
            list(entry["values"].values())
            for rows in table["rows"].values()
            for entry in rows.values()
        ]
        printed = _tex_rows(tex, label)
        if label == "tab:lda_ensemble_debias":  # one printed row: ViT-B/16 then ViT-L/14
            printed = [row[:3] for row in printed] + [row[3:] for row in printed]
        assert ours == printed, label
