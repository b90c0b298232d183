"""The examples run, and what they print holds: examples/recast_in_your_loop.py's one epoch, and
the Python blocks of docs/use_in_your_trainer.md and docs/your_reward.md as a reader copies them
(run as written on tiny stand-ins for the reader's own tensors and model), and the functions that
guide has a trainer copy from recast.py, run with torch and math alone.

In the pytest process conftest.py has switched the Triton interpreter on, so nft_loss and
renyi_gains run their Triton kernels here (on CPU tensors), as the example does from the shell.
"""

import importlib.util
import math
import os
import re

import torch

import rewards

HERE = os.path.dirname(os.path.abspath(__file__))
DOCS = os.path.join(os.path.dirname(HERE), "docs")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recast_in_your_loop_takes_one_step_with_a_valid_W(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the example runs from the shell: small ops, no thread contention
    try:
        out = _load("recast_in_your_loop").main(n_prompts=4, G=4, T=6)
    finally:
        torch.set_num_threads(threads)
    W, lam, T = out["W"].double(), out["lam"], 6
    assert W.shape == (4, T) and (W >= 0).all()
    assert torch.allclose(W.sum(1), lam / lam.sum(), atol=1e-6)  # rows: the budgets λ
    assert torch.allclose(W.sum(0), torch.full((T,), 1 / T, dtype=W.dtype), atol=1e-6)
    assert (W - lam[:, None] / T).abs().max() > 1e-3  # the gains moved W away from λ/T
    assert out["gains"].shape == (4, T) and torch.isfinite(out["gains"]).all()
    assert math.isfinite(out["loss"]) and out["loss"] > 0
    assert out["moved"] > 0  # the optimizer step changed the policy's parameters
    printed = capsys.readouterr().out
    assert "W (K × T = 4 × 6" in printed and f"loss {out['loss']:.4f}" in printed


def python_blocks(doc: str) -> list[str]:
    """The ```python blocks of docs/`doc`, in order, as written."""
    with open(os.path.join(DOCS, doc), encoding="utf-8") as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), re.S | re.M)


def test_the_trainer_guide_blocks_run_as_written():
    """docs/use_in_your_trainer.md: the rollout block on a stand-in velocity (bf16 latents), and
    the gains/W/r block on random scores (K = 3 rewards, T = 4 steps, N = 8 images in groups of
    G = 4): the shapes, dtypes and marginals its tables state."""
    rollout, weights = python_blocks("use_in_your_trainer.md")
    K, T, N, G = 3, 4, 8, 4
    gen = torch.Generator().manual_seed(0)

    def v_old(x, cond, t):
        assert t.shape == (len(x),) and t.dtype == torch.float32
        return 0.5 * x

    noise = torch.randn(N, 2, 5, 5, generator=gen).bfloat16()
    ns = dict(torch=torch, T=T, v_old=v_old, cond=None, noise=noise,
              sigmas=torch.linspace(1, 0, T + 1))  # fmt: skip
    exec(rollout, ns)
    assert ns["x0"].shape == (N, 2, 5, 5) and ns["preds"].shape == (T, N, 2, 5, 5)
    assert ns["x0"].dtype == ns["preds"].dtype == torch.bfloat16  # the latent dtype

    scores = torch.randn(K, T + 1, N, generator=gen)
    scores[:, 0] = 0  # never read
    lam = torch.tensor([0.5, 0.3, 0.2])
    ns = dict(scores=scores, final=scores[:, -1], G=G, lam=lam, device=torch.device("cpu"))
    exec(weights, ns)
    D, gains, W, r = ns["D"], ns["gains"], ns["W"], ns["r"]
    assert D.shape == (K, T + 1) and D.dtype == torch.float32 and (D[:, 0] == 0).all()
    assert gains.shape == (K, T) and torch.allclose(gains, D[:, 1:] - D[:, :-1])
    assert W.shape == (K, T) and W.dtype == torch.float32
    assert torch.allclose(W.sum(1), lam, atol=1e-6)  # rows: λ
    assert torch.allclose(W.sum(0), torch.full((T,), 1 / T), atol=1e-6)  # columns: 1/T
    assert r.shape == (K, N) and r.dtype == torch.float32


# What docs/use_in_your_trainer.md §4 tells a trainer to copy from recast.py, besides the kernels.
COPIED_FROM_RECAST = (
    "group_centred", "group_optimality", "joint_optimality", "pooled_spread", "unit_free",
    "unit_joint_optimality", "shift_gains", "gain_profiles", "recast_weights",
)  # fmt: skip


def test_the_functions_a_trainer_copies_need_only_torch_and_math():
    """The functions the trainer guide lists, their source alone in a namespace holding only torch
    and math (a trainer's file): they run, and give what recast.py's give."""
    import inspect

    import recast

    ns = {"torch": torch, "math": math}
    for name in COPIED_FROM_RECAST:
        exec(inspect.getsource(getattr(recast, name)), ns)
    gen = torch.Generator().manual_seed(1)
    final, lam = torch.randn(3, 8, generator=gen), torch.tensor([0.5, 0.3, 0.2])
    gains = torch.rand(3, 5, generator=gen)
    for name, args in (
        ("group_optimality", (final, 4)),
        ("joint_optimality", (final, lam, 4)),
        ("unit_joint_optimality", (final, lam, 4)),
        ("recast_weights", (gains, lam, 1.0, 0.1, 1)),
    ):
        assert torch.equal(ns[name](*args), getattr(recast, name)(*args)), name


def test_the_reward_guide_block_registers_two_rewards_that_score():
    """docs/your_reward.md's block, pasted into rewards.py (run in its namespace), with a stand-in
    for load_my_model: `saturation` is a reward and `my_model` a loader, both scoring (B,)."""
    (block,) = python_blocks("your_reward.md")

    class MyModel(torch.nn.Module):
        def forward(self, images, prompts):
            return images.mean((1, 2, 3))

    ns = {**vars(rewards), "load_my_model": MyModel}
    try:
        exec(block, ns)
        images = torch.tensor([[1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])[:, :, None, None].repeat(
            1, 1, 4, 4
        )
        prompts = ["a red square", "a grey square"]
        saturation = rewards.get("saturation", torch.device("cpu"))
        s = rewards.score("saturation", saturation, images, prompts)
        assert s.tolist() == [1.0, 0.0]  # pure red: saturated; grey: not
        assert "my_model" in rewards.LOADERS
        score = rewards.get("my_model", torch.device("cpu"))
        assert rewards.score("my_model", score, images, prompts).shape == (2,)
    finally:
        rewards.REWARDS.pop("saturation", None)
        rewards.LOADERS.pop("my_model", None)
