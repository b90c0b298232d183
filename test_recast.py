"""Tests for ReCAST: toy world and rewards, the weighting, the loop, the kernels, failure modes.

pytest                # the fast suite (CPU, a few minutes)
pytest -m slow        # end-to-end checks that take minutes (SIGKILL + resume, torchrun)
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import rewards
import toyworld as tw
from recast import centroid, gain_profiles, recast_weights

HERE = os.path.dirname(os.path.abspath(__file__))
P = tw.HELDOUT_PROMPTS


def _swap(prompts, slot, choices):
    """The same prompts with word `slot` replaced by another word of `choices`."""
    out = []
    for p in prompts:
        words = p.split()
        words[slot] = next(c for c in choices if c != words[slot])
        out.append(" ".join(words))
    return out


# ---------------------------------------------------------------------------------------------
# Toy world and rewards
# ---------------------------------------------------------------------------------------------
def test_prompt_split_is_fixed_and_disjoint():
    assert len(tw.PROMPTS) == 90 and len(tw.HELDOUT_PROMPTS) == tw.N_HELDOUT
    assert not set(tw.TRAIN_PROMPTS) & set(tw.HELDOUT_PROMPTS)
    assert sorted(tw.TRAIN_PROMPTS + tw.HELDOUT_PROMPTS) == sorted(tw.PROMPTS)
    for slot, words in enumerate([tw.COLORS, tw.SHAPES, tw.POSITIONS]):  # every word is trained on
        assert {p.split()[slot] for p in tw.TRAIN_PROMPTS} == set(words)
    with pytest.raises(ValueError, match="purple"):
        tw.parse(["purple circle left"])


def test_text_encoder_is_fixed_and_distinguishes_words():
    tokens, pooled = tw.encode(["red circle left", "red circle right"])
    assert tokens.shape == (2, 3, tw.WORD_DIM) and pooled.shape == (2, 3 * tw.WORD_DIM)
    assert torch.equal(tokens[0, :2], tokens[1, :2]) and not torch.equal(tokens[0, 2], tokens[1, 2])
    assert torch.equal(tw.encode(["red circle left"])[0], tw.encode(["red circle left"])[0])


def test_position_reward_measures_position():
    ideal = rewards.position(tw.render(P), P)
    wrong = rewards.position(tw.render(_swap(P, 2, list(tw.POSITIONS))), P)
    assert (ideal > wrong + 3).all()  # several pixels off for every prompt
    assert torch.allclose(
        ideal, rewards.position(tw.render(_swap(P, 0, list(tw.COLORS))), P), atol=0.05
    )


def test_color_reward_measures_color():
    ideal = rewards.color(tw.render(P), P)
    wrong = rewards.color(tw.render(_swap(P, 0, list(tw.COLORS))), P)
    assert (ideal > wrong + 0.3).all()
    assert torch.allclose(
        ideal, rewards.color(tw.render(_swap(P, 2, list(tw.POSITIONS))), P), atol=0.01
    )


def test_sharpness_reward_measures_edges_and_is_not_raised_by_noise():
    images = tw.render(P)
    ideal = rewards.sharpness(images, P)
    blurred = rewards.sharpness(rewards._blur(images.flatten(0, 1), 1.0).view_as(images), P)
    assert (ideal > blurred + 0.1).all()
    gen = torch.Generator().manual_seed(0)
    for amplitude in (0.02, 0.05, 0.1, 0.3):
        noisy = rewards.sharpness(images + amplitude * torch.randn(images.shape, generator=gen), P)
        assert noisy.mean() < ideal.mean()


def test_background_reward_measures_background():
    images = tw.render(P)
    ideal = rewards.background(images, P)
    far = 1 - torch.nn.functional.max_pool2d(rewards.hard_mask(images)[:, None], 11, 1, 5)
    gen = torch.Generator().manual_seed(0)
    dirty = images + 0.1 * torch.randn(images.shape, generator=gen) * far
    assert (ideal > rewards.background(dirty, P) + 0.02).all()
    assert ideal.abs().max() < 1e-6  # the ideal background is exactly the world's


def test_judges_measure_shape_and_overlap():
    images = tw.render(P)
    assert rewards.shape(images, P).eq(1).all()
    assert rewards.shape(tw.render(_swap(P, 1, list(tw.SHAPES))), P).eq(0).all()
    assert rewards.iou(images, P).gt(0.99).all()
    assert (rewards.iou(tw.render(_swap(P, 2, list(tw.POSITIONS))), P) < 0.5).all()
    blank = torch.full_like(images, -1)
    assert rewards.shape(blank, P).eq(0).all() and rewards.iou(blank, P).eq(0).all()


def test_nonfinite_reward_names_reward_and_prompt():
    def broken(images, prompts):
        s = torch.zeros(len(prompts))
        s[3] = float("nan")
        return s

    with pytest.raises(rewards.RewardError, match=rf"'broken'.*{P[3]!r}"):
        rewards.score("broken", broken, tw.render(P), P)


# ---------------------------------------------------------------------------------------------
# The shipped base model
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    return tw.ToyWorld(torch.device("cpu"))


def test_base_model_samples_between_chance_and_ideal(world):
    import recast

    prompts = [p for p in P for _ in range(2)]
    noise = torch.randn(
        len(prompts), 3, tw.SIZE, tw.SIZE, generator=torch.Generator().manual_seed(0)
    )
    judges = {n: rewards.get(n, world.device) for n in world.judge_names}
    base, images = recast.evaluate(world, judges, prompts, noise, world.sigmas(10), 64, "ref")
    assert images.shape == (len(prompts), 3, tw.SIZE, tw.SIZE)
    assert 0.5 < base["shape"].mean() < 0.97  # chance is 1/3, the ideal rendering scores 1
    assert 0.3 < base["iou"].mean() < 0.9  # a random prompt's rendering scores ~0.1


def test_base_model_position_is_decided_before_sharpness_and_background(world):
    names, D, gains, profiles = tw.base_profiles(world, tw.TRAIN_PROMPTS[::3], 8, seed=0)
    c = dict(zip(names, centroid(profiles).tolist(), strict=True))
    assert c["position"] < c["sharpness"] and c["position"] < c["background"], c
    assert torch.allclose(gains.sum(1), D[:, -1], atol=1e-5)  # the gains telescope to D_T


# ---------------------------------------------------------------------------------------------
# The weight matrix W (DESIGN §5)
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
    assert centroid(W[0]) < 3 < 6 < centroid(W[1])
    # the last column carries no gain (Euler's last prediction is the sample), so it stays at λ
    assert torch.allclose(W[:, -1] * 10, torch.tensor([0.5, 0.5]), atol=0.05)
    prof = gain_profiles(gains, 0.1)
    assert torch.allclose(prof.sum(1), torch.ones(2, dtype=prof.dtype))
    assert prof.min() >= 0.1 / 10 - 1e-12


def test_zero_budget_reward_gets_no_weight():
    W = recast_weights(_random_gains(4), torch.tensor([0.5, 0.0, 0.25, 0.25]))
    assert W[1].abs().max() == 0
    assert torch.allclose(W.double().sum(0), torch.full((10,), 0.1, dtype=torch.float64), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The loss as recast.py calls it, and the loop end to end
# ---------------------------------------------------------------------------------------------
def test_single_reward_uniform_loss_is_diffusionnft():
    """One reward, W = 1/T: recast.py's loss is DiffusionNFT's, written out here independently."""
    from kernels.nft_loss import nft_loss

    gen = torch.Generator().manual_seed(0)
    N, T, beta, A = 12, 10, 0.7, 5.0
    v_theta, v_old, x0, eps = (torch.randn(N, 3, 8, 8, generator=gen) for _ in range(4))
    t_index = torch.randint(T, (N,), generator=gen)
    t = torch.linspace(1, 0.05, T)[t_index]
    advantage = 3 * torch.randn(N, generator=gen)
    # DiffusionNFT: r = clip(A, ±A_max)/A_max/2 + 1/2, then the implicit positive/negative losses
    r = advantage.clamp(-A, A) / A / 2 + 0.5
    tt = t.view(-1, 1, 1, 1)
    x_t = (1 - tt) * x0 + tt * eps
    dnft = 0.0
    for policy, weight in [
        (beta * v_theta + (1 - beta) * v_old, r),
        ((1 + beta) * v_old - beta * v_theta, 1 - r),
    ]:
        err = (x_t - tt * policy) - x0
        scale = err.abs().mean((1, 2, 3)).clamp(min=1e-5)
        dnft = dnft + weight * (err**2).mean((1, 2, 3)) / scale / beta
    expected = (A * dnft).mean()
    W = torch.full((1, T), 1 / T)
    got = nft_loss(v_theta, v_old, x0, eps, t, t_index, r[:, None], W, beta=beta, adv_clip_max=A)
    assert torch.allclose(got, expected, rtol=1e-5)


def run_recast(*flags, check=True, **kw):
    return subprocess.run(
        [sys.executable, os.path.join(HERE, "recast.py"), *flags],
        capture_output=True,
        text=True,
        check=check,
        cwd=HERE,
        **kw,
    )


TINY = [
    "--epochs",
    "2",
    "--prompts",
    "4",
    "--group-size",
    "4",
    "--batch-size",
    "32",
    "--eval-seeds",
    "1",
]


def test_two_epoch_smoke_run_writes_every_output(tmp_path):
    out = tmp_path / "run"
    run_recast("--lambda", "0.4,0.2,0.2,0.2", *TINY, "--out", str(out))
    for name in ["args.json", "metrics.jsonl", "W.png", "samples.png", "summary.json"]:
        assert (out / name).is_file(), name
    assert sorted(os.listdir(out / "ckpt")) == ["epoch_0001", "epoch_0002"]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["epoch"] for m in lines] == [0, 1, 2]
    names = ["position", "color", "sharpness", "background"]
    for m in lines[1:]:
        for key in [
            "loss",
            "time/rollout",
            "time/score",
            "time/weights",
            "time/update",
            "W",
            "gains",
            "D",
        ]:
            assert key in m, key
        W = torch.tensor(m["W"], dtype=torch.float64)
        assert W.shape == (4, 10) and torch.tensor(m["D"]).shape == (4, 11)
        assert torch.allclose(
            W.sum(1), torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64), atol=1e-5
        )
        assert torch.allclose(W.sum(0), torch.full((10,), 0.1, dtype=torch.float64), atol=1e-5)
        assert all(math.isfinite(m[f"reward/{n}"]) for n in names)
    for n in [*names, "shape", "iou"]:
        assert f"eval/{n}" in lines[0] and f"eval/{n}" in lines[2] and f"gap/{n}" in lines[2]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["base"]) == set(summary["final"]) == {*names, "shape", "iou"}
    assert json.loads((out / "args.json").read_text())["lam"] == "0.4,0.2,0.2,0.2"
