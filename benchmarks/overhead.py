"""Overhead of Frolic over zero-shot CLIP, end to end in ``trainer.predict``.

Run: ``python benchmarks/overhead.py`` (about 5 minutes on 2 CPU cores; ``--quick``: ~1 min).
GPU: ``python benchmarks/overhead.py --device cuda --precision 16-mixed --n 8192
--batch-size 256`` (writes ``overhead_cuda.json``; also ``bf16-mixed``).

Same open_clip model (ViT-B-16, ``pretrained=None``: timing does not depend on weight values),
same generated 224-px images held in memory, same Trainer configuration, K = 1000 class
prototypes built once with the text encoder and handed to both (prompt encoding is the same
for both and is reported separately). Zero-shot is a ``FrolicModule`` subclass whose
``predict_step`` scores each batch with f_c / tau_c (same encode path, no statistics, no
finalize). Runs alternate between the two; the median is reported. Encoder passes per image
are counted with ``FrolicModule.images_encoded``. The ImageNet extrapolation uses the
measured per-image encode cost, the measured per-image moment-update cost and the finalize
cost measured at 50,000 x 1,000 x 512 by ``benchmarks/finalize.py`` (its JSON, or measured now).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from typing import Any

import common
import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from frolic_tta import FrolicModule
from frolic_tta.lightning.outcome import fill_output
from frolic_tta.lightning.samples import unpack_batch

for _name in ("lightning.pytorch", "lightning.fabric"):  # no start-up banners in the tables
    logging.getLogger(_name).setLevel(logging.WARNING)


IMAGENET_N = 50_000
GOAL_RATIO = 1.02


class MemoryImages(Dataset):
    """``n`` items ``{"image", "index"}`` from a pool of pre-generated 3 x 224 x 224 tensors."""

    def __init__(self, n: int, pool: int = 256, size: int = 224, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.images = torch.randn(min(n, pool), 3, size, size, generator=g).clamp_(-2, 2)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": self.images[index % len(self.images)], "index": index}


class ZeroShotModule(FrolicModule):
    """Plain zero-shot CLIP on FrolicModule's encode path: softmax(f_c / tau_c), no adaptation."""

    def configure_callbacks(self) -> list[L.Callback]:
        return []  # no FrolicAdaptation: nothing accumulated, nothing fitted

    def on_predict_start(self) -> None:
        self.zero_shot_prototypes = self.build_prototypes()

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        images, index, _, _ = unpack_batch(batch)
        features = self.encode_images(images)
        logits = features @ self.zero_shot_prototypes.t() / self.tau_c
        n = features.shape[0]
        output = {
            "index": index.detach().cpu(),
            "valid": torch.ones(n, dtype=torch.bool),
            "prediction": torch.full((n,), -1, dtype=torch.long),
            "confidence": torch.full((n,), float("nan")),
        }
        return fill_output(output, logits)


class TimedFrolic(FrolicModule):
    """FrolicModule with timers around the per-batch moment update and finalize."""

    seconds: dict[str, float]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        finalize = self.adaptation.finalize

        def timed_finalize(trainer: L.Trainer) -> None:
            common.sync(self.device)
            start = common.now()
            finalize(trainer)
            common.sync(self.device)
            self.seconds["finalize"] += common.now() - start

        self.adaptation.finalize = timed_finalize  # type: ignore[method-assign]

    def on_predict_start(self) -> None:
        super().on_predict_start()
        self.seconds = {"moments": 0.0, "finalize": 0.0}
        update = self.moments.update

        def timed_update(features: Tensor, **kwargs: Any) -> None:
            start = common.now()
            update(features, **kwargs)
            common.sync(self.device)
            self.seconds["moments"] += common.now() - start

        self.moments.update = timed_update  # type: ignore[method-assign]


def predict(module: FrolicModule, loader: DataLoader, args: argparse.Namespace) -> float:
    """Wall time of one ``trainer.predict`` (fresh Trainer, same configuration every time)."""
    trainer = common.trainer_for(args)
    common.sync(args.device)
    start = common.now()
    outputs = trainer.predict(module, dataloaders=loader)
    common.sync(args.device)
    wall = common.now() - start
    predictions = torch.cat([o["prediction"] for o in outputs])
    if bool((predictions < 0).any()):
        raise RuntimeError("some predictions were not filled in")
    return wall


def imagenet_finalize(device: str, quick: bool) -> dict[str, Any]:
    """The 50,000 x 1,000 x 512 case of finalize.py: from its JSON, else measured now
    (``quick``: measured at N = 5,000 and scaled by 10, for a smoke run only)."""
    from finalize import default_cases

    saved = common.read_result("finalize_cuda" if device.startswith("cuda") else "finalize")
    for entry in (saved or {}).get("cases", []):
        case = entry["case"]
        if (case["n"], case["k"], case["d"], case["mode"]) == (IMAGENET_N, 1000, 512, "ours"):
            return {"source": "benchmarks/results/finalize.json", **entry["result"]}
    case = next(c for c in default_cases(False) if c["label"] == "ImageNet, ViT-B-16")
    case.update(device=device, batch_size=256, n_run=5000 if quick else IMAGENET_N)
    result = common.run_json_worker(["benchmarks/finalize.py", "--worker", json.dumps(case)])
    if quick:
        return {"source": "quick: N = 5,000 x 10", "finalize_s": 10 * result["finalize_s"]}
    return {"source": "measured by this run", **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--n", type=int, default=128, help="images per run")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--quick", action="store_true", help="16 images, 10 classes, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.n, args.batch_size, args.classes, args.repeats = 16, 8, 10, 1
    info = common.machine_info(args.device)
    names = [f"class {i}" for i in range(args.classes)]
    kwargs = dict(model_name=args.model, pretrained=None, class_names=names, templates=["{}"])
    frolic = TimedFrolic(**kwargs).to(args.device)
    zero_shot = ZeroShotModule(**kwargs)
    zero_shot.clip = frolic.clip  # literally the same encoder
    start = common.now()
    prototypes = frolic.build_prototypes()
    prompt_seconds = common.now() - start
    for module in (frolic, zero_shot):  # built once above, for both
        module.build_prototypes = lambda m=module: prototypes.to(m.device)  # type: ignore
    loader = DataLoader(MemoryImages(args.n), batch_size=args.batch_size)
    warmup = DataLoader(MemoryImages(args.batch_size), batch_size=args.batch_size)
    for module in (zero_shot, frolic):
        predict(module, warmup, args)
    walls: dict[str, list[float]] = {"zero-shot": [], "frolic": []}
    inner: list[dict[str, float]] = []
    passes: dict[str, float] = {}
    for repeat in range(args.repeats):
        order = [("zero-shot", zero_shot), ("frolic", frolic)]
        for name, module in order if repeat % 2 == 0 else order[::-1]:
            before = module.images_encoded
            walls[name].append(predict(module, loader, args))
            passes[name] = (module.images_encoded - before) / args.n
            if name == "frolic":
                inner.append(dict(frolic.seconds))
            print(f"{name}: {walls[name][-1]:.2f} s", flush=True)
    zs, fr = statistics.median(walls["zero-shot"]), statistics.median(walls["frolic"])
    moments = statistics.median(r["moments"] for r in inner)
    finalize = statistics.median(r["finalize"] for r in inner)
    per_image = zs / args.n
    at_scale = imagenet_finalize(args.device, args.quick)
    zs_imagenet = per_image * IMAGENET_N
    frolic_imagenet = (
        zs_imagenet + moments / args.n * IMAGENET_N + at_scale["finalize_s"]
    )  # encode-loop extra per image (moments) + finalize measured at ImageNet scale
    result = {
        "config": vars(args),
        "prompt_encoding_s": prompt_seconds,
        "wall_s": walls,
        "median_s": {"zero-shot": zs, "frolic": fr},
        "ratio_measured": fr / zs,
        "encoder_passes_per_image": passes,
        "frolic_moments_s": moments,
        "frolic_finalize_s": finalize,
        "encode_s_per_image": per_image,
        "moments_s_per_image": moments / args.n,
        "other_s_per_image": (fr - zs - moments - finalize) / args.n,
        "imagenet": {
            "n": IMAGENET_N,
            "finalize_s": at_scale["finalize_s"],
            "finalize_source": at_scale["source"],
            "zero_shot_s": zs_imagenet,
            "frolic_s": frolic_imagenet,
            "ratio": frolic_imagenet / zs_imagenet,
            "goal_ratio": GOAL_RATIO,
            "goal_met": frolic_imagenet / zs_imagenet <= GOAL_RATIO,
            # the finalize time at which ratio = 1.02, given this machine's encode cost
            "finalize_budget_s": (GOAL_RATIO - 1) * zs_imagenet - moments / args.n * IMAGENET_N,
        },
    }
    suffix = ("_quick" if args.quick else "") + ("_cuda" if "cuda" in args.device else "")
    payload = {"machine": common.finish_info(info), **result}
    from report import overhead_section

    print(overhead_section(payload))
    print(f"wrote {common.write_result('overhead' + suffix, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
