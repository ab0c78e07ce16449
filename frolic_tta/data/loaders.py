"""How the datamodules' loaders are sized: worker processes and samples per process."""

from __future__ import annotations

from lightning.fabric.utilities.data import suggested_max_num_workers

from frolic_tta.errors import FrolicInputError

__all__ = ["MAX_DEFAULT_WORKERS", "check_samples_per_rank", "default_num_workers"]

MAX_DEFAULT_WORKERS = 8


def default_num_workers(devices_per_node: int = 1) -> int:
    """DataLoader workers when none are given: what this machine's CPUs allow per process.

    Lightning's suggestion (CPUs available to this process // ``devices_per_node`` - 1, at least
    1), at most :data:`MAX_DEFAULT_WORKERS`: neither Lightning nor PyTorch warns about it.
    """
    return min(MAX_DEFAULT_WORKERS, suggested_max_num_workers(max(1, devices_per_node)))


def check_samples_per_rank(num_samples: int, world_size: int) -> None:
    """Fail before any sampler is built when there are fewer samples than processes.

    Raises:
        FrolicInputError: ``num_samples < world_size``.
    """
    if num_samples < world_size:
        raise FrolicInputError(
            f"Expected at least one sample per process (N >= world size {world_size}), but the "
            f"dataset has N={num_samples}; use fewer --trainer.devices or more data (--data.limit)"
        )
