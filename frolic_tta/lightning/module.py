r"""FrolicModule: Frolic on a frozen open_clip model inside ``trainer.predict``.

**Two-phase predict.** ``trainer.predict(model, loader)`` runs one predict epoch:

1. *Encode* (``predict_step``, once per batch): the image encoder runs once per image; the
   L2-normalised features are cached on this rank (``N_rank x d``) and added to the float64
   :class:`~frolic_tta.stats.FrolicMoments` sums. The step returns CPU *placeholders*
   (``logits`` NaN, ``prediction`` -1, plus ``index`` and ``target``). No collective is called
   per batch.
2. *Finalize* (``on_predict_batch_end`` of this rank's last batch, known in advance from the
   public ``trainer.num_predict_batches``): the moment sums are all-reduced (torchmetrics
   sync), the GDA head, :math:`\\tau_g` and :math:`\\beta` are fitted with
   :func:`frolic_tta.fit_frolic`, whose every dataset-wide sum goes through
   ``trainer.strategy.reduce(..., reduce_op="sum")``, and the cached features are scored
   (no second encoder pass). The placeholders are filled **in place**.

Lightning keeps CPU tensors returned by ``predict_step`` by reference, so the filled values are
what ``trainer.predict`` returns and what an *epoch*-interval
:class:`~lightning.pytorch.callbacks.BasePredictionWriter` writes (callbacks'
``on_predict_epoch_end`` runs after the last batch, hence after finalize). A *batch*-interval
writer would see placeholders (NaN logits, prediction -1), because no prediction is final before
the rank's last batch: use ``write_interval="epoch"``.

**DDP contract.** Lightning's predict sampler (``UnrepeatedDistributedSamplerWrapper``) does not
pad, so ranks may differ by one batch; a collective inside ``predict_step`` would deadlock. Each
rank finalizes exactly once, after its own last batch, and every collective in finalize is
decided on all-reduced values, so every rank calls the same collectives in the same order.
The global sample count must equal the dataset length (a padding ``DistributedSampler`` or
``use_distributed_sampler=False`` is detected) and N must be at least the world size.

**Precision.** Features are cached in float32 and the statistics are float64 under any Trainer
precision (``32``, ``bf16-mixed``, ``16-mixed``, ``bf16-true``): the metric is created after the
precision plugin has converted the module, and finalize runs with autocast disabled.

**Attributes after predict.** ``head`` (:class:`~frolic_tta.FrolicHead`), ``metrics_`` (accuracy
of every Table 3/4 row when batches carry labels, plus ``tau_g``), ``class_probability_``
(``"before"``/``"after"``: per-class mean predicted probability of :math:`f_f` and :math:`f_d`
over the whole dataset, the paper's Fig. 1c/d), ``images_encoded``.

**Re-use.** After adaptation ``f_d(x) = A x + c`` (:meth:`adapted_classifier`); it is saved in
checkpoints. With ``reuse_head=True`` a later ``predict`` scores batches with the stored head
in one phase (no statistics, no re-adaptation); set it back to ``False`` to re-adapt.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from frolic_tta.clip.loading import check_tau_c, load_open_clip, model_temperature
from frolic_tta.clip.prompts import build_class_prompts, encode_prototypes
from frolic_tta.head import FrolicClassifier, FrolicHead
from frolic_tta.metrics import FrolicMoments, row_accuracies, update_row_accuracies
from frolic_tta.options import FrolicOptions
from frolic_tta.pipeline import fit_frolic
from frolic_tta.rows import RowContext, build_rows


class FrolicModule(L.LightningModule):
    r"""Frolic test-time adaptation of a frozen open_clip model.

    Args:
        model_name: any name open_clip accepts: an architecture (``"ViT-B-16"``),
            ``"hf-hub:org/name"``, ``"local-dir:/path/to/folder"``, or a model-config JSON path
            (see :mod:`frolic_tta.clip.loading`).
        pretrained: open_clip tag (``"openai"``), local checkpoint path, or ``None``; ignored
            for ``hf-hub:``/``local-dir:`` names, which bring their weights.
        class_names: the K class names, in label order.
        templates: ``"openai"`` (80), ``"simple"`` (7), a dataset key, or a list of ``"{}"``
            templates.
        prompts_file: CuPL-style JSON (class name -> sentences), ensembled per class.
        tau_c: zero-shot temperature :math:`\tau_c`. ``"model"`` (default): the loaded model's
            own, :math:`1/\exp(\text{logit\_scale})` (0.01 for OpenAI CLIP, the paper's value;
            SigLIP's ``logit_bias`` shifts every class alike and does not enter); a float
            overrides it. The value used is ``self.tau_c`` (``hparams["tau_c"]`` keeps the
            argument).
        options: the estimator's :class:`~frolic_tta.options.FrolicOptions` (covariance,
            shrinkage, label-bias method, tolerance); ``--model.options.<field>`` on the CLI.
        ablations: with labels, also compute Table 3/4 rows' accuracy (extra passes).
        return_logits: return ``(n, K)`` logits per batch. ``False`` also keeps finalize free of
            any ``(N, K)`` tensor (logits recomputed chunk by chunk; for very large K).
        reuse_head: score with the stored head instead of re-adapting, if one exists.
        text_batch_size: prompts per text-encoder forward.
        chunk_size: rows per chunk in finalize (``None``: about 2M logits per chunk).
    """

    def __init__(
        self,
        model_name: str = "ViT-B-16",
        pretrained: str | None = "openai",
        class_names: list[str] | None = None,
        templates: str | list[str] = "openai",
        prompts_file: str | None = None,
        tau_c: float | Literal["model"] = "model",
        options: FrolicOptions = FrolicOptions(),  # noqa: B008 (frozen, immutable)
        ablations: bool = True,
        return_logits: bool = True,
        reuse_head: bool = False,
        text_batch_size: int = 256,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # the CLI (and load_from_checkpoint) hand over a dict; hparams keep plain values
        self.options = options if isinstance(options, FrolicOptions) else FrolicOptions(**options)
        self.hparams["options"] = asdict(self.options)
        fixed_tau_c = check_tau_c(tau_c)  # a bad value fails before any weights load
        self.clip, self.preprocess, self.tokenizer = load_open_clip(model_name, pretrained)
        self.tau_c = model_temperature(self.clip) if fixed_tau_c is None else fixed_tau_c
        self.class_names = list(class_names) if class_names is not None else None
        self.reuse_head = reuse_head
        self.head: FrolicHead | None = None
        self.metrics_: dict[str, float] = {}
        self.class_probability_: dict[str, Tensor] = {}
        self.images_encoded = 0
        self._reset_epoch()

    def _reset_epoch(self) -> None:
        self._features: list[Tensor] = []
        self._labels: list[Tensor] = []
        self._outputs: list[dict[str, Tensor]] = []
        self._prototypes: Tensor | None = None
        self._last_batch = -1

    # ------------------------------------------------------------------ prototypes / features
    def build_prototypes(self) -> Tensor:
        """Encode class names x templates (and descriptions) into ``(K, d)`` unit prototypes."""
        if not self.class_names or len(self.class_names) < 2:
            raise ValueError(
                "Expected `class_names` with at least 2 classes, but got "
                f"{self.class_names!r}; pass --model.class_names or a datamodule with class_names"
            )
        prompts = build_class_prompts(
            self.class_names, self.hparams.templates, self.hparams.prompts_file
        )
        trainer = self._trainer
        progress = bool(trainer and trainer.is_global_zero and trainer.progress_bar_callback)
        with torch.autocast(self.device.type, enabled=False):
            return encode_prototypes(
                self.clip,
                self.tokenizer,
                prompts,
                batch_size=self.hparams.text_batch_size,
                device=self.device,
                progress=progress,
            ).float()

    def encode_images(self, images: Tensor) -> Tensor:
        """L2-normalised image features ``(n, d)`` in float32 (one encoder forward)."""
        self.images_encoded += images.shape[0]
        features = self.clip.encode_image(images).float()
        return features / features.norm(dim=1, keepdim=True)

    @staticmethod
    def _unpack(batch: Any) -> tuple[Tensor | None, Tensor, Tensor | None]:
        has_input = isinstance(batch, dict) and ("image" in batch or "features" in batch)
        if not has_input or "index" not in batch:
            raise ValueError(
                "Expected each batch to be a dict with 'image' and 'index' (and optionally "
                f"'label'); wrap your dataset in frolic_tta.data.IndexedDataset. Got {type(batch)}"
            )
        return batch.get("image"), batch["index"], batch.get("label")

    # ------------------------------------------------------------------ hooks
    @override
    def on_predict_start(self) -> None:
        self._reset_epoch()
        if self.reuse_head and self.head is not None:
            return
        loaders = self.trainer.predict_dataloaders
        loaders = loaders if isinstance(loaders, list | tuple) else [loaders]
        if len(loaders) != 1:
            raise ValueError(f"Expected exactly one predict dataloader, but got {len(loaders)}")
        num_batches = self.trainer.num_predict_batches[0]
        if num_batches == float("inf"):
            raise ValueError("Expected a predict dataloader with a length (map-style dataset)")
        dataset_length = len(loaders[0].dataset)
        if dataset_length < self.trainer.world_size:
            raise ValueError(
                "Expected at least one sample per rank (N >= world size "
                f"{self.trainer.world_size}), but the dataset has N={dataset_length}"
            )
        self._dataset_length = dataset_length
        self._last_batch = int(num_batches) - 1
        self._prototypes = self.build_prototypes()
        self.moments = FrolicMoments(self._prototypes, self.tau_c).to(self.device)

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        images, index, labels = self._unpack(batch)
        # stored features (frolic_tta.data.store) skip the encoder; callbacks may read them
        features = batch["features"].float() if images is None else self.encode_images(images)
        self.batch_features = features
        output: dict[str, Tensor] = {"index": index.detach().cpu()}
        if labels is not None:
            output["target"] = labels.detach().cpu()
        if self.reuse_head and self.head is not None:
            return self._fill(output, self.head.score(features))
        with torch.autocast(self.device.type, enabled=False):
            self.moments.update(features)
        self._features.append(features)
        if labels is not None:
            self._labels.append(labels.detach())
        n, k = features.shape[0], self._prototypes.shape[0]
        if self.hparams.return_logits:
            output["logits"] = torch.full((n, k), float("nan"))
        output["prediction"] = torch.full((n,), -1, dtype=torch.long)
        output["confidence"] = torch.full((n,), float("nan"))
        self._outputs.append(output)
        return output

    @override
    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if batch_idx == self._last_batch and self._outputs:
            with torch.autocast(self.device.type, enabled=False):
                self.finalize()

    # ------------------------------------------------------------------ finalize
    def _reduce(self, tensor: Tensor) -> Tensor:
        reduced = self.trainer.strategy.reduce(tensor.to(self.device).clone(), reduce_op="sum")
        return reduced.to(tensor.device)

    def _fill(self, output: dict[str, Tensor], logits: Tensor) -> dict[str, Tensor]:
        probs = torch.softmax(logits.float(), dim=1)
        confidence, prediction = probs.max(1)
        values = {"logits": logits, "prediction": prediction, "confidence": confidence}
        for key, value in values.items():
            if key == "logits" and not self.hparams.return_logits:
                continue
            value = value.detach().cpu()
            if key in output:
                output[key].copy_(value)
            else:
                output[key] = value.to(torch.float32) if key == "logits" else value
        return output

    def finalize(self) -> None:
        r"""All-reduce, fit the head, :math:`\tau_g`, :math:`\beta`, and fill the outputs."""
        sums = self.moments.compute()  # synced over the process group
        total = int(round(float(sums.count)))
        if total != self._dataset_length:
            raise RuntimeError(
                f"Frolic saw {total} samples over all ranks but the dataset has "
                f"{self._dataset_length}: the sampler duplicated or skipped samples (a "
                "DistributedSampler pads to equal shards, and use_distributed_sampler=False "
                "gives every rank all data). Let Lightning set the predict sampler."
            )
        features = torch.cat(self._features)
        hp = self.hparams
        fit = fit_frolic(
            features,
            self._prototypes,
            self.options,
            tau_c=self.tau_c,
            sums=sums,
            reduce_fn=self._reduce,
            keep_logits=hp.return_logits,  # else no (N, K) tensor: rescored batch by batch
            chunk_size=hp.chunk_size,
        )
        self.head = fit.head
        log_beta = torch.log(self.head.beta).to(device=features.device, dtype=torch.float32)
        probability = torch.zeros(2, log_beta.shape[0], dtype=torch.float64)
        start = 0
        for output in self._outputs:
            n = output["prediction"].shape[0]
            if fit.logits is not None:
                logits = fit.logits[start : start + n]
            else:
                logits = self.head.score(features[start : start + n])
            self._fill(output, logits)
            probability[0] += torch.softmax(logits + log_beta, 1).sum(0).double().cpu()
            probability[1] += torch.softmax(logits, 1).sum(0).double().cpu()
            start += n
        probability = self._reduce(probability) / sums.count.cpu()
        self.class_probability_ = {"before": probability[0], "after": probability[1]}
        has_labels = len(self._labels) == len(self._outputs)
        if has_labels and hp.ablations:
            self._evaluate(features, torch.cat(self._labels), sums)
        self._features, self._labels = [], []

    def _evaluate(self, features: Tensor, labels: Tensor, sums: Any) -> None:
        hp = self.hparams
        ctx = RowContext(
            self.head, sums, features, self.options, labels, self._reduce, hp.chunk_size
        )
        rows = build_rows(ctx)
        metrics = row_accuracies(len(self.class_names)).to(self.device)
        update_row_accuracies(metrics, rows, features, labels.to(self.device), hp.chunk_size)
        computed = metrics.compute()  # torchmetrics syncs over the process group
        self.metrics_ = {key: float(value) for key, value in computed.items()}
        self.metrics_.update(
            tau_g=self.head.tau_g,
            beta_max_over_min=float(self.head.beta.max() / self.head.beta.min()),
        )
        if self.trainer.logger is not None:
            self.trainer.logger.log_metrics(self.metrics_, step=0)
        rank_zero_info(
            "Frolic accuracy: " + ", ".join(f"{k}={v:.4f}" for k, v in self.metrics_.items())
        )

    # ------------------------------------------------------------------ re-use
    def adapted_classifier(self) -> FrolicClassifier:
        r"""The adapted classifier :math:`f_d(x) = A (x - \mu) + c` on normalised features.

        A :class:`~frolic_tta.core.FrolicClassifier` (``nn.Module``); ``self.head.to_linear()``
        gives a plain ``nn.Linear`` computing :math:`A x + c'`.
        """
        if self.head is None:
            raise RuntimeError("FrolicModule has not been adapted yet: run trainer.predict first")
        return self.head.to_module()

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.head is not None:
            checkpoint["frolic_head"] = self.head.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "frolic_head" in checkpoint:
            self.head = FrolicHead.from_state_dict(checkpoint["frolic_head"])
