"""What fuzzing the public API found (issue 38, item 8), each case rebuilt: a module restored from
its checkpoint, mixed labelled and unlabelled batches, unclear errors, and online bookkeeping."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from frolic_tta import FrolicModule, FrolicOptions, SolverOptions
from frolic_tta.data import IndexedDataset
from frolic_tta.lightning.writer import concat_outputs
from frolic_tta.online import OnlineFrolic
from frolic_tta.options import options_from_dict
from frolic_tta.synthetic import clip_like_world
from tests.generated import GeneratedImages
from tests.test_module import loader, make_module, make_trainer

# ---------------------------------------------------------------- load_from_checkpoint


@pytest.fixture(scope="module")
def saved(tiny_clip, tmp_path_factory):
    module = make_module(tiny_clip)
    trainer = make_trainer()
    out = concat_outputs(trainer.predict(module, loader(40)))
    path = tmp_path_factory.mktemp("saved") / "full.ckpt"
    trainer.save_checkpoint(path)
    return module, out, path


def test_a_restored_module_adapts_with_its_own_tau_c(saved, caplog):
    """tau_c="model" was read from open_clip's freshly initialised weights (1/0.07) before the
    checkpoint's were restored (0.01): a new predict refitted with it."""
    module, out, path = saved
    with caplog.at_level(logging.WARNING):
        restored = FrolicModule.load_from_checkpoint(path)
    assert "initialized randomly" not in caplog.text  # the weights are restored right after
    assert restored.tau_c == module.tau_c == pytest.approx(0.01)
    again = concat_outputs(make_trainer().predict(restored, loader(40)))  # adapts again
    assert restored.head.tau_g == pytest.approx(module.head.tau_g, rel=1e-6)
    assert torch.equal(again["prediction"], out["prediction"])
    torch.testing.assert_close(again["logits"], out["logits"], rtol=1e-5, atol=1e-4)


# ---------------------------------------------------------------- mixed batches


class Alternating(GeneratedImages):
    """Every other sample without a label (``None``), starting with ``first``."""

    def __init__(self, n: int, first_labelled: bool) -> None:
        super().__init__(n)
        self.first = 0 if first_labelled else 1

    def __getitem__(self, index: int):
        image, label = super().__getitem__(index)
        return image, (label if index % 2 == self.first else None)


@pytest.mark.parametrize("first_labelled", [True, False])
def test_a_batch_of_labelled_and_unlabelled_samples_collates_with_target_minus_one(
    tiny_clip, first_labelled
):
    """A mixed batch raised KeyError: 'label' (first item labelled) or dropped every label of
    the batch (first item unlabelled: "labelled: 0", no metrics)."""
    data = Alternating(40, first_labelled)
    batch = next(iter(DataLoader(IndexedDataset(data), batch_size=40)))
    expected = torch.tensor([i % 3 if i % 2 == data.first else -1 for i in range(40)])
    assert torch.equal(batch["label"], expected)
    module = make_module(tiny_clip)
    with pytest.warns(UserWarning, match="20 of the 40 usable samples carry no label"):
        out = concat_outputs(make_trainer().predict(module, DataLoader(IndexedDataset(data),
                                                                       batch_size=40)))  # fmt: skip
    assert torch.equal(out["target"], expected) and module.samples_["labelled"] == 20
    scored = expected >= 0
    correct = int((out["prediction"][scored] == expected[scored]).sum())
    assert module.metrics_["accuracy/f_d"] == correct / 20


# ---------------------------------------------------------------- clear errors


def test_the_head_checks_what_it_scores(saved):
    module, _, _ = saved
    head, wide = module.head, torch.randn(5, 16)
    message = "Expected `features` to have 32 columns (dimension mismatch), but got shape (5, 16)"
    for score in (head.score, head.to_module(), head.to_linear()):
        with pytest.raises(ValueError) as error:
            score(wide)
        assert str(error.value) == message
    with pytest.raises(ValueError, match="Expected `features` to be floating point, but got "
                                         "torch.int64"):  # fmt: skip
        head.score(torch.ones(5, 32, dtype=torch.long))
    assert isinstance(head.to_linear(), torch.nn.Linear)
    x = torch.nn.functional.normalize(torch.randn(5, 32), dim=1)
    torch.testing.assert_close(head.to_linear(torch.float64)(x.double()).float(), head.score(x),
                               rtol=1e-4, atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("name", ["online", "reuse_head", "ablations", "return_logits",
                                  "allow_head_mismatch", "save_clip_weights"])  # fmt: skip
def test_flags_are_bools_not_strings(tiny_clip, tmp_path, name):
    """online="false" turned online mode on (a truthy string), as reuse_head="false" did."""
    with pytest.raises(TypeError, match=f"Expected `{name}` to be True or False, but got str "
                                        "'false'"):  # fmt: skip
        FrolicModule(model_name=tiny_clip.model_name, pretrained=str(tmp_path / "missing.pt"),
                     **{name: "false"})  # fmt: skip


def test_options_none_or_a_preset_name(tiny_clip):
    assert make_module(tiny_clip, options=None).options == FrolicOptions()
    with pytest.raises(TypeError) as error:
        make_module(tiny_clip, options="paper")
    assert str(error.value) == (
        "Expected `options` to be a FrolicOptions or a mapping of its fields, but got str "
        "'paper': for the paper's method pass options=frolic_tta.paper_options() "
        "(frolic_tta.released_options() for the released one)"
    )


def test_numpy_scalars_are_numbers():
    options = FrolicOptions(solver={"eps": np.float32(1e-3), "max_iter": np.int64(5)},
                            inmap_gamma=np.float64(0.5))  # fmt: skip
    assert options.solver.eps == pytest.approx(1e-3) and type(options.solver.eps) is float
    assert options.solver.max_iter == 5 and type(options.solver.max_iter) is int
    assert SolverOptions(prior_rounds=np.int32(2)).prior_rounds == 2
    with pytest.raises(TypeError, match=r"Expected `max_iter` to be an int, but got .*5\.5"):
        SolverOptions(max_iter=np.float64(5.5))
    with pytest.raises(TypeError, match="Expected `eps` to be a real number, but got .*True"):
        SolverOptions(eps=np.bool_(True))


def test_options_from_dict_names_the_fields_and_keeps_every_value():
    with pytest.raises(TypeError) as error:
        options_from_dict({"bais": "paper"})
    assert str(error.value).startswith(
        "Expected `options` keys among the FrolicOptions fields ['bias', 'bias_test', "
        "'covariance', "
    )
    assert str(error.value).endswith("but got ['bais']; did you mean 'bias'?")
    # a flat solver field beside a solver mapping: merged, not dropped
    assert options_from_dict({"solver": {"max_iter": 5}, "eps": 1e-3}).solver == SolverOptions(
        eps=1e-3, max_iter=5
    )
    once = r"Expected each solver option once, but `eps` is given flat \(0.001\) and in `solver`"
    with pytest.raises(ValueError, match=once + r" \(0.01\)"):
        options_from_dict({"solver": SolverOptions(), "eps": 1e-3})


def test_online_min_coverage_is_a_number_in_0_1():
    z = torch.nn.functional.normalize(torch.randn(4, 8), dim=1)
    for bad in ("0.5", True, None):
        with pytest.raises(TypeError, match="Expected `min_coverage` to be a real number"):
            OnlineFrolic(z, min_coverage=bad)
    with pytest.raises(ValueError, match=r"Expected `min_coverage` in \[0, 1\], but got 1.5"):
        OnlineFrolic(z, min_coverage=1.5)
    assert OnlineFrolic(z, min_coverage=np.float32(0.25)).min_coverage == 0.25


# ---------------------------------------------------------------- online bookkeeping


def _stream():
    world = clip_like_world(600, 5, 16, seed=3)
    return world.features, world.prototypes


def test_a_step_after_finalize_reports_the_head_that_answered():
    x, z = _stream()
    online = OnlineFrolic(z, tau_c=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for batch in x[:500].split(50):
            online.step(batch)
        refits, head = online.refits, online.head
        fit = online.finalize()
        answer = online.step(x[500:550])
    assert online.refits == refits and online.history[-1].seen == 400  # 50, 100, 200, 400
    assert fit.head is not head and online.head is head  # the stream's state is unchanged
    assert answer.refit == refits and answer.fitted_on == 400 and answer.seen == 550
    kept = ~answer.fallback
    torch.testing.assert_close(answer.logits[kept], head.score(x[500:550])[kept])


def test_a_step_whose_refit_raises_changes_nothing(monkeypatch):
    """A step whose refit raised kept its batch in the running sums without counting the step
    (51 batches -> steps=47)."""
    import frolic_tta.online as online_module

    x, z = _stream()
    online = OnlineFrolic(z, tau_c=0.01)
    real, calls = online_module.fit_frolic, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("refit failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(online_module, "fit_frolic", flaky)
    batches = list(x.split(50))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        done = []
        for batch in batches:
            try:
                online.step(batch)
                done.append(batch)
            except ValueError:
                pass
        assert online.steps == len(done) == len(batches) - 1
        assert online.seen == sum(b.shape[0] for b in done) == online.features.shape[0]
        fit = online.finalize()
        monkeypatch.setattr(online_module, "fit_frolic", real)
        ref = real(torch.cat(done), z, tau_c=0.01)
    assert fit.head.tau_g == pytest.approx(ref.head.tau_g, rel=1e-9)
    torch.testing.assert_close(fit.head.beta, ref.head.beta)
