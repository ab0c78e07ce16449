"""Behaviour kept through a restructuring: logits and metrics equal to values saved before it.

``tests/data/unchanged.pt`` holds what the code gave at the commit before issue 18's
restructuring (the module, its callbacks, the packed sums, the prompts): the module's logits,
every Table 3/4 row's logits (40 samples) and metrics (all 600) on a 20-class long-tailed
world, and the prototypes encoded with prompt batches that straddle classes. Regenerate only
on purpose:
``FROLIC_SAVE_UNCHANGED=1 python -m pytest tests/test_unchanged.py`` (then say why in the
commit). The file records the torch version it was saved with: under another torch build the
tiny encoder's float32 kernels differ (measured: 3e-5 of the logits' scale from torch 2.13 to
2.14), and so do they with another thread count (1 against 2), so there the values are
compared to 1e-4 of their scale instead of 1e-6. They were saved under Eq. 12's plain sum, the
default before issue 15's pooled fusion, so they are computed with ``fusion="matched"``
(:data:`SAVED_OPTIONS`): the file guards the restructuring, not the choice of default.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import frolic_tta
from frolic_tta.clip.prompts import build_class_prompts, encode_prototypes
from frolic_tta.metrics import evaluate_rows
from frolic_tta.options import FrolicOptions
from frolic_tta.rows import RowContext, build_rows
from tests.test_module import CLASS_NAMES, loader, make_module, make_trainer
from tests.worlds import long_tailed_world

SAVED = Path(__file__).parent / "data" / "unchanged.pt"
TEMPLATES = ["a photo of a {}.", "a drawing of a {}.", "a {} in the wild."]
SAVED_OPTIONS = FrolicOptions(fusion="matched")
"""The options the saved values were computed with (the defaults of their day)."""


def current(tiny_clip, tiny_clip_loaded) -> dict[str, torch.Tensor]:
    """The values to compare, computed by the code as it is now."""
    values: dict[str, torch.Tensor] = {}
    module = make_module(tiny_clip, templates=TEMPLATES, text_batch_size=2, options=SAVED_OPTIONS)
    outputs = make_trainer().predict(module, loader(61, batch=8))
    values["module/logits"] = torch.cat([o["logits"] for o in outputs])
    values["module/confidence"] = torch.cat([o["confidence"] for o in outputs])
    for key, value in sorted(module.metrics_.items()):
        values[f"module/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    for key, value in module.class_probability_.items():
        values[f"module/probability_{key}"] = value.double()
    model, _, tokenizer = tiny_clip_loaded
    prompts = build_class_prompts(CLASS_NAMES, TEMPLATES + ["{}"])
    with torch.no_grad():
        values["prototypes"] = encode_prototypes(model, tokenizer, prompts, batch_size=5)
    features, prototypes, labels = long_tailed_world(n=600, k=20)
    result = frolic_tta.frolic(features, prototypes, SAVED_OPTIONS)
    for row, logits in result.ablations(labels).items():
        values[f"world/{row}"] = logits[:40].double()  # 40 samples keep the file small
    ctx = RowContext(result.head, result.sums, features, result.options, labels, chunk_size=97)
    scalars, _ = evaluate_rows(
        build_rows(ctx), result.head, features, labels, num_labelled=len(labels), chunk_size=97
    )
    for key, value in sorted(scalars.items()):
        values[f"world/{key}"] = torch.tensor(float(value), dtype=torch.float64)
    return values


def test_logits_and_metrics_equal_the_saved_ones(tiny_clip, tiny_clip_loaded):
    values = current(tiny_clip, tiny_clip_loaded)
    if os.environ.get("FROLIC_SAVE_UNCHANGED"):
        SAVED.parent.mkdir(exist_ok=True)
        build = {"torch_version": str(torch.__version__), "threads": torch.get_num_threads()}
        torch.save({**values, **build}, SAVED)
        pytest.skip(f"saved {len(values)} values to {SAVED}")
    saved = torch.load(SAVED, weights_only=True)
    same_torch = saved.pop("torch_version", None) == str(torch.__version__)
    same_torch &= saved.pop("threads", None) == torch.get_num_threads()
    assert sorted(values) == sorted(saved)
    for key, value in saved.items():
        atol = 1e-6 if same_torch else 1e-4 * max(1.0, float(value.abs().max()))
        torch.testing.assert_close(values[key], value, rtol=0, atol=atol, msg=key)
