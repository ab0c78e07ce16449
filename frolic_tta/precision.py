"""Full float32 precision for Frolic's own products, whatever precision the caller chose.

The statistics are float64, but the N x K logit products (:math:`f_c`, :math:`f_g = W x + b`,
the soft class sums) are float32 matrix products. Two global switches can silently lower them:

* ``torch.set_float32_matmul_precision("high" | "medium")`` (Lightning suggests it on every
  tensor-core GPU) lets float32 products run in TF32 on CUDA (10-bit mantissa) and in bfloat16
  on CPUs with AMX (``"medium"``);
* autocast (``16-mixed``, ``bf16-mixed``) runs them in float16 / bfloat16.

Measured: bfloat16 autocast moved a stored head's logits by 4e-3 of their scale (CPU); TF32
moved the ImageNet-size logits by 7.4e-5 and 4 of 50,000 predictions on an H100
(``benchmarks/precision.py``), so predictions would depend on the card and the flag.
:func:`full_precision` turns both off for its block and restores the caller's settings on
exit; the encoder keeps the caller's choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch


@contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matrix products in IEEE float32 inside the block (no TF32, no bfloat16).

    Restores the caller's setting on exit, through the same API it was set with: the legacy
    :func:`torch.set_float32_matmul_precision`, or the per-backend ``fp32_precision`` of
    PyTorch >= 2.9 (reading the legacy value raises once those were set separately).
    """
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through the per-backend API: restore it the same way
        legacy = None
    if legacy == "highest":  # already IEEE: nothing to change
        yield
        return
    if legacy is not None:
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(legacy)
        return
    backends = [torch.backends.cuda.matmul, torch.backends.mkldnn.matmul]
    saved = [backend.fp32_precision for backend in backends]
    for backend in backends:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        for backend, value in zip(backends, saved, strict=True):
            backend.fp32_precision = value


@contextmanager
def full_precision(device_type: str) -> Iterator[None]:
    """No autocast on ``device_type`` (``"cpu"``, ``"cuda"``, ...) and IEEE float32 matrix
    products (:func:`ieee_float32`) inside the block; the caller's settings come back on exit."""
    with ExitStack() as stack:
        stack.enter_context(torch.autocast(device_type, enabled=False))
        stack.enter_context(ieee_float32())
        yield
