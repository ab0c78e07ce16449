"""Refit from a feature store at ImageNet size, beside the cost of encoding the images again.

Run: ``python benchmarks/store.py`` (about 2 minutes on 2 CPU cores; ``--quick``: seconds).
Writes ``benchmarks/results/store.json``.

N = 50,000 CLIP-like unit features, d = 512, K = 1,000 (``common.clip_like``), for each storage
dtype (float32, float16) in a fresh process:

* **write**: the features as 8 rank shards (rank r holds indices r, r + 8, ...: what 8 GPUs
  write) and the manifest (``frolic_tta.data.store``: ``write_shard``, ``write_manifest``,
  which reads every shard back and hashes it); then the moment sums kept with them
  (``add_store_moments``: computed from the store as read back, as for a float16 store; a
  float32 store written by ``FeatureStoreWriter`` keeps the run's own sums without this pass);
* **load**: ``load_store`` with the key check and each shard's SHA-256 verified, joined by
  global index (float16: back to float32, re-normalised);
* **refit**: ``trainer.predict`` of a real ``FrolicModule`` (ViT-B-16 architecture, not used:
  its ``build_prototypes`` returns the generated prototypes) over a DataLoader of the stored
  features and their moment sums (``FeatureDataset(..., moments=stored.moments)``), batches
  of ``FEATURE_BATCH_SIZE`` gathered by ``collate_stored`` (the CLI's loader for a store),
  ``ablations=False``, on the CPU: the predict loop without the encoder (batches, N and sum x,
  the kept zero-shot logits) and finalize (head, tau_g, beta, filling the outputs, f_d's
  metrics), measured inside the run, the median of 5 runs (the previous runs' garbage collected
  first, as in a process that refits once); once with ``ablations=True`` (every Table 3/4 row,
  labels given); and once without the stored sums (the loop computes them).

The encode cost beside it is ``benchmarks/results/overhead.json``'s: ViT-B-16 per image on this
CPU, times 50,000, and its text-prototype time (1,000 classes x 80 templates), which a refit
pays again (the store holds image features and moment sums, no text features). The estimator
measured is the one checked out (``commit`` in the JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import common
import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader

from frolic_tta import FrolicModule
from frolic_tta.data.datamodules import FEATURE_BATCH_SIZE
from frolic_tta.data.store import (
    FeatureDataset,
    collate_stored,
    load_store,
    write_manifest,
    write_shard,
)
from frolic_tta.data.store_moments import StoredMoments
from frolic_tta.lightning.store import add_store_moments

for _name in ("lightning.pytorch", "lightning.fabric"):
    logging.getLogger(_name).setLevel(logging.WARNING)

GOAL_REFIT_S = 5.0
TAU_C = 0.01
RANKS = 8
KEY = {"format": 1, "model_name": "benchmark", "dataset": "clip-like"}


class GivenPrototypes(FrolicModule):
    """FrolicModule whose prototypes are given (no text encoder), finalize timed."""

    prototypes_given: Tensor
    finalize_s: float = 0.0
    loop_s: float = 0.0
    loop_start: float = 0.0

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        finalize = self.adaptation.finalize

        def timed_finalize(trainer: L.Trainer) -> None:
            start = common.now()
            self.loop_s = start - self.loop_start  # batches, moment updates
            finalize(trainer)
            self.finalize_s = common.now() - start

        self.adaptation.finalize = timed_finalize  # type: ignore[method-assign]

    def build_prototypes(self) -> Tensor:
        return self.prototypes_given

    def on_predict_start(self) -> None:
        self.loop_start = common.now()


def refit(
    features: Tensor,
    labels: Tensor,
    prototypes: Tensor,
    ablations: bool,
    moments: StoredMoments | None = None,
) -> dict:
    module = GivenPrototypes(
        model_name="ViT-B-16",
        pretrained=None,
        class_names=[f"class {j}" for j in range(prototypes.shape[0])],
        templates=["{}"],
        tau_c=TAU_C,
        ablations=ablations,
    )
    module.prototypes_given = prototypes
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False,
    )  # fmt: skip
    dataset = FeatureDataset(features, labels, moments=moments)  # batched as the CLI batches it
    loader = DataLoader(dataset, batch_size=FEATURE_BATCH_SIZE, collate_fn=collate_stored)
    gc.collect()  # the earlier runs' modules (a ViT-B-16 each) are garbage, not yet collected
    start, cpu = common.now(), common.cpu_seconds()
    outputs = trainer.predict(module, loader)
    total, cpu = common.now() - start, common.cpu_seconds() - cpu
    prediction = torch.cat([o["prediction"] for o in outputs])
    return {
        "predict_s": total,
        "cores_used": cpu / total,  # CPU time / wall time: 2 = both cores were ours
        "loop_s": module.loop_s,
        "finalize_s": module.finalize_s,
        "images_encoded": module.images_encoded,
        "accuracy": float((prediction == labels).double().mean()),
        "tau_g": module.head.tau_g,
        "moments_from_store": module.outcome.moments_from_store,
    }


def worker(case: dict[str, Any]) -> dict[str, Any]:
    n, k, d = case["n"], case["k"], case["d"]
    features, prototypes, labels = common.clip_like(n, k, d)
    folder = Path(tempfile.mkdtemp(prefix="frolic_store_"))
    try:
        dtype = {"float32": torch.float32, "float16": torch.float16}[case["dtype"]]
        start = common.now()
        for rank in range(RANKS):
            index = torch.arange(rank, n, RANKS)
            write_shard(folder, rank, index, features[index].to(dtype), labels[index], key=KEY)
        write_manifest(folder, KEY, RANKS)
        write_s = common.now() - start
        add_store_moments(folder, prototypes, TAU_C)
        moments_s = common.now() - start - write_s
        size = sum(p.stat().st_size for p in folder.iterdir())
        start = common.now()
        stored = load_store(folder, KEY)
        load_s = common.now() - start
        error = float((stored.features - features).abs().max())
        data = (stored.features, stored.labels, prototypes)
        repeats = [
            refit(*data, ablations=False, moments=stored.moments) for _ in range(case["repeats"])
        ]
        median = sorted(repeats, key=lambda r: r["predict_s"])[len(repeats) // 2]
        runs = {"refit": {**median, "predict_s_runs": [r["predict_s"] for r in repeats]}}
        runs["refit, every row"] = refit(*data, ablations=True, moments=stored.moments)
        runs["refit, moments computed"] = refit(*data, ablations=False)  # a store without them
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "write_s": write_s,
        "moments_s": moments_s,
        "store_mib": size / 2**20,
        "load_s": load_s,
        "max_abs_feature_error": error,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 2,000, K = 100 (smoke run)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    info = common.machine_info()
    size = {"n": 2_000, "k": 100, "d": 64} if args.quick else {"n": 50_000, "k": 1_000, "d": 512}
    cases = []
    for dtype in ("float32", "float16"):
        case = {**size, "dtype": dtype, "repeats": 1 if args.quick else 5}
        result = common.run_json_worker(["benchmarks/store.py", "--worker", json.dumps(case)])
        cases.append({"case": case, "result": result})
        print(f"{dtype}: {json.dumps(result)[:200]}...", flush=True)
    over = common.read_result("overhead")
    encode = None
    if over is not None and not args.quick:
        encode = {
            "n": size["n"],
            "encode_s_per_image": over["encode_s_per_image"],
            "encode_s": over["encode_s_per_image"] * size["n"],
            "prompt_encoding_s": over["prompt_encoding_s"],
            "source": f"overhead.json, {over['machine']['date']}",
        }
    payload = {
        "machine": common.finish_info(info),
        "goal_refit_s": GOAL_REFIT_S,
        "batch_size": FEATURE_BATCH_SIZE,
        "encode": encode,
        "cases": cases,
    }
    from report import store_section

    print(store_section(payload))
    name = "store_quick" if args.quick else "store"
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
