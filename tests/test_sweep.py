"""Sweeps end to end on tiny models and generated image folders: each (model, dataset) encoded once,
a second invocation encodes nothing, the tables match the runs' metrics.json; the shipped sweeps."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
import yaml
from PIL import Image

from frolic_tta.data.paper_results import paper_number, paper_results
from frolic_tta.lightning.cli import FrolicCLI
from frolic_tta.lightning.sweep import load_sweep, main, plan_runs, run_sweep
from frolic_tta.lightning.tables import AVERAGES, RunResult, markdown_tables, write_csv
from frolic_tta.rows import ROWS
from tests.conftest import IMAGE_FOLDER_CLASSES, IMAGES_PER_CLASS
from tests.towers import build_tower

ROOT = Path(__file__).resolve().parents[1]
N_EUROSAT = len(IMAGE_FOLDER_CLASSES) * IMAGES_PER_CLASS
N_DTD = 2 * 6
QUIET = {
    "trainer": {"accelerator": "cpu", "enable_progress_bar": False},
    "data": {"batch_size": 4, "num_workers": 0},
    "model": {"templates": ["a photo of a {}."]},
    "report": {"plots": False, "print_table": False},
}


@pytest.fixture(scope="module")
def second_folder(tmp_path_factory) -> Path:
    """2 classes x 6 random 36x36 PNGs."""
    root = tmp_path_factory.mktemp("second_folder")
    rng = np.random.default_rng(1)
    for name in ("banded", "speckled"):
        (root / name).mkdir()
        for i in range(6):
            pixels = rng.integers(0, 255, size=(36, 36, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def resnet(tmp_path_factory):
    return build_tower(tmp_path_factory.mktemp("resnet"), "frolic-tiny-resnet")


def write_config(path: Path, **config) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def encoded(monkeypatch):
    """Images through each image tower's forward: ``{tower class: [batch sizes]}``."""
    calls: dict[str, list[int]] = {}
    towers = (open_clip.transformer.VisionTransformer, open_clip.modified_resnet.ModifiedResNet)
    for tower in towers:
        forward = tower.forward

        def counting(self, x, *args, _forward=forward, **kwargs):
            calls.setdefault(type(self).__name__, []).append(x.shape[0])
            return _forward(self, x, *args, **kwargs)

        monkeypatch.setattr(tower, "forward", counting)
    monkeypatch.setattr(sys, "argv", ["sweep.py"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield calls
    torch.set_num_threads(threads)


def test_two_models_two_datasets_two_options(
    tiny_clip, resnet, image_folder, second_folder, tmp_path, encoded
):
    out = tmp_path / "sweep"
    config = load_sweep(
        write_config(
            tmp_path / "sweep.yaml",
            output_dir=str(out),
            runner="inprocess",
            args=QUIET,
            models={
                "vit": {
                    "model_name": str(tiny_clip.config_path),
                    "pretrained": str(tiny_clip.checkpoint_path),
                    "paper_backbone": "ViT-B/16",
                },
                "resnet": {
                    "model_name": resnet.model_name,
                    "pretrained": str(resnet.checkpoint_path),
                },
            },
            datasets={
                "eurosat": {
                    "data": {"class_path": "ImageFolderDataModule", "root": str(image_folder)}
                },
                "dtd": {
                    "data": {"class_path": "ImageFolderDataModule", "root": str(second_folder)}
                },
            },
            options={"default": {}, "paper": {"covariance": "paper", "bias": "paper"}},
        )
    )
    first = run_sweep(config, echo=lambda line: None)
    assert len(first["ran"]) == 8 and not first["skipped"] and not first["failed"]
    # each (model, dataset) encoded once: every image of both datasets once per model
    assert {k: sum(v) for k, v in encoded.items()} == {
        "VisionTransformer": N_EUROSAT + N_DTD,
        "ModifiedResNet": N_EUROSAT + N_DTD,
    }
    runs = plan_runs(config)
    metrics = {r.name: json.loads((r.run_dir / "metrics.json").read_text()) for r in runs}
    for run in runs:
        n = N_EUROSAT if run.dataset == "eurosat" else N_DTD
        assert metrics[run.name]["images_encoded"] == (n if run.encodes else 0), run.name
    encoded.clear()
    second = run_sweep(config, echo=lambda line: None)
    assert encoded == {} and not second["ran"] and len(second["skipped"]) == 8

    # results.csv: every run and row, values exactly as in metrics.json
    with (out / "results.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 8 * len(ROWS)
    by_dir = {str(r.run_dir): r for r in runs}
    for line in lines:
        run = by_dir[line["run_dir"]]
        assert (line["model"], line["dataset"], line["options"]) == (
            run.model, run.dataset, run.options
        )  # fmt: skip
        assert float(line["top1"]) == metrics[run.name]["accuracy"][line["row"]]
    # tables.md: Table 1's layout, ours beside the paper's number and the difference
    tables = (out / "tables.md").read_text()
    columns = list(paper_results()["tables"]["tab:cross_data"]["columns"])
    for run in runs:
        if run.model != "vit" or run.dataset != "eurosat":
            continue
        accuracy = metrics[run.name]["accuracy"]
        section = tables.split(f"· options: {run.options} ")[1].split("\n## ")[0]
        table1 = section.split("#### Table 1 ")[1].split("####")[0]
        dtd = metrics[run.name.replace("eurosat", "dtd")]["accuracy"]
        ours, delta = ["–"] * len(columns), ["–"] * len(columns)
        for name, value in (("dtd", dtd["f_d"]), ("eurosat", accuracy["f_d"])):
            paper = paper_number(1, "ViT-B/16", "Frolic", name).value
            ours[columns.index(name)] = f"{100 * value:.1f}"
            delta[columns.index(name)] = f"{100 * value - paper:+.1f}"
        frolic = f"| f_d: {ROWS['f_d'].label} | ours | " + " | ".join(ours) + " |\n"
        assert frolic + "| | paper, Table 1: Frolic | 92.9 | 74.8 | " in table1
        assert "| | Δ | " + " | ".join(delta) + " |" in table1.split(frolic)[1]
        assert "| | paper, Table 1: CLIP | " in table1  # templates only: CLIP, not CuPL-CLIP
        assert "#### Table 4 (tab:debias_cmp)" in section and "#### Table 2" not in section
    resnet_sections = tables.split("## resnet ")[1:]
    assert len(resnet_sections) == 2 and all("paper, Table" not in s for s in resnet_sections)


def test_sweep_of_ddp_runs_through_the_cli(tiny_clip, image_folder, tmp_path):
    """runner: subprocess, 2 processes per run: the first writes a 2-shard store, the second
    reads it."""
    out = tmp_path / "sweep"
    args = {**QUIET, "trainer": {**QUIET["trainer"], "devices": 2, "strategy": "ddp"}}
    path = write_config(
        tmp_path / "sweep.yaml",
        output_dir=str(out),
        args=args,
        models={"vit": {"model_name": str(tiny_clip.config_path),
                        "pretrained": str(tiny_clip.checkpoint_path)}},
        datasets={"shapes": {"data": {"class_path": "ImageFolderDataModule",
                                      "root": str(image_folder)}}},
        options={"default": {}, "paper": {"bias": "paper"}},
    )  # fmt: skip
    assert main(["--config", str(path)]) == 0
    runs = plan_runs(load_sweep(path))
    metrics = [json.loads((r.run_dir / "metrics.json").read_text()) for r in runs]
    assert [m["images_encoded"] for m in metrics] == [N_EUROSAT, 0]
    assert [m["world_size"] for m in metrics] == [2, 2]
    manifest = json.loads((runs[0].store / "manifest.json").read_text())
    assert manifest["written_by"]["world_size"] == 2 and manifest["num_samples"] == N_EUROSAT
    assert metrics[1]["features"].startswith(f"feature store {runs[0].store} (")
    assert (out / "tables.md").is_file() and "| f_d |" in (out / "tables.md").read_text()


def test_config_errors_are_one_line(tmp_path, capsys):
    bad = write_config(tmp_path / "bad.yaml", output_dir="x", models={"m": {"model_name": "RN50"}},
                       datasets=["dtd"], options={"p": {"bias": "nope"}})  # fmt: skip
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: options 'p': Expected `bias` to be one of ('soft', 'paper', 'implicit', "
        "'none', 'released'), but got 'nope'\n"
    )
    unknown = write_config(tmp_path / "unknown.yaml", output_dir="x", modles={})
    assert main(["--config", str(unknown)]) == 2
    assert "but got ['modles']" in capsys.readouterr().err


class ParseOnly(FrolicCLI):
    def instantiate_classes(self) -> None:
        pass


@pytest.mark.parametrize("name", ["paper_vit_b16", "paper_vit_l14"])
def test_shipped_sweeps_plan_the_paper_grid(name, capsys):
    path = ROOT / "configs" / "sweeps" / f"{name}.yaml"
    runs = plan_runs(load_sweep(path))
    table_datasets = {c for t in paper_results()["tables"].values() for c in t["columns"]}
    datasets = {r.dataset for r in runs}
    assert datasets == {c for c in table_datasets if not c.startswith("avg_")}  # all 16
    assert len(runs) == len(datasets) * 2 * 3 and sum(r.encodes for r in runs) == len(datasets)
    assert {r.backbone for r in runs} == {"ViT-B/16" if "b16" in name else "ViT-L/14"}
    parser = ParseOnly(args=["--config", str(ROOT / "configs" / "folder.yaml")], run=False).parser
    released = [r for r in runs if r.options == "released"][:1]
    for run in runs[:4] + [r for r in runs if r.encodes] + released:  # every config, option set
        config = parser.parse_args(run.args[1:])
        assert config.data.init_args.feature_store == str(run.store)
        assert config.output_dir == str(run.run_dir)
        assert config.data.init_args.dataset == config.model.templates == run.dataset
        assert config.data.init_args.num_workers == 4  # the paper file's, over the model base
        if run.prompts == "templates":
            assert config.model.prompts_file is None
        if run.options == "released":
            assert config.model.options.zero_shot == "inmap_both"
            assert config.model.options.inmap_tolerance is None
    assert main(["--config", str(path), "--dry_run"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("# 1.") and len(printed) == 2 + len(runs)


def test_tables_fill_the_papers_averages_and_compare_with_the_right_method(tmp_path):
    ten, variants = AVERAGES["avg_10_datasets"], AVERAGES["avg_in_variants"]
    accuracy = {**dict.fromkeys(ten, 0.5), "imagenet": 0.6, **dict.fromkeys(variants, 0.6)}
    results = [
        RunResult("b16", "ViT-B/16", d, "descriptions", "paper", True,
                  {"model": "ViT-B-16", "pretrained": "openai",
                   "accuracy": {"f_c": value - 0.1, "f_d": {"top1": value, "top5": 0.9}}},
                  tmp_path / d)
        for d, value in accuracy.items()
    ]  # fmt: skip
    tables = markdown_tables(results)
    table1 = tables.split("#### Table 1 ")[1].split("####")[0]
    assert "| f_d: Frolic (fused, debiased) | ours | " + "50.0 | " * 10 + "50.0 |" in table1
    assert "| | paper, Table 1: CuPL-CLIP | 92.0 | " in table1  # f_c with descriptions
    assert table1.count("| | Δ |") == 2 and "| -21.1 |\n" in table1  # 50.0 - 71.1
    table2 = tables.split("#### Table 2 ")[1].split("####")[0]
    assert "| ours | 60.0 | 60.0 | 60.0 | 60.0 | 60.0 | 60.0 | 60.0 |" in table2
    assert "| | Δ | -10.9 | -4.7 | +6.7 | -0.4 | -20.7 | +3.4 | -4.4 |" in table2
    table3 = tables.split("#### Table 3 ")[1].split("####")[0]
    assert "| f_d: Frolic (fused, debiased) | ours | 50.0 | 60.0 | 60.0 |" in table3
    assert "| | Δ | -21.1 | -10.9 | -3.1 |" in table3 and "Averages not shown" not in table3
    table4 = tables.split("#### Table 4 ")[1].split("####")[0]
    assert "| 60.0 | 50.9 |" in table4  # ImageNet, then the mean of 10 x 50 and 60 over 11
    write_csv(tmp_path / "results.csv", results)
    with (tmp_path / "results.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 2 * 16 and {line["top5"] for line in lines} == {"", "0.9"}
