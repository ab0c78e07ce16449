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
from torch import Tensor
from typing_extensions import override

from frolic_tta.data.store import DTYPES, MANIFEST, write_manifest, write_shard


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
        self._parts: list[tuple[Tensor, Tensor, Tensor | None]] = []

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
        labels = batch.get("label")
        self._parts.append(
            (
                torch.as_tensor(batch["index"]).cpu(),
                features.detach().to("cpu", DTYPES[self.dtype]),
                None if labels is None else torch.as_tensor(labels).cpu(),
            )
        )

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        index = torch.cat([p[0] for p in self._parts]) if self._parts else torch.zeros(0).long()
        features = torch.cat([p[1] for p in self._parts]) if self._parts else None
        if features is None:
            dim = int(getattr(pl_module, "batch_features", torch.zeros(0, 0)).shape[-1])
            features = torch.zeros(0, dim, dtype=DTYPES[self.dtype])
        labelled = bool(self._parts) and self._parts[0][2] is not None
        labels = torch.cat([p[2] for p in self._parts]) if labelled else None  # type: ignore[misc]
        write_shard(self.directory, trainer.global_rank, index, features, labels)
        self._parts = []
        trainer.strategy.barrier()  # every shard is on disk
        if trainer.is_global_zero:
            written_by = {
                "precision": str(trainer.precision),
                "accelerator": type(trainer.accelerator).__name__.replace("Accelerator", ""),
                "open_clip": open_clip.__version__,
            }
            write_manifest(self.directory, self.key, trainer.world_size, written_by)
        trainer.strategy.barrier()
