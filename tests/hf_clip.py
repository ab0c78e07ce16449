"""A user's own LightningModule around a Hugging Face ``transformers`` CLIPModel (a tiny config,
random weights: no download), adapted by adding ``FrolicAdaptation``. Also a script, for a DDP
run in a subprocess:

    python tests/hf_clip.py DEVICES N OUT_DIR

writes ``FrolicReport``'s files (``OUT_DIR/report``) and, on rank 0, ``OUT_DIR/summary.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import CLIPConfig, CLIPModel, PreTrainedTokenizerFast  # noqa: E402

from frolic_tta import FrolicAdaptation, FrolicReport  # noqa: E402
from frolic_tta.lightning.entry import close_process_group  # noqa: E402

CLASS_NAMES = ["apple", "boat", "cloud", "dog"]
TEMPLATES = ["a photo of a {}.", "a drawing of a {}."]
SPECIAL = ["[BOS]", "[EOS]", "[PAD]", "[UNK]"]  # ids 0..3: CLIP pools the text at [EOS]


def tiny_clip(seed: int = 0) -> CLIPModel:
    """A CLIPModel from a tiny config with seeded random weights (eval mode)."""
    config = CLIPConfig(
        text_config={"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2,
                     "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 1,
                     "pad_token_id": 2},
        vision_config={"image_size": 32, "patch_size": 8, "hidden_size": 32,
                       "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
        projection_dim=24,
    )  # fmt: skip
    torch.manual_seed(seed)
    return CLIPModel(config).eval()


def word_tokenizer(prompts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the prompts' words (the real one: CLIPTokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = sorted({w for prompt in prompts for w in prompt.split()})
    vocab = {token: i for i, token in enumerate([*SPECIAL, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", 0), ("[EOS]", 1)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]")


def embeddings(output: Tensor | object) -> Tensor:
    """``get_*_features``' embeddings: a tensor (transformers 4) or ``pooler_output`` (5)."""
    return output if isinstance(output, Tensor) else output.pooler_output  # type: ignore[attr-defined]


class ClipZeroShot(L.LightningModule):
    """A team's zero-shot classifier: their CLIPModel, their prompts, their predict_step."""

    def __init__(self, model: CLIPModel, class_names: list[str], templates: list[str]) -> None:
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.class_names, self.templates = class_names, templates
        self.prompts = [t.format(c) for c in class_names for t in templates]
        self.tokenizer = word_tokenizer(self.prompts)
        self.tau_c = 1.0 / float(model.logit_scale.exp())  # CLIP's zero-shot temperature

    def text_prototypes(self) -> Tensor:
        """``(K, d)``: each class's prompts encoded, normalised and averaged."""
        tokens = self.tokenizer(self.prompts, padding=True, return_tensors="pt").to(self.device)
        with torch.no_grad():
            text = embeddings(self.model.get_text_features(**tokens))
        text = F.normalize(text, dim=-1).view(len(self.class_names), len(self.templates), -1)
        return F.normalize(text.mean(1), dim=-1)

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        features = embeddings(self.model.get_image_features(pixel_values=batch["image"]))
        return {"features": features}  # the one change: return the image features


class Pictures(Dataset):
    """``n`` items ``{"image" (3, 32, 32), "index", "label"}``: a colour per class, noise."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.arange(n) % len(CLASS_NAMES)
        colours = torch.rand(len(CLASS_NAMES), 3, 1, 1, generator=g)
        self.images = colours[self.labels] + 0.3 * torch.randn(n, 3, 32, 32, generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, object]:
        return {"image": self.images[i], "index": i, "label": int(self.labels[i])}


def adaptation(**kwargs: object) -> FrolicAdaptation:
    """The callback a user adds: prototypes from the module's text tower, its tau_c."""
    defaults = {"prototypes": ClipZeroShot.text_prototypes, "tau_c": "module",
                "class_names": CLASS_NAMES}  # fmt: skip
    return FrolicAdaptation(**{**defaults, **kwargs})  # type: ignore[arg-type]


def main() -> None:
    devices, n, out_dir = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    module = ClipZeroShot(tiny_clip(), CLASS_NAMES, TEMPLATES)
    frolic = adaptation(rows=["f_c", "f_g"])
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
        logger=False, enable_progress_bar=False, enable_checkpointing=False,
        callbacks=[frolic, FrolicReport(str(out_dir / "report"), print_table=False)],
    )  # fmt: skip
    trainer.predict(module, DataLoader(Pictures(n), batch_size=1), return_predictions=False)
    if trainer.global_rank == 0:
        outcome = frolic.outcome
        summary = {"tau_c": frolic.tau_c_, "prototypes": frolic.prototypes_.cpu(),
                   "samples": outcome.samples, "metrics": outcome.metrics}  # fmt: skip
        torch.save(summary, out_dir / "summary.pt")
    close_process_group()  # as train.py does: else a rank can abort at exit (SIGABRT)


if __name__ == "__main__":
    main()
