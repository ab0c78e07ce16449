"""DDP on CPU: FrolicModule with 1 vs 2 processes, same long-tailed data and weights.

Run: ``python benchmarks/ddp.py`` (about 2 minutes on 2 CPU cores, 4 runs; ``--quick``: ~80 s).
Writes ``benchmarks/results/ddp.json``.

A small open_clip ViT (registered from a config JSON; seeded weights saved to a checkpoint so
every process loads the same ones) encodes N generated 64-px labelled images. Each run is a
fresh subprocess: ``devices=1`` with 2 torch threads, or ``strategy="ddp"`` with 2 processes of
1 thread each (the same 2 cores). Predictions are written per rank by
``FrolicPredictionWriter`` and joined by global index; we report the max |Δ logits|, the share
of identical predictions, tau_g and beta differences, the Table 3/4 accuracies of both runs,
encoder passes per image, and wall times (``trainer.predict`` on rank 0, and the whole process
including start-up).

The encoder's float32 output depends on the thread count and on which images share a batch,
so the same comparison is made once more on identical features: the 1-process run also writes
a feature store (``FeatureStoreWriter``), which 1 process (batch 32) and 2 DDP processes (batch
48, so the batches and shard edges differ), each with 1 thread (the same text prototypes),
then refit (``comparison_store``): what is left is the estimator's own order of summation.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import common
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

for _name in ("lightning.pytorch", "lightning.fabric"):  # no start-up banners in the tables
    logging.getLogger(_name).setLevel(logging.WARNING)


SMALL_CLIP = {
    "embed_dim": 64,
    "vision_cfg": {"image_size": 64, "patch_size": 8, "width": 128, "layers": 4, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 2},
}
STORE_KEY = {"format": 1, "benchmark": "ddp"}
CLASS_NAMES = [
    "red",
    "green",
    "blue",
    "cyan",
    "magenta",
    "yellow",
    "grey",
    "dark",
    "bright",
    "noise",
]


class PatternImages(Dataset):
    """Seeded 3 x 64 x 64 images with a class-specific colour offset; the labels follow a
    long-tailed test prior (max/min 10, :func:`frolic_tta.synthetic.shifted_prior`), so the
    default's test prior is estimated, not taken as balanced."""

    def __init__(self, n: int, k: int, size: int = 64) -> None:
        from frolic_tta.synthetic import class_labels, shifted_prior

        self.n, self.k, self.size = n, k, size
        prior = shifted_prior("long-tailed:10", k, seed=0)
        self.labels = class_labels(n, k, torch.Generator().manual_seed(0), prior).tolist()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(index)
        label = self.labels[index]
        image = 0.5 * torch.randn(3, self.size, self.size, generator=g)
        image[label % 3] += 0.2 * (1 + label // 3)
        return {"image": image, "index": index, "label": label}


class LoopTimer(Callback):
    """Seconds from ``on_predict_start`` (ranks launched, process group up, model on device)
    to ``on_predict_end`` (after finalize): the predict loop without start-up."""

    seconds = 0.0

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.strategy.barrier()
        self.start = common.now()

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self.seconds = common.now() - self.start


def worker(args: argparse.Namespace) -> None:
    """One run (rank 0 and, with ddp, the ranks Lightning launches by re-running this)."""
    import lightning as L

    from frolic_tta import FrolicModule, FrolicPredictionWriter
    from frolic_tta.data.store import FeatureDataset, collate_stored, load_store
    from frolic_tta.lightning.store import FeatureStoreWriter

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 2) // args.devices))
    module = FrolicModule(
        model_name=args.config,
        pretrained=args.checkpoint,
        class_names=CLASS_NAMES[: args.classes],
        templates=["a photo of a {}."],
    )
    timer = LoopTimer()
    callbacks: list[Callback] = [FrolicPredictionWriter(args.out), timer]
    loader = DataLoader(PatternImages(args.n, args.classes), batch_size=args.batch_size)
    if args.store and args.mode == "images":  # the 1-process run keeps its features
        callbacks.append(FeatureStoreWriter(args.store, {**STORE_KEY, "n": args.n}))
    elif args.store:  # a refit from those features: no encoder
        s = load_store(args.store, {**STORE_KEY, "n": args.n})
        data = FeatureDataset(s.features, s.labels, s.errors, s.moments)
        loader = DataLoader(data, batch_size=args.batch_size, collate_fn=collate_stored)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    start = common.now()
    trainer.predict(module, dataloaders=loader, return_predictions=False)
    wall = common.now() - start
    encoded = torch.tensor(float(module.images_encoded))
    encoded = trainer.strategy.reduce(encoded, reduce_op="sum")
    if trainer.global_rank == 0:
        summary = {
            "predict_s": wall,
            "loop_s": timer.seconds,
            "images_encoded": float(encoded),
            "tau_g": module.head.tau_g,
            "beta": module.head.beta.tolist(),
            "metrics": module.metrics_,
        }
        (Path(args.out) / "summary.json").write_text(json.dumps(summary))


def compare(one: Path, two: Path, n: int) -> dict[str, Any]:
    """Joined predictions of the two runs against each other."""
    from frolic_tta import join_predictions

    a, b = join_predictions(one, dataset_length=n), join_predictions(two, dataset_length=n)
    sa, sb = (json.loads((p / "summary.json").read_text()) for p in (one, two))
    beta_a, beta_b = torch.tensor(sa["beta"]), torch.tensor(sb["beta"])
    delta = (a["logits"] - b["logits"]).abs()
    accuracies = [k for k in sa["metrics"] if k.startswith("accuracy/")]
    metric_delta = max(abs(sa["metrics"][k] - sb["metrics"][k]) for k in accuracies)
    return {
        "max_abs_logit_diff": float(delta.max()),
        "max_abs_logit": float(a["logits"].abs().max()),
        "relative_logit_diff": float(delta.max() / a["logits"].abs().max()),
        "prediction_agreement": float((a["prediction"] == b["prediction"]).double().mean()),
        "tau_g_relative_diff": abs(sa["tau_g"] - sb["tau_g"]) / sa["tau_g"],
        "beta_max_abs_diff": float((beta_a - beta_b).abs().max()),
        "max_accuracy_diff": metric_delta,
        "accuracies_compared": len(accuracies),
        "accuracy_f_c": [sa["metrics"]["accuracy/f_c"], sb["metrics"]["accuracy/f_c"]],
        "accuracy_f_d": [sa["metrics"]["accuracy/f_d"], sb["metrics"]["accuracy/f_d"]],
        "test_prior_weight": [s["metrics"]["test_prior/shift_weight"] for s in (sa, sb)],
        "encoder_passes_per_image": [sa["images_encoded"] / n, sb["images_encoded"] / n],
        "index_each_once": True,  # join_predictions raised otherwise
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="N = 96")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--config", default="", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="images", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.n = 96
    info = common.machine_info()
    import open_clip

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "frolic-bench-small-vit.json"  # registered under the file stem
        config.write_text(json.dumps(SMALL_CLIP))
        open_clip.add_model_config(config)
        torch.manual_seed(0)
        checkpoint = Path(tmp) / "weights.pt"
        torch.save(open_clip.create_model(config.stem).state_dict(), checkpoint)
        runs: dict[str, Any] = {}
        store = Path(tmp) / "store"
        plan = [("1", 1, "images", args.batch_size, 0), ("2", 2, "images", args.batch_size, 0),
                ("store, 1", 1, "store", args.batch_size, 1), ("store, 2", 2, "store", 48, 1)]
        for name, devices, mode, batch, threads in plan:
            out = Path(tmp) / name.replace(", ", "_")
            keeps = mode == "store" or devices == 1  # the 1-process run writes the store
            command = [
                "benchmarks/ddp.py", "--worker", "--devices", str(devices),
                "--config", str(config), "--checkpoint", str(checkpoint), "--out", str(out),
                "--n", str(args.n), "--batch-size", str(batch),
                "--classes", str(args.classes), "--mode", mode,
                "--store", str(store) if keeps else "", "--threads", str(threads),
            ]  # fmt: skip
            start = common.now()
            common.run_script(command)
            total = common.now() - start
            summary = json.loads((out / "summary.json").read_text())
            runs[name] = {
                "loop_s": summary["loop_s"],
                "predict_s": summary["predict_s"],
                "process_s": total,
                "batch_size": batch,
            }
            print(f"{name} process(es): {runs[name]}", flush=True)
        comparison = compare(Path(tmp) / "1", Path(tmp) / "2", args.n)
        comparison_store = compare(Path(tmp) / "store_1", Path(tmp) / "store_2", args.n)
    payload = {
        "machine": common.finish_info(info),
        "config": {
            "n": args.n,
            "batch_size": args.batch_size,
            "classes": args.classes,
            "model": SMALL_CLIP,
        },  # fmt: skip
        "runs": runs,
        "comparison": comparison,
        "comparison_store": comparison_store,
    }
    name = "ddp_quick" if args.quick else "ddp"
    from report import ddp_section

    print(ddp_section(payload))
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
