"""The shipped toy base model's figures for docs/toy_world.md: held-out scores of the ideal
rendering, the world's pictures, the base model and chance; a sample grid; the gain profiles of the
four rewards (DESIGN §4) with their centroids, and each reward's spread within a group of 8 samples.

    python benchmarks/base_model.py             # → docs/base_samples.png, docs/base_profiles.png
"""

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import plots  # noqa: E402
import recast  # noqa: E402
import rewards  # noqa: E402
import toyworld as tw  # noqa: E402
from kernels.renyi import gain_profiles, renyi_gains  # noqa: E402


def base_profiles(
    world: tw.ToyWorld,
    prompts: list[str],
    group_size: int,
    seed: int,
    steps: int = 10,
    alpha: float = 2.0,
    floor: float = 0.1,
):
    """DESIGN §4 on base-model samples, G images per prompt: (names, D, gains, profiles, scores),
    scores (K, T+1, N) as recast.trajectory_scores gives them."""
    gen = torch.Generator().manual_seed(seed)
    names = list(world.reward_names)
    fns = {n: rewards.get(n, world.device) for n in names}
    per_image = [p for p in prompts for _ in range(group_size)]
    noise = torch.randn(len(per_image), *world.latent_shape, generator=gen).to(world.device)
    x0, preds = recast.sample(
        lambda x, c, t: world.v("ref", x, c, t), noise, world.encode(per_image), world.sigmas(steps)
    )
    final = recast.score_all(fns, x0, per_image)
    scores = recast.trajectory_scores(fns, world.decode, preds, final, per_image)
    D, gains = renyi_gains(scores, group_size, alpha)
    return names, D, gains, gain_profiles(gains, floor), scores


def report(out_dir: str) -> None:
    """Figures of the shipped base model (docs/toy_world.md): eval table, samples, gain profiles."""
    os.makedirs(out_dir, exist_ok=True)
    world = tw.ToyWorld(torch.device("cpu"))
    seeds = 4
    prompts = [p for p in tw.HELDOUT_PROMPTS for _ in range(seeds)]
    noise = torch.randn(
        len(prompts), *world.latent_shape, generator=torch.Generator().manual_seed(recast.EVAL_SEED)
    )
    scorers = {n: rewards.get(n, world.device) for n in (*world.reward_names, *world.judge_names)}
    base, images = recast.evaluate(world, scorers, prompts, noise, world.sigmas(10), 64, "ref")
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
    plots.save_samples_figure(
        os.path.join(out_dir, "base_samples.png"), panels, tw.HELDOUT_PROMPTS[:12]
    )

    names, D, gains, prof, scores = base_profiles(world, tw.TRAIN_PROMPTS[::2], 8, seed=0)
    spread = scores[:, -1].view(len(names), -1, 8).std(2).mean(1)  # (K,) within a group of 8
    print("base model, mean within-group std of 8 samples:",
          {n: round(v.item(), 3) for n, v in zip(names, spread, strict=True)})  # fmt: skip
    cents = recast.centroid(prof)
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
    fig.savefig(os.path.join(out_dir, "base_profiles.png"), dpi=110)
    print(
        "profile centroids (DESIGN §4 on the base model, 29 prompts × 8 images):",
        {n: round(c.item(), 2) for n, c in zip(names, cents, strict=True)},
    )
    print("D_T:", {n: round(d.item(), 4) for n, d in zip(names, D[:, -1], strict=True)})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="docs", help="folder for the PNGs")
    report(ap.parse_args().out)
