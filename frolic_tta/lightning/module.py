r"""FrolicModule: Frolic on a frozen open_clip model inside ``trainer.predict``.

**Two-phase predict.** ``trainer.predict(model, loader)`` runs one predict epoch:

1. *Encode* (``predict_step``, once per batch): the image encoder runs once per image; the
   L2-normalised features of usable samples are cached on this rank (``N_rank x d``, one
   buffer) and added to the float64 :class:`~frolic_tta.metrics.FrolicMoments` sums (N and Σx
   only where a feature store brings the rest: :mod:`frolic_tta.data.store_moments`). The step
   returns CPU placeholders (``logits`` NaN, ``prediction`` -1, ``index``, ``valid``, ``target``).
2. *Finalize* (``on_predict_batch_end`` of this rank's last batch, known in advance from the
   public ``trainer.num_predict_batches``): the moment sums are all-reduced (torchmetrics
   sync), the head, the test prior, :math:`\tau_g` and :math:`\beta` are fitted with
   :func:`frolic_tta.fit_frolic`, whose every dataset-wide sum goes through
   ``trainer.strategy.reduce(..., reduce_op="sum")``, and the cached features are scored
   (no second encoder pass). The placeholders are filled **in place**: Lightning keeps them by
   reference, so ``trainer.predict`` returns, and an *epoch*-interval prediction writer writes,
   the final values (a *batch*-interval writer would see placeholders).

**Bad samples and labels.** An unreadable file or non-finite features skip that sample only
(policy in :mod:`frolic_tta.lightning.samples`); samples without a label (-1, or a batch without
``"label"``) are adapted on and predicted, and accuracy counts the labelled ones.

**DDP contract.** Lightning's predict sampler (``UnrepeatedDistributedSamplerWrapper``) does not
pad, so ranks may differ by one batch; a collective inside ``predict_step`` would deadlock. Each
rank finalizes exactly once, after its own last batch, and every collective in finalize is
decided on all-reduced values, so every rank calls the same collectives in the same order.
The global count of samples (used + skipped) must equal the dataset length (a padding
``DistributedSampler`` or ``use_distributed_sampler=False`` is detected) unless the Trainer
limits the batches (``limit_predict_batches``, ``fast_dev_run``): then Frolic adapts on the
samples seen and warns.

**Precision.** Float32 features, float64 statistics under any Trainer precision; Frolic's own
products run without autocast and in IEEE float32 (TF32 off): :mod:`frolic_tta.precision`.

**After predict**: ``head`` and ``outcome``, one frozen :class:`~.outcome.PredictOutcome` set
once at the end of finalize (a stored head: after the last batch), the contract the callbacks
read (:mod:`.outcome`). ``priors_`` (:class:`~frolic_tta.prior.Priors`), ``metrics_`` (with
labels), ``class_accuracy_``, ``class_probability_`` (Fig. 1c/d), ``samples_``, ``skipped_``,
``finalize_`` (seconds and passes per phase, :mod:`.progress`), ``adapted_`` and ``partial_``
read its fields (empty until predict ends; reset when the next predict starts).

**Re-use.** ``module(images)`` gives :math:`f_d`; with ``head_file`` or ``reuse_head=True``,
``predict`` scores with the stored head (no re-adaptation). Checkpoints: :mod:`.checkpoint`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal, cast

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from typing_extensions import override

from frolic_tta.clip.loading import check_tau_c, model_temperature
from frolic_tta.clip.prompts import (
    build_class_prompts,
    encode_prototypes,
    load_descriptions,
    resolve_templates,
)
from frolic_tta.data.indexed import check_class_names
from frolic_tta.errors import FrolicInputError
from frolic_tta.head import FrolicClassifier, FrolicHead
from frolic_tta.lightning import checkpoint as ckpt
from frolic_tta.lightning import online, samples
from frolic_tta.lightning.outcome import (
    PredictOutcome,
    RunCounts,
    evaluate_fit,
    fill_output,
    fill_outputs,
    outcome_field,
    placeholders,
    predict_loader,
)
from frolic_tta.lightning.progress import FinalizeProgress
from frolic_tta.lightning.provenance import check_provenance
from frolic_tta.lightning.store import FeatureStoreWriter, checked_sums, stored_sums, writes_store
from frolic_tta.logits import RowBuffer
from frolic_tta.metrics import FrolicMoments
from frolic_tta.options import FrolicOptions, options_from_dict
from frolic_tta.pipeline import fit_frolic
from frolic_tta.precision import full_precision


class FrolicModule(online.OnlineHooks, ckpt.CheckpointHooks, L.LightningModule):
    r"""Frolic test-time adaptation of a frozen open_clip model.

    Args:
        model_name: any name open_clip accepts: an architecture (``"ViT-B-16"``),
            ``"hf-hub:org/name"``, ``"local-dir:/path/to/folder"``, or a model-config JSON path
            (see :mod:`frolic_tta.clip.loading`).
        pretrained: open_clip tag (``"openai"``), local checkpoint path, or ``None``; ignored
            for ``hf-hub:``/``local-dir:`` names, which bring their weights.
        class_names: the K class names, in label order (a list, not one string).
        templates: ``"openai"`` (80), ``"simple"`` (7), a dataset key, or a list of ``"{}"``
            templates.
        prompts_file: CuPL-style JSON (class name -> sentences), ensembled per class.
        tau_c: zero-shot temperature :math:`\tau_c`. ``"model"`` (default): the loaded model's
            own, :math:`1/\exp(\text{logit\_scale})` (0.01 for OpenAI CLIP, the paper's value;
            SigLIP's ``logit_bias`` shifts every class alike and does not enter); a float
            overrides it. The value used is ``self.tau_c`` (``hparams["tau_c"]`` keeps the
            argument).
        options: the estimator's :class:`~frolic_tta.options.FrolicOptions` (covariance,
            shrinkage, ...; tolerances in ``options.solver``): ``--model.options.<field>``,
            ``--model.options.solver.<field>``; older checkpoints' flat dicts load too.
        ablations: with labels, score every Table 3/4 row (extra passes), else only f_d.
        return_logits: return ``(n, K)`` logits per batch. ``False`` also keeps finalize free of
            any ``(N, K)`` tensor (logits recomputed chunk by chunk; for very large K).
        reuse_head: score with the stored head instead of re-adapting (an error if there is
            none: pass ``head_file`` or predict once first).
        head_file: a run's ``head.pt`` or a checkpoint saved after predict: score with its head,
            no adaptation (implies ``reuse_head``); its class names are used if none are given.
            A checkpoint with CLIP weights brings them (``pretrained`` is not read). The head
            must have been fitted with this encoder and these prompts (:mod:`.provenance`).
        allow_head_mismatch: reuse a head fitted with another encoder or other prompts (or
            recording none) with a warning instead of an error.
        save_clip_weights: checkpoints carry the CLIP weights (self-contained) or only the head.
        max_skipped_fraction: largest share of samples that may be skipped (unreadable file or
            non-finite features) before the run stops with an error.
        text_batch_size: prompts per text-encoder forward.
        chunk_size: rows per chunk in finalize (``None``: about 2M logits per chunk).
        online: also answer each batch as it arrives (``online_*`` keys): :mod:`.online`.
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
        head_file: str | None = None,
        allow_head_mismatch: bool = False,
        save_clip_weights: bool = True,
        max_skipped_fraction: float = 0.05,
        text_batch_size: int = 256,
        chunk_size: int | None = None,
        online: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # the CLI (and load_from_checkpoint) hand over a dict; hparams keep plain values
        self.options = options if isinstance(options, FrolicOptions) else options_from_dict(options)
        self.hparams["options"] = asdict(self.options)
        fixed_tau_c = check_tau_c(tau_c)  # bad values fail before any weights load
        self.class_names = check_class_names(class_names)
        resolve_templates(templates)  # a bad key or file fails here, before any weights load
        if prompts_file is not None:
            load_descriptions(prompts_file)
        samples.check_arguments(self.hparams)  # flags are bools, the fraction in [0, 1]
        samples.check_sizes(text_batch_size, chunk_size, self.class_names)
        stored = ckpt.read_stored_head(head_file) if head_file is not None else None
        self.head: FrolicHead | None = None if stored is None else stored.head
        if stored is not None:  # matched to the given classes by name, in their order
            self.head, self.class_names, order = ckpt.head_class_names(
                stored.head, self.class_names, stored.class_names
            )
        self.reuse_head = reuse_head or head_file is not None
        self.clip, self.preprocess, self.tokenizer, self.encoder_ = ckpt.load_clip(
            model_name, pretrained, stored, save_clip_weights and ckpt.loading_checkpoint()
        )
        self.tau_c = model_temperature(self.clip) if fixed_tau_c is None else fixed_tau_c
        ckpt.check_head_dim(self.head, self.clip, model_name)
        if stored is not None:
            source, mine = f"`head_file` '{head_file}'", self.provenance(order)  # the head's order
            check_provenance(stored.provenance, mine, source, allow_mismatch=allow_head_mismatch)
        self.images_encoded = 0
        self.online_: dict[str, Any] = {}  #: online answers' summary (``OnlineAnswers`` sets it)
        self._reset()

    priors_ = outcome_field("priors")
    metrics_ = outcome_field("metrics")
    class_accuracy_ = outcome_field("class_accuracy")
    class_probability_ = outcome_field("class_probability")
    samples_ = outcome_field("samples")
    skipped_ = outcome_field("skipped")
    adapted_ = outcome_field("adapted")
    partial_ = outcome_field("partial")
    finalize_ = outcome_field("finalize")

    @property
    def outcome(self) -> PredictOutcome:
        """The last predict's :class:`~.outcome.PredictOutcome` (what callbacks read)."""
        if self._outcome is None:
            raise RuntimeError("FrolicModule has no predict outcome yet: run trainer.predict")
        return self._outcome

    def _reset(self) -> None:
        self._outcome: PredictOutcome | None = None
        self._features, self._labels = RowBuffer(), RowBuffer()  # this rank's usable rows
        self._outputs: list[dict[str, Tensor]] = []
        self.prototypes_: Tensor | None = None  #: ``(K, d)`` of this predict (online reads it)
        self._last_batch = -1
        #: The latest batch's features ``(n, d)`` (what :class:`FeatureStoreWriter` saves).
        self.batch_features: Tensor | None = None

    # ------------------------------------------------------------------ prototypes / features
    def build_prototypes(self) -> Tensor:
        """Encode class names x templates (and descriptions) into ``(K, d)`` unit prototypes."""
        if not self.class_names or len(self.class_names) < 2:
            raise FrolicInputError(
                "Expected `class_names` with at least 2 classes, but got "
                f"{self.class_names!r}; pass --model.class_names or a datamodule with class_names"
            )
        prompts = build_class_prompts(
            self.class_names, self.hparams.templates, self.hparams.prompts_file
        )
        trainer = self._trainer
        progress = bool(trainer and trainer.is_global_zero and trainer.progress_bar_callback)
        with full_precision(self.device.type):
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

    @override
    def forward(self, images: Tensor) -> Tensor:
        """``(n, K)`` logits :math:`f_d` of the adapted head for preprocessed ``images``."""
        if self.head is None:
            raise RuntimeError(
                "FrolicModule has no adapted head yet: run trainer.predict(module, data) first, "
                "or build it with head_file='outputs/<run>/head.pt'"
            )
        return self.head.score(self.encode_images(images))

    # ------------------------------------------------------------------ hooks
    @override
    def configure_callbacks(self) -> list[L.Callback]:
        """``OnlineAnswers`` if ``online``; a ``FeatureStoreWriter`` for a datamodule's store."""
        callbacks = list(super().configure_callbacks())
        if self._trainer is not None and writes_store(self._trainer.datamodule):
            callbacks.append(FeatureStoreWriter())
        return callbacks

    @override
    def on_predict_start(self) -> None:
        self._reset()
        if self.reuse_head and self.head is None:
            raise FrolicInputError(
                "Expected a stored head with `reuse_head`=True, but this module has none (a "
                "fresh process re-adapts otherwise): pass --model.head_file outputs/<run>/head.pt"
                ", or set --model.reuse_head false to adapt"
            )
        loader = predict_loader(self.trainer)
        num_batches = self.trainer.num_predict_batches[0]
        if num_batches == float("inf"):
            raise ValueError("Expected a predict dataloader with a length (map-style dataset)")
        self._dataset_length = len(loader.dataset)
        self._partial = int(num_batches) < len(loader)  # limit_predict_batches, fast_dev_run
        world = self.trainer.world_size
        expected = samples.expected_local_samples(
            self._dataset_length, world, int(num_batches), loader.batch_size
        )
        self._skipped = samples.SkippedSamples(self.hparams.max_skipped_fraction, expected)
        self._features.capacity = self._labels.capacity = expected  # allocated once
        self._last_batch = int(num_batches) - 1
        if self.reuse_head:
            return
        if self._dataset_length < world:
            raise FrolicInputError(
                f"Expected at least one sample per rank (N >= world size {world}), but the "
                f"dataset has N={self._dataset_length}"
            )
        self.prototypes_ = self.build_prototypes()
        keep = self.hparams.return_logits  # f_c / tau_c of the products, finalize's buffer
        self._stored = stored_sums(loader.dataset, self.prototypes_, self.tau_c)  # a store's
        soft = self._stored is None  # else N and sum x only, checked in finalize
        moments = FrolicMoments(self.prototypes_, self.tau_c, keep, soft, rows=expected)
        self.moments = moments.to(self.device)

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        images, index, labels, errors = samples.unpack_batch(batch)
        # stored features (frolic_tta.data.store) skip the encoder; callbacks may read them
        features = batch["features"].float() if images is None else self.encode_images(images)
        self.batch_features = features
        valid, reasons = samples.sample_validity(features, errors)
        self._skipped.add(index.detach().cpu(), reasons)
        k = self.head.prototypes.shape[0] if self.reuse_head else self.prototypes_.shape[0]
        output = placeholders(index, valid, labels, k, self.hparams.return_logits)
        mask, n = valid.to(features.device), features.shape[0]
        if self.reuse_head:
            return fill_output(output, self.head.score(features[mask]))
        with full_precision(self.device.type):
            self.moments.update(features[mask])
        self._features.append(features[mask])
        if labels is None:
            labels = torch.full((n,), -1, dtype=torch.long)
        self._labels.append(labels.detach().to(features.device)[mask])
        self._outputs.append(output)
        return output

    @override
    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if batch_idx != self._last_batch:
            return
        if self.reuse_head:  # a stored head scored every batch: nothing to fit
            head = cast(FrolicHead, self.head)
            self._outcome = PredictOutcome.stored(head, self._partial, self._skipped.records)
        elif self._outputs:
            with full_precision(self.device.type):
                self.finalize()

    # ------------------------------------------------------------------ finalize
    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over ranks: the one collective of the module and its callbacks."""
        reduced = self.trainer.strategy.reduce(tensor.to(self.device).clone(), reduce_op="sum")
        return reduced.to(tensor.device)

    def _count(self, used: Tensor) -> dict[str, int]:
        """Counts over all ranks (one all-reduce; every rank gets the same numbers)."""
        labelled = int((self._labels.rows(torch.zeros(0)) >= 0).sum())
        seen = sum(o["index"].numel() for o in self._outputs)
        local = RunCounts(len(self._skipped.records), labelled, self._partial, seen)
        counts = asdict(local.reduce(self.reduce_sum))
        return {**counts, "partial": int(counts["partial"]), "used": int(round(float(used)))}

    def finalize(self) -> None:
        r"""All-reduce, fit the head, :math:`\tau_g`, :math:`\beta`, and fill the outputs."""
        computed = self.moments.compute()  # synced over the process group
        counts = self._count(computed.count)
        samples.check_counts(counts, self._dataset_length, self._skipped)
        used = counts["used"]
        features = self._features.rows()
        hp, k = self.hparams, self.prototypes_.shape[0]  # the phases: [i/n], in order
        progress = FinalizeProgress(self.trainer, self.reduce_sum, used, k, options=self.options)
        sums = checked_sums(computed, self._stored, progress.say)  # None: fit_frolic's own
        fit = fit_frolic(
            features,
            self.prototypes_,
            self.options,
            tau_c=self.tau_c,
            sums=sums,
            reduce_fn=progress.reduce,
            keep_logits=hp.return_logits,  # else no (N, K) tensor: rescored batch by batch
            chunk_size=hp.chunk_size,
            progress=progress,
            zero_shot_logits=self.moments.zero_shot_logits(),
        )
        self.head, finalize = fit.head, progress.finish(fit.head.tau_g, fit.priors)
        probability = fill_outputs(
            self._outputs, fit.logits, fit.head, features, self.reduce_sum, computed.count.cpu()
        )
        metrics: dict[str, float] = {}
        class_accuracy: dict[str, Tensor] = {}
        if counts["labelled"]:
            if counts["labelled"] < used:
                rank_zero_warn(
                    f"{used - counts['labelled']} of the {used} usable samples carry no label: "
                    f"accuracy is computed on the {counts['labelled']} that do"
                )
            labels, rows = self._labels.rows(), None if hp.ablations else ["f_d"]
            args = (self.options, self.reduce_sum, hp.chunk_size, rows)
            metrics, class_accuracy = evaluate_fit(fit, features, labels, counts["labelled"], *args)
            if self.trainer.logger is not None:
                self.trainer.logger.log_metrics(metrics, step=0)
        self._features, self._labels = RowBuffer(), RowBuffer()
        self._outcome = PredictOutcome(
            head=fit.head,
            priors=fit.priors,
            adapted=True,
            partial=bool(counts["partial"]),
            samples={"dataset_length": self._dataset_length, "used": used, **counts},
            skipped=self._skipped.records,
            metrics=metrics,
            class_accuracy=class_accuracy,
            class_probability=probability,
            finalize=finalize,
            moments=computed if self._stored is None else None,
            moments_from_store=sums is not None and sums is not computed,
        )

    # ------------------------------------------------------------------ re-use
    def adapted_classifier(self) -> FrolicClassifier:
        r"""The adapted classifier :math:`f_d(x) = A (x - \mu) + c` on normalised features, a
        :class:`~frolic_tta.head.FrolicClassifier` (``self.head.to_linear()``: an ``nn.Linear``)."""
        if self.head is None:
            raise RuntimeError("FrolicModule has not been adapted yet: run trainer.predict first")
        return self.head.to_module()
