"""Run a function on shards in lockstep threads with a summing reduce function (test helper)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


def summing_reduce(
    rank: int, barrier: threading.Barrier, slots: list[torch.Tensor | None]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Shard ``rank``'s ``reduce_fn``: the sum over every shard's tensor, in shard order."""

    def reduce_fn(tensor: torch.Tensor) -> torch.Tensor:
        slots[rank] = tensor.clone()
        barrier.wait()
        total = slots[0].clone()
        for other in slots[1:]:
            total += other
        barrier.wait()
        return total

    return reduce_fn


def run_sharded(fn: Callable[[Any, Callable], Any], shards: Sequence[Any]) -> list[Any]:
    """Call ``fn(shard, reduce_fn)`` for every shard in its own thread.

    ``reduce_fn`` sums a tensor over all shards (in shard order, so every shard sees the same
    bits) like an all-reduce; a shard that calls it a different number of times deadlocks,
    which the barrier timeout turns into an error.
    """
    n = len(shards)
    barrier = threading.Barrier(n, timeout=60)
    slots: list[torch.Tensor | None] = [None] * n
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def make_reduce(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return summing_reduce(rank, barrier, slots)

    def target(rank: int) -> None:
        try:
            results[rank] = fn(shards[rank], make_reduce(rank))
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def outcomes_sharded(
    fn: Callable[[Any, Callable], Any], shards: Sequence[Any], timeout: float = 5.0
) -> list[Any]:
    """Like :func:`run_sharded`, but every shard's result *or exception* is returned, and a
    shard that raises does not abort the others: a shard raising alone leaves the others
    waiting in their next reduction until ``timeout`` (``threading.BrokenBarrierError``), as a
    DDP rank would wait forever."""
    n = len(shards)
    barrier = threading.Barrier(n, timeout=timeout)
    slots: list[torch.Tensor | None] = [None] * n
    results: list[Any] = [None] * n

    def make_reduce(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return summing_reduce(rank, barrier, slots)

    def target(rank: int) -> None:
        try:
            results[rank] = fn(shards[rank], make_reduce(rank))
        except BaseException as error:  # noqa: BLE001 - returned
            results[rank] = error

    threads = [threading.Thread(target=target, args=(r,)) for r in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def fit_interleaved(world: Any, shards: int, **options: Any) -> tuple[list[torch.Tensor], list]:
    """``frolic_tta.fit_frolic`` of ``world`` on ``shards`` interleaved row sets (rows
    ``i::shards``) in lockstep: ``(index, fits)``."""
    import frolic_tta

    n = world.features.shape[0]
    index = [torch.arange(n)[i::shards] for i in range(shards)]
    fits = run_sharded(
        lambda rows, reduce: frolic_tta.fit_frolic(
            world.features[rows], world.prototypes, reduce_fn=reduce, **options
        ),
        index,
    )
    return index, fits


def check_against_whole(world: Any, check: Callable[[Any, Any], None]) -> None:
    """``fit_frolic`` of ``world`` on 2 and 3 interleaved shards, and with other chunkings
    (777 rows; 3,000 rows without the kept logits), each against the whole set's fit: the same
    tau_g to 1e-6 and the same predictions, and ``check(other, whole)`` (warnings silenced)."""
    import warnings

    import pytest

    import frolic_tta

    x, z = world.features, world.prototypes
    pairs = []  # (fit, its predictions, the whole fit's of the same rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        whole = frolic_tta.fit_frolic(x, z)
        for shards in (2, 3):
            index, parts = fit_interleaved(world, shards)
            for rows, part in zip(index, parts, strict=True):
                pairs.append((part, part.logits.argmax(1), whole.logits[rows].argmax(1)))
        expected = whole.head.debiased().logits(x).argmax(1)
        for options in ({"chunk_size": 777}, {"keep_logits": False, "chunk_size": 3000}):
            other = frolic_tta.fit_frolic(x, z, **options)
            pairs.append((other, other.head.debiased().logits(x).argmax(1), expected))
    for other, predictions, theirs in pairs:
        assert other.head.tau_g == pytest.approx(whole.head.tau_g, rel=1e-6)
        assert torch.equal(predictions, theirs)
        check(other, whole)
