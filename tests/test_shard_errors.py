"""Every function with ``reduce_fn`` decides input errors on reduced values: all shards raise
together (the same message) or none does; a shard raising alone would leave the others waiting
in a collective forever (issue 16, found 7)."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import frolic_tta
from frolic_tta.calibration import confidence, match_temperature
from frolic_tta.debias import estimate_label_bias
from frolic_tta.inmap import inmap_proxies
from tests.sharding import outcomes_sharded


def shards(n: int = 2, rows: int = 12, k: int = 3, d: int = 8):
    g = torch.Generator().manual_seed(0)
    z = torch.nn.functional.normalize(torch.randn(k, d, generator=g), dim=1)
    parts = []
    for _ in range(n):
        x = z[torch.arange(rows) % k] + 0.3 * torch.randn(rows, d, generator=g)
        parts.append(torch.nn.functional.normalize(x, dim=1))
    return z, parts


def raised_together(outcomes: list, message: str) -> None:
    kinds = [type(o).__name__ for o in outcomes]
    assert all(isinstance(o, ValueError) for o in outcomes), kinds  # none left waiting
    assert all(message in str(o) for o in outcomes), [str(o) for o in outcomes]


def spoil(parts: list, how) -> list:
    parts = [p.clone() for p in parts]
    how(parts[1])  # the second shard only
    return parts


def nan_row(x):
    x[3, 0] = float("nan")


def zero_row(x):
    x[3] = 0.0


@pytest.mark.parametrize(
    ("how", "normalize", "message"),
    [
        (
            nan_row,
            None,
            "Expected `features` to hold only finite values, but found NaN or inf in 1",
        ),
        (nan_row, True, "Expected `features` to hold only finite values"),
        (zero_row, True, "Expected every row of `features` to have non-zero norm to normalise"),
        (zero_row, None, "Expected unit-norm rows in `features`"),
    ],
)
def test_frolic_raises_on_every_shard(how, normalize, message):
    z, parts = shards()

    def run(x, reduce_fn):
        return frolic_tta.frolic(x, z, normalize=normalize, reduce_fn=reduce_fn)

    raised_together(outcomes_sharded(run, spoil(parts, how)), message)


def test_estimate_label_bias_raises_on_every_shard():
    _, parts = shards()
    logits = [10 * p[:, :3] for p in parts]

    def run(x, reduce_fn):
        return estimate_label_bias(x, reduce_fn=reduce_fn)

    raised_together(outcomes_sharded(run, spoil(logits, nan_row)), "`logits` to hold only finite")
    labels = [torch.arange(12) % 3, torch.arange(12) % 3 - 1]  # a -1 on the second shard only

    def run(i, reduce_fn):
        return estimate_label_bias(logits[i], labels=labels[i], reduce_fn=reduce_fn)

    raised_together(outcomes_sharded(run, [0, 1]), "Expected integer `labels` of shape (N,)")
    good = outcomes_sharded(run, [0, 0])  # valid labels everywhere: no error, one answer
    assert torch.equal(good[0], good[1])


def test_match_temperature_raises_on_every_shard():
    _, parts = shards()
    gda = [5 * p[:, :3] for p in parts]
    zero_shot = [p[:, 3:6] for p in parts]
    bad = spoil(gda, nan_row)

    def run(i, reduce_fn):
        return match_temperature(bad[i], zero_shot[i], reduce_fn=reduce_fn)

    raised_together(outcomes_sharded(run, [0, 1]), "`gda_logits` to hold only finite values")
    short = [zero_shot[0], zero_shot[1][:5]]  # rows differ on the second shard only

    def run(i, reduce_fn):
        return match_temperature(gda[i], short[i], reduce_fn=reduce_fn)

    raised_together(outcomes_sharded(run, [0, 1]), "to have the same shape on every shard")


@pytest.mark.parametrize(("labels", "rel"), [("zero_shot", 1e-9), ("debiased", 1e-3)])
def test_valid_shards_give_the_single_process_answer(labels, rel):
    """The raw-label head is a function of float64 sums (1e-9). The default's labels come from
    matchings solved to 1e-6 in class mass; with 24 samples every class is undetermined
    (N h_j < 1), so beta-hat, and tau_g with it, move 1e-4 with the summation order."""
    z, parts = shards()

    def run(x, reduce_fn):
        return frolic_tta.frolic(x, z, reduce_fn=reduce_fn, head_labels=labels).tau_g

    sharded = outcomes_sharded(run, parts)
    whole = frolic_tta.frolic(torch.cat(parts), z, head_labels=labels).tau_g
    assert sharded[0] == sharded[1] == pytest.approx(whole, rel=rel)


def _gloo_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),  # a rank left waiting fails instead of hanging
    )
    torch.set_num_threads(1)
    z, parts = shards()
    features = spoil(parts, nan_row)[rank]  # NaN on rank 1 only

    def reduce_fn(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    try:
        frolic_tta.frolic(features, z, reduce_fn=reduce_fn)
        outcome = "no error"
    except ValueError as error:
        outcome = f"ValueError: {error}"
    except Exception as error:  # noqa: BLE001 - a collective that timed out
        outcome = f"{type(error).__name__}: {error}"
    Path(out_dir, f"rank{rank}.txt").write_text(outcome)
    dist.destroy_process_group()


def test_a_real_two_process_group_raises_on_both_ranks(tmp_path):
    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    for outcome in outcomes:
        assert outcome.startswith("ValueError: Expected `features` to hold only finite"), outcomes


def test_confidence_and_inmap_raise_on_every_shard():
    z, parts = shards()
    bad = spoil(parts, nan_row)

    def proxies(x, reduce_fn):
        return inmap_proxies(x, z, reduce_fn=reduce_fn, iterations=2)

    raised_together(outcomes_sharded(proxies, bad), "`features` to hold only finite values")
    logits = [5 * p[:, :3] for p in bad]

    def conf(x, reduce_fn):
        return confidence(x, 0.1, reduce_fn=reduce_fn)

    raised_together(outcomes_sharded(conf, logits), "`logits` to hold only finite values")
