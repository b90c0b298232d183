"""The shipped toy base model's figures for docs/toy_world.md: held-out scores of the ideal
rendering, the world's pictures, the base model and chance; a sample grid; the gain profiles of the
four rewards (DESIGN §4) with their centroids, and each reward's spread within a group of 8 samples.

    python studies/base_model.py             # → docs/base_samples.png, docs/base_profiles.png
    python studies/base_model.py --rewards toy2   # setting 2 → docs/base_profiles_toy2.png

With --rewards toy2 it also prints what setting 2's four were chosen on (docs/toy_world.md,
"Setting 2"): the within-group correlations of every candidate and of setting 1's rewards,
candidates that were measured and not chosen (`symmetry`, below) among them.

    python studies/base_model.py --measure   # what settings 3 and 4 were chosen on

prints, for all eight rewards of settings 1 and 2 on the base model (64 groups of 8 images over
the 58 training prompts, 6 of them twice), each one's within-group spread, its headroom over it,
the share of groups in which it spreads, its gain-profile centroid (DESIGN §4; ± over bootstrap
resamples of the groups) and the within-group correlations between them (docs/toy_world.md,
"Settings 3 and 4").
"""

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness
import recast
import rewards
from plumbing import cli, plots
from recast import gain_profiles
from recast_kernels.renyi import renyi_gains
from worlds import toyworld as tw


def symmetry(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """A setting-2 candidate not chosen: −(1 − IoU) of the soft mask with its mirror image about
    the vertical through its centroid (every ideal shape is mirror-symmetric so). On the base
    model it correlates with outline and elongation within groups (docs/toy_world.md)."""
    a = rewards.soft_mask(rewards._rgb(images))
    B, H, W = a.shape
    mirrored_x = 2 * rewards.mask_centre(a)[:, :1] - (torch.arange(W) + 0.5)  # (B, W) pixels
    gx = (mirrored_x / W * 2 - 1)[:, None, :].expand(B, H, W)
    gy = ((torch.arange(H) + 0.5) / H * 2 - 1)[None, :, None].expand(B, H, W)
    mirror = torch.nn.functional.grid_sample(a[:, None], torch.stack([gx, gy], -1),
                                             align_corners=False)[:, 0]  # fmt: skip
    inter, union = torch.minimum(a, mirror).sum((1, 2)), torch.maximum(a, mirror).sum((1, 2))
    return -(1 - inter / (union + 1e-6))


CANDIDATES = {"symmetry": symmetry}  # measured for setting 2 beside its four, not chosen


def base_profiles(
    world: tw.ToyWorld,
    prompts: list[str],
    group_size: int,
    seed: int,
    steps: int = 10,
    alpha: float = 2.0,
    floor: float = 0.1,
    names: list[str] | None = None,
):
    """DESIGN §4 on base-model samples, G images per prompt: (names, D, gains, profiles, scores),
    scores (K, T+1, N) as recast.trajectory_scores gives them (default: the world's rewards)."""
    gen = torch.Generator().manual_seed(seed)
    names = list(names or world.reward_names)
    fns = {n: CANDIDATES.get(n) or rewards.get(n, world.device) for n in names}
    per_image = [p for p in prompts for _ in range(group_size)]
    noise = torch.randn(len(per_image), *world.latent_shape, generator=gen).to(world.device)
    x0, preds = recast.sample(
        lambda x, c, t: world.v("ref", x, c, t), noise, world.encode(per_image), world.sigmas(steps)
    )
    final = recast.score_all(fns, x0, per_image)
    scores = recast.trajectory_scores(fns, world.decode, preds, final, per_image)
    D, gains = renyi_gains(scores, group_size, alpha)
    return names, D, gains, gain_profiles(gains, floor), scores


def report(out_dir: str, setting2: bool = False) -> None:
    """Figures of the shipped base model (docs/toy_world.md): eval table, samples, gain profiles;
    of setting 2's rewards (with setting 1's as its judges) when `setting2`."""
    os.makedirs(out_dir, exist_ok=True)
    world = tw.ToyWorld(torch.device("cpu"))
    names = list(rewards.PRESETS["toy2"] if setting2 else world.reward_names)
    judges = [*world.judge_names, *world.reward_names] if setting2 else list(world.judge_names)
    seeds = 4
    prompts = [p for p in tw.HELDOUT_PROMPTS for _ in range(seeds)]
    seed = torch.Generator().manual_seed(harness.EVAL_SEED)
    noise = torch.randn(len(prompts), *world.latent_shape, generator=seed)
    scorers = {n: rewards.get(n, world.device) for n in (*names, *judges)}
    sigmas = world.sigmas(10)
    base, images = harness.evaluate(
        recast.sample, world, scorers, prompts, noise, sigmas, 64, "ref"
    )
    gen = torch.Generator().manual_seed(0)
    world_images = tw.render(prompts, gen)  # what the base model learnt from: defects and all
    chance_images = tw.render(
        [tw.PROMPTS[i] for i in torch.randint(len(tw.PROMPTS), (len(prompts),), generator=gen)], gen
    )
    rows = {
        "ideal rendering": tw.render(prompts),
        "world picture (defects)": world_images,
        "base model": images,
        "chance (random prompt)": chance_images,
    }
    table = {
        k: {n: rewards.score(n, fn, im, prompts).mean().item() for n, fn in scorers.items()}
        for k, im in rows.items()
    }
    lines = ["| | " + " | ".join(scorers) + " |", "|---|" + "---|" * len(scorers)]
    lines += [
        f"| {k} | " + " | ".join(f"{v[n]:.3f}" for n in scorers) + " |" for k, v in table.items()
    ]
    print(
        f"held-out set: {len(tw.HELDOUT_PROMPTS)} prompts × {seeds} seeds, fixed noise\n"
        + "\n".join(lines)
    )
    shown = 12 * seeds  # the first 12 held-out prompts, all their seeds
    panels = {
        "base model": images[:shown],
        "ideal": rows["ideal rendering"][:shown:seeds],
    }
    if not setting2:  # the same pictures in both settings
        plots.save_samples_figure(
            os.path.join(out_dir, "base_samples.png"), panels, tw.HELDOUT_PROMPTS[:12]
        )
    measured = [*names, *CANDIDATES, *world.reward_names] if setting2 else names
    _, D, gains, prof, scores = base_profiles(world, tw.TRAIN_PROMPTS[::2], 8, 0, names=measured)
    spread = scores[:, -1].view(len(measured), -1, 8).std(2).mean(1)  # (K,) within a group of 8
    print("base model, mean within-group std of 8 samples:",
          {n: round(v.item(), 3) for n, v in zip(measured, spread, strict=True)})  # fmt: skip
    if setting2:  # what the four were chosen on: independence within groups
        z = scores[:, -1].view(len(measured), -1, 8)
        z = ((z - z.mean(2, keepdim=True)) / (z.std(2, keepdim=True) + 1e-8)).flatten(1)
        corr = (z @ z.T) / (z.shape[1] - z.shape[1] // 8)
        print("within-group correlation of the final scores (29 groups of 8):")
        print(" " * 11 + "".join(f"{n[:9]:>10}" for n in measured))
        for n, row in zip(measured, corr.tolist(), strict=True):
            print(f"{n:11}" + "".join(f"{c:+10.2f}" for c in row))
        keep = [measured.index(n) for n in names]
        D, gains, prof = D[keep], gains[keep], prof[keep]
    cents = plots.timestep_centroid(prof)
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for k, n in enumerate(names):
        ax.plot(
            range(len(gains[k])),
            prof[k].numpy(),
            marker="o",
            ms=3,
            label=f"{n} (centroid {cents[k]:.1f})",
        )
    ax.set_xlabel("training timestep i (0 = pure noise)")
    ax.set_ylabel("gain profile p_k,i")
    ax.set_title("base model: where each reward is informative", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"base_profiles{'_toy2' if setting2 else ''}.png"), dpi=110)
    print(
        "profile centroids (DESIGN §4 on the base model, 29 prompts × 8 images):",
        {n: round(c.item(), 2) for n, c in zip(names, cents, strict=True)},
    )
    print("D_T:", {n: round(d.item(), 4) for n, d in zip(names, D[:, -1], strict=True)})


def measure(prompts: int = 64, group_size: int = 8, seed: int = 0) -> dict:
    """What settings 3 and 4 were chosen on, for the eight rewards of settings 1 and 2: per
    reward its headroom (the ideal rendering's mean score − the base model's) over its mean
    within-group std, the share of groups where it spreads, its profile centroid as --profile
    reports it (the shipped --gain-shift 1) with the std over 200 bootstrap resamples of the
    groups, and the within-group correlations."""
    world = tw.ToyWorld(torch.device("cpu"))
    names = [*world.reward_names, *rewards.PRESETS["toy2"]]
    train = [tw.TRAIN_PROMPTS[i * len(tw.TRAIN_PROMPTS) // prompts] for i in range(prompts)]
    _, _, gains, _, scores = base_profiles(world, train, group_size, seed, names=names)
    final = scores[:, -1].view(len(names), prompts, group_size)  # (K, M, G)
    per_image = [p for p in train for _ in range(group_size)]
    ideal = torch.stack([rewards.get(n, "cpu")(tw.render(per_image), per_image) for n in names])
    spread = final.std(2).mean(1)
    z = (final - final.mean(2, keepdim=True)) / (final.std(2, keepdim=True) + 1e-8)
    corr = torch.einsum("kgn,jgn->kj", z, z) / (z[0].numel() - z.shape[1])
    gen = torch.Generator().manual_seed(seed)
    boot = []
    for _ in range(200):
        pick = torch.randint(prompts, (prompts,), generator=gen)
        image = (pick[:, None] * group_size + torch.arange(group_size)).flatten()
        _, g = renyi_gains(scores[:, :, image], group_size)
        boot.append(plots.timestep_centroid(gain_profiles(g.double(), 0.1, 1)))
    return {
        "names": names, "headroom_over_spread": ((ideal.mean(1) - final.mean((1, 2))) / spread),
        "spreads": (final.std(2) > 0).float().mean(1), "corr": corr, "spread": spread,
        "centroid": plots.timestep_centroid(gain_profiles(gains.double(), 0.1, 1)),
        "centroid_std": torch.stack(boot).std(0),
    }  # fmt: skip


def print_measure() -> None:
    m = measure()
    print("the eight rewards on the base model, 64 groups of 8 images over the 58 training "
          "prompts (studies/base_model.py --measure):\n")  # fmt: skip
    print("| reward | within-group spread | headroom ÷ spread | groups that spread | "
          "profile centroid | " +
          " | ".join(m["names"]) + " |")  # fmt: skip
    print("|---" * (5 + len(m["names"])) + "|")
    for k, n in enumerate(m["names"]):
        print(f"| {n} | {m['spread'][k]:.4f} | {m['headroom_over_spread'][k]:.2f} | "
              f"{m['spreads'][k]:.2f} | "
              f"{m['centroid'][k]:.2f} ± {m['centroid_std'][k]:.2f} | "
              + " | ".join(f"{v:+.2f}" for v in m["corr"][k].tolist()) + " |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(
        prog="base_model.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", default="docs", help="folder for the PNGs")
    ap.add_argument(
        "--rewards",
        choices=["toy", "toy2"],
        default="toy",
        help="toy: setting 1's four; toy2: setting 2's (setting 1's as judges)",
    )
    ap.add_argument("--measure", action="store_true",
                    help="print what settings 3 and 4 were chosen on")  # fmt: skip
    a = ap.parse_args(argv)
    if a.measure:
        print_measure()
        return
    if os.path.exists(a.out) and not os.path.isdir(a.out):  # before the model samples a minute
        cli.fail("--out", f"{a.out} is a file, not a folder for the PNGs: pick a folder", ap.prog)
    report(a.out, a.rewards == "toy2")


if __name__ == "__main__":
    main()
