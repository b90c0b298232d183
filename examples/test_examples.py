"""The examples run, and what they print holds: examples/recast_in_your_loop.py's one epoch.

In the pytest process conftest.py has switched the Triton interpreter on, so nft_loss and
renyi_gains run their Triton kernels here (on CPU tensors), as the example does from the shell.
"""

import importlib.util
import math
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


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
