"""Tests of the method's formulas written out in recast.py: the sampler and its step predictions
of DESIGN §1-2, the step scores the gains read (§4), the optimality r of §3 (each reward's own,
the same r that the gains kernel computes inside, and each reward's share of the signal), the
gains' EMA and the weight matrix W of §5 (gain_profiles, recast_weights, --gain-shift), the
readable NFT loss of §6 against the fused kernel's own reference (the kernel is tested against
that reference in kernels/test_nft_loss.py), each pair's noising, and the old policy's EMA.
Also: the flags' displayed defaults are the ones that run."""

import math

import pytest
import torch

import harness
import recast
from plumbing import cli
from recast import gain_profiles, recast_weights, shift_gains
from recast_kernels import nft_loss as kernel_loss
from recast_kernels import renyi


# ---------------------------------------------------------------------------------------------
# The sampler and the step scores it leaves (DESIGN §1-2, §4)
# ---------------------------------------------------------------------------------------------
def test_sample_is_euler_and_keeps_each_steps_clean_prediction():
    """recast.sample against DESIGN §1-2 written out: x_t_i+1 = x_t_i + (t_i+1 - t_i)·v and
    x̂0_i = x_t_i - t_i·v at t_i (i = 0 … T-1), the velocity read at t_i; with t_T = 0 the last
    prediction is the sample itself, bit for bit (why Euler's last gain is 0, DESIGN §4)."""
    gen = torch.Generator().manual_seed(5)
    noise, target = (torch.randn(3, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    sigmas = torch.tensor([1.0, 0.8, 0.45, 0.2, 0.0], dtype=torch.float64)
    velocity = lambda x, c, t: (x - target) * (1 + t[:, None, None]) + c  # noqa: E731
    x0, preds = recast.sample(velocity, noise, 0.3, sigmas)
    x, expected = noise, []
    for i in range(4):
        v = (x - target) * (1 + sigmas[i]) + 0.3
        expected.append(x - sigmas[i] * v)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    assert preds.shape == (4, 3, 2, 4)
    torch.testing.assert_close(preds, torch.stack(expected), rtol=0, atol=1e-12)
    torch.testing.assert_close(x0, x, rtol=0, atol=1e-12)
    assert torch.equal(preds[-1], x0)


def test_trajectory_scores_put_step_is_prediction_in_column_i():
    """recast.trajectory_scores (DESIGN §4): (K, T+1, n), column i reward k's score of the step-i
    prediction x̂0_i for i = 1 … T-1, column T the final scores as given, column 0 left 0 (the
    prediction from pure noise is never read: D_k,0 := 0), each prediction decoded first."""
    gen = torch.Generator().manual_seed(2)
    preds = torch.arange(4.0)[:, None, None, None] + torch.rand(4, 3, 2, 2, generator=gen)  # T=4
    fns = {"mean": lambda x, p: x.mean((1, 2)), "first": lambda x, p: x[:, 0, 0]}
    final = torch.tensor([[7.0, 8.0, 9.0], [1.0, 2.0, 3.0]])
    decoded = []
    got = recast.trajectory_scores(fns, lambda x: decoded.append(1) or 2 * x, preds, final,
                                   ["a", "b", "c"])  # fmt: skip
    assert got.shape == (2, 5, 3) and len(decoded) == 3  # steps 1 … T-1, once each
    assert (got[:, 0] == 0).all() and torch.equal(got[:, 4], final)
    for i in range(1, 4):
        assert torch.equal(got[0, i], (2 * preds[i]).mean((1, 2)))
        assert torch.equal(got[1, i], 2 * preds[i, :, 0, 0])


# ---------------------------------------------------------------------------------------------
# r (DESIGN §3)
# ---------------------------------------------------------------------------------------------
def test_group_optimality():
    scores = torch.tensor([[0.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0]])
    r = recast.group_optimality(scores, 4, adv_clip_max=5.0)
    assert torch.all(r[0, 4:] == 0.5)  # zero spread
    g = scores[0, :4]
    expected = 0.5 + ((g - g.mean()) / (g.std(correction=0) + 1e-4)).clamp(-5, 5) / 10
    torch.testing.assert_close(r[0, :4], expected)
    wide = recast.group_optimality(torch.tensor([0.0] * 30 + [100.0]), 31, adv_clip_max=2.0)
    assert wide[-1] == 1.0 and wide.min() >= 0.0  # clipped at A_max
    assert math.isclose(recast.group_optimality(torch.ones(3), 3)[0].item(), 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_r_is_the_r_inside_the_gains_kernel(dtype):
    """The per-reward r that trains (recast.group_optimality) is the r the gains' reference
    computes (renyi._group_optimality): the same numbers, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(4, 48, generator=gen, dtype=dtype) * torch.tensor(
        [[1.0], [0.1], [3.0], [0.5]], dtype=dtype
    )
    scores[:, :8] = 0.25  # a constant group
    scores[0, 8] = 40.0  # a clipped advantage
    assert torch.equal(recast.group_optimality(scores, 8, 5.0),
                       renyi._group_optimality(scores, 8, 5.0))  # fmt: skip


# Units (DESIGN §3): which rules give the same r when a reward is written in other units
# ---------------------------------------------------------------------------------------------
def _r(rule: str, scores: torch.Tensor, lam: torch.Tensor, G: int = 8) -> torch.Tensor:
    """r of `scores` (K, N) as recast.optimality makes it under `rule` (a --normalize choice, or
    'sum' / 'sum unit-joint' for --weighting sum on raw or unit-free scores)."""
    from types import SimpleNamespace

    weighting, _, normalize = rule.partition(" ")
    if weighting != "sum":
        weighting, normalize = "recast", rule
    args = SimpleNamespace(group_size=G, adv_clip_max=5.0, weighting=weighting,
                           normalize=normalize or "per-reward")  # fmt: skip
    return recast.optimality(SimpleNamespace(args=args, lam=lam), scores)


RULES = ["per-reward", "batch", "joint", "unit-joint", "sum", "sum unit-joint"]
UNIT_FREE = {"unit-joint", "sum unit-joint"}  # exactly; per-reward and batch to the 1e-4 guard


def _scores(dtype=torch.float64, spread=(1.0, 0.1, 3.0, 0.5), G=8, M=12, seed=4):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.tensor(spread, dtype=dtype)[:, None] * torch.randn(4, G * M, generator=gen,
                                                                      dtype=dtype)  # fmt: skip
    scores[:, :G] = 0.25  # a group flat in every reward
    scores[1, G : 2 * G] = -3.0  # a group flat in one reward
    return scores


@pytest.mark.parametrize("rule", RULES)
def test_units_change_r_only_under_the_rules_that_read_raw_scale(rule):
    """Each reward multiplied by a positive factor and shifted (other units): r is unchanged to
    float rounding under the unit-free rules, and moves under joint and the raw sum. Per-reward
    and batch move by what the fixed 1e-4 guard takes, at most 1e-4/σ of an advantage where σ
    is the smallest group spread (the next test)."""
    lam = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    scores = _scores()
    c = torch.tensor([10.0, 0.1, 1.0, 3.7], dtype=torch.float64)[:, None]
    b = torch.tensor([-20.0, 5.0, 0.0, 1e3], dtype=torch.float64)[:, None]
    r, moved = _r(rule, scores, lam), _r(rule, c * scores + b, lam)
    assert torch.isfinite(r).all() and r.shape[1] == scores.shape[1]
    if rule in UNIT_FREE:
        torch.testing.assert_close(moved, r, rtol=0, atol=1e-12)
    elif rule in ("per-reward", "batch"):  # |ΔA| ≤ |A|·1e-4/σ, σ the smallest group spread
        g = (c * scores).unflatten(1, (-1, 8)).std(-1, correction=0)
        bound = 5.0 * 1e-4 / g[g > 0].min() / 10  # |A| ≤ A_max = 5, and r = 1/2 + A/10
        assert 0 < (moved - r).abs().max() <= bound
    else:
        assert (moved - r).abs().max() > 0.01  # joint and the raw sum read the units


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unit_joint_holds_where_the_fixed_guard_does_not(dtype):
    """The limit of per-reward's and batch's invariance: a reward of within-group spread σ keeps
    σ / (σ + 1e-4) of its advantage, so written in units where σ = 5e-4 it loses a sixth. Under
    unit-joint the guard meets numbers in no units: the same r in those units as in any other
    (fp32: to its rounding, offsets included), and a reward flat in every group gets 1/2."""
    lam = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    scores = _scores(dtype)
    s1 = scores[1].unflatten(0, (-1, 8))
    s1 = s1 - s1.mean(-1, keepdim=True)
    sigma = s1.std(-1, correction=0)  # reward 1's spread in each group
    small = scores.clone()
    small[1] = scores[1] * (5e-4 / sigma[2])  # group 2 of reward 1 now spreads 5e-4
    A = lambda r: 10 * (r - 0.5)  # noqa: E731  (A_max = 5)
    kept = A(_r("per-reward", small, lam))[1, 16:24] / A(_r("per-reward", scores, lam))[1, 16:24]
    expected = 5e-4 / (5e-4 + 1e-4) * (sigma[2] + 1e-4) / sigma[2]  # 5/6, over the big units'
    torch.testing.assert_close(kept, torch.full_like(kept, expected.item()), rtol=1e-4, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for moved in (small, small * 1e3 + 20.0):
        torch.testing.assert_close(_r("unit-joint", moved, lam), _r("unit-joint", scores, lam),
                                   rtol=0, atol=tol)  # fmt: skip
    flat = scores.clone()
    flat[2] = 7.0  # reward 2 constant over the batch: pooled spread 0
    r = _r("unit-joint", flat, lam)
    assert torch.isfinite(r).all() and (recast.pooled_spread(flat, 8)[2] == 0).all()
    others = _r("unit-joint", flat[[0, 1, 3]], lam[[0, 1, 3]])  # as if it were not there
    torch.testing.assert_close(r[[0, 1, 3]], others, rtol=0, atol=tol)
    assert (r[2] == 0.5).all()


@pytest.mark.parametrize("rule", RULES)
def test_a_flat_group_gets_exactly_one_half_under_every_rule(rule):
    """A group whose scores are all equal (in one reward, or in all) gets r = 1/2 exactly, in
    fp32, where its mean rounds (0.1 · 8 / 8 ≠ 0.1 in fp32): no advantage from rounding."""
    lam = torch.tensor([0.4, 0.2, 0.2, 0.2])
    scores = _scores(torch.float32)
    scores[:, :8] = 0.1  # flat in every reward; 0.1 has no exact fp32 mean over 8 summed
    scores[1, 8:16] = 1 / 3
    r = _r(rule, scores, lam)
    assert (r[:, :8] == 0.5).all()
    if rule in ("per-reward", "batch"):  # one reward's flat group: each reward on its own
        assert (r[1, 8:16] == 0.5).all()


def test_joint_gives_one_half_where_the_weighted_sum_is_constant():
    """DESIGN §3: under joint a group whose λ-weighted sum is constant gets r = 1/2 for every
    reward, even where the rewards themselves vary (here they cancel), as the summed reward does;
    (s - mean)/1e-4 would otherwise give them advantages of thousands."""
    lam = torch.tensor([0.5, 0.5], dtype=torch.float64)
    scores = _scores()[:2].clone()
    scores[1, 8:16] = -scores[0, 8:16]  # group 1: 0.5·s_0 + 0.5·s_1 = 0 exactly, both vary
    assert scores[0, 8:16].std() > 0.1 and (lam @ scores[:, 8:16] == 0).all()
    r = recast.joint_optimality(scores, lam, 8)
    assert (r[:, 8:16] == 0.5).all()
    assert (r[:, 16:] != 0.5).any()  # the other groups train


def test_unit_joint_divides_by_batchs_pooled_spread():
    """σ_k of batch and unit-joint (DESIGN §3) written out: √(mean over groups of the population
    variance), a flat group counting 0; unit-joint is joint of s_k / σ_k. (The units tests above
    cannot see which spread divides: any σ that scales with the reward's units passes them.)"""
    lam = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    scores = _scores()
    var = scores.unflatten(1, (-1, 8)).var(-1, correction=0)  # (K, M), 0 in the flat groups
    sigma = var.mean(1).sqrt()
    torch.testing.assert_close(recast.pooled_spread(scores, 8)[:, 0], sigma, rtol=1e-14, atol=0)
    torch.testing.assert_close(_r("unit-joint", scores, lam),
                               recast.joint_optimality(scores / sigma[:, None], lam, 8),
                               rtol=0, atol=1e-12)  # fmt: skip
    A = 10 * (_r("batch", scores, lam) - 0.5)  # batch's advantage: centred over σ_k + 1e-4
    centred = scores.unflatten(1, (-1, 8)) - scores.unflatten(1, (-1, 8)).mean(-1, keepdim=True)
    torch.testing.assert_close(A, (centred / (sigma[:, None, None] + 1e-4)).flatten(1),
                               rtol=0, atol=1e-12)  # fmt: skip


@pytest.mark.parametrize("rule", ["per-reward", "batch", "joint", "unit-joint"])
def test_signal_share_is_lambda_times_the_advantages_spread(rule):
    """DESIGN §3, what λ weighs: harness.signal_share is λ_k × mean over groups of the
    within-group spread of A_k, summed to 1, with A_k the advantage recast.optimality trains on
    under `rule` (G = 8: |A| ≤ √7, no clip binds). The share is computed from the scores, not
    from r, so a rule's formula can drift apart from the loop's: here they are held together."""
    lam = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    scores = _scores()
    A = 10 * (_r(rule, scores, lam) - 0.5)  # A_max = 5
    weight = lam * A.unflatten(1, (-1, 8)).std(-1, correction=0).mean(1)
    share = harness.signal_share(scores, lam, 8, rule)
    torch.testing.assert_close(share, weight / weight.sum(), rtol=1e-9, atol=0)


def test_signal_share_under_joint_counts_nothing_of_a_group_whose_sum_cancels():
    """A group whose λ-weighted sum is constant while its rewards move (two rewards' moves cancel
    exactly) trains nothing under joint (r = 1/2, as the summed reward): its share is 0 there,
    not its rewards' spread over the 1e-4 guard, which took nearly all of the signal."""
    lam = torch.full((4,), 0.25, dtype=torch.float64)
    scores = _scores()
    scores[0, 8:16] = torch.linspace(-1, 1, 8, dtype=torch.float64)
    scores[1, 8:16] = -scores[0, 8:16]  # group 1: rewards 0 and 1 cancel
    scores[2:, 8:16] = 0.5
    summed = (lam @ scores)[8:16]
    assert summed.amax() == summed.amin()
    A = 10 * (_r("joint", scores, lam) - 0.5)
    assert A[:, 8:16].abs().max() == 0  # the loop trains nothing there
    weight = lam * A.unflatten(1, (-1, 8)).std(-1, correction=0).mean(1)
    share = harness.signal_share(scores, lam, 8, "joint")
    torch.testing.assert_close(share, weight / weight.sum(), rtol=1e-9, atol=0)


def test_unit_joint_gains_read_the_step_scores_in_no_units():
    """DESIGN §3: under unit-joint the gains read the step scores divided by σ_k of the epoch's
    final scores (recast.gain_scores), so their 1e-4 guard too meets numbers in no units: the
    gains of a reward written in units where it spreads 5e-4 are its gains in any other. Under
    joint the step scores are read as scored and those units cost the gains their guard's share."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(13)
    K, T, G, M = 2, 4, 8, 6
    final = torch.randn(K, G * M, generator=gen, dtype=torch.float64)
    steps = final[:, None] * torch.linspace(0, 1, T + 1, dtype=torch.float64)[:, None]
    steps = steps + 0.5 * torch.randn(K, T + 1, G * M, generator=gen, dtype=torch.float64)
    steps[:, -1] = final
    c = torch.tensor([1e3, 5e-4], dtype=torch.float64)[:, None]  # reward 1 now spreads ~5e-4

    def gains(normalize, units):
        run = SimpleNamespace(args=SimpleNamespace(normalize=normalize, group_size=G))
        scored = recast.gain_scores(run, units[:, None] * steps + 3.0, units * final + 3.0)
        return renyi.reference_renyi_gains(scored, G)[1].double()

    one = torch.ones(2, 1, dtype=torch.float64)
    native = gains("unit-joint", one)
    assert native.abs().max() > 0.01
    torch.testing.assert_close(gains("unit-joint", c), native, rtol=0, atol=1e-6)
    assert (gains("joint", c) - gains("joint", one))[1].abs().max() > 1e-3


def test_unit_joint_with_uniform_w_is_the_unit_free_sum():
    """W = λ/T under unit-joint gives the advantage of Σ_k λ_k s_k / σ_k, the summed reward of the
    unit-free scores (--weighting sum --normalize unit-joint), as joint does for the raw sum."""
    lam = torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)
    scores = _scores()
    mix = lam @ _r("unit-joint", scores, lam)  # W = λ/T: every column mixes r by λ
    torch.testing.assert_close(mix.clamp(0, 1), _r("sum unit-joint", scores, lam)[0])


def test_gdpo_is_the_hand_computation():
    """--weighting gdpo (DESIGN §3) on a batch small enough to do by hand: each reward z-scored in
    its group (population std), λ-summed, whitened over the batch, clipped and mapped to r."""
    import statistics

    lam = torch.tensor([0.75, 0.25], dtype=torch.float64)
    s = [[1.0, 2.0, 6.0, 0.0, 0.0, 3.0], [10.0, 40.0, 10.0, 5.0, 5.0, 5.0]]  # G = 3, M = 2
    z = []
    for k in range(2):
        row = []
        for g in range(2):
            grp = s[k][3 * g : 3 * g + 3]
            mu, sd = statistics.fmean(grp), statistics.pstdev(grp)
            row += [0.0 if sd == 0 else (x - mu) / max(sd, 1e-6) for x in grp]
        z.append(row)
    mixed = [0.75 * a + 0.25 * b for a, b in zip(*z, strict=True)]
    mu, sd = statistics.fmean(mixed), statistics.pstdev(mixed)
    expected = [0.5 + max(-5.0, min(5.0, (x - mu) / sd)) / 10 for x in mixed]
    got = recast.gdpo_optimality(torch.tensor(s, dtype=torch.float64), lam, 3)
    assert got.shape == (1, 6)
    torch.testing.assert_close(got[0], torch.tensor(expected, dtype=torch.float64), rtol=0,
                               atol=1e-12)  # fmt: skip
    # a clip that binds: one image far above a batch of equals
    wide = torch.zeros(1, 40, dtype=torch.float64)
    wide[0, 0] = 1.0
    r = recast.gdpo_optimality(wide, torch.ones(1, dtype=torch.float64), 4, adv_clip_max=2.0)
    assert r[0, 0] == 1.0 and r.min() >= 0
    # the whitening removes λ's scale, and a group flat in every reward trains nothing there
    flat = _scores()
    torch.testing.assert_close(recast.gdpo_optimality(flat, 3 * LAM.double(), 8),
                               recast.gdpo_optimality(flat, LAM.double(), 8))  # fmt: skip
    r = recast.gdpo_optimality(flat, LAM.double(), 8)
    assert r[0, :8].std() == 0


def test_gdpo_without_its_whitening_is_per_reward_uniform():
    """Per-reward uniform (W = λ/T on per-reward r) mixes 1/2 + Σ λ_k A_k / (2 A_max): GDPO's
    λ-sum before the whitening (G = 8: no per-reward clip binds, and the guards differ by 1e-4)."""
    scores = _scores()
    lam = LAM.double()
    mix = lam @ _r("per-reward", scores, lam)  # (N,)
    s = scores.unflatten(1, (-1, 8))
    z = recast.group_centred(scores, 8) / s.std(-1, correction=0, keepdim=True).clamp_min(1e-6)
    unwhitened = 0.5 + (lam @ z.flatten(1)) / 10
    torch.testing.assert_close(mix, unwhitened, rtol=0, atol=1e-3)


# gain_profiles and recast_weights: the weight matrix W (DESIGN §5)
# ---------------------------------------------------------------------------------------------
LAM = torch.tensor([0.4, 0.2, 0.2, 0.2])


def _random_gains(seed, K=4, T=10):
    return torch.rand(K, T, generator=torch.Generator().manual_seed(seed)) ** 3


@pytest.mark.parametrize("seed", range(5))
def test_weights_have_the_marginals(seed):
    W = recast_weights(_random_gains(seed), LAM)
    assert torch.allclose(W.double().sum(1), LAM.double(), atol=1e-6)
    assert torch.allclose(W.double().sum(0), torch.full((10,), 0.1, dtype=torch.float64), atol=1e-6)


def test_weights_ignore_the_scale_of_a_rewards_gains():
    g = _random_gains(0)
    scaled = g.clone()
    scaled[1] *= 37.0
    assert torch.allclose(recast_weights(g, LAM), recast_weights(scaled, LAM), atol=1e-7)


def test_equal_profiles_zero_gains_and_high_temperature_give_static_weights():
    static = LAM[:, None].expand(4, 10) / 10
    same = _random_gains(1, K=1).expand(4, 10)
    assert torch.allclose(recast_weights(same, LAM), static, atol=1e-7)
    assert torch.allclose(recast_weights(torch.zeros(4, 10), LAM), static, atol=1e-7)
    assert torch.allclose(recast_weights(_random_gains(2), LAM, tau=1e6), static, atol=1e-6)
    assert not torch.allclose(recast_weights(_random_gains(2), LAM), static, atol=1e-3)


@pytest.mark.parametrize("tau, shift", [(0.5, 1), (1.0, 0), (2.0, 1), (0.25, 2)])
def test_w_is_the_kernel_scaled_by_rows_and_columns(tau, shift):
    """DESIGN §5: W is a Sinkhorn scaling of M_k,i = λ_k·p_k,i^(1/τ), i.e. W = diag(a)·M·diag(b):
    log W - log M is u_k + v_i, which with the marginals fixes W. Pins the kernel itself (where
    τ enters: on the floored profile, not on the gains), which the marginals and the limits
    τ → ∞ and equal profiles leave free."""
    g = _random_gains(11)
    W = recast_weights(g, LAM, tau=tau, shift=shift).double()
    log_m = LAM.double().log()[:, None] + gain_profiles(g, 0.1, shift).log() / tau
    L = W.log() - log_m
    residual = L - L[:, :1] - L[:1, :] + L[0, 0]  # 0 where L = u_k + v_i
    assert residual.abs().max() < 1e-5  # W is fp32
    torch.testing.assert_close(W.sum(1), LAM.double(), rtol=0, atol=1e-6)


def test_raising_a_gain_never_lowers_its_own_weight():
    g = _random_gains(3)
    for k, i in [(0, 0), (1, 5), (3, 9), (2, 2)]:
        W0 = recast_weights(g, LAM)[k, i]
        for factor in (1.5, 3.0, 10.0):
            up = g.clone()
            up[k, i] = up[k, i] * factor + 0.01
            assert recast_weights(up, LAM)[k, i] >= W0 - 1e-7


def test_weights_follow_the_gains():
    gains = torch.zeros(2, 10)
    gains[0, :3], gains[1, -4:-1] = 1.0, 1.0  # reward 0 informative early, reward 1 late
    W = recast_weights(gains, torch.tensor([0.5, 0.5]))
    centre = (W * torch.arange(10.0)).sum(1) / W.sum(1)  # where along the steps each row sits
    assert centre[0] < 3 < 6 < centre[1]
    # the last column carries no gain (Euler's last prediction is the sample), so it stays at λ
    assert torch.allclose(W[:, -1] * 10, torch.tensor([0.5, 0.5]), atol=0.05)
    prof = gain_profiles(gains, 0.1)
    assert torch.allclose(prof.sum(1), torch.ones(2, dtype=prof.dtype))
    assert prof.min() >= 0.1 / 10 - 1e-12


@pytest.mark.parametrize("shift", [0, 1])
def test_profiles_clip_negative_gains_and_a_reward_without_gain_is_flat(shift):
    """DESIGN §4-5: negative gains count as 0 in the profile, and a reward with no positive gain
    in any column has no timing to follow: its profile is 1/T in every column, the first S
    included (not the floor ε_f / T that a column without gain gets in another reward's profile)."""
    g = _random_gains(8).double()
    g[0, 3] = -0.7  # a negative gain: as if it were 0
    g[1] = -_random_gains(9)[1].double()  # no positive gain anywhere
    g[2, 0] = -2.0
    clipped = g.clamp(min=0)
    p = gain_profiles(g, 0.1, shift)
    torch.testing.assert_close(p, gain_profiles(clipped, 0.1, shift), rtol=0, atol=0)
    assert (p[1] == 1 / 10).all()
    expected = 0.9 * shift_gains(clipped[0:1], shift) / clipped[0, : 10 - shift].sum() + 0.01
    torch.testing.assert_close(p[0:1], expected, rtol=1e-15, atol=0)
    assert (p[[0, 2, 3], :shift] == 0.01).all()


def test_zero_budget_reward_gets_no_weight():
    W = recast_weights(_random_gains(4), torch.tensor([0.5, 0.0, 0.25, 0.25]))
    assert W[1].abs().max() == 0
    assert torch.allclose(W.double().sum(0), torch.full((10,), 0.1, dtype=torch.float64), atol=1e-6)


def test_weights_smooth_the_gains_with_their_ema_and_uniform_is_static():
    """recast.weights (DESIGN §4-5): this epoch's gains are renyi_gains of the step scores, the
    EMA is --gain-ema·previous + (1 - --gain-ema)·this epoch's (the first epoch: its own gains),
    W is recast_weights of the EMA; the metrics log this epoch's D and gains, not the EMA.
    --weighting uniform's W is λ/T and leaves the EMA as it was."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(6)
    scores = torch.randn(4, 7, 24, generator=gen) * torch.linspace(0.2, 1.0, 7)[:, None]
    args = SimpleNamespace(steps=6, group_size=8, alpha=2.0, adv_clip_max=5.0, gain_ema=0.8,
                           tau=1.0, floor=0.1, gain_shift=1, weighting="recast")  # fmt: skip
    run = SimpleNamespace(args=args, names=list("abcd"), lam=LAM.double(), observe=nullcontext)
    D, gains = renyi.reference_renyi_gains(scores, 8, 2.0, 5.0)  # the kernel's, to fp32
    previous = _random_gains(10, T=6).double()
    metrics = {}
    W, ema = recast.weights(run, scores, previous, metrics)
    logged = torch.tensor(metrics["gains"], dtype=torch.float64)
    torch.testing.assert_close(logged, gains.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(metrics["D"]), D, rtol=0, atol=1e-6)
    torch.testing.assert_close(ema, 0.8 * previous + 0.2 * logged, rtol=1e-15, atol=0)
    assert torch.equal(W, recast_weights(ema, LAM, 1.0, 0.1, 1))
    W, first = recast.weights(run, scores, None, {})
    assert torch.equal(first, logged)
    args.weighting = "uniform"
    W, kept = recast.weights(run, None, previous, {})
    assert kept is previous and torch.equal(W, (LAM[:, None] / 6).expand(4, 6))


# ---------------------------------------------------------------------------------------------
# --gain-shift S: W column i reads the gain of step i - S (DESIGN §4, alignment)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_shift_0_is_todays_w_bit_for_bit(seed):
    g = _random_gains(seed)
    assert torch.equal(recast_weights(g, LAM, shift=0), recast_weights(g, LAM))
    assert torch.equal(gain_profiles(g, 0.1, shift=0), gain_profiles(g, 0.1))


@pytest.mark.parametrize("shift", [1, 2, 5])
def test_shifted_w_keeps_its_marginals_and_ignores_the_dropped_gains(shift):
    g = _random_gains(shift)
    W = recast_weights(g, LAM, shift=shift)
    assert torch.allclose(W.double().sum(1), LAM.double(), atol=1e-6)
    assert torch.allclose(W.double().sum(0), torch.full((10,), 0.1, dtype=torch.float64), atol=1e-6)
    # the columns with no gain have the same profile (the floor) for every reward, hence one mix:
    # λ_k reweighted by Sinkhorn's row scalings only, near λ but not λ exactly
    assert torch.allclose(W[:, :shift], W[:, :1].expand(4, shift), rtol=0, atol=1e-7)
    assert torch.allclose(W[:, 0] * 10, LAM, atol=0.15)
    # the last S gains are dropped: changing them changes nothing
    other = g.clone()
    other[:, -shift:] = torch.rand(4, shift) * 10
    assert torch.equal(recast_weights(other, LAM, shift=shift), W)
    assert not torch.allclose(W[:, shift:] * 10, LAM[:, None].expand(4, 10 - shift), atol=1e-3)


def test_shift_1_moves_the_profile_one_column():
    g = _random_gains(7)
    g[:, -1] = 0  # Euler's last gain: nothing is dropped at the end
    moved = gain_profiles(g, 0.1, shift=1)
    today = gain_profiles(g, 0.1)
    assert torch.allclose(moved[:, 1:], today[:, :-1], rtol=0, atol=1e-15)
    assert torch.allclose(moved[:, 0], torch.full((4,), 0.1 / 10, dtype=moved.dtype))
    assert torch.equal(shift_gains(g, 1)[:, 1:], g[:, :-1]) and (shift_gains(g, 1)[:, 0] == 0).all()
    # and W is today's W of the moved gains (the column sums fix W's overall timing, so a shift
    # moves the rewards relative to each other and to the first column, not all of them later)
    assert torch.equal(recast_weights(g, LAM, shift=1), recast_weights(shift_gains(g, 1), LAM))


def test_shift_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="shift"):
        shift_gains(_random_gains(0), 10)
    with pytest.raises(ValueError, match="shift"):
        shift_gains(_random_gains(0), -1)


# ---------------------------------------------------------------------------------------------
# The loss (DESIGN §6): readable form against the kernel's reference
# ---------------------------------------------------------------------------------------------
def loss_inputs(seed: int, n=12, shape=(3, 5, 7), K=4, T=6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    v_theta, v_old, x0, noise, v_ref = (torch.randn(n, *shape, generator=gen, dtype=dtype)
                                        for _ in range(5))  # fmt: skip
    t = torch.rand(n, generator=gen).clamp_min(0.05).to(dtype)
    t_index = torch.randint(0, T, (n,), generator=gen)
    r = torch.rand(n, K, generator=gen) * 1.4 - 0.2  # joint's r leaves [0, 1]: the clamp is hit
    W = torch.softmax(torch.randn(K, T, generator=gen), 0) / T
    return v_theta, v_old, x0, noise, t, t_index, r, W, v_ref


@pytest.mark.parametrize("seed, kl", [(0, 0.0), (1, 0.3), (2, 1.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_readable_loss_is_the_kernels_reference(seed, kl, dtype):
    """recast.nft_loss_readable and reference_nft_loss (kernels/nft_loss.py, which the fused
    kernel is tested against): the same loss and gradient in v_θ, to float rounding."""
    v_theta, v_old, x0, noise, t, t_index, r, W, v_ref = loss_inputs(seed, dtype=dtype)
    got = []
    for fn in (recast.nft_loss_readable, kernel_loss.reference_nft_loss):
        v = v_theta.clone().requires_grad_()
        loss = fn(v, v_old, x0, noise, t, t_index, r, W, 0.3, 5.0, v_ref if kl else None, kl)
        loss.backward()
        got.append((loss.detach(), v.grad))
    (loss_a, grad_a), (loss_b, grad_b) = got
    tol = dict(rtol=4 * torch.finfo(dtype).eps, atol=0)
    torch.testing.assert_close(loss_a, loss_b, **tol)
    torch.testing.assert_close(
        grad_a,
        grad_b,
        rtol=4 * torch.finfo(dtype).eps,
        atol=4 * torch.finfo(dtype).eps * grad_b.abs().max().item(),
    )
    assert loss_a != 0 and grad_a.abs().max() > 0


def test_readable_loss_reads_c_from_ws_column():
    """DESIGN §6's c = Σ_k W_k,i, the clamp's top and the negative term's weight, read from W's
    column rather than assumed 1/T (the test above has W's columns summing to 1/T, where the two
    agree): a W whose columns sum to anything gives reference_nft_loss's loss and gradient."""
    v_theta, v_old, x0, noise, t, t_index, r, W, v_ref = loss_inputs(5)
    W = W * torch.linspace(0.3, 4.0, W.shape[1])  # column sums 0.3/T … 4/T
    got = []
    for fn in (recast.nft_loss_readable, kernel_loss.reference_nft_loss):
        v = v_theta.clone().requires_grad_()
        loss = fn(v, v_old, x0, noise, t, t_index, r, W, 0.3, 5.0)
        loss.backward()
        got.append((loss.detach(), v.grad))
    torch.testing.assert_close(got[0][0], got[1][0], rtol=4e-7, atol=0)
    torch.testing.assert_close(got[0][1], got[1][1], rtol=4e-7,
                               atol=4e-7 * got[1][1].abs().max().item())  # fmt: skip


def test_readable_loss_takes_the_kernels_defaults_and_any_integer_t_index():
    """Called as the fused nft_loss may be (β and A_max left to their defaults, t_index of any
    integer dtype), the readable loss is the reference's: a uint8 t_index selected W's columns as
    a mask, not by index."""
    v_theta, v_old, x0, noise, t, t_index, r, W, _ = loss_inputs(6)
    want = kernel_loss.reference_nft_loss(v_theta, v_old, x0, noise, t, t_index, r, W)
    for index in (t_index, t_index.to(torch.uint8), t_index.to(torch.int32)):
        got = recast.nft_loss_readable(v_theta, v_old, x0, noise, t, index, r, W)
        torch.testing.assert_close(got, want, rtol=4e-7, atol=0)


def test_readable_loss_sees_every_input():
    """A mutation check of the comparison above: the readable loss moves with r, W, t and β."""
    v_theta, v_old, x0, noise, t, t_index, r, W, v_ref = loss_inputs(4)
    base = recast.nft_loss_readable(v_theta, v_old, x0, noise, t, t_index, r, W, 0.3, 5.0)
    for changed in ({"r": r.flip(1)}, {"W": W.flip(1)}, {"t": t * 0.5}, {"beta": 0.7}):
        kw = dict(r=r, W=W, t=t, beta=0.3) | changed
        other = recast.nft_loss_readable(v_theta, v_old, x0, noise, kw["t"], t_index, kw["r"],
                                         kw["W"], kw["beta"], 5.0)  # fmt: skip
        assert not torch.isclose(other, base), changed


def test_pair_loss_noises_each_image_to_its_own_timestep():
    """recast.pair_loss (DESIGN §1, §6): pair (n, i) noises image n to t_i (the sampler's
    schedule at the pair's timestep index, which also picks W's column), x_t = (1 - t_i)·x0_n +
    t_i·ε, reads the three policies there with image n's prompt (n // G) and r of image n; the
    loss is the sum over the pairs. Written out with nft_loss_readable."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(9)
    K, T, G, N = 3, 5, 4, 12
    x0, eps = torch.randn(N, 2, 3, generator=gen), torch.randn(5, 2, 3, generator=gen)
    cond = (torch.randn(N // G, 2, 3, generator=gen),)
    scale = torch.tensor(1.5, requires_grad=True)
    speed = {"policy": scale, "old": torch.tensor(1.2), "ref": torch.tensor(0.7)}

    def v(which, x, c, t):  # a velocity that reads the state, the prompt and the time
        return speed[which] * x - c[0] * t[:, None, None]

    sigmas = torch.tensor([1.0, 0.9, 0.7, 0.4, 0.15, 0.0])
    args = SimpleNamespace(group_size=G, beta=0.3, adv_clip_max=5.0, kl_coef=0.5)
    run = SimpleNamespace(args=args, sigmas=sigmas, nft_loss=recast.nft_loss_readable,
                          observe=lambda name: nullcontext(),
                          world=SimpleNamespace(v=v, device=torch.device("cpu")))  # fmt: skip
    r = torch.rand(K, N, generator=gen)
    W = torch.softmax(torch.randn(K, T, generator=gen), 0) / T
    n, i = torch.tensor([7, 0, 11, 4, 5]), torch.tensor([3, 0, 1, 4, 3])
    got = recast.pair_loss(run, x0, cond, r, W, n, i, eps)
    t = sigmas[i]  # t_i: the model at t_i makes the step t_i → t_i+1
    x_t = (1 - t[:, None, None]) * x0[n] + t[:, None, None] * eps
    c = (cond[0][n // G],)
    expected = len(n) * recast.nft_loss_readable(
        v("policy", x_t, c, t), v("old", x_t, c, t), x0[n], eps, t, i, r[:, n].T, W, 0.3, 5.0,
        v("ref", x_t, c, t), 0.5)  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    other = recast.pair_loss(run, x0, cond, r, W, n, i.flip(0), eps)
    assert not torch.isclose(other, got)  # the timestep index matters


def test_an_optimizer_steps_gradient_is_the_mean_over_its_pairs():
    """recast.nft_update (DESIGN §6): round(--train-frac·N·T) of the epoch's pairs, drawn with
    the epoch's generator, in micro-batches of --batch-size, --grad-accum of them per optimizer
    step; each step's gradient is the mean over its own pairs (a short last step's too), and the
    loss returned is the mean over micro-batches of their mean. Here 10 pairs, 4 a micro-batch,
    2 micro-batches a step: steps of 8 and 2 pairs."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from plumbing.seeding import epoch_generator

    K, T, G, N = 2, 4, 3, 6
    gen = torch.Generator().manual_seed(12)
    x0, r = torch.randn(N, 2, 2, generator=gen), torch.rand(K, N, generator=gen)
    W = torch.softmax(torch.randn(K, T, generator=gen), 0) / T
    theta = torch.tensor(1.3, requires_grad=True)
    words = {"a": torch.ones(2, 2), "b": -torch.ones(2, 2)}
    speed = {"policy": theta, "old": torch.tensor(1.1), "ref": torch.tensor(0.9)}
    world = SimpleNamespace(
        v=lambda which, x, c, t: speed[which] * x - c[0] * t[:, None, None],
        encode=lambda prompts: (torch.stack([words[p] for p in prompts]),),
        latent_shape=(2, 2), device=torch.device("cpu"), policy=None)  # fmt: skip
    grads = []
    optimizer = SimpleNamespace(
        step=lambda: grads.append(theta.grad.clone()),
        zero_grad=lambda set_to_none: setattr(theta, "grad", None),
    )
    args = SimpleNamespace(steps=T, seed=3, train_frac=10 / 24, batch_size=4, grad_accum=2,
                           grad_clip=1e9, beta=0.3, adv_clip_max=5.0, kl_coef=0.2,
                           group_size=G, weighting="recast", out="")  # fmt: skip
    run = SimpleNamespace(args=args, world=world, sigmas=torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0]),
                          nft_loss=recast.nft_loss_readable, observe=lambda name: nullcontext(),
                          progress=lambda starts, desc: starts, share=lambda n: slice(0, n),
                          world_size=1, optimizer=optimizer, params=[theta])  # fmt: skip
    loss, steps = recast.nft_update(run, 2, ["a", "b"], x0, r, W, 5)
    assert steps == 7 and len(grads) == 2
    g = epoch_generator(3, 2, 2)
    pairs = torch.randperm(N * T, generator=g)[:10]
    cond, means, expected = world.encode(["a", "b"]), [], []
    for step in (pairs[:8], pairs[8:]):
        total = 0
        for batch in step.split(4):
            eps = torch.randn(len(batch), 2, 2, generator=g)
            pair_sum = recast.pair_loss(run, x0, cond, r, W, batch // T, batch % T, eps)
            means.append(pair_sum.detach() / len(batch))
            total = total + pair_sum
        expected.append(torch.autograd.grad(total / len(step), theta)[0])
    torch.testing.assert_close(torch.stack(grads), torch.stack(expected), rtol=1e-6, atol=0)
    torch.testing.assert_close(loss, torch.stack(means).mean(), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# The old policy (DESIGN §6)
# ---------------------------------------------------------------------------------------------
def test_old_policy_decay_rises_with_the_optimizer_steps_to_its_cap():
    """d = min(--decay-rate · optimizer steps, --decay-cap), and the toy world's
    θ_old ← d·θ_old + (1 - d)·θ (the diffusers world's is tested in test_recast.py)."""
    from types import SimpleNamespace

    from worlds import toyworld

    theta, old = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in old.parameters()]
    world = SimpleNamespace(trainable=theta, old_model=old)
    world.update_old = lambda d: toyworld.ToyWorld.update_old(world, d)
    run = SimpleNamespace(args=SimpleNamespace(decay_rate=0.001, decay_cap=0.5), world=world)
    assert recast.update_old(run, 300) == pytest.approx(0.3)
    for p_old, p, b in zip(old.parameters(), theta.parameters(), before, strict=True):
        torch.testing.assert_close(p_old.detach(), 0.3 * b + 0.7 * p.detach())
    assert recast.update_old(run, 2000) == 0.5 and recast.update_old(run, 0) == 0.0


# ---------------------------------------------------------------------------------------------
# The flags: the defaults --help shows are the defaults that run
# ---------------------------------------------------------------------------------------------
FILLED = {  # the flags harness.scoring_defaults may set → what their `default:` line must name
    "normalize": "--weighting uniform", "gain_shift": "--weighting flat, uniform, sum or gdpo",
    "gain_frac": "diffusers --model", "score_precision": "diffusers --model",
}  # fmt: skip


def test_a_default_that_depends_on_other_flags_says_so():
    """Each flag whose default harness.scoring_defaults fills by --weighting or --model shows a
    `default:` line naming when; every other flag shows its dataclass default, which runs."""
    docs = cli.field_docs(recast.Args)
    for name, doc in docs.items():
        line = next((x for x in doc.splitlines() if x.strip().startswith("default:")), None)
        if name in FILLED:
            assert line and FILLED[name] in line, (name, line)
        else:
            assert line is None, name
    args = cli.parse(recast.Args, ["--lambda", "1,1,1,1", "--weighting", "uniform"], "")
    set_ = harness.scoring_defaults(args, ["--lambda", "1,1,1,1", "--weighting", "uniform"])
    assert set_ == {} and (args.normalize, args.gain_shift) == ("per-reward", 0)
    changed = {k for k, v in vars(args).items() if getattr(recast.Args, k) != v}
    assert changed <= {"lam", "weighting", *FILLED}, changed


@pytest.mark.parametrize("rule", ["joint", "unit-joint", "batch", "per-reward"])
def test_a_rewards_advantage_and_the_mix_are_bounded_where_rewards_nearly_cancel(rule):
    """DESIGN §3's bounds, on groups whose two rewards nearly cancel under λ (each varies, the
    λ-sum barely does): |A_k| ≤ √(G − 1) · advantage_ratios, with equality in groups of 2; the mix
    of a W column w departs from λ's by at most ‖w − λ‖₁ · max_k |A_k|; under joint and unit-joint
    λ's mix is the summed reward's, |Σ λ_k A_k| < √(G − 1); and r̄ clamped to [0, 1] is within
    ±A_max. The ratio is large only under the two joint rules."""
    gen = torch.Generator().manual_seed(3)
    lam = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    A_max = 5.0
    for G in (2, 8):
        s = torch.randn(3, 6, G, generator=gen, dtype=torch.float64)
        # half the groups: reward 1 undoes reward 0 up to 1e-5; the other half holds reward 0's
        # groups in another order, so both rewards have one pooled spread (unit-joint cancels too)
        s[1, :3] = -s[0, :3] + 1e-5 * torch.randn(3, G, generator=gen, dtype=torch.float64)
        s[1, 3:] = s[0, 3:].roll(1, 0)
        s[2, :3] = 0.0
        s = s.flatten(1)
        if rule == "joint":
            r = recast.joint_optimality(s, lam, G, A_max)
        elif rule == "unit-joint":
            r = recast.unit_joint_optimality(s, lam, G, A_max)
        elif rule == "batch":
            r = recast.batch_optimality(s, G, A_max)
        else:
            r = recast.group_optimality(s, G, A_max)
        A = 2 * A_max * (r - 0.5)  # (K, N)
        ratio = harness.advantage_ratios(s, G, rule, lam)  # (K, M)
        bound = math.sqrt(G - 1) * ratio.repeat_interleave(G, -1)
        assert (A.abs() <= bound * (1 + 1e-6) + 1e-9).all()
        if G == 2 and rule != "per-reward":  # per-reward clips at ±A_max; 2-groups are at ±1 there
            assert torch.allclose(A.abs(), bound, rtol=1e-6, atol=1e-9)
        if rule in ("joint", "unit-joint"):
            assert ratio[:, :3].max() > 100 and ratio[:, 3:].max() < 10  # the near-cancelling ones
            assert ((lam @ A).abs() < math.sqrt(G - 1)).all()
        gains = torch.rand(3, 5, generator=gen, dtype=torch.float64)
        W = recast.recast_weights(gains, lam, tau=0.25).double()
        for i in range(W.shape[1]):
            w = W[:, i] / W[:, i].sum()
            departs = ((w - lam) @ A).abs()
            assert (departs <= (w - lam).abs().sum() * A.abs().amax(0) * (1 + 1e-9)).all()
            mix = (w @ r).clamp(0, 1)
            assert (2 * A_max * (mix - 0.5)).abs().max() <= A_max


def test_unit_joint_in_fp32_holds_at_extreme_scales_and_offsets():
    """Scores in fp32, as rewards return them (DESIGN §3's units, at the edges): one reward × 1e-6
    or × 1e6 leaves unit-joint's r unchanged to 1e-6; offset by 1e3 times its pooled spread, to
    1e-4 (the offset's own fp32 rounding is about 1e-5 of the spread there). A reward constant
    over the whole batch keeps r = 1/2 (its note: harness.note_flat_rewards); one constant in every
    group but one stays finite (1/2 in its constant groups to the rounding of their fp32 mean, as
    joint centres: DESIGN §3)."""
    lam = torch.tensor([0.4, 0.2, 0.2, 0.2])
    scores = _scores(torch.float32)
    r = _r("unit-joint", scores, lam)
    for factor in (1e-6, 1e6):
        moved = scores.clone()
        moved[2] = scores[2] * factor
        torch.testing.assert_close(_r("unit-joint", moved, lam), r, rtol=0, atol=1e-6)
    moved = scores.clone()
    moved[3] = scores[3] + 1e3 * recast.pooled_spread(scores, 8)[3]
    torch.testing.assert_close(_r("unit-joint", moved, lam), r, rtol=0, atol=1e-4)
    flat = scores.clone()
    flat[1] = 2.5
    assert (_r("unit-joint", flat, lam)[1] == 0.5).all()
    one = scores.clone()
    one[1] = 2.5
    one[1, 24:32] = torch.linspace(2.0, 3.0, 8)  # group 3 varies, every other is constant
    r_one = _r("unit-joint", one, lam)
    assert torch.isfinite(r_one).all()  # its constant groups: 1/2 to their mean's rounding
    assert (r_one[1, :24] - 0.5).abs().max() < 1e-6
    assert (r_one[1, 24:32] != 0.5).any()
