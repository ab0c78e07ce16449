r"""Online answers: every predict batch answered as it arrives (:mod:`frolic_tta.online`).

:class:`OnlineAnswers` is a callback beside
:class:`~frolic_tta.lightning.adaptation.FrolicAdaptation` (``FrolicModule(online=True)``
attaches it itself; with a module of your own, add both to the Trainer), so the transductive
predict is unchanged and its end-of-stream state (head, :math:`\tau_g`, priors, metrics, the
final ``prediction``) is the adaptation's. The adaptation hands it each batch it has read
(:class:`~frolic_tta.lightning.adaptation.AdaptationListener`), before finalizing; it gives the
batch's usable features (the tensor the adaptation cached, no copy) to an
:class:`~frolic_tta.online.OnlineFrolic` and writes into the batch's output dict, before
anything else reads it:

* ``online_prediction``, ``online_confidence``: the answer given now (-1 / NaN for skipped
  samples), from the latest refit's :math:`f_d` or zero-shot before the first refit;
* ``online_step`` (arrival: the step number, the same on every rank), ``online_refit`` (0:
  zero-shot), ``online_seen`` (samples seen over all ranks when it was answered) and
  ``online_fallback`` (answered zero-shot after a refit: its zero-shot class was thin there);
* ``zero_shot_prediction``: argmax :math:`f_c` (the reference).

A batch-interval writer sees these at once; ``prediction``, ``logits`` and ``confidence`` are
filled after the rank's last batch with the transductive fit (the final pass re-scoring
everything). **DDP:** each step all-reduces one float64 (this rank's usable samples); a rank
with fewer batches (Lightning's predict sampler does not pad) takes empty steps after its last
batch, before the adaptation finalizes, so every rank calls the same collectives; a refit
all-reduces the running moment sums and runs :func:`~frolic_tta.pipeline.fit_frolic` through
``trainer.strategy``. ``summary`` (``FrolicModule.online_``) holds the refits and, with labels,
the online, zero-shot and end-of-stream accuracies over all ranks.
"""

from __future__ import annotations

import csv
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning as L
import torch
from matplotlib.figure import Figure
from torch import Tensor
from typing_extensions import override

from frolic_tta.errors import FrolicInputError
from frolic_tta.lightning.adaptation import AdaptationListener, FrolicAdaptation, find_adaptation
from frolic_tta.lightning.batch import FrolicBatch
from frolic_tta.online import OnlineFrolic
from frolic_tta.precision import full_precision

ONLINE_KEYS = (
    "online_prediction",
    "online_confidence",
    "online_step",
    "online_refit",
    "online_seen",
    "online_fallback",
    "zero_shot_prediction",
)
"""Per-sample keys the callback adds to each batch's output."""


class OnlineAnswers(AdaptationListener, L.Callback):
    """Answers each predict batch online, beside a ``FrolicAdaptation`` (see module)."""

    def __init__(self) -> None:
        self.online: OnlineFrolic | None = None
        self.steps = 0
        self.outputs: list[dict[str, Tensor]] = []  # the batches' outputs, filled at the end
        #: The refits and, with labels, the accuracies over all ranks (after predict).
        self.summary: dict[str, Any] = {}
        self._adaptation: FrolicAdaptation | None = None

    @override
    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._adaptation = adaptation = find_adaptation(trainer)
        if adaptation.reuse_head:
            raise FrolicInputError(
                "Expected `online`=False with a stored head (head_file or reuse_head): a stored "
                "head is not adapted, so there is nothing to answer online"
            )
        local = torch.tensor(float(trainer.num_predict_batches[0]), device=pl_module.device)
        self.steps = int(trainer.strategy.reduce(local, reduce_op="max").item())
        self.online = None
        self.outputs = []
        self.summary = {}

    @override
    def on_adaptation_batch(
        self, trainer: L.Trainer, adaptation: FrolicAdaptation, batch: FrolicBatch
    ) -> None:
        if self.online is None:
            self.online = OnlineFrolic(
                adaptation.prototypes_,
                adaptation.options,
                tau_c=adaptation.tau_c_,
                reduce_fn=adaptation.reduce_sum,
                chunk_size=adaptation.chunk_size,
            )
        outputs = batch.output
        self.outputs.append(outputs)  # the adaptation fills its end-of-stream predictions later
        features = batch.features
        with full_precision(features.device.type):
            answer = self.online.step(features[batch.valid.to(features.device)])
            fill(outputs, answer.logits, answer.zero_shot, answer.fallback)
            outputs.update(
                {
                    key: torch.full_like(outputs["index"], value)
                    for key, value in (
                        ("online_step", answer.step),
                        ("online_refit", answer.refit),
                        ("online_seen", answer.seen),
                    )
                }
            )
            if batch.last:
                self.online.pad_to(self.steps)  # no rank leaves a collective waiting

    @override
    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.online is None or self._adaptation is None:
            return
        outputs = self.outputs
        counts = torch.zeros(4, dtype=torch.float64)
        for output in outputs:
            target = output.get("target")
            if target is None:
                continue
            scored = output["valid"] & (target >= 0)
            counts[0] += int(scored.sum())
            for i, key in enumerate(("online_prediction", "zero_shot_prediction", "prediction")):
                counts[i + 1] += int((output[key][scored] == target[scored]).sum())
        counts = self._adaptation.reduce_sum(counts)
        labelled = int(counts[0])
        self.summary = {
            "steps": self.online.steps,
            "seen": self.online.seen,
            "refits": [asdict(r) for r in self.online.history],
            "labelled": labelled,
        }
        if labelled:
            names = ("online", "zero_shot", "end_of_stream")
            self.summary["accuracy"] = {
                n: float(c) / labelled for n, c in zip(names, counts[1:], strict=True)
            }


def find_online(trainer: L.Trainer) -> OnlineAnswers | None:
    """The Trainer's :class:`OnlineAnswers`, if any."""
    found = [c for c in trainer.callbacks if isinstance(c, OnlineAnswers)]  # type: ignore[attr-defined]
    return found[0] if found else None


def fill(output: dict[str, Tensor], logits: Tensor, zero_shot: Tensor, fallback: Tensor) -> None:
    """Write the online answer ``logits`` ``(n_valid, K)``, the zero-shot prediction and the
    zero-shot fallback flag of the valid rows into ``output`` (-1 / NaN / False when skipped)."""
    valid = output["valid"]
    n = valid.shape[0]
    confidence, prediction = torch.softmax(logits.float(), dim=1).max(1)
    output["online_prediction"] = torch.full((n,), -1, dtype=torch.long)
    output["online_confidence"] = torch.full((n,), float("nan"), dtype=torch.float32)
    output["zero_shot_prediction"] = torch.full((n,), -1, dtype=torch.long)
    output["online_prediction"][valid] = prediction.cpu()
    output["online_confidence"][valid] = confidence.cpu()
    output["zero_shot_prediction"][valid] = zero_shot.argmax(1).cpu()
    output["online_fallback"] = torch.zeros(n, dtype=torch.bool)
    output["online_fallback"][valid] = fallback.cpu()


def arrival_order(joined: dict[str, Any]) -> Tensor:
    """Indices of the joined predictions in arrival order (by step, then dataset index)."""
    index = joined["index"]
    key = joined["online_step"].long() * (int(index.max()) + 1) + index.long()
    return torch.argsort(key)


def online_summary(joined: dict[str, Any], answers: OnlineAnswers | None) -> dict[str, Any]:
    """The ``online`` section of ``metrics.json``: refits, and with labels the accuracy of the
    answers as they were made, of zero-shot and of the end-of-stream re-scoring (exact ratios
    over the labelled usable samples)."""
    summary = {} if answers is None else dict(answers.summary)
    target = joined.get("target")
    if target is None:
        return summary
    scored = joined["valid"] & (target >= 0)
    if not bool(scored.any()):
        return summary
    keys = {"online": "online_prediction", "zero_shot": "zero_shot_prediction"}
    keys["end_of_stream"] = "prediction"
    summary["accuracy"] = {
        name: float((joined[key][scored] == target[scored]).double().mean())
        for name, key in keys.items()
    }
    return summary


def plot_online(joined: dict[str, Any], output_dir: str | Path, title: str = "") -> Path | None:
    """``online_accuracy.png``: cumulative accuracy of the online answers against samples seen,
    with zero-shot and the end-of-stream (transductive) re-scoring as curves over the same
    order and their whole-stream accuracies as reference lines. ``None`` without labels."""
    order = arrival_order(joined)
    target = joined.get("target")
    if target is None:
        return None
    target = target[order]
    scored = joined["valid"][order] & (target >= 0)
    if not bool(scored.any()):
        return None
    seen = torch.cumsum(scored.double(), 0)[scored]
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    styles = {
        "online (as answered)": ("online_prediction", {"color": "C0", "lw": 2}),
        "zero-shot": ("zero_shot_prediction", {"color": "C1", "ls": "--"}),
        "transductive (end of stream)": ("prediction", {"color": "C2", "ls": ":"}),
    }
    for label, (key, style) in styles.items():
        correct = (joined[key][order] == target)[scored].double()
        ax.plot(seen, torch.cumsum(correct, 0) / seen, label=label, **style)
        if key != "online_prediction":
            ax.axhline(float(correct.mean()), color=style["color"], lw=0.8, alpha=0.6)
    refits = joined["online_refit"][order][scored]
    for at in torch.nonzero(refits[1:] != refits[:-1]).flatten().tolist():
        ax.axvline(float(seen[at + 1]), color="grey", lw=0.5, alpha=0.4)
    ax.set_xlabel("labelled samples answered (arrival order); grey: a refit")
    ax.set_ylabel("cumulative top-1 accuracy")
    ax.set_title(f"{title}: online Frolic" if title else "online Frolic")
    ax.legend(loc="lower right")
    path = Path(output_dir) / "online_accuracy.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def write_online_csv(path: Path, joined: dict[str, Any], names: list[str]) -> None:
    """``online.csv``: one row per sample in arrival order: ``step, index, online_prediction,
    online_confidence, refit, seen, fallback, zero_shot_prediction, final_prediction[, target]``
    (class names; empty for a skipped sample)."""
    has_target = "target" in joined
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        header = ["step", "index", "online_prediction", "online_confidence", "refit", "seen"]
        header += ["fallback"]
        header += ["zero_shot_prediction", "final_prediction"]
        writer.writerow(header + (["target"] if has_target else []))
        for i in arrival_order(joined).tolist():
            ok = bool(joined["valid"][i])

            def name(key: str, i: int = i, ok: bool = ok) -> str:
                value = int(joined[key][i])
                return names[value] if ok and value >= 0 else ""

            row = [int(joined["online_step"][i]), int(joined["index"][i])]
            confidence = f"{float(joined['online_confidence'][i]):.6f}" if ok else ""
            row += [name("online_prediction"), confidence]
            row += [int(joined["online_refit"][i]), int(joined["online_seen"][i])]
            row += [int(joined["online_fallback"][i])]
            row += [name("zero_shot_prediction"), name("prediction")]
            writer.writerow(row + ([name("target")] if has_target else []))
