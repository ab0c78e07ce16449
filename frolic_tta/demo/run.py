"""The demo's command line: build (or reuse) the digits CLIP and its images, then ``predict``.

``python -m frolic_tta.demo [--steps N] [--seed S] [--cache_dir DIR] [--output_dir DIR]``; any
other option goes to ``train.py predict`` (e.g. ``--model.options.test_prior uniform``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from frolic_tta.errors import FrolicInputError

if TYPE_CHECKING:
    from frolic_tta.demo.digits import DigitsClip

IMBALANCE = 20.0
"""Frequency of the demo's most common digit in pre-training over that of its rarest."""


def write_images(digits: DigitsClip, folder: Path) -> Path:
    """The held-out digits as ``folder/<class name>/<n>.png`` (once; PNG is lossless)."""
    done = folder / ".complete"
    if not done.is_file():
        for n, (image, label) in enumerate(
            zip(digits.heldout_images, digits.heldout_labels.tolist(), strict=True)
        ):
            target = folder / digits.class_names[label] / f"{n:03d}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            image.save(target)
        done.write_text("")
    return folder


def write_config(digits: DigitsClip, images: Path, output_dir: str) -> Path:
    """A ``train.py`` config for the demo run, beside the checkpoint (paths are absolute)."""
    config = {
        "output_dir": output_dir,
        "trainer": {"accelerator": "auto", "devices": 1},
        "data": {
            "class_path": "frolic_tta.data.ImageFolderDataModule",
            "init_args": {
                "root": str(images),
                "labeled": True,
                "batch_size": 100,
                "num_workers": 0,
            },
        },  # fmt: skip
        "model": {
            "model_name": str(digits.config_path),
            "pretrained": str(digits.checkpoint_path),
            "templates": list(digits.templates),
        },
    }
    import yaml

    path = digits.checkpoint_path.parent / "demo.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main(argv: list[str] | None = None) -> None:
    """Run the demo; options it does not know go to ``train.py predict``."""
    from frolic_tta.demo.digits import DEFAULT_STEPS, cache_entry, default_cache_dir, pretrain
    from frolic_tta.lightning.cli import main as cli_main

    parser = argparse.ArgumentParser(
        prog="python -m frolic_tta.demo",
        description="Frolic offline: a tiny CLIP pre-trained here on long-tailed digits, then "
        "adapted with Frolic on 300 held-out digits. Other options go to train.py predict.",
    )
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="pre-training steps")
    parser.add_argument("--seed", type=int, default=0, help="which model and held-out split")
    parser.add_argument("--cache_dir", type=Path, default=None,
                        help=f"where the model is cached (default {default_cache_dir()}; "
                        "or set FROLIC_TTA_CACHE)")  # fmt: skip
    parser.add_argument("--output_dir", default="outputs/demo", help="where the outputs go")
    args, rest = parser.parse_known_args(argv)
    cache = (args.cache_dir or default_cache_dir()) / "digits_clip"
    print(
        "Frolic demo (offline; a demo, not a benchmark). A tiny open_clip ViT is pre-trained\n"
        f"here on scikit-learn's digits, the most frequent digit {IMBALANCE:g}x as common as the "
        "rarest, so\nits zero-shot predictions carry a label bias. Frolic then adapts it, without "
        "labels,\nto 300 held-out digits (30 per class) in trainer.predict.",
        flush=True,
    )
    cached = (cache_entry(cache, args.seed, IMBALANCE, args.steps) / "model.pt").is_file()
    try:
        digits = pretrain(args.seed, IMBALANCE, args.steps, cache, show_progress=True)
    except (FrolicInputError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    how = "cached" if cached else f"trained in {digits.train_seconds:.0f} s, now cached"
    print(f"Model: {digits.checkpoint_path} ({how})", flush=True)
    images = write_images(digits, digits.checkpoint_path.parent / "heldout")
    config = write_config(digits, images, args.output_dir)
    argv0, sys.argv = sys.argv, sys.argv[:1]  # the CLI reads its arguments from the list alone
    try:
        cli_main(["predict", "--config", str(config), *rest])
    finally:
        sys.argv = argv0
    print(
        f"\nThe same run with the CLI: python train.py predict --config {config}\n"
        "Next: the Quickstart with OpenAI's CLIP, or your own images (configs/folder.yaml).",
        flush=True,
    )
