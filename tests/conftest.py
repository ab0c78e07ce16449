"""Shared fixtures: a tiny randomly initialised open_clip model and a generated image folder."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import open_clip
import pytest
import torch
from PIL import Image

from tests.towers import TOWERS, Tower, build_tower

TINY_CLIP_NAME = "frolic-tiny-vit"
TINY_CLIP_CONFIG: dict[str, Any] = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
IMAGE_FOLDER_CLASSES = ("red_square", "green_circle", "blue_stripes")
IMAGES_PER_CLASS = 7


@dataclass(frozen=True)
class TinyClip:
    """A tiny open_clip architecture registered with open_clip, and random weights for it.

    ``open_clip.create_model_and_transforms(model_name, pretrained=str(checkpoint_path))`` and
    ``open_clip.get_tokenizer(model_name)`` work offline.
    """

    model_name: str
    config_path: Path
    checkpoint_path: Path


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory: pytest.TempPathFactory) -> TinyClip:
    """Register a tiny ViT CLIP config (embed_dim 32, 32px images) and save seeded weights.

    Its ``logit_scale`` is OpenAI CLIP's, ln 100, so the model's tau_c is the paper's 0.01.
    """
    folder = tmp_path_factory.mktemp("tiny_clip")
    config_path = folder / f"{TINY_CLIP_NAME}.json"  # open_clip registers configs by file stem
    config_path.write_text(json.dumps(TINY_CLIP_CONFIG, indent=2))
    open_clip.add_model_config(config_path)
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_CLIP_NAME)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(100.0))
    checkpoint_path = folder / "tiny_clip.pt"
    torch.save(model.state_dict(), checkpoint_path)
    return TinyClip(TINY_CLIP_NAME, config_path, checkpoint_path)


@pytest.fixture(scope="session")
def tiny_clip_loaded(tiny_clip: TinyClip) -> tuple[torch.nn.Module, Any, Any]:
    """``(model, eval preprocess, tokenizer)`` of :func:`tiny_clip`, loaded once, in eval mode."""
    model, _, preprocess = open_clip.create_model_and_transforms(
        tiny_clip.model_name, pretrained=str(tiny_clip.checkpoint_path)
    )
    model.eval()
    return model, preprocess, open_clip.get_tokenizer(tiny_clip.model_name)


@pytest.fixture(scope="session")
def tiny_towers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tower]:
    """One tiny model per tower type of the other open_clip families (see tests/towers.py)."""
    folder = tmp_path_factory.mktemp("tiny_towers")
    return {name: build_tower(folder, name) for name in TOWERS}


def _pattern_image(rng: np.random.Generator, kind: int, size: int = 40) -> Image.Image:
    """A 40x40 RGB image: noisy base colour per class plus a class-specific shape."""
    base = np.zeros((size, size, 3), dtype=np.float64)
    base[..., kind] = 160.0
    image = base + rng.normal(0.0, 25.0, size=base.shape)
    yy, xx = np.mgrid[:size, :size]
    if kind == 0:
        mask = (abs(yy - size / 2) < size / 4) & (abs(xx - size / 2) < size / 4)
    elif kind == 1:
        mask = (yy - size / 2) ** 2 + (xx - size / 2) ** 2 < (size / 3) ** 2
    else:
        mask = (xx // 5) % 2 == 0
    image[mask] += rng.uniform(40.0, 90.0, size=3)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageFolder layout: 3 class sub-folders x 7 seeded 40x40 RGB PNGs (+ a stray .txt)."""
    root = tmp_path_factory.mktemp("image_folder")
    rng = np.random.default_rng(0)
    for kind, name in enumerate(IMAGE_FOLDER_CLASSES):
        (root / name).mkdir()
        for i in range(IMAGES_PER_CLASS):
            _pattern_image(rng, kind).save(root / name / f"img_{i:02d}.png")
    (root / "notes.txt").write_text("not an image\n")
    return root
