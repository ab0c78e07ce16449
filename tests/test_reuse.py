"""Reusing an adapted head: it remembers its encoder and prompts, and a mismatch is refused."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from frolic_tta import FrolicModule, FrolicOptions, SolverOptions
from frolic_tta.lightning.writer import concat_outputs
from tests.test_module import TEMPLATES, loader, make_module, make_trainer


@pytest.fixture(scope="module")
def adapted(tiny_clip, tmp_path_factory):
    """Model A adapted on 30 images; a full and a head-only checkpoint of it, and weights B
    (same architecture, d = 32, other values)."""
    folder = tmp_path_factory.mktemp("reuse")
    module = make_module(tiny_clip)
    trainer = make_trainer()
    out = concat_outputs(trainer.predict(module, loader(30)))
    full, head_only = folder / "full.ckpt", folder / "head_only.ckpt"
    trainer.save_checkpoint(full)
    module.hparams.save_clip_weights = False
    trainer.save_checkpoint(head_only)
    state = torch.load(tiny_clip.checkpoint_path, weights_only=True)
    g = torch.Generator().manual_seed(1)
    other = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
             for k, v in state.items()}  # fmt: skip
    weights_b = folder / "weights_b.pt"
    torch.save(other, weights_b)
    return module, out, full, head_only, weights_b


def test_head_from_other_weights_is_refused(tiny_clip, adapted):
    # issue 16, found 1: model A's head on model B (same architecture) was accepted silently
    _, _, _, head_only, weights_b = adapted
    with pytest.raises(ValueError) as info:
        make_module(tiny_clip, pretrained=str(weights_b), head_file=str(head_only))
    message = str(info.value)
    assert message.startswith(
        f"Expected `head_file` '{head_only}' to have been fitted with this run's encoder and "
        "prompts, but they differ (weights: head sha256:"
    )
    assert "--model.allow_head_mismatch true" in message and "\n" not in message
    with pytest.warns(UserWarning, match="allow_head_mismatch: expected `head_file`"):
        scorer = make_module(
            tiny_clip, pretrained=str(weights_b), head_file=str(head_only), allow_head_mismatch=True
        )
    assert scorer.reuse_head
    same = make_module(tiny_clip, head_file=str(head_only))  # the weights it was fitted with
    assert same.encoder_ == adapted[0].encoder_


def test_head_with_other_prompts_or_none_recorded_is_refused(tiny_clip, adapted, tmp_path):
    _, _, _, head_only, _ = adapted
    with pytest.raises(ValueError, match=r"they differ \(prompts: head [0-9a-f]+"):
        make_module(tiny_clip, templates=["a sketch of a {}."], head_file=str(head_only))
    old = torch.load(head_only, weights_only=True)
    del old["frolic_provenance"]
    torch.save(old, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match="records none \\(written by an older version\\)"):
        make_module(tiny_clip, head_file=str(tmp_path / "old.ckpt"))


def test_checkpoint_as_head_file_brings_its_clip_weights(tiny_clip, adapted):
    # issue 16, found 2: the checkpoint's CLIP weights were ignored (random encoder scored)
    module, out, full, _, _ = adapted
    scorer = FrolicModule(
        model_name=tiny_clip.model_name, pretrained=None, templates=TEMPLATES, head_file=str(full)
    )
    for key, value in module.clip.state_dict().items():
        assert torch.equal(scorer.clip.state_dict()[key], value), key
    new = concat_outputs(make_trainer().predict(scorer, loader(30)))
    torch.testing.assert_close(new["logits"], out["logits"], rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="Expected `model_name` 'frolic-tiny-vit', the encoder"):
        FrolicModule(model_name="ViT-B-32", templates=TEMPLATES, head_file=str(full))


def test_head_only_checkpoint_reloaded_with_changed_weights_is_refused(tiny_clip, adapted):
    _, _, _, head_only, weights_b = adapted
    state = torch.load(head_only, weights_only=True)
    state["hyper_parameters"]["pretrained"] = str(weights_b)
    torch.save(state, weights_b.parent / "moved.ckpt")
    with pytest.raises(ValueError, match="Expected the checkpoint's head to have been fitted"):
        FrolicModule.load_from_checkpoint(weights_b.parent / "moved.ckpt")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"chunk_size": 0}, "Expected `chunk_size` to be an int >= 1 or None, but got 0"),
        ({"chunk_size": -3}, "Expected `chunk_size` to be an int >= 1 or None, but got -3"),
        ({"text_batch_size": 0}, "Expected `text_batch_size` to be an int >= 1, but got 0"),
        ({"class_names": []}, "class_names"),
        ({"class_names": ["cat", ""]}, "class_names"),
    ],
)
def test_constructor_arguments_are_checked_when_built(tiny_clip, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_module(tiny_clip, **kwargs)


def test_checkpoint_with_the_flat_options_of_older_versions_loads(adapted, tmp_path):
    """Checkpoints written before the solver group kept ``eps``, ``max_iter``, ... flat."""
    module, _, full, _, _ = adapted
    state = torch.load(full, weights_only=True)
    nested = state["hyper_parameters"]["options"]
    assert nested["solver"] == asdict(SolverOptions())  # written nested now
    flat = {k: v for k, v in nested.items() if k != "solver"} | nested["solver"] | {"eps": 0.05}
    del flat["temperature_tol"]  # not a field then
    state["hyper_parameters"]["options"] = flat
    torch.save(state, tmp_path / "flat.ckpt")
    restored = FrolicModule.load_from_checkpoint(tmp_path / "flat.ckpt")
    assert restored.options == FrolicOptions(solver=SolverOptions(eps=0.05))
    assert restored.hparams["options"]["solver"]["eps"] == 0.05
    torch.testing.assert_close(restored.head.debiased().weight, module.head.debiased().weight)
