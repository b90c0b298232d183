"""Tests of kernels/renyi.py: the one-launch kernel against reference_renyi_gains, both against
DESIGN §4 written out with Python floats, the properties of DESIGN §4 (D[:, 0] = 0, telescoping,
flat groups, Euler's last gain), and the gains traced
(torch.compile, FakeTensorMode, meta tensors). W, built from the gains in recast.py, is tested in
test_method.py.

On CPU (the default) the kernel runs in the Triton interpreter, switched on by the repository's
conftest.py. With RECAST_TEST_DEVICE=cuda it is compiled and run on the GPU; the tolerances below
hold for both (see `tolerance`).
"""

import contextlib
import math
import os
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import renyi  # the file beside this one (pytest puts this folder on sys.path)

DEVICE = torch.device(os.environ.get("RECAST_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("RECAST_TEST_DEVICE=cuda but no GPU", allow_module_level=True)

EPS32 = torch.finfo(torch.float32).eps


def error_names(name: str) -> str:
    """Regex: the error message names `name` as a word (at the start or after a space)."""
    return rf"(^|\s){re.escape(name)}\b"


def make_scores(n_rewards, n_steps, n_groups, group_size, seed=0, flat_group=True):
    """Step scores (on DEVICE) that reveal the final ones progressively; group 0 of reward 0 is
    flat."""
    gen = torch.Generator().manual_seed(seed)
    final = torch.randn(n_rewards, 1, n_groups * group_size, generator=gen)
    if flat_group:
        final[0, 0, :group_size] = 0.7
    mix = torch.linspace(0, 1, n_steps + 1)[None, :, None]
    noise = torch.randn(n_rewards, n_steps + 1, n_groups * group_size, generator=gen)
    blur = 0.3 * torch.arange(n_steps + 1.0)[None, :, None]  # a per-step bias, removed by centring
    return (mix * final + (1 - mix) * noise + blur * (mix < 1)).to(DEVICE)


def divergence_ulps(alpha: float) -> float:
    """How much the divergence amplifies an fp32 ulp of error in the log-sum-exp (α·ℓ of up to
    |log 1e-4| ≈ 9.2, with the 1/|α - 1| in front): (1 + α)/|α - 1|, or 1 for the KL form."""
    return 1.0 if alpha == 1.0 else (1 + alpha) / abs(alpha - 1)


def tolerance(scores, group_size, alpha, adv_clip_max):
    """(atol of D, atol of the gains): at most twice the error of the same algorithm run in fp32
    (on the CPU, against float64), plus 64 fp32 ulp scaled by divergence_ulps(α) for the
    approximate exp and division of a GPU (ex2.approx, div.full.f32)."""
    cpu = scores.cpu()
    D_64, gains_64 = renyi._reference_gains(cpu, group_size, alpha, adv_clip_max, torch.float64)
    D_32, gains_32 = renyi._reference_gains(cpu, group_size, alpha, adv_clip_max, torch.float32)
    slack = 64 * EPS32 * divergence_ulps(alpha)
    err_D = (D_32 - D_64).abs().max().item()
    err_gains = (gains_32 - gains_64).abs().max().item()
    return 2 * err_D + slack, 2 * err_gains + 2 * slack


# (K, T, M groups, G, A_max); A_max = 1 clips many advantages, so r hits 0 and 1 exactly, r̂ hits
# its clamp and differs from r at the last column.
RENYI_CASES = [
    (2, 4, 6, 4, 5.0),
    (3, 5, 5, 3, 5.0),
    (1, 2, 7, 1, 5.0),
    (2, 3, 5, 300, 5.0),
    (3, 6, 16, 8, 5.0),
    (2, 4, 6, 8, 1.0),
    (2, 3, 3, 300, 1.0),
    (2, 1, 4, 5, 5.0),  # T = 1: one program per reward computes D[:, 1] only
]


@pytest.mark.parametrize("alpha", [2.0, 1.0, 0.5, 3.0])
@pytest.mark.parametrize("case", RENYI_CASES, ids=lambda c: "K{}-T{}-M{}-G{}-A{}".format(*c))
def test_renyi_gains_matches_reference(case, alpha):
    n_rewards, n_steps, n_groups, group_size, adv_clip_max = case
    scores = make_scores(n_rewards, n_steps, n_groups, group_size)
    D, gains = renyi.renyi_gains(scores, group_size, alpha, adv_clip_max)
    D_ref, gains_ref = renyi.reference_renyi_gains(scores, group_size, alpha, adv_clip_max)
    assert D.shape == (n_rewards, n_steps + 1) and gains.shape == (n_rewards, n_steps)
    assert D.dtype == gains.dtype == torch.float32 and D.device == gains.device == scores.device
    atol_D, atol_gains = tolerance(scores, group_size, alpha, adv_clip_max)
    torch.testing.assert_close(D, D_ref, rtol=0, atol=atol_D)
    torch.testing.assert_close(gains, gains_ref, rtol=0, atol=atol_gains)
    assert torch.all(D[:, 0] == 0)
    # The kernel writes D and the gains from the same computation of each D[k, i].
    torch.testing.assert_close(gains, D[:, 1:] - D[:, :-1], rtol=0, atol=1e-7)
    torch.testing.assert_close(gains.sum(1), D[:, -1], rtol=1e-6, atol=1e-6)
    if group_size > 1:  # the scores reveal more and more: D must be informative, D ≥ 0
        assert D[:, -1].min() > 1e-3 and D.min() >= -atol_D
    else:
        assert torch.all(D == 0)  # groups of one image are flat


def design_section_4(scores, group_size, alpha, adv_clip_max) -> torch.Tensor:
    """D (K, T+1) of DESIGN §4 written out image by image with Python floats, as the module
    docstring of renyi.py states it: each reward's own r of the final scores (a flat group has
    r = 1/2), at each step i < T the slope b pooled over all groups of z = (s_i - mean s_i) /
    (std s_T + 1e-4) (0 in a flat group), r̂ = clamp(mean r + b z, 1e-4, 1), at T r clamped
    alike; ℓ = log r̂ - log mean r̂, D_group = (log Σ exp(α ℓ) - log G) / (α - 1) or, at α = 1,
    mean ρ log ρ; D the mean over groups, D[:, 0] = 0."""
    eps = 1e-4
    n_rewards, n_cols, n = scores.shape
    G, A = group_size, adv_clip_max
    s = scores.double().cpu().tolist()

    def mean(xs):
        return sum(xs) / len(xs)

    def pstd(xs):
        return math.sqrt(mean([(x - mean(xs)) ** 2 for x in xs]))

    def groups(row):
        return [row[j : j + G] for j in range(0, n, G)]

    D = []
    for k in range(n_rewards):
        final = groups(s[k][-1])
        flat = [max(f) == min(f) for f in final]
        r = [
            [0.5] * G
            if fl
            else [0.5 + max(-A, min(A, (x - mean(f)) / (pstd(f) + eps))) / (2 * A) for x in f]
            for f, fl in zip(final, flat, strict=True)
        ]
        row = [0.0]
        for i in range(1, n_cols):
            if i < n_cols - 1:
                z = [
                    [0.0] * G if fl else [(x - mean(g)) / (pstd(f) + eps) for x in g]
                    for g, f, fl in zip(groups(s[k][i]), final, flat, strict=True)
                ]
                num = sum(
                    zj * (rj - mean(rg))
                    for zg, rg in zip(z, r, strict=True)
                    for zj, rj in zip(zg, rg, strict=True)
                )
                den = sum(zj * zj for zg in z for zj in zg)
                b = num / den if den > 0 else 0.0
                r_hat = [[mean(rg) + b * zj for zj in zg] for zg, rg in zip(z, r, strict=True)]
            else:
                r_hat = r
            per_group = []
            for rg in r_hat:
                rg = [min(1.0, max(eps, x)) for x in rg]
                ell = [math.log(x) - math.log(mean(rg)) for x in rg]
                if alpha == 1.0:
                    per_group.append(mean([math.exp(x) * x for x in ell]))
                else:
                    lse = math.log(sum(math.exp(alpha * x) for x in ell))
                    per_group.append((lse - math.log(G)) / (alpha - 1))
            row.append(mean(per_group))
        D.append(row)
    return torch.tensor(D, dtype=torch.float64)


@pytest.mark.parametrize("alpha", [2.0, 1.0, 0.5])
@pytest.mark.parametrize("adv_clip_max", [5.0, 1.0])  # 1.0: r reaches 0 and 1, r̂ its clamp
@pytest.mark.parametrize("fn_name", ["renyi_gains", "reference_renyi_gains"])
def test_renyi_gains_are_design_section_4_written_out(fn_name, adv_clip_max, alpha):
    """D and the gains against design_section_4, not against other code of renyi.py: a change
    made alike to the kernel and its reference (the 1/(α - 1), the pooled slope, the spread z is
    divided by, the mean over groups) fails here. The reference to float64 rounding (its outputs
    are fp32), the kernel within `tolerance`."""
    scores = make_scores(2, 4, 3, 6, seed=11)  # group 0 of reward 0 flat
    expected = design_section_4(scores, 6, alpha, adv_clip_max)
    assert expected[:, -1].min() > 1e-3  # informative: D is not trivially 0
    D, gains = getattr(renyi, fn_name)(scores, 6, alpha, adv_clip_max)
    if fn_name == "reference_renyi_gains":
        atol_D, atol_gains = 1e-7, 2e-7
    else:
        atol_D, atol_gains = tolerance(scores, 6, alpha, adv_clip_max)
    torch.testing.assert_close(D.double().cpu(), expected, rtol=1e-6, atol=atol_D)
    torch.testing.assert_close(gains.double().cpu(), expected.diff(dim=1), rtol=1e-6,
                               atol=atol_gains)  # fmt: skip


def test_renyi_gains_runs_the_kernel(monkeypatch):
    """Guards the tests above against comparing the reference with itself: in a process where
    the interpreter is off (this file copied without the repository's conftest.py, and pytest run
    without TRITON_INTERPRET=1), renyi_gains on CPU tensors is the reference."""
    assert renyi._INTERPRET or DEVICE.type == "cuda", "run with TRITON_INTERPRET=1 on a CPU"
    monkeypatch.setattr(renyi, "_reference_gains", no_reference)
    D, gains = renyi.renyi_gains(make_scores(2, 3, 2, 3, seed=9), 3)
    assert D.shape == (2, 4) and gains.shape == (2, 3)


@pytest.mark.parametrize("fn_name", ["renyi_gains", "reference_renyi_gains"])
def test_renyi_gains_never_require_grad(fn_name):
    """Scores that require a gradient (a differentiable reward scored outside no_grad): D and
    the gains are statistics, detached on both paths; the kernel's operator has no backward."""
    scores = make_scores(2, 3, 2, 3, seed=9).requires_grad_()
    D, gains = getattr(renyi, fn_name)(scores, 3)
    assert not D.requires_grad and not gains.requires_grad


def test_renyi_gains_is_one_launch(monkeypatch):
    launches = []
    kernel = renyi._renyi_gains_kernel

    class Count:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(renyi, "_renyi_gains_kernel", Count())
    renyi.renyi_gains(make_scores(2, 4, 6, 4), 4)
    assert launches == [(2, 4)]


def test_renyi_gains_strided_and_double_scores():
    scores = make_scores(2, 4, 6, 4, seed=1).double().transpose(0, 2).contiguous().transpose(0, 2)
    assert not scores.is_contiguous()
    D, gains = renyi.renyi_gains(scores, 4)
    D_ref, gains_ref = renyi.reference_renyi_gains(scores, 4)
    atol_D, atol_gains = tolerance(scores, 4, 2.0, 5.0)
    torch.testing.assert_close(D, D_ref, rtol=0, atol=atol_D)
    torch.testing.assert_close(gains, gains_ref, rtol=0, atol=atol_gains)
    # every fourth image of a wider tensor: a stride along N
    wide = torch.zeros(2, 5, 24 * 4, device=DEVICE, dtype=torch.float64)
    wide[..., ::4] = scores
    D_wide, gains_wide = renyi.renyi_gains(wide[..., ::4], 4)
    assert torch.equal(D_wide, D) and torch.equal(gains_wide, gains)


@pytest.mark.parametrize("fn_name", ["renyi_gains", "reference_renyi_gains"])
def test_renyi_flat_group_does_not_touch_the_others(fn_name):
    """A group with equal final scores has z = 0 and D_group = 0: appending one to M groups
    multiplies D by M / (M + 1) exactly, whatever its step scores. With z = (s_i - mean)/1e-4 there
    instead, it would dominate Σ z² and flatten every other group's r̂."""
    fn = getattr(renyi, fn_name)
    scores = make_scores(2, 4, 5, 4, seed=2, flat_group=False)
    D, _ = fn(scores, 4)
    flat = torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    flat[:, -1] = 0.25
    D_more, _ = fn(torch.cat([scores, flat], dim=2), 4)
    assert not D_more.isnan().any()
    torch.testing.assert_close(D_more * 6 / 5, D, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fn_name", ["renyi_gains", "reference_renyi_gains"])
def test_renyi_constant_step_scores_give_zero(fn_name):
    """Step scores all equal within every group reveal nothing: r̂ = mean r, D ≈ 0 at that step
    (the group means of seven copies of 0.1 are rounded; the equal residues must not matter)."""
    scores = make_scores(2, 4, 3, 7, seed=4).double()
    scores[:, 2] = 0.1
    D, _ = getattr(renyi, fn_name)(scores, 7)
    assert D[:, 2].abs().max() < 1e-6  # the fp32 log-ratio of r̂ = mean r to its mean: ~1 ulp


def test_renyi_last_gain_is_zero_for_euler():
    """Euler's last step prediction is the sample itself: with no clipped advantage r̂ = r there, so
    the last gain is 0 (D[:, T] clamps r like r̂), up to the rounding of r̂ = mean r + b z."""
    scores = make_scores(3, 5, 6, 8, seed=5)  # G = 8: |A| ≤ √7 < 5, nothing clipped
    scores[:, -2] = scores[:, -1]
    for alpha in (2.0, 1.0):
        _, gains = renyi.renyi_gains(scores, 8, alpha)
        atol = 16 * EPS32 * divergence_ulps(alpha)
        torch.testing.assert_close(gains[:, -1], torch.zeros_like(gains[:, -1]), rtol=0, atol=atol)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter
def test_renyi_nonfinite_scores_without_checks_give_nan():
    """What CUDA does without CHECK_VALUES: D is NaN at every step whose program read a NaN or an
    inf, and so are the gains next to it; a NaN in the step-0 scores is never read."""
    scores = make_scores(2, 4, 3, 4, seed=6)
    scores[0, 2, 5] = float("nan")  # reward 0, step 2
    scores[1, 4, 0] = float("inf")  # reward 1, final scores: every step of reward 1
    scores[1, 0, 3] = float("nan")  # step 0: unused
    D, gains = renyi._renyi_gains_op(scores, 4, 2.0, 5.0)  # no checks
    assert D[0, 2].isnan() and not D[0, [0, 1, 3, 4]].isnan().any()
    assert gains[0, 1:3].isnan().all() and not gains[0, [0, 3]].isnan().any()
    assert D[1, 0] == 0 and D[1, 1:].isnan().all() and gains[1].isnan().all()


def nan_at(scores):
    scores = scores.clone()
    scores[1, 2, 5] = float("nan")
    return scores


# (argument the error must name, how to break the inputs)
BAD_RENYI_INPUTS = [
    ("scores", lambda s: {"scores": s[0]}),
    ("scores", lambda s: {"scores": s[:, :1]}),  # T = 0
    ("scores", lambda s: {"scores": s[:, :, :0]}),  # N = 0
    ("scores", lambda s: {"scores": nan_at(s)}),
    ("scores", lambda s: {"scores": (10 * s).long()}),
    ("group_size", lambda s: {"group_size": 5}),
    ("group_size", lambda s: {"group_size": 0}),
    ("alpha", lambda s: {"alpha": 0.0}),
    ("adv_clip_max", lambda s: {"adv_clip_max": -1.0}),
]


@pytest.mark.parametrize("name, breaks", BAD_RENYI_INPUTS, ids=[n for n, _ in BAD_RENYI_INPUTS])
@pytest.mark.parametrize("fn_name", ["renyi_gains", "reference_renyi_gains"])
def test_renyi_bad_inputs(fn_name, name, breaks, monkeypatch):
    monkeypatch.setattr(renyi, "CHECK_VALUES", True)  # finiteness on CUDA too
    scores = make_scores(2, 3, 4, 3)
    kwargs = {"scores": scores, "group_size": 3, **breaks(scores)}
    with pytest.raises(ValueError, match=error_names(name)):
        getattr(renyi, fn_name)(**kwargs)


# ---------------------------------------------------------------------------------------------
# Tracing: torch.compile, FakeTensorMode and meta tensors (what a memory plan runs)
# ---------------------------------------------------------------------------------------------
RENYI_OP = torch.ops.recast.renyi_gains.default


class RecordOps(TorchDispatchMode):
    """Records every operator that reaches the dispatcher below autograd."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append(func)
        return func(*args, **(kwargs or {}))


def no_reference(*args, **kwargs):
    raise AssertionError("the reference ran instead of the kernel's operator")


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_renyi_gains_compiles_without_graph_break(backend):
    """torch.compile(fullgraph=True), W built from the gains in the same graph: one graph, the
    kernel's operator in it, D and the gains equal eager's bit for bit (under inductor, which
    generates its own code around the operator, to float rounding)."""

    def gains_to_weights(scores):
        D, gains = renyi.renyi_gains(scores, 4, alpha=2.0)
        return D, gains.clamp(min=0) / gains.clamp(min=0).sum(1, keepdim=True)

    graphs = []

    def backend_fn(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    scores = make_scores(2, 4, 6, 4, seed=7)
    compiled = torch.compile(gains_to_weights, backend=backend_fn, fullgraph=True)
    for got, expected in zip(compiled(scores), gains_to_weights(scores), strict=True):
        if backend == "inductor":
            torch.testing.assert_close(got, expected)
        else:
            assert torch.equal(got, expected)
    (graph,) = graphs
    assert sum(node.target is RENYI_OP for node in graph.graph.nodes) == 1


@pytest.mark.parametrize("where", ["fake", "meta"])
def test_renyi_gains_traces_without_values(where, monkeypatch):
    """FakeTensorMode, and meta tensors in a process without the interpreter (a planner's): the
    operator's fake implementation gives D and the gains' shapes; the kernel is not launched, the
    reference does not run, and no value is read (a NaN score would otherwise be an error)."""
    monkeypatch.setattr(renyi, "_INTERPRET", False if where == "meta" else renyi._INTERPRET)
    monkeypatch.setattr(renyi, "_reference_gains", no_reference)
    monkeypatch.setattr(renyi, "_renyi_gains_kernel", None)  # a launch would fail: None[grid]
    scores = make_scores(3, 5, 4, 6, seed=8)
    scores[0, 1, 0] = float("nan")
    with FakeTensorMode() if where == "fake" else contextlib.nullcontext() as mode:
        scores = mode.from_tensor(scores) if where == "fake" else scores.to("meta")
        with RecordOps() as ops:
            D, gains = renyi.renyi_gains(scores, 6)
    assert D.shape == (3, 6) and gains.shape == (3, 5)
    assert D.dtype == gains.dtype == torch.float32
    assert (D.is_meta and gains.is_meta) if where == "meta" else isinstance(D, FakeTensor)
    assert ops.calls.count(RENYI_OP) == 1
