"""A tiny open_clip model contrastively pre-trained on scikit-learn's handwritten digits with a
long-tailed class frequency, and a balanced held-out split (not a benchmark by itself; the
recipe lives in :mod:`frolic_tta.demo.digits`, shared with the offline demo).

:func:`pretrain` trains (or loads from its cache) a tiny ViT CLIP on the 8x8 digits of
``sklearn.datasets.load_digits`` upsampled to 32x32 RGB, captioned "a handwritten seven." etc.
Class frequencies in pre-training fall exponentially from a head to a tail ``imbalance`` times
rarer, so the model's zero-shot predictions carry a known label bias; :func:`encode` returns the
held-out features and the class-name prototypes to study it. ``python benchmarks/digits_clip.py``
trains a few seeds and prints accuracy and how the predictions follow the pre-training frequency.
"""

from __future__ import annotations

from pathlib import Path

import open_clip
import torch
import torch.nn.functional as F

from frolic_tta.demo.digits import DEFAULT_STEPS, QUICK_STEPS, DigitsClip
from frolic_tta.demo.digits import pretrain as digits_pretrain

__all__ = ["CACHE_DIR", "DEFAULT_STEPS", "QUICK_STEPS", "DigitsClip", "encode", "pretrain"]

CACHE_DIR = Path(__file__).resolve().parent / "results" / "cache" / "digits_clip"


def pretrain(
    seed: int = 0,
    imbalance: float = 20.0,
    steps: int = DEFAULT_STEPS,
    cache_dir: Path | None = None,
) -> DigitsClip:
    """:func:`frolic_tta.demo.digits.pretrain` with the benchmarks' cache, :data:`CACHE_DIR`."""
    return digits_pretrain(seed, imbalance, steps, CACHE_DIR if cache_dir is None else cache_dir)


@torch.no_grad()
def encode(digits: DigitsClip) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Held-out image features and class prototypes, through open_clip's own eval preprocess.

    Args:
        digits: a :func:`pretrain` result.

    Returns:
        ``(features (N, d), prototypes (K, d), labels (N,))``: the L2-normalised
        ``encode_image`` of the held-out images; per class, the L2-normalised mean over the
        templates of the L2-normalised ``encode_text`` of its prompts; the held-out digits.
        Zero-shot logits are ``digits.logit_scale * features @ prototypes.T``.
    """
    open_clip.add_model_config(digits.config_path)
    model, _, preprocess = open_clip.create_model_and_transforms(
        digits.model_name, pretrained=str(digits.checkpoint_path)
    )
    model.eval()
    tokenizer = open_clip.get_tokenizer(digits.model_name)
    pixels = torch.stack([preprocess(image) for image in digits.heldout_images])
    features = F.normalize(model.encode_image(pixels), dim=-1)
    prompts = [t.format(name) for name in digits.class_names for t in digits.templates]
    text = F.normalize(model.encode_text(tokenizer(prompts)), dim=-1)  # (K * T, d)
    prototypes = F.normalize(text.view(len(digits.class_names), -1, text.shape[-1]).mean(1), dim=-1)
    return features, prototypes, digits.heldout_labels.clone()


def main() -> None:
    """Train a few seeds and print accuracy and how zero-shot predictions follow the frequency."""
    import argparse

    from scipy.stats import spearmanr

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--quick", action="store_true", help=f"--steps {QUICK_STEPS}")
    parser.add_argument("--imbalance", type=float, default=20.0)
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR)
    args = parser.parse_args()
    steps = QUICK_STEPS if args.quick else args.steps
    for seed in args.seeds:
        digits = pretrain(seed, args.imbalance, steps, args.cache_dir)
        features, prototypes, labels = encode(digits)
        probs = (digits.logit_scale * features @ prototypes.T).softmax(-1)  # (N, K)
        predicted = probs.argmax(-1)
        counts = torch.bincount(predicted, minlength=len(digits.class_names))
        frequency = digits.pretrain_frequency
        order = frequency.argsort(descending=True)  # head first
        print(
            f"seed {seed}, {steps} steps: trained in {digits.train_seconds:.1f} s, "
            f"held-out accuracy {(predicted == labels).float().mean().item():.3f}, "
            f"logit_scale {digits.logit_scale:.2f}, Spearman(frequency, prediction counts) "
            f"{spearmanr(frequency, counts).statistic:+.2f}, (frequency, mean probability) "
            f"{spearmanr(frequency, probs.mean(0)).statistic:+.2f}\n"
            f"  digits, head first:  {order.tolist()}\n"
            f"  pre-training share:  {[round(f, 3) for f in frequency[order].tolist()]}\n"
            f"  predicted of 300:    {counts[order].tolist()}",
            flush=True,
        )


if __name__ == "__main__":
    main()
