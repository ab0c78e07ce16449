r"""FrolicModule: Frolic on a frozen open_clip model inside ``trainer.predict``.

The module is a frozen open_clip model, its prompts, and the callback every Frolic adaptation
goes through, :class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` (``self.adaptation``,
registered by :meth:`FrolicModule.configure_callbacks`):

1. *Encode* (``predict_step``, once per batch): the image encoder runs once per image and the
   step returns the L2-normalised features (``{"features": (n, d)}``; a batch of stored
   features, :mod:`frolic_tta.data.store`, skips the encoder).
2. *Adapt* (the callback): the features are added to the float64 moment sums and cached on the
   rank, the output becomes CPU placeholders (``logits`` NaN, ``prediction`` -1, ``index``,
   ``valid``, ``target``); after the rank's last batch the sums are all-reduced, the head,
   the test prior, :math:`\tau_g` and :math:`\beta` are fitted and the placeholders filled
   **in place**, so ``trainer.predict`` returns, and an *epoch*-interval prediction writer
   writes, the final values. Its DDP contract (uneven ranks, one finalize per rank, the same
   collectives in the same order), the bad-sample policy (:mod:`.samples`) and the checks are
   the callback's.

**Precision.** Float32 features, float64 statistics under any Trainer precision; Frolic's own
products run without autocast and in IEEE float32 (TF32 off): :mod:`frolic_tta.precision`.

**After predict**: ``head`` and ``outcome`` (the callback's frozen
:class:`~.outcome.PredictOutcome`); ``priors_``, ``metrics_``, ``class_accuracy_``,
``class_probability_``, ``samples_``, ``skipped_``, ``finalize_``, ``adapted_`` and
``partial_`` read its fields (empty until predict ends; reset when the next predict starts).

**Re-use.** ``module(images)`` gives :math:`f_d`; with ``head_file`` or ``reuse_head=True``,
``predict`` scores with the stored head (no re-adaptation). Checkpoints: :mod:`.checkpoint`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Literal

import lightning as L
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
from frolic_tta.lightning import samples
from frolic_tta.lightning.adaptation import FrolicAdaptation
from frolic_tta.lightning.online import OnlineAnswers
from frolic_tta.lightning.outcome import ModelDescription, PredictOutcome, outcome_field
from frolic_tta.lightning.provenance import check_provenance
from frolic_tta.lightning.store import FeatureStoreWriter, writes_store
from frolic_tta.metrics import FrolicMoments
from frolic_tta.options import FrolicOptions, options_from_dict
from frolic_tta.precision import full_precision


def encoded_prototypes(module: FrolicModule) -> Tensor:
    """The adaptation's prototypes of a :class:`FrolicModule`: its prompts, text-encoded."""
    return module.build_prototypes()

class FrolicModule(ckpt.CheckpointHooks, L.LightningModule):
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
        options = options if isinstance(options, FrolicOptions) else options_from_dict(options)
        self.hparams["options"] = asdict(options)
        fixed_tau_c = check_tau_c(tau_c)  # bad values fail before any weights load
        self.class_names = check_class_names(class_names)
        resolve_templates(templates)  # a bad key or file fails here, before any weights load
        if prompts_file is not None:
            load_descriptions(prompts_file)
        samples.check_arguments(self.hparams)  # flags are bools, the fraction in [0, 1]
        samples.check_sizes(text_batch_size, chunk_size, self.class_names)
        stored = ckpt.read_stored_head(head_file) if head_file is not None else None
        if stored is not None:  # matched to the given classes by name, in their order
            head, self.class_names, order = ckpt.head_class_names(
                stored.head, self.class_names, stored.class_names
            )
        #: The callback that adapts (registered by :meth:`configure_callbacks`).
        self.adaptation = FrolicAdaptation(
            encoded_prototypes,
            tau_c="module",
            options=options,
            class_names=self.class_names,
            ablations=ablations,
            return_logits=return_logits,
            normalize=False,  # encode_images and the feature store give unit features
            max_skipped_fraction=max_skipped_fraction,
            chunk_size=chunk_size,
        )
        self.head = None if stored is None else head
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
        self._online: OnlineAnswers | None = None  # (configure_callbacks, if ``online``)

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
        if self.adaptation.last_outcome is None:
            raise RuntimeError("FrolicModule has no predict outcome yet: run trainer.predict")
        return self.adaptation.last_outcome

    @property
    def options(self) -> FrolicOptions:
        """The estimator's options (the adaptation's)."""
        return self.adaptation.options

    @options.setter
    def options(self, options: FrolicOptions) -> None:
        self.adaptation.options = options

    @property
    def head(self) -> FrolicHead | None:
        """The adapted head (after predict), or the stored one (``head_file``)."""
        return self.adaptation.head

    @head.setter
    def head(self, head: FrolicHead | None) -> None:
        self.adaptation.head = head

    @property
    def reuse_head(self) -> bool:
        """Score with the stored head instead of adapting."""
        return self.adaptation.reuse_head

    @reuse_head.setter
    def reuse_head(self, reuse: bool) -> None:
        self.adaptation.reuse_head = bool(reuse)

    @property
    def prototypes_(self) -> Tensor | None:
        """``(K, d)`` this predict's prototypes (the adaptation's)."""
        return self.adaptation.prototypes_

    @property
    def batch_features(self) -> Tensor | None:
        """The latest batch's features ``(n, d)`` (the adaptation's)."""
        return self.adaptation.batch_features

    @property
    def moments(self) -> FrolicMoments | None:
        """This predict's float64 moment sums (the adaptation's)."""
        return self.adaptation.moments

    @property
    def online_(self) -> dict[str, Any]:
        """The online answers' summary (``online=True``; else empty)."""
        return {} if self._online is None else self._online.summary

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over ranks (the adaptation's one collective)."""
        return self.adaptation.reduce_sum(tensor)

    def describe_model(self) -> ModelDescription:
        """What the report says about the model (:class:`~.outcome.DescribesModel`)."""
        hp = self.hparams
        brings_weights = str(hp.model_name).startswith(("hf-hub:", "local-dir:"))
        pretrained = None if brings_weights else hp.pretrained
        return ModelDescription(hp.model_name, pretrained, self.provenance(), self.images_encoded)

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
        """The adaptation; ``OnlineAnswers`` if ``online``; a ``FeatureStoreWriter`` for a
        datamodule's feature store."""
        callbacks: list[L.Callback] = [self.adaptation]
        if self.hparams.get("online", False):
            self._online = self._online or OnlineAnswers()
            callbacks.append(self._online)
        if self._trainer is not None and writes_store(self._trainer.datamodule):
            callbacks.append(FeatureStoreWriter())
        return callbacks

    @override
    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Tensor]:
        """``{"features": (n, d)}``: the batch's unit features (the adaptation reads the rest
        of the batch: ``index``, ``label``, ``error``)."""
        images, _, _, _ = samples.unpack_batch(batch)
        # stored features (frolic_tta.data.store) skip the encoder
        features = batch["features"].float() if images is None else self.encode_images(images)
        return {"features": features}

    # ------------------------------------------------------------------ re-use
    def adapted_classifier(self) -> FrolicClassifier:
        r"""The adapted classifier :math:`f_d(x) = A (x - \mu) + c` on normalised features, a
        :class:`~frolic_tta.head.FrolicClassifier` (``self.head.to_linear()``: an ``nn.Linear``)."""
        if self.head is None:
            raise RuntimeError("FrolicModule has not been adapted yet: run trainer.predict first")
        return self.head.to_module()
