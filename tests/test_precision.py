"""Frolic's own products ignore autocast and the float32 matmul-precision flag (TF32 / bf16)."""

from __future__ import annotations

import pytest
import torch

from frolic_tta import fit_frolic
from frolic_tta.lightning.writer import concat_outputs
from frolic_tta.precision import full_precision, ieee_float32
from tests.test_module import loader, make_module, make_trainer
from tests.worlds import long_tailed_world


@pytest.fixture(scope="module")
def fitted():
    features, prototypes, _ = long_tailed_world(n=600, k=12)
    return features, fit_frolic(features, prototypes, tau_c=0.01).head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_head_scores_in_float32_under_autocast(fitted, dtype):
    # before: under the Trainer's bf16-mixed a stored head scored in bfloat16 (4e-3 of the scale)
    features, head = fitted
    plain = head.score(features)
    with torch.autocast("cpu", dtype=dtype):
        mixed = head.score(features)
    assert mixed.dtype == torch.float32
    assert torch.equal(mixed, plain)


@pytest.fixture
def restore_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("user", ["high", "medium"])
def test_legacy_precision_is_ieee_inside_and_restored_after(user, restore_precision):
    torch.set_float32_matmul_precision(user)
    with ieee_float32():
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
    assert torch.get_float32_matmul_precision() == user


def test_per_backend_precision_is_ieee_inside_and_restored_after(restore_precision):
    torch.backends.cuda.matmul.fp32_precision = "tf32"  # the PyTorch >= 2.9 API
    cpu = torch.backends.mkldnn.matmul.fp32_precision
    with full_precision("cpu"):
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        assert not torch.is_autocast_enabled("cpu")
    assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    assert torch.backends.mkldnn.matmul.fp32_precision == cpu


def test_fit_restores_the_flag_and_does_not_depend_on_it(fitted, restore_precision):
    features, head = fitted
    torch.set_float32_matmul_precision("medium")  # bf16 products on CPUs with AMX
    other = fit_frolic(features, head.prototypes, tau_c=0.01).head
    assert torch.get_float32_matmul_precision() == "medium"
    assert torch.equal(other.score(features), head.score(features))


def test_a_stored_head_scores_in_float32_under_bf16_mixed(tiny_clip):
    # before: the Trainer's autocast ran the stored head's product in bfloat16
    adapted = make_module(tiny_clip)
    make_trainer().predict(adapted, loader(24))
    module = make_module(tiny_clip, reuse_head=True)
    module.head, seen = adapted.head, []
    encode = module.encode_images
    module.encode_images = lambda images: seen.append(encode(images)) or seen[-1]
    out = concat_outputs(make_trainer(precision="bf16-mixed").predict(module, loader(24)))
    assert out["logits"].dtype == torch.float32
    expected = adapted.head.score(torch.cat(seen).float())
    torch.testing.assert_close(out["logits"], expected, rtol=1e-6, atol=1e-6)
