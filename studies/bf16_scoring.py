"""Does bf16 scoring of the step predictions move W? (toy world, base model, CPU)

    python studies/bf16_scoring.py [--seeds 5]     # about a minute per seed on 2 cores

For each seed, `recast.py --profile` (the default command's flags: one rollout of the base model,
every step prediction scored, the gains and the W that ReCAST would use) runs twice on the same
prompts and noise: with `--score-precision fp32` and with `bf16`. It prints, per seed, W's L1
distance Σ|W_bf16 − W_fp32| and the gains' relative L1 change, and, as the yardstick, the same
distance between the fp32 W of two different seeds (the noise floor of one epoch's W, every pair).
The toy rewards are hand-written, so this bounds the rounding of bf16 on this pipeline only: what
bf16 does to a VAE and four CLIP reward models needs their weights (docs/sd35.md).
"""

import itertools
import json
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import recast
from plumbing import cli

LAM = "0.4,0.2,0.2,0.2"


def profile(seed: int, precision: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"s{seed}-{precision}")
    recast.main(["--profile", "--lambda", LAM, "--seed", str(seed), "--score-precision",
                 precision, "--out", out])  # fmt: skip
    with open(os.path.join(out, "profile.json")) as f:
        p = json.load(f)
    return {"W": torch.tensor(p["W"], dtype=torch.float64),
            "gains": torch.tensor(p["gains"], dtype=torch.float64)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="bf16_scoring.py", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0 … N-1 (default 5)")
    a = ap.parse_args(argv)
    if a.seeds < 2:
        cli.fail("--seeds", f"needs ≥ 2 (the noise floor pairs seeds), got {a.seeds}", ap.prog)
    lines, w_moves = [], []
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = {}
        for s in range(a.seeds):
            fp32[s], bf16 = profile(s, "fp32", tmp), profile(s, "bf16", tmp)
            w = float((bf16["W"] - fp32[s]["W"]).abs().sum())
            g = float((bf16["gains"] - fp32[s]["gains"]).abs().sum() / fp32[s]["gains"].abs().sum())
            w_moves.append(w)
            lines.append(f"seed {s}: Σ|W_bf16 − W_fp32| {w:.4f}; gains' relative L1 change {g:.4f}")
    floor = [float((fp32[x]["W"] - fp32[y]["W"]).abs().sum())
             for x, y in itertools.combinations(range(a.seeds), 2)]  # fmt: skip
    print(f"\nbf16 against fp32 scoring, same rollout (--profile --lambda {LAM}, base model):")
    print("\n".join(lines))
    print(f"mean Σ|W_bf16 − W_fp32| {statistics.fmean(w_moves):.4f} over {a.seeds} seeds; the "
          f"noise floor, Σ|W_fp32(seed a) − W_fp32(seed b)| over {len(floor)} pairs: mean "
          f"{statistics.fmean(floor):.4f}, smallest {min(floor):.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
