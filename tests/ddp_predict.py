"""Run FrolicModule.predict on generated images; used by tests in a subprocess (DDP on CPU).

Usage: python tests/ddp_predict.py CONFIG_JSON CHECKPOINT N BATCH DEVICES STRATEGY OUT_DIR
       [pad] [nan=INDEX] [online]
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from frolic_tta import FrolicModule, FrolicPredictionWriter  # noqa: E402
from frolic_tta.data import IndexedDataset  # noqa: E402
from frolic_tta.lightning.entry import close_process_group  # noqa: E402
from frolic_tta.options import FrolicOptions  # noqa: E402
from tests.generated import CLASS_NAMES, GeneratedImages  # noqa: E402


def main() -> None:
    config, checkpoint, n, batch, devices, strategy, out_dir = sys.argv[1:8]
    flags = sys.argv[8:]
    pad = "pad" in flags
    online = "online" in flags
    nan = [int(f.split("=")[1]) for f in flags if f.startswith("nan=")]
    labels = [f.split("=")[1] for f in flags if f.startswith("labels=")]
    torch.set_num_threads(1)
    dataset = IndexedDataset(GeneratedImages(int(n), nan_index=nan[0] if nan else None))
    module = FrolicModule(
        model_name=config,
        pretrained=checkpoint,
        class_names=CLASS_NAMES,
        templates=["a photo of a {}."],
        ablations=True,
        online=online,
        options=(  # tests/test_module.py's RAW_LABELS
            FrolicOptions(head_labels=labels[0], solver={"eps": 1e-6})
            if labels
            else FrolicOptions()
        ),
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(devices),
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        callbacks=[FrolicPredictionWriter(out_dir)],
    )
    sampler = None
    if pad:  # a user's own padding sampler: must be detected
        sampler = DistributedSampler(
            dataset, num_replicas=int(devices), rank=trainer.global_rank, shuffle=False
        )
    loader = DataLoader(dataset, batch_size=int(batch), sampler=sampler)
    trainer.predict(module, dataloaders=loader, return_predictions=False)
    if online:  # every rank: what it saw and holds, for the end-of-stream check
        answers = next(c for c in trainer.callbacks if type(c).__name__ == "OnlineAnswers")
        torch.save(
            {"features": answers.online.features, "online": module.online_, "head": module.head},
            Path(out_dir) / f"online_rank{trainer.global_rank}.pt",
        )
    if trainer.global_rank == 0:
        torch.save(
            {
                "metrics": module.metrics_,
                "class_accuracy": module.class_accuracy_,
                "tau_g": module.head.tau_g,
                "beta": module.head.beta,
                "head": module.head.state_dict(),
                "samples": module.samples_,
            },
            Path(out_dir) / "summary.pt",
        )
    close_process_group()  # as train.py does: else a rank can abort at exit (SIGABRT)


if __name__ == "__main__":
    main()
