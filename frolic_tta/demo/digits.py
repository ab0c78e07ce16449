"""A tiny open_clip model contrastively pre-trained on scikit-learn's handwritten digits with a
long-tailed class frequency, and a balanced held-out split: the data of the offline demo
(``python -m frolic_tta.demo``) and of ``benchmarks/pretrained_bias.py``.

:func:`pretrain` trains (or loads from its cache) a tiny ViT CLIP on the 8x8 digits of
``sklearn.datasets.load_digits`` upsampled to 32x32 RGB, captioned "a handwritten seven." etc.
Class frequencies in pre-training fall exponentially from a head to a tail ``imbalance`` times
rarer, so the model's zero-shot predictions carry a known label bias. scikit-learn is needed for
the digits only (``pip install "frolic-tta[demo]"``).
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F
from PIL import Image

from frolic_tta.errors import FrolicInputError
from frolic_tta.progress import progress

__all__ = ["DigitsClip", "cache_entry", "default_cache_dir", "load_digits", "pretrain"]

MODEL_NAME = "frolic-digits-tiny-vit"
MODEL_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 3, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
CLASS_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["a photo of the digit {}.", "a handwritten {}.", "the number {}."]
HELDOUT_PER_CLASS = 30
DEFAULT_STEPS = 300
QUICK_STEPS = 150
LEARNING_RATE = 3e-4
_VERSION = 2  # bump when the recipe changes: old cache entries are then ignored


def default_cache_dir() -> Path:
    """Where the demo caches what it builds: ``$FROLIC_TTA_CACHE``, else
    ``$XDG_CACHE_HOME/frolic-tta``, else ``~/.cache/frolic-tta``."""
    if os.environ.get("FROLIC_TTA_CACHE"):
        return Path(os.environ["FROLIC_TTA_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "frolic-tta"


def cache_entry(folder: Path, seed: int, imbalance: float, steps: int) -> Path:
    """The folder under ``folder`` that holds the model of ``(seed, imbalance, steps)``."""
    return Path(folder) / f"v{_VERSION}_seed{seed}_imbalance{imbalance:g}_steps{steps}"


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 handwritten digits: ``(images (1797, 8, 8) in 0..16, labels)``.

    Raises:
        FrolicInputError: scikit-learn is not installed (it ships the digits).
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise FrolicInputError(
            "Expected scikit-learn, which ships the demo's digits, but it is not installed: "
            'pip install "frolic-tta[demo]" (or pip install scikit-learn)'
        ) from None
    digits = sklearn_digits()
    return digits.images, digits.target


@dataclass(frozen=True)
class DigitsClip:
    """A pre-trained tiny digits CLIP registered with open_clip, and its balanced held-out set.

    ``open_clip.create_model_and_transforms(model_name, pretrained=str(checkpoint_path))`` and
    ``open_clip.get_tokenizer(model_name)`` work offline in this process (elsewhere, first
    ``open_clip.add_model_config(config_path)``; or give ``config_path`` to frolic_tta's loader).

    Attributes:
        model_name: the open_clip name (the stem of ``config_path``).
        config_path: the model-config JSON.
        checkpoint_path: the trained weights, a plain state_dict.
        class_names: the K = 10 class names, ``"zero"`` ... ``"nine"`` (index = digit).
        templates: the caption templates, each with one ``{}`` for the class name.
        pretrain_frequency: (K,) the class frequencies of the pre-training set; sums to 1.
        heldout_images: the N = 300 balanced held-out 32x32 RGB images, never trained on.
        heldout_labels: (N,) their digits.
        logit_scale: ``exp`` of the learned logit scale.
        train_seconds: wall time of the training run that produced the checkpoint.
    """

    model_name: str
    config_path: Path
    checkpoint_path: Path
    class_names: list[str]
    templates: list[str]
    pretrain_frequency: torch.Tensor
    heldout_images: list[Image.Image]
    heldout_labels: torch.Tensor
    logit_scale: float
    train_seconds: float


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, so readers never see half a file."""
    temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


def _to_image(digit: np.ndarray) -> Image.Image:
    """An 8x8 digit with values 0..16 as a 32x32 RGB image with values 0..255."""
    gray = Image.fromarray(np.round(digit * (255.0 / 16.0)).astype(np.uint8))  # mode "L"
    return gray.resize((32, 32), Image.Resampling.BILINEAR).convert("RGB")


def _split(seed: int, imbalance: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Balanced held-out indices, long-tailed pre-training indices, per-class counts, all digits.

    Returns:
        ``(heldout (N,), pretrain (M,), counts (K,), images (1797, 8, 8))``.
    """
    images, labels = load_digits()
    rng = np.random.default_rng(seed)
    k = len(CLASS_NAMES)
    heldout, pools = [], []
    for c in range(k):
        members = rng.permutation(np.flatnonzero(labels == c))
        heldout.append(members[:HELDOUT_PER_CLASS])
        pools.append(members[HELDOUT_PER_CLASS:])
    rank = rng.permutation(k)  # rank[c] = 0 for the head class, k - 1 for the tail
    head = len(pools[int(np.argmin(rank))])
    counts = np.array(
        [min(len(pools[c]), round(head * imbalance ** (-rank[c] / (k - 1)))) for c in range(k)]
    )
    pretrain = np.concatenate([pools[c][: counts[c]] for c in range(k)])
    return np.concatenate(heldout), pretrain, counts, images


def _augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random small affine (rotation, scale, shift) and Gaussian noise on a (B, 3, H, W) batch."""
    u = torch.rand(x.shape[0], 4, generator=generator) * 2 - 1
    angle, scale = u[:, 0] * math.radians(12), 1 + 0.1 * u[:, 1]
    cos, sin = torch.cos(angle) / scale, torch.sin(angle) / scale
    theta = torch.stack(
        [torch.stack([cos, -sin, 0.15 * u[:, 2]], 1), torch.stack([sin, cos, 0.15 * u[:, 3]], 1)],
        1,
    )
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    background = x.amin(dim=(2, 3), keepdim=True)  # the normalised black of each channel
    out = F.grid_sample(x - background, grid, align_corners=False) + background
    return out + 0.2 * torch.randn(x.shape, generator=generator)


def _train(
    seed: int, imbalance: float, steps: int, batch_size: int = 128, show_progress: bool = False
) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """Contrastive pre-training on the long-tailed split; ``(state_dict, counts)``."""
    _, pretrain_idx, counts, images = _split(seed, imbalance)
    torch.manual_seed(seed)
    root = logging.getLogger()
    level, root.level = root.level, logging.ERROR  # not "no pretrained weights": none wanted
    try:
        model, _, preprocess = open_clip.create_model_and_transforms(MODEL_NAME)
    finally:
        root.setLevel(level)
    x_all = torch.stack([preprocess(_to_image(images[i])) for i in pretrain_idx])
    y_all = torch.as_tensor(np.repeat(np.arange(len(CLASS_NAMES)), counts))
    tokenizer = open_clip.get_tokenizer(MODEL_NAME)
    captions = tokenizer([t.format(c) for c in CLASS_NAMES for t in TEMPLATES])  # (K * T, L)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=LEARNING_RATE, total_steps=steps, pct_start=0.1
    )
    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    model.train()
    bar = progress(steps, "Pre-training the demo CLIP on digits", "step", enabled=show_progress)
    for _ in range(steps):
        if len(order) < batch_size:
            order = torch.cat([order, torch.randperm(len(y_all), generator=generator)])
        batch, order = order[:batch_size], order[batch_size:]
        template = torch.randint(len(TEMPLATES), (len(batch),), generator=generator)
        caption = y_all[batch] * len(TEMPLATES) + template  # index into ``captions``
        image_features = F.normalize(model.encode_image(_augment(x_all[batch], generator)), dim=-1)
        unique, inverse = torch.unique(caption, return_inverse=True)
        text_features = F.normalize(model.encode_text(captions[unique]), dim=-1)
        logits = model.logit_scale.exp() * image_features @ text_features.T  # (B, U)
        # Only K * T distinct captions exist, so a batch repeats them; repeats are not negatives.
        # Image -> text: softmax over the U distinct captions of the batch (learns p(caption |
        # image), pre-training prior included). Text -> image: every image of that caption is a
        # positive, with equal target mass.
        positives = (inverse[None, :] == torch.arange(len(unique))[:, None]).float()  # (U, B)
        loss = (
            F.cross_entropy(logits, inverse)
            + F.cross_entropy(logits.T, positives / positives.sum(1, keepdim=True))
        ) / 2
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0, math.log(100))
        bar.update(1)
    bar.close()
    return model.state_dict(), counts


def pretrain(
    seed: int = 0,
    imbalance: float = 20.0,
    steps: int = DEFAULT_STEPS,
    cache_dir: str | Path | None = None,
    show_progress: bool = False,
) -> DigitsClip:
    """Pre-train (or load from the cache) the tiny digits CLIP under a long-tailed frequency.

    Args:
        seed: seeds the held-out split, which digit is the head, the initial weights, batches,
            captions and augmentation; the same seed gives the same model.
        imbalance: frequency of the head class over that of the tail class (>= 1).
        steps: optimiser steps (batch 128); :data:`QUICK_STEPS` for a quick, weaker model.
        cache_dir: folder of the config and the checkpoints, keyed by (seed, imbalance, steps);
            ``default_cache_dir() / "digits_clip"`` if ``None``.
        show_progress: show progress while training (nothing is shown when the cache has it).

    Returns:
        The registered model, its checkpoint, the pre-training frequency and the held-out set.

    Raises:
        ValueError: ``imbalance < 1`` or ``steps < 1``.
    """
    if not imbalance >= 1.0:
        raise ValueError(f"Expected `imbalance` >= 1, but got {imbalance}")
    if steps < 1:
        raise ValueError(f"Expected `steps` >= 1, but got {steps}")
    folder = Path(default_cache_dir() / "digits_clip" if cache_dir is None else cache_dir)
    entry = cache_entry(folder, seed, imbalance, steps)
    entry.mkdir(parents=True, exist_ok=True)
    config_path = folder / f"{MODEL_NAME}.json"  # open_clip registers configs by file stem
    if not config_path.is_file() or json.loads(config_path.read_text()) != MODEL_CONFIG:
        _write_atomic(config_path, json.dumps(MODEL_CONFIG, indent=2).encode())
    open_clip.add_model_config(config_path)
    checkpoint_path, meta_path = entry / "model.pt", entry / "meta.json"
    if not (checkpoint_path.is_file() and meta_path.is_file()):
        start = time.perf_counter()
        threads = torch.get_num_threads()
        # One thread: the same floating-point result whatever the caller's setting, and no
        # many-fold slow-down when other processes busy the cores (seen with 2 threads on 2).
        torch.set_num_threads(1)
        try:
            state_dict, counts = _train(seed, imbalance, steps, show_progress=show_progress)
        finally:
            torch.set_num_threads(threads)
        seconds = time.perf_counter() - start
        buffer = io.BytesIO()
        torch.save(state_dict, buffer)
        _write_atomic(checkpoint_path, buffer.getvalue())
        meta = {"counts": counts.tolist(), "train_seconds": seconds,
                "logit_scale": state_dict["logit_scale"].exp().item()}  # fmt: skip
        _write_atomic(meta_path, json.dumps(meta, indent=2).encode())
    meta = json.loads(meta_path.read_text())
    heldout_idx, _, counts, images = _split(seed, imbalance)
    frequency = torch.as_tensor(counts, dtype=torch.float64)
    return DigitsClip(
        model_name=MODEL_NAME,
        config_path=config_path,
        checkpoint_path=checkpoint_path,
        class_names=list(CLASS_NAMES),
        templates=list(TEMPLATES),
        pretrain_frequency=(frequency / frequency.sum()).float(),
        heldout_images=[_to_image(images[i]) for i in heldout_idx],
        heldout_labels=torch.arange(len(CLASS_NAMES)).repeat_interleave(HELDOUT_PER_CLASS),
        logit_scale=float(meta["logit_scale"]),
        train_seconds=float(meta["train_seconds"]),
    )
