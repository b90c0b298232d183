"""Which normalisation reads the rewards' units? The table of docs/results.md ("λ in any units"),
measured on the shipped toy base model: 64 training prompts × 8 images of each setting of the
units test (settings 5 and 6), each reward's final scores in its native units and in the units
test's changed ones (`--reward-scale`, comparison.UNITS), then with an offset added to every
reward as well (+100 in its own units: the units' origin moved). Per rule, the largest change of r
over every image and reward, of its gains' W (ReCAST's W from the base model's step scores, as
`--profile` builds it) and of each reward's share of the signal (harness.signal_share).

    python studies/units.py         # about a minute on one core
"""

import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # noqa: E402
import recast  # noqa: E402
import rewards  # noqa: E402
from recast_kernels.renyi import renyi_gains  # noqa: E402
from studies.base_model import base_profiles  # noqa: E402
from studies.comparison import UNITS  # noqa: E402
from worlds import toyworld as tw  # noqa: E402

# rule → (--weighting, --normalize), as recast.optimality reads them
RULES = {
    "joint": ("recast", "joint"),
    "per-reward": ("recast", "per-reward"),
    "batch": ("recast", "batch"),
    "unit-joint": ("recast", "unit-joint"),
    "sum (raw)": ("sum", "per-reward"),
    "sum, unit-joint": ("sum", "unit-joint"),
}
LAM = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
G = 8


def what_training_reads(rule: str, scores: torch.Tensor) -> dict:
    """r (rows, N), ReCAST's W (K, T; None for sum) and the signal shares (K,) of `scores`
    (K, T+1, N) in float32, as a run reads them under `rule`."""
    weighting, normalize = RULES[rule]
    args = SimpleNamespace(group_size=G, adv_clip_max=5.0, weighting=weighting,
                           normalize=normalize, alpha=2.0, tau=1.0, floor=0.1,
                           gain_shift=1)  # fmt: skip
    run = SimpleNamespace(args=args, lam=LAM)
    final = scores[:, -1]
    r = recast.optimality(run, final)
    W = None
    if weighting == "recast":
        _, gains = renyi_gains(recast.gain_scores(run, scores, final), G, 2.0, 5.0)
        W = recast.recast_weights(gains.double(), LAM, 1.0, 0.1, 1)
    share = harness.signal_share(final, LAM, G, harness.signal_rule(args))
    return {"r": r, "W": W, "share": share}


def table(prompts: int = 64, seed: int = 0) -> list[str]:
    world = tw.ToyWorld(torch.device("cpu"))
    train = [tw.TRAIN_PROMPTS[i * len(tw.TRAIN_PROMPTS) // prompts] for i in range(prompts)]
    lines = ["| setting | units | rule | max abs Δr | max abs ΔW·T | shares, native → changed |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for k in (5, 6):
        names = list(rewards.PRESETS[f"toy{k}"])
        *_, scores = base_profiles(world, train, G, seed, names=names)  # (K, T+1, N) fp32
        factor = torch.tensor([float(x) for x in UNITS[k].split(",")])[:, None, None]
        for units, moved in ((UNITS[k], scores * factor),
                             (f"{UNITS[k]}, +100", scores * factor + 100.0)):  # fmt: skip
            moved[:, 0] = 0.0  # step 0 is never scored (recast.trajectory_scores)
            for rule in RULES:
                a, b = what_training_reads(rule, scores), what_training_reads(rule, moved)
                dr = (a["r"] - b["r"]).abs().max().item()
                dw = "" if a["W"] is None else f"{(a['W'] - b['W']).abs().max().item() * 10:.1e}"
                shares = ", ".join(f"{x:.2f}" for x in a["share"].tolist()) + " → " + ", ".join(
                    f"{x:.2f}" for x in b["share"].tolist())  # fmt: skip
                lines.append(f"| {k} ({', '.join(names)}) | ×({units}) | {rule} | {dr:.1e} | "
                             f"{dw} | {shares} |")  # fmt: skip
    return lines


if __name__ == "__main__":
    print("\n".join(table()))
