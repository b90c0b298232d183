"""Does scoring the step predictions at a reduced size (--score-size) move W? (toy world, base
model, CPU; the protocol and decision rule: docs/results.md, "Step scoring at a reduced size")

    python studies/score_size.py [--seeds 5] [--sizes 24,16,8]    # about 10 minutes on 2 cores

For each seed, one rollout of the base model (`recast.py --profile`'s: the default command's 16
prompts × 8 images, the seed's prompts and noise), its final scores, then its step predictions
scored by recast.score_steps at full size (32 px) and at each --score-size PX (through the run's
own decode_step: area-averaged to PX and brought back to 32 px, the toy rewards measuring in the
world's pixels), and from each the gains and the W that ReCAST would use (recast.gain_scores,
renyi_gains, recast_weights, as --profile builds them). It prints, per size, Σ|W_PX − W_full| per
seed, its mean, each reward's row of it and the gains' relative L1 change, and, as the yardstick,
Σ|W_full(seed a) − W_full(seed b)| over every pair of seeds (the noise floor of one epoch's W).
"""

import itertools
import os
import statistics
import sys
import tempfile

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import harness
import recast
from plumbing import cli
from recast_kernels.renyi import renyi_gains

LAM = "0.4,0.2,0.2,0.2"
TOY_PX = 32  # worlds/toyworld.py's SIZE


def scored(seed: int, sizes: list[int], tmp: str) -> tuple[list[str], dict]:
    """The reward names and {size (0: full): (W (K, T) float64, gains (K, T) float64)} of one
    rollout of the base model with the seed's prompts and noise."""
    run = harness.setup(recast.Args, ["--profile", "--lambda", LAM, "--seed", str(seed), "--out",
                                      os.path.join(tmp, f"s{seed}")], recast.__doc__)  # fmt: skip
    args, G = run.args, run.args.group_size
    _, my_prompts, x0, preds = recast.rollout(run, 1)
    per_image = [p for p in my_prompts for _ in range(G)]
    final = recast.score_all(run.reward_fns, run.world.decode(x0), per_image)
    out = {}
    for px in [0, *sizes]:
        args.score_size = px  # this scoring's --score-size (main checked the sizes)
        steps = recast.score_steps(run, preds, final, per_image)
        _, gains = renyi_gains(recast.gain_scores(run, steps, final), G, args.alpha,
                               args.adv_clip_max)  # fmt: skip
        W = recast.recast_weights(gains, run.lam, args.tau, args.floor, args.gain_shift)
        out[px] = (W.double(), gains.double())
    return run.names, out


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="score_size.py", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds 0 … N-1 (default 5)")
    ap.add_argument("--sizes", default="24,16,8", help="--score-size values, px (default 24,16,8)")
    a = ap.parse_args(argv)
    if a.seeds < 2:
        cli.fail("--seeds", f"needs ≥ 2 (the noise floor pairs seeds), got {a.seeds}", ap.prog)
    try:
        sizes = [int(x) for x in a.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(not 1 <= px < TOY_PX for px in sizes):
        cli.fail("--sizes", f"a comma-separated list of sizes in [1, {TOY_PX}) px (the toy "
                 f"world's size), got {a.sizes!r}", ap.prog)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        seeds = tqdm(range(a.seeds), desc="seeds (rollout, scoring at each size)", leave=False)
        runs = {s: scored(s, sizes, tmp) for s in seeds}  # minutes: a bar on stderr
    names = runs[0][0]
    full = {s: r[1][0] for s, r in runs.items()}
    floor = [float((full[x][0] - full[y][0]).abs().sum())
             for x, y in itertools.combinations(range(a.seeds), 2)]  # fmt: skip
    print(
        f"\nstep scoring at --score-size PX against full size ({TOY_PX} px), same rollout "
        f"(--profile --lambda {LAM}, base model, seeds 0-{a.seeds - 1}):\n"
    )
    print(
        "| --score-size | Σ\\|W_PX − W_full\\| per seed | mean | largest | per reward (mean "
        "row L1: " + ", ".join(names) + ") | gains' relative L1 change (mean) |"
    )
    print("|---|---|---|---|---|---|")
    for px in sizes:
        moves, rows, gains = [], [], []
        for s in range(a.seeds):
            (W0, g0), (W, g) = full[s], runs[s][1][px]
            moves.append(float((W - W0).abs().sum()))
            rows.append((W - W0).abs().sum(1))
            gains.append(float((g - g0).abs().sum() / g0.abs().sum()))
        per_reward = ", ".join(f"{x:.3f}" for x in torch.stack(rows).mean(0).tolist())
        print(
            f"| {px} | {', '.join(f'{m:.3f}' for m in moves)} | {statistics.fmean(moves):.3f} "
            f"| {max(moves):.3f} | {per_reward} | {statistics.fmean(gains):.3f} |"
        )
    print(f"\nnoise floor, Σ|W_full(seed a) − W_full(seed b)| over {len(floor)} pairs: mean "
          f"{statistics.fmean(floor):.3f}, smallest {min(floor):.3f}; a tenth of the mean "
          f"{statistics.fmean(floor) / 10:.3f} (the decision rule's bound)")  # fmt: skip


if __name__ == "__main__":
    main()
