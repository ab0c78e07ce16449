r"""The options of the Frolic estimator: one vocabulary for the functions, the module and the CLI.

:class:`FrolicOptions` is a frozen dataclass; its values are validated once, when it is built
(so a command line with a bad value fails before any model loads). :func:`frolic_tta.frolic`,
:func:`frolic_tta.fit_frolic` and ``FrolicModule(options=...)`` take it; the command line exposes
it as ``--model.options.<field>``. Its fields are the method's choices; the tolerances and caps
of its solvers are one nested group, :class:`SolverOptions` (``options.solver``,
``--model.options.solver.<field>``, ``solver: {eps: 0.001}`` in YAML), so a user reads the
choices without the internals and overrides those explicitly.

The zero-shot temperature :math:`\tau_c` is not an option of the method but a property of the
zero-shot classifier (CLIP's learned ``logit_scale``), so it is passed beside the options.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_args

from frolic_tta.option_values import (  # noqa: F401 (imported from here by the estimators)
    check_choice,
    check_count,
    check_positive,
    is_bool,
    plain_numbers,
)

Covariance = Literal["soft", "paper", "released"]
r"""``"soft"``: within-class scatter under the zero-shot posterior; ``"paper"``: Eq. 7;
``"released"``: the authors' script, :math:`0.9I + 0.1\,\mathrm{diag}` with the prototypes as
means (:mod:`frolic_tta.released`)."""
BiasMethod = Literal["soft", "paper", "implicit", "none", "released"]
"""Label-bias estimators of :func:`frolic_tta.estimate_label_bias` (``"released"``: the
authors' script, :func:`frolic_tta.released.released_label_bias`)."""
Fusion = Literal["matched", "fixed", "pooled", "selected"]
r"""``"matched"``: :math:`\tau_g` by confidence matching (Eq. 11); ``"fixed"``: :math:`\tau_g =
\tau_c` (the released script's); ``"pooled"``: Eq. 11's :math:`\tau_g`, then
:math:`f_f = \frac12(f_g/\tau_g + f_c/\tau_c)` (:func:`frolic_tta.calibration.pool_weight`);
``"selected"``: pooled or :math:`f_g/\tau_g` alone, by the images (:mod:`frolic_tta.fusion`)."""
TestPriorMethod = Literal["em", "uniform"]
"""``"em"``: the test prior estimated by EM on the Gaussian mixture; ``"uniform"``: a balanced
test set, the paper's assumption (Proposition 2)."""
ZeroShot = Literal["text", "inmap", "inmap_both"]
"""``"text"``: the text prototypes; ``"inmap"``: InMaP's image-space proxies (:mod:`.inmap`);
``"inmap_both"``: proxies for f_c and f_g, the released script (:mod:`.released`)."""
HeadLabels = Literal["debiased", "zero_shot"]
"""``"debiased"``: the Gaussian head's means weighted by the zero-shot posterior with its label
bias removed; ``"zero_shot"``: by the raw zero-shot posterior (Eqs. 4-8 as written)."""
HeadMeans = Literal["tested", "sample"]
"""``"tested"``: the prototypes' image where the images allow it (:mod:`.prototype_means`)."""
BiasTest = Literal["off", "aic"]
"""``"off"``: the label bias is always removed; ``"aic"``: where the images show one
(:mod:`frolic_tta.evidence`)."""
ShrinkageMode = Literal["auto", "oas"]
Shrinkage = float | ShrinkageMode | None
"""``"auto"`` (OAS only when rank-deficient), ``"oas"``, a float in [0, 1], or ``None``."""

COVARIANCES: tuple[str, ...] = get_args(Covariance)
BIAS_METHODS: tuple[str, ...] = get_args(BiasMethod)
SHRINKAGE_MODES: tuple[str, ...] = get_args(ShrinkageMode)
TEST_PRIORS: tuple[str, ...] = get_args(TestPriorMethod)
ZERO_SHOTS: tuple[str, ...] = get_args(ZeroShot)
HEAD_LABELS: tuple[str, ...] = get_args(HeadLabels)
HEAD_MEANS: tuple[str, ...] = get_args(HeadMeans)
FUSIONS: tuple[str, ...] = get_args(Fusion)
BIAS_TESTS: tuple[str, ...] = get_args(BiasTest)


def check_shrinkage(value: Any) -> None:
    """Raise unless ``value`` is ``"auto"``, ``"oas"``, ``None`` or a real number in [0, 1]."""
    if value is None or (isinstance(value, str) and value in SHRINKAGE_MODES):
        return
    message = f"Expected `shrinkage` in [0, 1], 'auto', 'oas' or None, but got {value!r}"
    if is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(message)
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(message)


@dataclass(frozen=True)
class SolverOptions:
    r"""Tolerances and caps of the Frolic estimator's solvers (``FrolicOptions.solver``).

    Args:
        eps: tolerance :math:`\epsilon` of the label-bias loop (Eq. 16).
        max_iter: cap on the label-bias iterations.
        prior_rounds: refits of the mixture once the balanced one shows an imbalanced test set
            (``test_prior="em"``; :mod:`frolic_tta.prior` says how far each is solved).
        prior_tol: tolerance of the mixture weights (L1 change of an EM step on :math:`\pi`),
            converged once the optimality gap is also at most 1e-5 nats per sample
            (:data:`~frolic_tta.mixture_newton.KKT_TOL`); a solve stopped at its cap warns.
        shift_evidence: how much evidence an imbalanced test prior needs: :math:`c` of the
            James-Stein shrinkage towards uniform (:class:`~frolic_tta.prior.TestPriorEstimate`)
            and of the uncorrected reading's preliminary test (:mod:`frolic_tta.evidence`);
            ``0`` uses the EM estimates as they are.
        beta_ratio_bound: largest :math:`\max_j\hat\beta_j / \min_j\hat\beta_j` of the zero-shot
            model's pre-training prior (a box on :math:`\ln\hat\beta`, :mod:`frolic_tta.matching`;
            classes at the box are reported as undetermined); ``None``: only ``prior_floor``.
        prior_floor: every :math:`\hat\beta_j \ge` ``prior_floor`` / K.
        inmap_tolerance: stop the InMaP proxies' gradient steps once no proxy moves more than
            this in one step (at most 2,000 steps); ``None``: InMaP's fixed 2,000 steps.
        temperature_tol: tolerance of the confidence matching that finds :math:`\tau_g`
            (Eq. 11, :func:`frolic_tta.match_temperature`'s ``tol``).
        prior_cross_fit: the test prior's last weights solved on densities refitted on the
            other half of the samples (:mod:`frolic_tta.cross_fit`); ``False``: in-sample.

    Example::

        >>> SolverOptions(eps=1e-3).max_iter
        100
    """

    eps: float = 0.01
    max_iter: int = 100
    prior_rounds: int = 3
    prior_tol: float = 1e-7
    shift_evidence: float = 0.5
    beta_ratio_bound: float | None = 1e8
    prior_floor: float = 1e-30
    inmap_tolerance: float | None = 1e-6
    temperature_tol: float = 1e-5
    prior_cross_fit: bool = True

    def __post_init__(self) -> None:
        check_positive("shift_evidence", self.shift_evidence, allow_zero=True)
        if self.beta_ratio_bound is not None:
            bound = check_positive("beta_ratio_bound", self.beta_ratio_bound)
            if not bound > 1.0:
                raise ValueError(
                    f"Expected `beta_ratio_bound` > 1, but got {self.beta_ratio_bound!r}"
                )
        check_positive("eps", self.eps)
        check_count("max_iter", self.max_iter, minimum=1)
        check_positive("prior_tol", self.prior_tol)
        check_count("prior_rounds", self.prior_rounds, minimum=0)
        floor = check_positive("prior_floor", self.prior_floor)
        if floor >= 1.0:
            raise ValueError(f"Expected `prior_floor` < 1, but got {self.prior_floor!r}")
        if self.inmap_tolerance is not None:
            check_positive("inmap_tolerance", self.inmap_tolerance)
        check_positive("temperature_tol", self.temperature_tol)
        if not is_bool(self.prior_cross_fit):
            raise TypeError(f"Expected `prior_cross_fit` a bool, but got {self.prior_cross_fit!r}")
        plain_numbers(self)


SOLVER_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SolverOptions))
"""The :class:`SolverOptions` field names (nested under ``solver``, never flat)."""


def solver_options(solver: Any, base: SolverOptions | None = None) -> SolverOptions:
    """``solver`` as :class:`SolverOptions`: itself, or a mapping of its fields over ``base``.

    Args:
        solver: a :class:`SolverOptions` (used as it is) or a mapping of some of its fields
            (from YAML or a sweep: ``{"eps": 0.001}``).
        base: the values a mapping's missing fields keep (default: :class:`SolverOptions`).

    Raises:
        TypeError: ``solver`` is neither, or a mapping has keys that are not fields.
    """
    if isinstance(solver, SolverOptions):
        return solver
    if not isinstance(solver, Mapping):
        raise TypeError(
            "Expected `solver` to be a SolverOptions or a mapping of its fields, but got "
            f"{solver!r}"
        )
    unknown = sorted(map(str, set(solver) - set(SOLVER_FIELDS)))
    if unknown:
        raise TypeError(
            f"Expected `solver` keys among the SolverOptions fields {list(SOLVER_FIELDS)}, "
            f"but got {unknown}"
        )
    return replace(base or SolverOptions(), **solver)


@dataclass(frozen=True)
class FrolicOptions:
    r"""Choices of the Frolic estimator (defaults: the numerically sound variants).

    Args:
        covariance: ``"soft"`` (default; positive semi-definite on unit-norm features),
            ``"paper"`` (Eq. 7 literally) or ``"released"`` (the authors' script).
        shrinkage: for ``"soft"``: ``"auto"`` (OAS only when the scatter is rank-deficient),
            ``"oas"``, a float in [0, 1], or ``None``.
        bias: label-bias estimator: ``"soft"`` (default), ``"paper"`` (Algorithm 2 as
            written), ``"implicit"`` (Eq. 15 on test data), ``"none"`` or ``"released"``
            (the authors' script: ``solver.max_iter`` rounds, power iteration to
            ``solver.eps``).
        test_prior: the test set's class prior :math:`\pi`: ``"em"`` (default; the weights of
            the Gaussian mixture, :mod:`frolic_tta.prior`: with ``head_labels="debiased"`` the
            head :math:`f_g` itself, its labels debiased to that prior) or ``"uniform"`` (a
            balanced test set, the paper's assumption).
        zero_shot: the zero-shot classifier :math:`f_c`: ``"text"`` (default; the text
            prototypes at :math:`\tau_c`) or ``"inmap"`` (InMaP's proxies learned on the test
            images, at their temperature 0.04: Tables 1-2's "InMaP + Frolic"; 2,022 extra
            passes over the features, see :mod:`frolic_tta.inmap`), or ``"inmap_both"``:
            InMaP proxies for :math:`f_c` (labels from the text) and for :math:`f_g` (labels
            from the Gaussian head), at :math:`\tau_c` each: the released script.
        head_labels: the soft labels that weight the Gaussian head's class means
            (``covariance="soft"``): ``"debiased"`` (default) the zero-shot posterior with its
            label bias removed, :math:`\mathrm{softmax}(f_c/\tau_c - \ln\hat\beta_c)` matched
            to the test prior, whose mixture then also estimates that prior
            (:mod:`frolic_tta.prior`; its matchings are solved to :math:`10^{-6}`), or
            ``"zero_shot"``: the raw zero-shot posterior (Eqs. 4-8 as written; the
            paper's and the released script's). ``docs/method.md`` compares them.
        head_means: ``"tested"`` (default): the head's class means are the prototypes'
            image :math:`c + a z_j` where the images do not reject it, else the soft-label
            means (:mod:`frolic_tta.prototype_means`; ``head_labels="debiased"``); ``"sample"``:
            the soft-label means always (Default 1's m_j).
        fusion: ``"selected"`` (default: ``"pooled"``, or :math:`f_g/\tau_g` alone where its
            labels make the images more likely, :mod:`frolic_tta.fusion`),
            ``"pooled"`` (:math:`\tau_g` by Eq. 11, then
            :math:`f_f = \frac12(f_g/\tau_g + f_c/\tau_c)`: the two experts averaged, not
            summed, before the label bias is matched, :func:`frolic_tta.calibration.pool_weight`),
            ``"matched"`` (Eq. 12 as written: the sum, :math:`\tau_g` by Eq. 11; the paper's)
            or ``"fixed"`` (:math:`\tau_g = \tau_c`, the released script's equal scales).
        bias_test: ``"aic"`` (default): remove the label bias only where the images show
            one (:mod:`frolic_tta.evidence`), or ``"off"``: always (the paper's).
        inmap_gamma: InMaP's ``gamma`` for the proxies' pseudo-labels: 0 (default, InMaP's)
            balances the class masses (to the text EM test prior with ``test_prior="em"``,
            ours; equal masses with ``"uniform"``, InMaP's), 1 keeps those of the zero-shot
            softmax (the released script's call).
        solver: the solvers' tolerances and caps (:class:`SolverOptions`), or a mapping of
            some of its fields (``{"eps": 0.001}``, the others at their defaults).

    Example::

        >>> FrolicOptions(bias="paper").covariance
        'soft'
        >>> FrolicOptions(solver={"eps": 1e-3}).solver.eps
        0.001
        >>> FrolicOptions(solver=SolverOptions(eps=0))
        Traceback (most recent call last):
        ...
        ValueError: Expected `eps` to be a finite number > 0, but got 0.0
    """

    covariance: Covariance = "soft"
    shrinkage: Shrinkage = "auto"
    bias: BiasMethod = "soft"
    test_prior: TestPriorMethod = "em"
    zero_shot: ZeroShot = "text"
    head_labels: HeadLabels = "debiased"
    head_means: HeadMeans = "tested"
    fusion: Fusion = "selected"
    bias_test: BiasTest = "aic"
    inmap_gamma: float = 0.0
    solver: SolverOptions = field(default_factory=SolverOptions)

    def __post_init__(self) -> None:
        check_choice("covariance", self.covariance, COVARIANCES)
        check_shrinkage(self.shrinkage)
        if self.covariance != "soft" and self.shrinkage not in ("auto", None):
            raise ValueError(
                f"Expected `shrinkage` 'auto' or None with covariance={self.covariance!r} (it "
                f"is used as it is), but got {self.shrinkage!r}"
            )
        check_choice("bias", self.bias, BIAS_METHODS)
        check_choice("test_prior", self.test_prior, TEST_PRIORS)
        check_choice("zero_shot", self.zero_shot, ZERO_SHOTS)
        check_choice("head_labels", self.head_labels, HEAD_LABELS)
        check_choice("head_means", self.head_means, HEAD_MEANS)
        check_choice("fusion", self.fusion, FUSIONS)
        check_choice("bias_test", self.bias_test, BIAS_TESTS)
        check_positive("inmap_gamma", self.inmap_gamma, allow_zero=True)
        if not isinstance(self.solver, SolverOptions):  # a mapping from YAML or a sweep
            object.__setattr__(self, "solver", solver_options(self.solver))
        plain_numbers(self)


def options_from_dict(values: Mapping[str, Any] | None) -> FrolicOptions:
    """:class:`FrolicOptions` from a plain mapping such as ``asdict(options)`` (hparams);
    ``None``: the defaults.

    Mappings written before the solver group (a checkpoint's hparams with ``eps``,
    ``max_iter``, ... beside the method's choices) still load: those flat keys are moved into
    ``solver``, beside the keys a ``solver`` entry has.

    Raises:
        TypeError: not a mapping (a preset's name says which function builds it), or a key is
            neither a :class:`FrolicOptions` nor a :class:`SolverOptions` field.
        ValueError: a solver field is given flat and in ``solver``, with other values.
    """
    if values is None:
        return FrolicOptions()
    if not isinstance(values, Mapping):
        hint = (
            ": for the paper's method pass options=frolic_tta.paper_options() "
            "(frolic_tta.released_options() for the released one)"
            if isinstance(values, str) else ""
        )  # fmt: skip
        raise TypeError(
            "Expected `options` to be a FrolicOptions or a mapping of its fields, but got "
            f"{type(values).__name__} {values!r:.60}{hint}"
        )
    values = dict(values)
    names = sorted(f.name for f in fields(FrolicOptions))
    unknown = sorted(map(str, set(values) - set(names) - set(SOLVER_FIELDS)))
    if unknown:
        near = difflib.get_close_matches(unknown[0], names + list(SOLVER_FIELDS), n=1)
        raise TypeError(
            f"Expected `options` keys among the FrolicOptions fields {names} (or the "
            f"SolverOptions fields, flat, as older checkpoints wrote them), but got {unknown}"
            + (f"; did you mean {near[0]!r}?" if near else "")
        )
    flat = {name: values.pop(name) for name in SOLVER_FIELDS if name in values}
    if flat:
        nested = values.get("solver") or {}
        nested = asdict(nested) if isinstance(nested, SolverOptions) else dict(nested)
        for name, value in flat.items():
            if name in nested and nested[name] != value:
                raise ValueError(
                    f"Expected each solver option once, but `{name}` is given flat ({value!r}) "
                    f"and in `solver` ({nested[name]!r}): keep the one in `solver`"
                )
        values["solver"] = {**nested, **flat}
    return FrolicOptions(**values)


def paper_options(**overrides: Any) -> FrolicOptions:
    r"""The paper's method as written: Eq. 7, Algorithm 2, a balanced test set, no prior on
    :math:`\beta` (``overrides`` on top, as in :func:`resolve_options`)."""
    paper = FrolicOptions(
        covariance="paper",
        bias="paper",
        test_prior="uniform",
        head_labels="zero_shot",
        fusion="matched",
        bias_test="off",
        solver=SolverOptions(beta_ratio_bound=None),
    )
    return resolve_options(paper, **overrides)


def released_options(**overrides: Any) -> FrolicOptions:
    r"""The authors' released method (``main_zeroshot.py`` of github.com/zhuhsingyuu/Frolic,
    :mod:`frolic_tta.released`), the one behind the paper's tables (``overrides`` on top, as
    in :func:`resolve_options`).

    A Gaussian head with the prototypes as means and :math:`0.9I + 0.1\,\mathrm{diag}` as
    covariance; two InMaP classifiers, supervised by the text and by that head (labels at
    InMaP's ``gamma=1``, all 2,000 steps), fused at equal fixed scales :math:`1/\tau_c`
    (x100 for CLIP); the label bias by 11 rounds of power iteration on hard labels. A
    balanced test set, no bound on :math:`\beta`.
    """
    released = FrolicOptions(
        covariance="released",
        zero_shot="inmap_both",
        fusion="fixed",
        inmap_gamma=1.0,
        bias="released",
        test_prior="uniform",
        head_labels="zero_shot",
        bias_test="off",
        solver=SolverOptions(eps=1e-3, max_iter=11, beta_ratio_bound=None, inmap_tolerance=None),
    )
    return resolve_options(released, **overrides)


def resolve_options(options: FrolicOptions | None = None, **overrides: Any) -> FrolicOptions:
    """``options`` (default :class:`FrolicOptions`) with ``overrides`` applied and validated.

    ``overrides`` are :class:`FrolicOptions` fields. ``solver=`` takes a
    :class:`SolverOptions` (the whole group) or a mapping of some of its fields, applied over
    ``options.solver`` (``released_options(solver={"max_iter": 5})`` keeps the released
    ``eps``).

    Raises:
        TypeError: ``options`` is not a :class:`FrolicOptions`, an override is not one of its
            fields (a solver field passed flat, ``eps=...``, says how to nest it), or a
            ``solver`` mapping has keys that are not :class:`SolverOptions` fields.
    """
    if options is None:
        options = FrolicOptions()
    elif not isinstance(options, FrolicOptions):
        raise TypeError(f"Expected `options` to be a FrolicOptions, but got {options!r}")
    flat = [name for name in SOLVER_FIELDS if name in overrides]
    if flat:
        example = ", ".join(f"{name}=..." for name in flat)
        nested = ", ".join(f"{name!r}: ..." for name in flat)
        raise TypeError(
            f"Expected the solver options {flat} inside `solver`, but got them as keyword "
            f"arguments: they are SolverOptions fields; pass solver=SolverOptions({example}) "
            f"or solver={{{nested}}}"
        )
    names = {f.name for f in fields(FrolicOptions)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise TypeError(
            f"Expected keyword arguments among the FrolicOptions fields {sorted(names)}, "
            f"but got {unknown}"
        )
    if "solver" in overrides:
        overrides["solver"] = solver_options(overrides["solver"], base=options.solver)
    return replace(options, **overrides) if overrides else options
