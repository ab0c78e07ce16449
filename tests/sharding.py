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
