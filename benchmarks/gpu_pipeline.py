"""Frolic against what a user would write instead, on the same GPU-bound data pipeline.

Run (GPU): ``python benchmarks/gpu_pipeline.py --device cuda`` (about 2 minutes on an H100).
CPU smoke run: ``python benchmarks/gpu_pipeline.py --quick`` (a tiny open_clip model, seconds).
Writes ``benchmarks/results/gpu_pipeline[_quick][_cuda].json``.

One open_clip model object (``--model``, ViT-B-16, ``pretrained=None``: timing does not depend
on weight values), K = ``--classes`` (1,000) prototypes from one template, encoded once and not
timed; ``--n`` (16,384) generated ``--size``-px images held in memory (a pool of 256, as
``overhead.py``), one ``DataLoader`` of single samples ``{"image", "index"}`` (``--batch-size``
256, ``--workers`` 6, pinned) for every method; ``--precision`` 16-mixed. Methods:

* ``plain``: a torch loop: the batch to the device (``non_blocking``), autocast float16,
  ``encode_image``, normalise, ``f @ z.T``, argmax; the predictions stay on the device until
  one copy at the end (the model is on the device before its clock starts; Lightning's
  teardown moves it to the host after each predict, and back at the next: that is inside the
  Lightning methods' times, and ``model_to_device_s`` says what one move costs);
* ``lightning``: a minimal ``LightningModule`` doing the same in ``predict_step`` and returning
  ``{"prediction", "confidence"}`` (Lightning moves them to the host per batch);
* ``frolic``: :class:`~frolic_tta.FrolicModule` in ``trainer.predict`` (the same model object
  and prototypes; ``finalize_`` gives its finalize seconds);
* ``callback``: the ``lightning`` module returning ``{"features"}`` with
  :class:`~frolic_tta.FrolicAdaptation` (``own-module.md``);
* ``frolic-nologits`` (not by default): ``FrolicModule(return_logits=False)``.

Every method runs once on ``--warmup-n`` images, then ``--repeats`` times in rotating order;
medians. Then one untimed run each on ``--count-n`` images under :class:`syncs.SyncCounter`
(CUDA: the sync debug mode; CPU: the simulation) gives the host synchronisations per batch and
where they come from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

import common
import lightning as L
import torch
import torch.nn.functional as F
from overhead import MemoryImages
from syncs import SyncCounter
from torch import Tensor
from torch.utils.data import DataLoader

from frolic_tta import FrolicAdaptation, FrolicModule

for _name in ("lightning.pytorch", "lightning.fabric", "frolic_tta"):
    logging.getLogger(_name).setLevel(logging.WARNING)

METHODS = ("plain", "lightning", "frolic", "callback")
TINY = {  # tests/conftest.py's tiny open_clip config (32-px images, d = 32)
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 64, "layers": 2, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 64, "heads": 2, "layers": 2},
}
AUTOCAST = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class ZeroShot(L.LightningModule):
    """What a user writes: encode, normalise, score against the prototypes, argmax (or, with
    ``features_only``, return the features for :class:`~frolic_tta.FrolicAdaptation`)."""

    def __init__(self, clip: torch.nn.Module, prototypes: Tensor, features_only: bool) -> None:
        super().__init__()
        self.clip, self.features_only = clip, features_only
        self.register_buffer("prototypes", prototypes, persistent=False)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        features = F.normalize(self.clip.encode_image(batch["image"]), dim=-1)
        if self.features_only:
            return {"features": features}
        confidence, prediction = (features @ self.prototypes.t()).softmax(1).max(1)
        return {"prediction": prediction, "confidence": confidence}


class Marks(L.Callback):
    """For a counted run: the counter's phase per batch (and finalize), the batch's tensors on
    the device (CPU simulation)."""

    def __init__(self, counter: SyncCounter) -> None:
        self.counter = counter

    def on_predict_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                               batch: Any, *args: Any) -> None:  # fmt: skip
        self.counter.phase = "batch"
        if not self.counter.cuda:
            found = [c for c in trainer.callbacks if isinstance(c, FrolicAdaptation)]
            moments = found[0].moments if found else None
            state = [] if moments is None else [getattr(moments, s) for s in moments._defaults]
            proto = [found[0].prototypes_] if found else []
            proto += [getattr(moments, "prototypes", None), getattr(pl_module, "prototypes", None)]
            self.counter.on_device(batch, state, proto)

    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.counter.phase = "end"  # then Lightning's teardown (the model to the host)


def run_plain(setup: dict[str, Any], loader: DataLoader, counter: SyncCounter | None) -> Tensor:
    """The plain torch loop; predictions on the host."""
    clip, z, device = setup["clip"], setup["prototypes"], setup["device"]
    dtype = AUTOCAST.get(setup["precision"])
    predictions = []
    with torch.inference_mode():
        for batch in loader:
            if counter is not None:
                counter.phase = "batch"
            images = batch["image"].to(device, non_blocking=True)
            if counter is not None and not counter.cuda:
                counter.on_device(images, z)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                features = F.normalize(clip.encode_image(images), dim=-1)
                predictions.append((features @ z.t()).argmax(1))
        if counter is not None:
            counter.phase = "end"
        return torch.cat(predictions).cpu()


def run_method(method: str, setup: dict[str, Any], n: int, counter: SyncCounter | None = None
               ) -> dict[str, Any]:  # fmt: skip
    """One run of ``method`` on ``n`` images: wall seconds, finalize seconds, predictions."""
    args = setup["args"]
    if n not in setup["data"]:  # the images made once per size of run
        setup["data"][n] = MemoryImages(n, size=setup["size"])
    data = setup["data"][n]
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=args.workers,
                        pin_memory=setup["device"].type == "cuda")  # fmt: skip
    callbacks: list[L.Callback] = [] if counter is None else [Marks(counter)]
    module: L.LightningModule | None = None
    adaptation: FrolicAdaptation | None = None
    if method in ("frolic", "frolic-nologits"):
        module = setup["frolic"]
        module.adaptation.return_logits = method == "frolic"
        adaptation = module.adaptation
    elif method == "lightning":
        module = setup["zero_shot"]
    elif method == "callback":
        module = setup["features"]
        adaptation = FrolicAdaptation(setup["prototypes"], tau_c=setup["tau_c"])
        callbacks.append(adaptation)
    if adaptation is not None and counter is not None:
        finalize = adaptation.finalize

        def marked(trainer: L.Trainer) -> None:
            counter.phase = "finalize"
            finalize(trainer)

        adaptation.finalize = marked  # type: ignore[method-assign]
    moved = None
    if module is None:  # Lightning's teardown left the model on the host: back, not timed
        moved = common.now()
        setup["clip"].to(setup["device"])
        common.sync(setup["device"])
        moved = common.now() - moved
    common.sync(setup["device"])
    start = common.now()
    with counter if counter is not None else contextlib.nullcontext():
        if module is None:
            predictions = run_plain(setup, loader, counter)
        else:
            outputs = common.trainer_for(args, callbacks).predict(module, dataloaders=loader)
            predictions = torch.cat([o["prediction"] for o in outputs])
    common.sync(setup["device"])
    wall = common.now() - start
    if adaptation is not None and counter is not None:
        del adaptation.finalize  # the instance's own attribute: the method again
    finalize_s = None
    if adaptation is not None:
        finalize_s = sum(adaptation.outcome.finalize["seconds"].values())
    if int((predictions < 0).sum()):
        raise RuntimeError(f"{method}: some predictions were not filled in")
    return {"wall_s": wall, "finalize_s": finalize_s, "predictions": predictions,
            "model_to_device_s": moved}  # fmt: skip


def build(args: argparse.Namespace) -> dict[str, Any]:
    """The shared model, prototypes and modules."""
    model_name = args.model
    if args.quick:
        folder = Path(tempfile.mkdtemp(prefix="frolic_tiny_"))
        model_name = str(folder / "frolic-tiny-vit.json")
        Path(model_name).write_text(json.dumps(TINY))
    names = [f"class {i}" for i in range(args.classes)]
    device = torch.device(args.device)
    torch.manual_seed(0)  # the same random weights in every run of the script
    frolic = FrolicModule(model_name=model_name, pretrained=None, class_names=names,
                          templates=["{}"]).to(device)  # fmt: skip
    start = common.now()
    prototypes = frolic.build_prototypes()
    prompt_s = common.now() - start
    frolic.build_prototypes = lambda: prototypes  # type: ignore[method-assign]  # once for all
    clip = frolic.clip.eval()
    size = clip.visual.image_size
    size = size[0] if isinstance(size, tuple | list) else size
    return {
        "args": args,
        "device": device,
        "precision": args.precision,
        "clip": clip,
        "size": int(size),
        "prototypes": prototypes,
        "tau_c": frolic.tau_c,
        "frolic": frolic,
        "zero_shot": ZeroShot(clip, prototypes, features_only=False),
        "features": ZeroShot(clip, prototypes, features_only=True),
        "prompt_s": prompt_s,
        "data": {},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="ViT-B-16")
    parser.add_argument("--n", type=int, default=16_384)
    parser.add_argument("--warmup-n", type=int, default=1024)
    parser.add_argument("--count-n", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--precision", default=None, help="default 16-mixed (CPU: 32-true)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--quick", action="store_true",
                        help="tiny open_clip config, 256 images, 64 per batch, 10 classes, "
                        "no workers, 1 repeat")  # fmt: skip
    args = parser.parse_args()
    if args.precision is None:
        args.precision = "16-mixed" if args.device.startswith("cuda") else "32-true"
    if args.quick:
        args.n, args.warmup_n, args.count_n, args.batch_size = 256, 64, 128, 64
        args.classes, args.workers, args.repeats = 10, 0, 1
    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)  # a shared CPU stalls with more (the smoke run only)
    info = common.machine_info(args.device)
    methods = args.methods.split(",")
    setup = build(args)
    for method in methods:
        run_method(method, setup, args.warmup_n)
    walls: dict[str, list[float]] = {m: [] for m in methods}
    finalize: dict[str, list[float]] = {m: [] for m in methods}
    predictions: dict[str, Tensor] = {}
    moves: list[float] = []
    for repeat in range(args.repeats):
        order = methods[repeat % len(methods) :] + methods[: repeat % len(methods)]
        for method in order:
            run = run_method(method, setup, args.n)
            walls[method].append(run["wall_s"])
            if run["finalize_s"] is not None:
                finalize[method].append(run["finalize_s"])
            predictions[method] = run["predictions"]
            if run["model_to_device_s"] is not None:
                moves.append(run["model_to_device_s"])
            print(f"{method}: {run['wall_s']:.3f} s", flush=True)
    counts: dict[str, dict[str, Any]] = {}
    batches = -(-args.count_n // args.batch_size)
    for method in methods:
        counter = SyncCounter(setup["device"])
        run_method(method, setup, args.count_n, counter)
        counts[method] = {
            "syncs_per_batch": counter.count("batch") / batches,
            "syncs_finalize": counter.count("finalize"),
            "syncs_end": counter.count("end"),
            "sites_batch": {s: c / batches for s, c in counter.sites("batch").items()},
            "sites_finalize": dict(list(counter.sites("finalize").items())[:10]),
        }
    median = {m: statistics.median(w) for m, w in walls.items()}
    ratios = {}
    for method in ("frolic", "callback", "frolic-nologits"):
        for base in ("lightning", "plain"):
            if method in median and base in median:
                ratios[f"{method} / {base}"] = median[method] / median[base]
    same = None
    if "plain" in predictions and "lightning" in predictions:
        same = float((predictions["plain"] == predictions["lightning"]).double().mean())
    result = {
        "config": vars(args),
        "prompt_encoding_s": setup["prompt_s"],
        "wall_s": walls,
        "median_s": median,
        "images_per_s": {m: args.n / s for m, s in median.items()},
        "ratios": ratios,
        "finalize_s": {m: statistics.median(f) for m, f in finalize.items() if f},
        "finalize_s_runs": {m: f for m, f in finalize.items() if f},
        "plain_vs_lightning_same_predictions": same,
        # Lightning moves the module to the host after every predict and back before the next
        # (inside the Lightning methods' times); the plain loop's move back, not in its time:
        "model_to_device_s": moves,
        "syncs": counts,
        "syncs_simulated": setup["device"].type != "cuda",
    }
    print(f"\n{args.n:,} images of {setup['size']} px, batch {args.batch_size}, "
          f"{args.workers} workers, K = {args.classes}, {args.precision}, median of "
          f"{args.repeats}:")  # fmt: skip
    rows = [[m, median[m], args.n / median[m], result["finalize_s"].get(m),
             counts[m]["syncs_per_batch"], counts[m]["syncs_finalize"]]
            for m in methods]  # fmt: skip
    headers = ["method", "s", "images/s", "finalize s", "host syncs / batch", "finalize syncs"]
    print(common.markdown_table(headers, rows))
    print("; ".join(f"{k}: {v:.3f}" for k, v in ratios.items()))
    for method in methods:
        sites = counts[method]["sites_batch"]
        if sites:
            print(f"  {method} per batch: " + "; ".join(f"{c:.2f} x {s}" for s, c in sites.items()))
    name = "gpu_pipeline" + ("_quick" if args.quick else "") + (
        "_cuda" if "cuda" in args.device else "")  # fmt: skip
    payload = {"machine": common.finish_info(info), **result}
    print(f"wrote {common.write_result(name, payload).relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
