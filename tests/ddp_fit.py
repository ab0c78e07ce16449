"""fit_frolic in a real gloo process group (used by tests in a subprocess).

Usage: python tests/ddp_fit.py WORLD_SIZE OUT_FILE
Every rank takes an uneven, contiguous shard of a long-tailed generated world and reduces with
``torch.distributed.all_reduce``; rank 0 writes the gathered logits and priors.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.worlds import long_tailed_world, uneven_bounds  # noqa: E402


def run(rank: int, world_size: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    import frolic_tta

    x, z, _ = long_tailed_world()
    lo, hi = uneven_bounds(x.shape[0], world_size)[rank]

    def reduce_fn(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = frolic_tta.fit_frolic(x[lo:hi], z, reduce_fn=reduce_fn)
    parts = [None] * world_size
    dist.all_gather_object(parts, fit.logits)
    if rank == 0:
        torch.save({"logits": torch.cat(parts), "priors": fit.priors}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    size, out = int(sys.argv[1]), sys.argv[2]
    port = str(29500 + os.getpid() % 1000)
    mp.spawn(run, args=(size, out, port), nprocs=size, join=True)
