"""The options: the method's choices in FrolicOptions, the solvers' tolerances in its group."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch

import frolic_tta
from frolic_tta.options import (
    SOLVER_FIELDS,
    FrolicOptions,
    SolverOptions,
    options_from_dict,
    paper_options,
    released_options,
    resolve_options,
)


@pytest.mark.parametrize(
    ("values", "error", "message"),
    [
        ({"eps": 0}, ValueError, "Expected `eps` to be a finite number > 0, but got 0.0"),
        ({"eps": "1e-3"}, TypeError, "Expected `eps` to be a real number, but got '1e-3'"),
        ({"max_iter": 0}, ValueError, "Expected `max_iter` >= 1, but got 0"),
        ({"max_iter": 2.0}, TypeError, "Expected `max_iter` to be an int, but got 2.0"),
        ({"prior_rounds": -1}, ValueError, "Expected `prior_rounds` >= 0, but got -1"),
        ({"prior_tol": math.inf}, ValueError, "Expected `prior_tol` to be a finite number > 0"),
        ({"prior_cross_fit": 1}, TypeError, "Expected `prior_cross_fit` a bool, but got 1"),
        ({"shift_evidence": -0.5}, ValueError, "Expected `shift_evidence` to be a finite number"),
        ({"beta_ratio_bound": 1.0}, ValueError, "Expected `beta_ratio_bound` > 1, but got 1.0"),
        ({"prior_floor": 1.0}, ValueError, "Expected `prior_floor` < 1, but got 1.0"),
        ({"inmap_tolerance": 0}, ValueError, "Expected `inmap_tolerance` to be a finite number"),
        ({"temperature_tol": math.nan}, ValueError, "Expected `temperature_tol` to be a finite"),
    ],
)  # fmt: skip
def test_solver_options_are_validated_when_built(values, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")):
        SolverOptions(**values)
    with pytest.raises(error, match=message.replace("(", r"\(")):  # and as a mapping
        FrolicOptions(solver=values)


def test_solver_defaults_and_the_method_choices_apart():
    assert FrolicOptions().solver == SolverOptions()
    assert asdict(SolverOptions()) == {
        "eps": 0.01, "max_iter": 100, "prior_rounds": 3, "prior_tol": 1e-7,
        "shift_evidence": 0.5, "beta_ratio_bound": 1e8, "prior_floor": 1e-30,
        "inmap_tolerance": 1e-6, "temperature_tol": 1e-5, "prior_cross_fit": True,
    }  # fmt: skip
    assert not set(SOLVER_FIELDS) & set(asdict(FrolicOptions()))
    assert frolic_tta.SolverOptions is SolverOptions and "SolverOptions" in frolic_tta.__all__


def test_a_mapping_for_solver_converts_and_anything_else_is_refused():
    options = FrolicOptions(bias="paper", solver={"eps": 1e-3, "max_iter": 11})
    assert type(options.solver) is SolverOptions
    assert options == FrolicOptions(bias="paper", solver=SolverOptions(eps=1e-3, max_iter=11))
    assert hash(options) == hash(FrolicOptions(bias="paper", solver=SolverOptions(1e-3, 11)))
    with pytest.raises(TypeError) as info:
        FrolicOptions(solver={"eps": 1e-3, "tolerance": 1e-6})
    assert str(info.value) == (
        f"Expected `solver` keys among the SolverOptions fields {list(SOLVER_FIELDS)}, but got "
        "['tolerance']"
    )
    for bad in (0.01, None, ["eps", 0.01]):
        with pytest.raises(TypeError, match="Expected `solver` to be a SolverOptions or a mapping"):
            FrolicOptions(solver=bad)


def test_a_flat_solver_override_says_how_to_nest_it():
    expected = (
        r"Expected the solver options \['eps'\] inside `solver`, but got them as keyword "
        r"arguments: they are SolverOptions fields; pass solver=SolverOptions\(eps=...\) or "
        r"solver=\{'eps': ...\}"
    )
    with pytest.raises(TypeError, match=expected):
        resolve_options(None, eps=1e-3)
    with pytest.raises(TypeError, match="inside `solver`"):
        paper_options(max_iter=11)
    with pytest.raises(TypeError, match="inside `solver`"):
        frolic_tta.frolic(torch.randn(5, 4), torch.randn(3, 4), prior_tol=1e-6)
    with pytest.raises(TypeError, match="FrolicOptions fields"):
        resolve_options(None, tolerance=1e-3)


def test_presets_build_their_solver_groups_and_take_overrides_on_top():
    assert paper_options().solver == SolverOptions(beta_ratio_bound=None)
    released = SolverOptions(eps=1e-3, max_iter=11, beta_ratio_bound=None, inmap_tolerance=None)
    assert released_options().solver == released
    # a mapping changes the fields it names; a SolverOptions replaces the whole group
    assert released_options(solver={"max_iter": 5}).solver == SolverOptions(
        eps=1e-3, max_iter=5, beta_ratio_bound=None, inmap_tolerance=None
    )
    assert released_options(solver=SolverOptions()).solver == SolverOptions()
    assert paper_options(bias="soft").covariance == "paper"
    base = FrolicOptions(solver={"eps": 1e-3})
    assert resolve_options(base, solver={"prior_rounds": 0}).solver == SolverOptions(
        eps=1e-3, prior_rounds=0
    )


def test_flat_dicts_of_older_versions_load_into_the_solver_group():
    options = released_options()
    nested = asdict(options)
    assert options_from_dict(nested) == options
    flat = {k: v for k, v in nested.items() if k != "solver"} | nested["solver"]
    del flat["temperature_tol"]  # not a field before the group
    assert options_from_dict(flat) == options
    # issue 38: the raw "__init__() got an unexpected keyword argument" is a sentence now
    with pytest.raises(TypeError, match=r"but got \['tolerance'\]; did you mean 'inmap_tolerance'"):
        options_from_dict({"tolerance": 1e-3})


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_temperature_tol_reaches_the_temperature_search(monkeypatch):
    from frolic_tta import fusion

    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs["tol"])
        return real(*args, **kwargs)

    real = fusion.match_temperature
    monkeypatch.setattr(fusion, "match_temperature", recording)
    g = torch.Generator().manual_seed(0)
    x, z = (torch.nn.functional.normalize(torch.randn(n, 8, generator=g), dim=1) for n in (60, 3))
    frolic_tta.frolic(x, z)
    frolic_tta.frolic(x, z, solver={"temperature_tol": 1e-3})
    assert calls == [1e-5, 1e-3]
