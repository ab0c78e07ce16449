"""FeatureStoreWriter: save the image features of a predict run as a feature store.

Every rank keeps the features ``FrolicModule.predict_step`` encodes (``batch_features``), with
the batch's global ``index`` and ``label``; after the epoch each rank writes its shard, all ranks
meet at a barrier, and rank 0 checks the shards and writes the manifest (last, so an interrupted
run leaves no store that could be read). The layout and the key are
:mod:`frolic_tta.data.store`'s. ``FrolicDataModule(feature_store=...)`` registers this callback
itself when it encodes; add it by hand for a DataLoader of your own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import open_clip
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from frolic_tta.data.store import (
    DTYPES,
    MANIFEST,
    FeatureStoreError,
    write_manifest,
    write_shard,
)


class FeatureStoreWriter(Callback):
    """Write ``features_rank{r}.pt`` per rank and ``manifest.json`` after a predict epoch.

    Args:
        directory: The store's folder (created; an earlier store there is replaced).
        key: The :func:`~frolic_tta.data.store.feature_key` of the run.
        dtype: ``"float32"`` or ``"float16"`` (half the size; read back as float32).
    """

    def __init__(self, directory: str, key: dict[str, Any], dtype: str = "float32") -> None:
        if dtype not in DTYPES:
            raise ValueError(f"Expected `dtype` to be one of {list(DTYPES)}, but got {dtype!r}")
        self.directory = Path(directory)
        self.key = key
        self.dtype = dtype
        self._parts: list[tuple[Tensor, Tensor, Tensor | None, list[str]]] = []

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._parts = []
        if trainer.is_global_zero:  # no stale manifest or shard survives a new write
            self.directory.mkdir(parents=True, exist_ok=True)
            (self.directory / MANIFEST).unlink(missing_ok=True)
            for stale in self.directory.glob("features_rank*.pt"):
                stale.unlink()
        trainer.strategy.barrier()

    @override
    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        features = getattr(pl_module, "batch_features", None)
        if features is None:
            raise ValueError(
                "Expected the LightningModule to set `batch_features` in predict_step (as "
                f"FrolicModule does), but {type(pl_module).__name__} has none"
            )
        index, labels = torch.as_tensor(batch["index"]).cpu(), batch.get("label")
        errors = batch.get("error")  # why an image could not be read ("": it was)
        self._parts.append(
            (
                index,
                features.detach().to("cpu", DTYPES[self.dtype]),
                None if labels is None else torch.as_tensor(labels).cpu(),
                [""] * len(index) if errors is None else [str(e) for e in errors],
            )
        )

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        parts, self._parts = self._parts, []
        dim = int(getattr(pl_module, "batch_features", torch.zeros(0, 0)).shape[-1])
        index = torch.cat([p[0] for p in parts]) if parts else torch.zeros(0, dtype=torch.long)
        features = (
            torch.cat([p[1] for p in parts])
            if parts
            else torch.zeros(0, dim).to(DTYPES[self.dtype])
        )
        labels = None
        if any(p[2] is not None for p in parts):  # -1 where a batch had no labels
            labels = torch.cat(
                [p[2] if p[2] is not None else torch.full_like(p[0], -1) for p in parts]
            )
        errors = [reason for p in parts for reason in p[3]]
        write_shard(self.directory, trainer.global_rank, index, features, labels, errors)
        trainer.strategy.barrier()  # every shard is on disk
        if trainer.is_global_zero:
            written_by = {
                "precision": str(trainer.precision),
                "accelerator": type(trainer.accelerator).__name__.replace("Accelerator", ""),
                "open_clip": open_clip.__version__,
            }
            try:
                write_manifest(self.directory, self.key, trainer.world_size, written_by)
            except FeatureStoreError as error:  # e.g. limit_predict_batches: part of the data
                rank_zero_warn(f"No feature store written: {error}")
                for shard in self.directory.glob("features_rank*.pt"):
                    shard.unlink()
        trainer.strategy.barrier()
