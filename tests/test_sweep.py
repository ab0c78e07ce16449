"""Sweeps end to end on tiny models and generated image folders: each (model, dataset) encoded once,
a second invocation encodes nothing, the tables match the runs' metrics.json; the shipped sweeps."""

from __future__ import annotations

import csv
import json
import re
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
from frolic_tta.lightning.sweep import (
    DONE,
    command_line,
    dry_run,
    load_sweep,
    main,
    plan_runs,
    run_sweep,
)
from frolic_tta.lightning.tables import (
    AVERAGES,
    RunResult,
    markdown_tables,
    write_atomically,
    write_csv,
)
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
            # Algorithm 2's label bias; Eq. 7's covariance is singular on these 21 images in
            # 32 dimensions, which is an error since issue 35 (it was accepted with 1e-19 pivots)
            options={"default": {}, "paper": {"bias": "paper"}},
        )
    )
    said: list[str] = []
    first = run_sweep(config, echo=said.append)
    assert len(first["ran"]) == 8 and not first["skipped"] and not first["failed"]
    # each (model, dataset) encoded once: every image of both datasets once per model
    assert {k: sum(v) for k, v in encoded.items()} == {
        "VisionTransformer": N_EUROSAT + N_DTD,
        "ModifiedResNet": N_EUROSAT + N_DTD,
    }
    runs = plan_runs(config)
    metrics = {r.name: json.loads((r.run_dir / "metrics.json").read_text()) for r in runs}
    for number, run in enumerate(runs, 1):
        n = N_EUROSAT if run.dataset == "eurosat" else N_DTD
        assert metrics[run.name]["images_encoded"] == (n if run.encodes else 0), run.name
        # one line per finished run as it finishes: f_c -> f_d and the time it took
        accuracy = metrics[run.name]["accuracy"]
        found = f"f_c {100 * accuracy['f_c']:.1f}% → f_d {100 * accuracy['f_d']:.1f}%"
        done = [line for line in said if line.startswith(f"[{number}/8] {run.name}: f_c")]
        assert len(done) == 1 and re.fullmatch(
            rf"\[{number}/8\] {re.escape(run.name)}: {found} \(\d+\.\d s\)", done[0]
        ), said
    assert said[-1].startswith("ran 8, skipped 0, failed 0; wrote ")
    encoded.clear()
    (runs[5].run_dir / DONE).unlink()  # one run not finished: --dry_run lists it to run
    planned = dry_run(config).splitlines()
    marked = [line for line in planned if line.startswith("# done: python -m")]
    assert len(marked) == 7 and planned[-1] == "# 7 of 8 runs finished earlier (# done:)"
    assert command_line(runs[5], []) in planned
    assert not any(line.startswith("# done:") for line in dry_run(config, force=True).splitlines())
    write_atomically(runs[5].run_dir / DONE, json.dumps({"args": runs[5].args}))
    second = run_sweep(config, echo=said.append)
    assert encoded == {} and not second["ran"] and len(second["skipped"]) == 8
    accuracy = metrics[runs[0].name]["accuracy"]
    skipped = f"[1/8] {runs[0].name}: done earlier, skipped: f_c {100 * accuracy['f_c']:.1f}% → "
    assert any(line.startswith(skipped) for line in said)

    # results.csv: every run and row, every metric of metrics.json under its own name, exactly
    with (out / "results.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 8 * len(ROWS)
    by_dir = {str(r.run_dir): r for r in runs}
    for line in lines:
        run = by_dir[line["run_dir"]]
        m, row = metrics[run.name], line["row"]
        assert (line["model"], line["dataset"], line["options"]) == (
            run.model, run.dataset, run.options
        )  # fmt: skip
        for kind in ("accuracy", "top5", "recall", "ece", "nll"):
            assert float(line[kind]) == m[kind][row], (kind, row)
        for key in ("tau_c", "tau_g", "test_prior/likelihood_ratio", "beta/max_over_min"):
            group, _, name = key.rpartition("/")
            assert float(line[key]) == (m[group][name] if group else m[key]), key
        assert line["options/bias"] == m["options"]["bias"] and line["num_samples"] == str(
            m["num_samples"]
        )
    # tables.md: one Table 1 per model and prompts, datasets as columns, option sets as lines,
    # ours with the difference to the paper's number, then the paper's number
    tables = (out / "tables.md").read_text()
    levels = [len(h) - len(h.lstrip("#")) for h in tables.splitlines() if h.startswith("#")]
    assert levels[0] == 1 and all(b <= a + 1 for a, b in zip(levels, levels[1:], strict=False))
    assert set(levels) == {1, 2, 3} and tables.count("\n## ") == 2
    columns = list(paper_results()["tables"]["tab:cross_data"]["columns"])
    section = tables.split("\n## vit ")[1].split("\n## ")[0]
    table1 = section.split("### Table 1 ")[1].split("###")[0]
    assert table1.count("### Table 1") == 0 and section.count("### Table 1 ") == 1
    frolic_lines = []
    for options in ("default", "paper"):
        key = ("vit", "eurosat", options)
        run = next(r for r in runs if (r.model, r.dataset, r.options) == key)
        ours = ["–"] * len(columns)
        for name in ("dtd", "eurosat"):
            value = metrics[run.name.replace("eurosat", name)]["accuracy"]["f_d"]
            paper = paper_number(1, "ViT-B/16", "Frolic", name).value
            ours[columns.index(name)] = f"{100 * value:.1f} ({100 * value - paper:+.1f})"
        first_cell = f"f_d: {ROWS['f_d'].label}" if options == "default" else ""
        frolic_lines.append(f"| {first_cell} | {options} | " + " | ".join(ours) + " |")
    frolic_lines.append("| | paper, Table 1: Frolic | 92.9 | 74.8 | ")
    assert "\n".join(frolic_lines) in table1
    assert "| | paper, Table 1: CLIP | " in table1  # templates only: CLIP, not CuPL-CLIP
    assert "### Table 4 (tab:debias_cmp)" in section and "### Table 2" not in section
    resnet_section = tables.split("\n## resnet ")[1]
    assert "paper, Table" not in resnet_section


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
            assert config.model.options.solver.inmap_tolerance is None
            assert config.model.options.solver.max_iter == 11
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
    table1 = tables.split("### Table 1 ")[1].split("###")[0]
    frolic = [paper_number(1, "ViT-B/16", "Frolic", d).value for d in ten]
    ours = " | ".join(f"50.0 ({50 - p:+.1f})" for p in frolic) + " | 50.0 (-21.1) |"
    assert "| f_d: Frolic (fused, debiased) | paper | " + ours in table1
    assert "| | paper, Table 1: CuPL-CLIP | 92.0 | " in table1  # f_c with descriptions
    assert table1.count("| | paper, Table 1:") == 2
    table2 = tables.split("### Table 2 ")[1].split("###")[0]
    assert "| paper | 60.0 (-10.9) | 60.0 (-4.7) | 60.0 (+6.7) | 60.0 (-0.4) | 60.0 (-20.7) | " in (
        table2
    )
    table3 = tables.split("### Table 3 ")[1].split("###")[0]
    frolic = "| f_d: Frolic (fused, debiased) | paper | 50.0 (-21.1) | 60.0 (-10.9) | 60.0 (-3.1) |"
    assert frolic in table3
    assert "Averages not shown" not in table3
    table4 = tables.split("### Table 4 ")[1].split("###")[0]
    assert "| 60.0 (-10.9) | 50.9 (-20.0) |" in table4  # ImageNet, the mean of 10 x 50, 60
    write_csv(tmp_path / "results.csv", results)
    with (tmp_path / "results.csv").open() as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 2 * 16 and {line["top5"] for line in lines} == {"", "0.9"}
    assert {line["accuracy"] for line in lines if line["row"] == "f_d"} == {"0.5", "0.6"}
