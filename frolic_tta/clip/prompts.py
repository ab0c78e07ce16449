"""Class prompts and CLIP text prototypes (prompt ensembling).

Templates are ``str.format``-style strings with one ``"{}"`` for the class name. Descriptions are
CuPL-style JSON files mapping a class name to sentences that describe it.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES, SIMPLE_IMAGENET_TEMPLATES

from frolic_tta.data.datasets import canonical_dataset_name
from frolic_tta.errors import warn
from frolic_tta.progress import progress as progress_bar

__all__ = [
    "DATASET_TEMPLATES",
    "build_class_prompts",
    "check_descriptions",
    "encode_prototypes",
    "load_descriptions",
    "lookup_descriptions",
    "resolve_templates",
]

Templates = str | Sequence[str | Callable[[str], str]]

_IMAGENET_LIKE = ("imagenet", "imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r")
with Path(__file__).with_name("templates.json").open(encoding="utf-8") as _file:
    _TEMPLATES = json.load(_file)["templates"]
#: CLIP's per-dataset prompt templates ("{}" marks the class name). ImageNet and its variants
#: (and ObjectNet) use the 80 templates of CLIP's ImageNet prompt-engineering notebook.
DATASET_TEMPLATES: dict[str, list[str]] = {
    **{key: list(value) for key, value in _TEMPLATES.items()},
    **{k: [t("{}") for t in OPENAI_IMAGENET_TEMPLATES] for k in (*_IMAGENET_LIKE, "objectnet")},
}


def _as_format_string(template: str | Callable[[str], str]) -> str:
    """Return the template as a "{}"-format string (open_clip's are ``lambda c: f"..."``)."""
    text = template("{}") if callable(template) else template
    if not isinstance(text, str) or "{}" not in text:
        raise ValueError(
            f"each template must be a string containing '{{}}' for the class name, got {text!r}"
        )
    return text


def resolve_templates(templates: Templates) -> list[str]:
    """Resolve a template specification into a list of "{}"-format strings.

    Args:
        templates: ``"openai"`` (open_clip's 80 ImageNet templates), ``"simple"`` (its 7 simple
            ones), a dataset key such as ``"dtd"`` (CLIP's templates for that dataset, see
            ``frolic_tta.clip.DATASET_TEMPLATES``), a single string containing ``"{}"``, or a
            sequence of such strings (or of open_clip-style callables).

    Returns:
        A new list of template strings.

    Raises:
        ValueError: Anything else, or a template without ``"{}"``.
    """
    if isinstance(templates, str):
        key = templates.strip().lower()
        if key == "openai":
            return [_as_format_string(t) for t in OPENAI_IMAGENET_TEMPLATES]
        if key == "simple":
            return [_as_format_string(t) for t in SIMPLE_IMAGENET_TEMPLATES]
        dataset = canonical_dataset_name(key, strict=False)
        if dataset is not None and dataset in DATASET_TEMPLATES:
            return list(DATASET_TEMPLATES[dataset])
        if "{}" in templates:
            return [templates]
        raise ValueError(
            f"templates must be 'openai', 'simple', a dataset key ({sorted(DATASET_TEMPLATES)}) "
            f"or a list of strings containing '{{}}'; got {templates!r}"
        )
    if not isinstance(templates, Sequence) or len(templates) == 0:
        raise ValueError(
            f"templates must be a name or a non-empty list of strings containing '{{}}'; "
            f"got {templates!r}"
        )
    return [_as_format_string(t) for t in templates]


def _normalise_name(name: str) -> str:
    return re.sub(r"[\s_]+", " ", name.strip().lower())


def _word_set(name: str) -> str:
    """Lower-case words in sorted order: ``"AM General Hummer SUV 2000"`` and ``"2000 AM
    General Hummer SUV"`` (torchvision's and CoOp's Stanford Cars names), ``"apartment
    building outdoor"`` and ``"outdoor apartment building"`` (SUN397) become equal."""
    return " ".join(sorted(re.findall(r"[a-z0-9]+", name.lower())))


def check_descriptions(content: Any, source: str) -> dict[str, list[str]]:
    """Check parsed CuPL-style descriptions: a non-empty ``{class name: [sentence, ...]}``.

    Args:
        content: The parsed JSON.
        source: Where it came from, for messages (``"descriptions file 'x.json'"``).

    Raises:
        ValueError: Not a JSON object of non-empty lists of non-empty strings.
    """
    if not isinstance(content, dict) or not content:
        raise ValueError(
            f"{source} must hold a non-empty JSON object {{class name: [sentences]}}, "
            f"got {type(content).__name__}"
        )
    for name, sentences in content.items():
        if (
            not isinstance(sentences, list)
            or not sentences
            or not all(isinstance(s, str) and s.strip() for s in sentences)
        ):
            raise ValueError(
                f"{source}, class {name!r}: expected a non-empty list of "
                f"non-empty strings, got {sentences!r:.80}"
            )
    return {str(k): list(v) for k, v in content.items()}


def load_descriptions(path: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Load CuPL-style class descriptions: a JSON object ``{class name: [sentence, ...]}``.

    Raises:
        FileNotFoundError: No such file.
        ValueError: Not a JSON object of non-empty lists of non-empty strings.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"descriptions file not found: '{file}' (the paper's descriptions: "
            f"python -m frolic_tta.clip.descriptions fetch --out {file.parent})"
        )
    with file.open(encoding="utf-8") as f:
        try:
            content = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"descriptions file '{file}' is not valid JSON: {exc}") from None
    return check_descriptions(content, f"descriptions file '{file}'")


def lookup_descriptions(descriptions: Mapping[str, Sequence[str]], name: str) -> list[str] | None:
    """The sentences of class ``name``, or ``None``.

    The exact key first, then a case/underscore-insensitive match, then a match of the same
    words in any order (each only if unambiguous).
    """
    if name in descriptions:
        return list(descriptions[name])
    for normalise in (_normalise_name, _word_set):
        target = normalise(name)
        hits = [k for k in descriptions if normalise(k) == target]
        if hits:
            return list(descriptions[hits[0]]) if len(hits) == 1 else None
    return None


def build_class_prompts(
    class_names: Sequence[str],
    templates: Templates | None = None,
    descriptions: Mapping[str, Sequence[str]] | str | os.PathLike[str] | None = None,
) -> list[list[str]]:
    """Build the prompts of each class, by class index.

    Duplicate class names are kept as separate classes (``K == len(class_names)``) and reported
    with a ``UserWarning``. With ``descriptions``, a class gets its sentences, followed by its
    template prompts when ``templates`` is also given; a class missing from the descriptions
    falls back to the templates.

    Args:
        class_names: The ``K`` class names.
        templates: Anything :func:`resolve_templates` accepts.
        descriptions: A mapping ``{class name: [sentences]}`` or a path to a CuPL JSON file.

    Returns:
        ``K`` non-empty lists of prompts.

    Raises:
        ValueError: No class names, an empty name, or a class with neither descriptions nor
            templates.
    """
    if isinstance(class_names, str) or len(class_names) == 0:
        raise ValueError(f"class_names must be a non-empty list of strings, got {class_names!r}")
    names = [str(c) for c in class_names]
    empty = [i for i, c in enumerate(names) if not c.strip()]
    if empty:
        raise ValueError(f"class names must be non-empty strings; empty at indices {empty[:10]}")
    duplicates = sorted(c for c, n in Counter(names).items() if n > 1)
    if duplicates:
        warn(
            f"duplicate class names {duplicates} are kept as separate classes "
            f"(K={len(names)}); their prototypes will be identical",
        )
    if templates is None and descriptions is None:
        raise ValueError("build_class_prompts needs templates or descriptions; got neither")
    resolved = resolve_templates(templates) if templates is not None else []
    if isinstance(descriptions, str | os.PathLike):
        descriptions = load_descriptions(descriptions)
    prompts: list[list[str]] = []
    missing: list[str] = []
    for name in names:
        described = lookup_descriptions(descriptions, name) if descriptions is not None else None
        from_templates = [t.replace("{}", name) for t in resolved]
        class_prompts = (described or []) + from_templates
        if not class_prompts:
            missing.append(name)
        prompts.append(class_prompts)
    if missing:
        raise ValueError(
            f"no descriptions and no templates for {len(missing)} class(es), e.g. {missing[:5]}; "
            f"expected every class in the descriptions or templates to fall back to"
        )
    return prompts


@torch.no_grad()
def encode_prototypes(
    model: Any,
    tokenizer: Callable[[list[str]], torch.Tensor],
    class_prompts: Sequence[Sequence[str]],
    *,
    batch_size: int = 256,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Encode class prompts into CLIP text prototypes (CLIP's prompt ensembling).

    Each prompt embedding is L2-normalised, the embeddings of a class are averaged, and the mean
    is L2-normalised again (open_clip's ``build_zero_shot_classifier``). Prompts go through the
    text encoder ``batch_size`` at a time whatever class they belong to (classes may have
    different numbers of prompts, e.g. with descriptions); each batch is added to its classes'
    sums, so memory stays ``(K, d)``.

    Args:
        model: An open_clip model (anything with ``encode_text(tokens)``).
        tokenizer: ``open_clip.get_tokenizer(...)``: a list of strings -> token tensor.
        class_prompts: ``K`` non-empty lists of prompts (see :func:`build_class_prompts`).
        batch_size: Prompts encoded per forward pass.
        device: Where to run and return; default: the model's device.
        progress: Show progress over the prompts (e.g. on rank 0 only): a tqdm bar at a
            terminal, a few plain lines in a log file.

    Returns:
        ``(K, d)`` float32 unit-norm prototypes on ``device``.

    Raises:
        ValueError: No classes, a class without prompts, or ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if len(class_prompts) == 0:
        raise ValueError("class_prompts must hold at least one class, got none")
    counts = [len(p) for p in class_prompts]
    empty = [i for i, n in enumerate(counts) if n == 0]
    if empty:
        raise ValueError(f"every class needs at least one prompt; classes {empty[:10]} have none")
    if device is None:
        param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
        device = param.device if param is not None else torch.device("cpu")
    device = torch.device(device)
    flat = [str(p) for prompts in class_prompts for p in prompts]
    owner = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    # (K, d) per class, the sum of its unit prompt embeddings, on the CPU: index_add_ adds the
    # rows in order there (CUDA's adds atomically), so every rank of a DDP run gets the same bits
    sums: torch.Tensor | None = None

    was_training = getattr(model, "training", False)
    if hasattr(model, "eval"):
        model.eval()
    bar = progress_bar(len(flat), "Encoding prompts", "prompt", enabled=progress)
    try:
        for start in range(0, len(flat), batch_size):
            tokens = tokenizer(flat[start : start + batch_size]).to(device)
            embeddings = F.normalize(model.encode_text(tokens).float(), dim=-1)
            if sums is None:
                sums = torch.zeros(len(counts), embeddings.shape[1], dtype=torch.float32)
            rows = owner[start : start + embeddings.shape[0]]
            sums.index_add_(0, rows, embeddings.cpu())
            bar.update(embeddings.shape[0])
    finally:
        bar.close()
        if was_training and hasattr(model, "train"):
            model.train()
    means = sums / torch.tensor(counts, dtype=torch.float32)[:, None]
    return F.normalize(means, dim=-1).to(device=device, dtype=torch.float32)
