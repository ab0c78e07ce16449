"""Logits as affine maps of the features, streamed in row chunks, and the reduce function.

Every dataset-wide quantity in Frolic is a *sum over samples*. The estimators never hold more
than one ``(chunk, K)`` block of logits at a time unless the caller hands them a full tensor;
they iterate a :class:`LogitSource` and pass each sum through one injected ``reduce_fn``
(identity in one process, an all-reduce-sum in a process group). Because every decision in an
iterative loop is taken on reduced values, every rank takes the same decisions and calls
``reduce_fn`` the same number of times.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from frolic_tta.validation import check_matrix, identity_reduce  # noqa: F401 (its home was here)

ReduceFn = Callable[[Tensor], Tensor]
"""Sums a tensor over all shards and returns the sum (must not be a mean)."""

DEFAULT_CHUNK_SIZE = None
"""``None``: rows per chunk chosen by :func:`chunk_rows` from K."""
CHUNK_ELEMENTS = 2**21
EXACT_PRODUCTS = 2.0**31
"""Largest :math:`N K d` (N over all shards) whose estimator passes are exact
(:func:`exact_arithmetic`): 2.1e9 multiply-adds, about 0.06 s in float64 on 2 cores."""


def exact_arithmetic(total: Tensor | float, num_classes: int, dim: int) -> bool:
    r"""Whether the estimator's passes over ``total`` samples (all shards) are *exact*: their
    products in float64 rounded once to the logits' dtype, their sums over samples in float64.

    A float32 product's rounding depends on the shape of the matrix product (a BLAS kernel
    picks its blocking by the number of rows: measured 1-2 ulp between 512 and 256 rows on an
    AVX-512 CPU) and a float32 column sum's on which rows share a chunk, so both follow how
    the rows are split over processes and chunks. On weakly informative features the solves
    behind the test prior amplify that rounding a hundredfold (``tests/test_sharded_core.py``:
    1.2e-5 of the largest logit between 1 and 2 shards). Exact passes leave only float64
    rounding, so 1, 2 or 3 shards and any chunk size agree to float32 rounding of the final
    logits. They cost about 2.5x the float32 product, so they are used where
    :math:`N K d \le` :data:`EXACT_PRODUCTS`; the decision is the same on every shard and
    every device (N is the reduced count)."""
    return float(total) * num_classes * dim <= EXACT_PRODUCTS


def chunk_rows(num_classes: int, chunk_size: int | None = None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else about 2M logits (8 MiB in float32) so
    temporaries stay below the caching allocator's reuse limit; at least 256 rows."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise ValueError(f"Expected `chunk_size` >= 1, but got {chunk_size}")
        return int(chunk_size)
    return max(256, CHUNK_ELEMENTS // max(1, num_classes))


def compute_dtype(tensor: Tensor) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


class RowBuffer:
    """Rows appended batch by batch into one tensor, allocated once for ``capacity`` rows
    (grown by doubling when more come): :meth:`rows` is the filled part, a view, so the
    batches need no concatenation (no second copy, no second allocation at finalize).

    Args:
        capacity: rows expected (``0``: the first batch's).
        dtype: the stored dtype (``None``: the first batch's); batches are cast on copy.
    """

    def __init__(self, capacity: int = 0, dtype: torch.dtype | None = None) -> None:
        self.capacity, self.dtype = max(0, int(capacity)), dtype
        self.data: Tensor | None = None
        self.used = 0

    def append(self, batch: Tensor) -> None:
        """Copy ``batch`` ``(n, ...)`` after the rows so far."""
        n, end = batch.shape[0], self.used + batch.shape[0]
        if self.data is None:
            size = (max(self.capacity, n), *batch.shape[1:])
            self.data = batch.new_empty(size, dtype=self.dtype or batch.dtype)
        elif end > self.data.shape[0]:
            grown = self.data.new_empty((max(2 * self.data.shape[0], end), *self.data.shape[1:]))
            grown[: self.used] = self.data[: self.used]
            self.data = grown
        self.data[self.used : end] = batch
        self.used = end

    def rows(self, empty: Tensor | None = None) -> Tensor | None:
        """The ``used`` rows (a view); ``empty`` (or ``None``) when nothing was appended."""
        return empty if self.data is None else self.data[: self.used]


class LogitSource:
    """Logits of the local shard, delivered as row chunks.

    Subclasses implement :meth:`chunks`. ``num_samples`` is local (this shard's) N. ``exact``:
    the passes over it sum samples in float64 (:func:`exact_arithmetic`).
    """

    num_samples: int
    num_classes: int
    exact: bool = False

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        """Yield ``(start, logits)`` with ``logits`` of shape ``(n, K)`` covering the rows."""
        raise NotImplementedError


class TensorLogits(LogitSource):
    """A materialised ``(N, K)`` logit tensor, iterated in row chunks."""

    def __init__(
        self, logits: Tensor, chunk_size: int | None = DEFAULT_CHUNK_SIZE, exact: bool = False
    ) -> None:
        self.logits = logits
        self.num_samples, self.num_classes = logits.shape
        self.chunk_size = chunk_rows(self.num_classes, chunk_size)
        self.exact = exact

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        dtype = compute_dtype(self.logits)
        for start in range(0, self.num_samples, self.chunk_size):
            yield start, self.logits[start : start + self.chunk_size].to(dtype)


class LinearLogits(LogitSource):
    r"""Logits of an affine map computed on the fly: :math:`f(x) = W (x - c) + b`.

    Args:
        features: ``(N, d)`` features of the local shard.
        weight: ``(K, d)``.
        bias: ``(K,)`` or ``None``.
        chunk_size: rows per chunk (``None``: :func:`chunk_rows`).
        center: ``(d,)`` subtracted from every row first, or ``None``.
        exact: products in float64, rounded once to the features' compute dtype
            (:func:`exact_arithmetic`): every row's logits then do not depend on the chunk.
    """

    def __init__(
        self,
        features: Tensor,
        weight: Tensor,
        bias: Tensor | None = None,
        chunk_size: int | None = DEFAULT_CHUNK_SIZE,
        center: Tensor | None = None,
        exact: bool = False,
    ) -> None:
        dtype = compute_dtype(features)
        work = torch.float64 if exact else dtype  # the products' dtype
        self.center = None if center is None else center.to(device=features.device, dtype=work)
        self.features = features
        self.weight_t = weight.to(device=features.device, dtype=work).t().contiguous()
        self.bias = None if bias is None else bias.to(device=features.device, dtype=work)
        self.num_samples = features.shape[0]
        self.num_classes = weight.shape[0]
        self.chunk_size = chunk_rows(self.num_classes, chunk_size)
        self.dtype, self.work, self.exact = dtype, work, exact

    def _product(self, start: int, out: Tensor | None = None, rows: Tensor | None = None) -> Tensor:
        block = self.features[start : start + self.chunk_size]
        block = (block if rows is None else block[rows]).to(self.work)
        if self.center is not None:
            block = block - self.center
        out = out if self.work == self.dtype else None  # exact: a float64 temporary, rounded
        if self.bias is None:
            return torch.matmul(block, self.weight_t, out=out)
        return torch.addmm(self.bias, block, self.weight_t, out=out)

    def rows(self, start: int, rows: Tensor) -> Tensor:
        """The logits of the chunk at ``start``'s rows where ``rows`` (bool, one per row)."""
        return self._product(start, rows=rows).to(self.dtype)

    def chunks(self) -> Iterator[tuple[int, Tensor]]:
        for start in range(0, self.num_samples, self.chunk_size):
            yield start, self._product(start).to(self.dtype)

    def write(self, buffer: Tensor) -> None:
        """Every chunk's logits written straight into ``buffer`` ``(N, K)`` (same dtype):
        the products' output, with no chunk-sized temporary and no copy (exact: one float64
        temporary per chunk, rounded into it)."""
        for start in range(0, self.num_samples, self.chunk_size):
            rows = buffer[start : start + self.chunk_size]
            product = self._product(start, rows)
            if product.data_ptr() != rows.data_ptr():
                rows.copy_(product)


FLUSH_BELOW = {torch.float32: -87.0, torch.float64: -708.0}
r"""Exponents below which :func:`flushed_exp` returns 0: :math:`e^{-87}` is just above
float32's smallest normal (:math:`1.2\cdot10^{-38} = e^{-87.34}`), :math:`e^{-708}` float64's."""


def flushed_exp(values: Tensor, out: Tensor | None = None) -> Tensor:
    r""":math:`e^{x}` of ``values`` into ``out`` (``None``: in place), results below about
    :math:`e^{-87}` (float64: :math:`e^{-708}`, :data:`FLUSH_BELOW`) set to 0.

    The CPU's vectorised ``exp`` leaves its fast path on every vector with a result below the
    smallest normal (a subnormal, or 0 reached through one): 15 to 50 times slower there
    (torch 2.14, AVX2). The mixture's log-likelihoods go that deep where samples per class are
    few (N = 2,000, K = 5,000, d = 512: the fit took 28.2 s with ``torch.exp`` and 14.3 s with
    this, ``benchmarks/exp_flush.py``). On the CPU, in a tensor that goes that deep (one
    ``min`` pass decides), the values are clamped at the bound first, so the exponential stays
    on its fast path, and what was clamped is set to 0 after it; elsewhere this is
    ``torch.exp``. Against ``torch.exp`` an entry moves by less than :math:`1.7\cdot10^{-38}`
    (float64: :math:`10^{-307}`), nothing beside a row's top term of 1 (the mixture weighs the
    entries by :math:`\pi_j/\max\pi`, so there only where the weights span more than
    :math:`10^{30}`); the fits of that benchmark and of ``tests/test_flushed_exp.py`` are
    bit-identical. NaN and :math:`\pm\infty` map as in ``torch.exp``.
    """
    out = values if out is None else out
    low = FLUSH_BELOW.get(values.dtype)
    cpu = values.device.type == "cpu" and values.numel() > 0  # a GPU's exp has no slow path
    if low is None or not cpu or not float(values.min()) < low:  # one cheap pass decides
        return torch.exp(values, out=out)
    torch.clamp(values, min=low, out=out).exp_()
    return torch.nn.functional.threshold_(out, math.exp(low + 0.01), 0.0)


def workspace(work: Tensor | None, like: Tensor, count: int = 1) -> Tensor:
    """``count`` temporaries of ``like``'s shape, dtype and device, as ``(count, n, K)``:
    ``work`` where it already holds them (its rows sliced to ``like``'s), else new ones.

    A pass over the logits reuses one workspace for every chunk: a fresh chunk-sized tensor
    per chunk is a fresh mapping from the system allocator, whose page faults cost as much as
    the exponentials themselves (about 3x the pass, measured on 2 CPU cores).
    """
    n, k = like.shape
    fits = work is not None and work.shape[0] >= count and work.shape[1] >= n
    fits = fits and work.shape[2] == k and work.dtype == like.dtype and work.device == like.device
    if not fits:
        work = like.new_empty((count, n, k))
    return work[:count, :n]


def fill(buffer: Tensor, source: LogitSource) -> TensorLogits:
    """Write every chunk of ``source`` into ``buffer`` ``(N, K)``; the buffer as a source."""
    if isinstance(source, LinearLogits) and buffer.dtype == source.dtype:
        source.write(buffer)
        return TensorLogits(buffer, source.chunk_size, source.exact)
    for start, chunk in source.chunks():
        buffer[start : start + chunk.shape[0]] = chunk
    return TensorLogits(buffer, getattr(source, "chunk_size", None), source.exact)


def as_source(logits: Tensor | LogitSource, name: str = "logits") -> LogitSource:
    """Wrap a tensor as a :class:`TensorLogits`; pass a :class:`LogitSource` through."""
    if isinstance(logits, LogitSource):
        return logits
    check_matrix(name, logits)
    return TensorLogits(logits)


def materialise(source: LogitSource) -> Tensor:
    """Concatenate every chunk of ``source`` into one ``(N, K)`` tensor."""
    parts = [chunk for _, chunk in source.chunks()]
    if not parts:
        return torch.empty(0, source.num_classes)
    return torch.cat(parts)


@dataclass(frozen=True)
class AffineMap:
    r"""A classifier :math:`f(x) = W (x - \mu) + b`: the one scoring path of every row.

    Every classifier Frolic builds (zero-shot, GDA, fused, debiased, the Table 3/4 rows) is
    affine in the features. It is always evaluated *centred*: :math:`W x` and :math:`W\mu`
    can be large and nearly equal (an ill-conditioned :math:`\hat\Sigma`), and subtracting
    :math:`\mu` from the features first keeps float32 exact.

    Attributes:
        weight: ``(K, d)`` :math:`W`.
        bias: ``(K,)`` :math:`b`.
        center: ``(d,)`` :math:`\mu`, or ``None`` for :math:`f(x) = W x + b`.
    """

    weight: Tensor
    bias: Tensor
    center: Tensor | None = None

    def __post_init__(self) -> None:  # one device: the weight's (K-vectors are often on CPU)
        device = self.weight.device
        object.__setattr__(self, "bias", self.bias.to(device))
        if self.center is not None:
            object.__setattr__(self, "center", self.center.to(device))

    def source(
        self, features: Tensor, chunk_size: int | None = DEFAULT_CHUNK_SIZE, exact: bool = False
    ) -> LinearLogits:
        """The logits of ``features`` ``(N, d)`` as a chunked :class:`LogitSource` (``exact``:
        float64 products, :func:`exact_arithmetic`)."""
        return LinearLogits(features, self.weight, self.bias, chunk_size, self.center, exact)

    def logits(self, features: Tensor, chunk_size: int | None = DEFAULT_CHUNK_SIZE) -> Tensor:
        """``(N, K)`` logits of ``features`` ``(N, d)``, in float32 (float64 for float64 input)."""
        return materialise(self.source(features, chunk_size))

    def shift(self, offset: Tensor) -> AffineMap:
        r"""The same map with ``offset`` ``(K,)`` added to every row of logits (e.g.
        :math:`-\ln\hat\beta`)."""
        return AffineMap(self.weight, self.bias + offset.to(self.bias), self.center)

    def uncentred(self) -> tuple[Tensor, Tensor]:
        """``(W (K, d), b' (K,))`` with :math:`f(x) = W x + b'` (for a plain ``nn.Linear``)."""
        if self.center is None:
            return self.weight, self.bias
        return self.weight, self.bias - self.weight @ self.center.to(self.weight)
