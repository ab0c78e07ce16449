"""FrolicAdaptation's per-batch path waits for the device once per batch (issue 36).

Counted with ``benchmarks/syncs.py``'s CPU simulation of a device run (the batch's tensors and
the prototypes on the "device"): before issue 36 a clean labelled batch made 10 host
synchronisations (the index, the labels and the finite flags copied one by one, the valid mask
copied to the device, three boolean masks, the finite check of the moments); now the adaptation
makes one (``batch.host_samples``), and ``gda.moment_sums`` one more, its count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from frolic_tta.lightning.batch import host_samples

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from batch_path import run  # noqa: E402
from syncs import SyncCounter  # noqa: E402


def test_a_clean_batch_is_read_from_the_device_once():
    args = argparse.Namespace(n=200, batch_size=32, k=5, d=8, bad=0, device="cpu")
    counter = SyncCounter("cpu")
    run(args, counter)
    batches = 7
    ours = {s: c for s, c in counter.sites("batch").items() if "frolic_tta/lightning/" in s}
    assert list(ours.values()) == [batches], ours  # one site, once per batch
    assert "frolic_tta/lightning/batch.py" in next(iter(ours))
    assert counter.count("batch") <= 2 * batches, counter.sites("batch")


def test_host_samples_gives_each_tensor_its_own_storage():
    features = torch.randn(6, 3)
    features[2, 1] = float("nan")
    index, labels = torch.arange(10, 16), torch.tensor([0, 1, -1, 2, 0, 1])
    finite, host_index, host_labels = host_samples(features, index, labels)
    assert finite.tolist() == [True, True, False, True, True, True]
    assert torch.equal(host_index, index) and torch.equal(host_labels, labels)
    for tensor in (host_index, host_labels):  # not a view of the stacked copy
        assert tensor.untyped_storage().nbytes() == 6 * 8
    finite, host_index, none = host_samples(features, index, None)
    assert none is None and torch.equal(host_index, index)
