"""FeatureStoreWriter: save the image features of a predict run as a feature store.

Every rank keeps the features ``FrolicModule.predict_step`` encodes (its public
``batch_features``; any LightningModule that sets it, :class:`FeatureSource`), with the batch's
global ``index`` and ``label``; after the epoch each rank writes its shard into this
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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

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
    FeatureDataset,
    FeatureStoreError,
    load_store,
    publish,
    staging_dir,
    write_manifest,
    write_shard,
)
from frolic_tta.data.store_moments import same_samples, write_moments
from frolic_tta.gda import MomentSums
from frolic_tta.lightning.samples import sample_validity
from frolic_tta.pipeline import shard_moment_sums


@runtime_checkable
class FeatureSource(Protocol):
    """A LightningModule whose ``predict_step`` sets ``batch_features`` ``(n, d)``."""

    batch_features: Tensor | None


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


def stored_sums(dataset: Any, prototypes: Tensor, tau_c: float) -> dict[str, Tensor] | None:
    """A feature store's sums for ``prototypes`` (bitwise) and ``tau_c``, when ``dataset`` is
    a :class:`~frolic_tta.data.store.FeatureDataset` that has them, else ``None``."""
    moments = dataset.moments if isinstance(dataset, FeatureDataset) else None
    return None if moments is None else moments.for_run(prototypes, tau_c)


def checked_sums(
    computed: MomentSums,
    stored: dict[str, Tensor] | None,
    say: Callable[[str], None] | None = None,
) -> MomentSums | None:
    r"""The sums finalize fits with: ``computed`` (the run's reduced sums) when nothing is
    ``stored``; else ``stored`` as :class:`~frolic_tta.gda.MomentSums` on ``computed``'s
    device where the run's N and :math:`\sum_i x_i` are theirs, or ``None`` (the fit computes
    every sum: a run over part of the store, other samples), saying so."""
    if stored is None:
        return computed
    if same_samples(computed.count, computed.feature_sum, stored):
        device = computed.count.device
        return MomentSums(**{name: value.to(device) for name, value in stored.items()})
    if say is not None:
        say("moments: the feature store's are not of this run's samples; computing them")
    return None


class FeatureStoreWriter(Callback):
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
    def on_predict_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._staging is None:
            return
        features = pl_module.batch_features if isinstance(pl_module, FeatureSource) else None
        if features is None:
            raise ValueError(
                "Expected the LightningModule to set `batch_features` in predict_step (as "
                f"FrolicModule does), but {type(pl_module).__name__} has none"
            )
        self._dim = features.shape[-1]
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
                self._add_moments(staging, pl_module)
                publish(staging, self.directory)
            except FeatureStoreError as error:  # e.g. limit_predict_batches: part of the data
                rank_zero_warn(f"No feature store written: {error}")
            finally:
                shutil.rmtree(staging, ignore_errors=True)  # gone when published
        trainer.strategy.barrier()

    def _add_moments(self, staging: Path, pl_module: L.LightningModule) -> None:
        """A FrolicModule's run: its moment sums (float32: the run's own; float16: from the
        rounded store) go with the store."""
        from frolic_tta.lightning.module import FrolicModule  # the module registers us

        if not isinstance(pl_module, FrolicModule) or pl_module.prototypes_ is None:
            return
        sums = pl_module.outcome.moments if self.dtype == "float32" else None
        if sums is None and self.dtype == "float32":
            return
        add_store_moments(staging, pl_module.prototypes_, pl_module.tau_c, sums)
