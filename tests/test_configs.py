"""The shipped configs: a base file per model composed with a file per dataset (parse only).

``configs_before.json`` holds, for each of the 71 files these replaced (one per dataset and
backbone, ``configs/paper/`` and ``configs/families/`` again), the composition that replaces it
and every value it set, read from the old file before it was deleted.
"""

from __future__ import annotations

import json
import re
import shlex
from functools import cache
from pathlib import Path

import open_clip
import pytest

from frolic_tta.clip.descriptions import PUBLISHED
from frolic_tta.clip.prompts import resolve_templates
from frolic_tta.data import DATASETS, STANDARD_SPLITS
from frolic_tta.lightning.cli import FrolicCLI

ROOT = Path(__file__).resolve().parents[1]
BEFORE = json.loads((ROOT / "tests" / "configs_before.json").read_text())
MODELS = ("configs/vit_b16.yaml", "configs/vit_l14.yaml")


class ParseOnly(FrolicCLI):
    """Parse configs without checking files, building data or loading weights."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


@cache
def parser():
    return ParseOnly(args=["--config", str(ROOT / "configs/folder.yaml")], run=False).parser


def parse(*args: str):
    """``train.py predict`` arguments, config paths relative to the repository root."""
    args = tuple(str(ROOT / a) if a.startswith("configs/") else a for a in args)
    return parser().parse_args(list(args))


def composed(files: list[str]):
    return parse(*(arg for file in files for arg in ("--config", file)))


def new_output_dir(old: str, files: list[str]) -> str:
    """The one value that changed: a dataset's file cannot know the model, so the output
    folder is ``outputs/<dataset>`` (``outputs/paper/<dataset>``), no longer with the model."""
    if len(files) == 1:
        return old
    dataset = Path(files[-1]).stem
    return f"outputs/paper/{dataset}" if "/paper/" in files[-1] else f"outputs/{dataset}"


@pytest.mark.parametrize("old", sorted(BEFORE))
def test_each_composition_sets_what_the_file_it_replaces_set(old):
    files, values = BEFORE[old]["config"], dict(BEFORE[old]["values"])
    assert not (ROOT / old).exists() or len(files) == 1  # replaced (folder.yaml stays)
    config = composed(files)
    values["output_dir"] = new_output_dir(values["output_dir"], files)
    got = {key: config[key] for key in values}
    assert got == values


def test_the_compositions_cover_every_dataset_and_backbone_and_every_file():
    compositions = [entry["config"] for entry in BEFORE.values()]
    pairs = [files for files in compositions if len(files) == 2]  # all but folder.yaml
    plain = {(m, d) for m, d in pairs if "/datasets/" in d and m in MODELS}
    paper = {(m, d) for m, d in pairs if "/paper/" in d}
    assert {Path(d).stem for _, d in plain} == {Path(d).stem for _, d in paper} == set(DATASETS)
    assert len(plain) == len(paper) == 2 * len(DATASETS)
    assert set(PUBLISHED) == set(DATASETS) - {"objectnet"}  # its paper file: templates alone
    used = {file for files in compositions for file in files}
    shipped = {str(p.relative_to(ROOT)) for p in (ROOT / "configs").rglob("*.yaml")}
    assert shipped - used == {
        "configs/sweeps/paper_vit_b16.yaml",
        "configs/sweeps/paper_vit_l14.yaml",
    }


@pytest.mark.parametrize("model", MODELS)
def test_every_dataset_composes_with_every_model(model):
    """The checks of the old per-file tests, on the compositions."""
    for dataset in DATASETS:
        for kind in ("datasets", "paper"):
            config = composed([model, f"configs/{kind}/{dataset}.yaml"])
            m, data = config.model, config.data.init_args
            assert (m.model_name, m.pretrained) in open_clip.list_pretrained()
            assert m.templates == data.dataset == dataset and resolve_templates(dataset)
            assert data.root == "data" and data.split_file is None
            assert dataset not in STANDARD_SPLITS or data.split == "test"  # CoOp's file found
            if kind == "paper":  # descriptions as `fetch --out descriptions` writes them
                expected = f"descriptions/{dataset}.json" if dataset in PUBLISHED else None
                assert m.prompts_file == expected and data.num_workers == 4
            else:
                assert m.prompts_file is None and data.num_workers is None


def documented_commands() -> list[str]:
    """Every ``python train.py predict`` line of the README, docs/ and configs/ that names a
    config of configs/ (comments and shell redirections dropped, ``\\`` lines joined)."""
    found = []
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "configs").rglob("*")]:
        if path.suffix not in (".md", ".yaml"):
            continue
        text = path.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            line = line.lstrip("# ").strip()
            if line.startswith("python train.py predict") and "configs/" in line:
                found.append(re.split(r"\s[#>]\s?", line)[0])
    return found


def test_every_documented_command_parses():
    commands = documented_commands()
    assert len(commands) >= 40  # the README's and every config's own command line
    for command in commands:
        args = shlex.split(command)[3:]
        for i, arg in enumerate(args):
            if arg == "--config":
                assert (ROOT / args[i + 1]).is_file(), command
        if "--print_config" in args:  # it prints and exits: parse the rest
            args.remove("--print_config")
        assert parse(*args).model.model_name, command
