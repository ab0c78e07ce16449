"""FeatureStoreWriter: save the image features of a predict run as a feature store.

Every rank keeps the features :class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` read
from each batch (it hands them over as an
:class:`~frolic_tta.lightning.adaptation.AdaptationListener`: ``FrolicModule``'s or any
module's that returns features), with the batch's global ``index`` and ``label``; after the
epoch each rank writes its shard into this
run's private folder (:func:`~frolic_tta.data.store.staging_dir`, named by rank 0 and
broadcast), all ranks meet at a barrier, and rank 0 checks the shards, writes the manifest and
publishes the folder as the store by renaming it (an interrupted run leaves no store that could
be read, and two runs writing one store never mix). The layout and the key are
:mod:`frolic_tta.data.store`'s. ``FrolicModule.configure_callbacks`` registers a writer without
a directory when its datamodule has a ``feature_store``: it writes the store the datamodule's
``setup`` requests (:class:`~frolic_tta.data.datamodules.StoreRequest`), and nothing when that
reads a store instead. For a DataLoader of your own, add ``FeatureStoreWriter(dir, key)``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import lightning as L
import open_clip
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from frolic_tta.data.datamodules import FrolicDataModule, ImageFolderDataModule, StoreRequest
from frolic_tta.data.store import (
    DTYPES,
    FeatureStoreError,
    load_store,
    publish,
    staging_dir,
    write_manifest,
    write_shard,
)
from frolic_tta.data.store_moments import write_moments
from frolic_tta.gda import MomentSums
from frolic_tta.lightning.adaptation import AdaptationListener, FrolicAdaptation, find_adaptation
from frolic_tta.lightning.batch import FrolicBatch
from frolic_tta.lightning.samples import sample_validity
from frolic_tta.pipeline import shard_moment_sums


def writes_store(datamodule: Any) -> bool:
    """Whether ``datamodule`` is a Frolic datamodule with a ``feature_store`` (its ``setup``
    then reads the store or requests one)."""
    datamodules = (FrolicDataModule, ImageFolderDataModule)
    return isinstance(datamodule, datamodules) and datamodule.feature_store is not None


def add_store_moments(
    directory: str | Path, prototypes: Tensor, tau_c: float, sums: MomentSums | None = None
) -> None:
    r"""Keep the moment sums of a written store's usable features under ``prototypes``
    ``(K, d)`` and ``tau_c`` in it (:mod:`frolic_tta.data.store_moments`): a refit with these
    prototypes then skips their float64 pass. ``sums``: already reduced sums of exactly the
    features a refit reads (a float32 store written by this run); ``None``: computed from the
    store as a refit reads it (float16: re-normalised), skipping unusable samples as
    ``FrolicModule`` does."""
    if sums is None:
        stored = load_store(directory, verify=False)
        valid, _ = sample_validity(stored.features, stored.errors)
        features = stored.features[valid].to(prototypes.device)
        sums = shard_moment_sums(features, prototypes, tau_c)
    values = {name: getattr(sums, name) for name in MomentSums.__dataclass_fields__}
    write_moments(directory, values, prototypes, tau_c)


class FeatureStoreWriter(AdaptationListener, Callback):
    """Write ``features_rank{r}.pt`` per rank and ``manifest.json`` after a predict epoch.

    Args:
        directory: The store's folder (created; an earlier store there is replaced); ``None``:
            the store the Trainer's datamodule requests (``store_request``), if any.
        key: The :func:`~frolic_tta.data.store.feature_key` of the run (with ``directory``).
        dtype: ``"float32"`` or ``"float16"`` (half the size; read back as float32).
    """

    def __init__(
        self,
        directory: str | None = None,
        key: dict[str, Any] | None = None,
        dtype: str = "float32",
    ) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"Expected `dtype` to be one of {list(DTYPES)}, but got {dtype!r}")
        if (directory is None) != (key is None):
            raise ValueError("Expected `directory` and `key` together, or neither of them")
        self.request = None if directory is None else StoreRequest(Path(directory), key, dtype)
        self._parts: list[tuple[Tensor, Tensor, Tensor | None, list[str]]] = []
        self._staging: Path | None = None
        self._dim = 0

    def _active(self, trainer: L.Trainer) -> StoreRequest | None:
        if self.request is not None:
            return self.request
        datamodule = trainer.datamodule
        return datamodule.store_request if writes_store(datamodule) else None

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._parts, self._staging = [], None
        request = self._active(trainer)
        if request is None:  # the datamodule reads its store: nothing to write
            return
        self.directory, self.key, self.dtype = request.directory, request.key, request.dtype
        staging = str(staging_dir(self.directory)) if trainer.is_global_zero else None
        self._staging = Path(trainer.strategy.broadcast(staging, src=0))
        if trainer.is_global_zero:
            self._staging.mkdir(parents=True)
        trainer.strategy.barrier()

    @override
    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if trainer.is_global_zero and self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    @override
    def on_adaptation_batch(
        self, trainer: L.Trainer, adaptation: FrolicAdaptation, batch: FrolicBatch
    ) -> None:
        if self._staging is None:
            return
        self._dim = batch.features.shape[-1]
        errors = batch.errors  # why an image could not be read ("": it was)
        self._parts.append(
            (
                batch.index,
                batch.features.detach().to("cpu", DTYPES[self.dtype]),
                batch.labels,
                [""] * len(batch.index) if errors is None else errors,
            )
        )

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._staging is None:
            return
        parts, self._parts, dim = self._parts, [], self._dim
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
        staging = self._staging
        write_shard(staging, trainer.global_rank, index, features, labels, errors, key=self.key)
        trainer.strategy.barrier()  # every shard is on disk
        if trainer.is_global_zero:
            written_by = {
                "precision": str(trainer.precision),
                "accelerator": type(trainer.accelerator).__name__.replace("Accelerator", ""),
                "open_clip": open_clip.__version__,
            }
            try:
                write_manifest(staging, self.key, trainer.world_size, written_by)
                self._add_moments(staging, find_adaptation(trainer))
                publish(staging, self.directory)
            except FeatureStoreError as error:  # e.g. limit_predict_batches: part of the data
                rank_zero_warn(f"No feature store written: {error}")
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # gone when published
        trainer.strategy.barrier()

    def _add_moments(self, staging: Path, adaptation: FrolicAdaptation) -> None:
        """An adapted run's moment sums (float32: the run's own; float16: from the rounded
        store) go with the store."""
        if adaptation.prototypes_ is None or adaptation.tau_c_ is None:
            return
        sums = adaptation.outcome.moments if self.dtype == "float32" else None
        if sums is None and self.dtype == "float32":
            return
        add_store_moments(staging, adaptation.prototypes_, adaptation.tau_c_, sums)
