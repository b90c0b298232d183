"""One epoch of ReCAST in pictures: the figures of docs/anatomy.md (toy world, base model, CPU).

    python studies/anatomy.py      # → docs/anatomy/*.png and anatomy.json, about a minute

It calls the functions recast.py trains with, on the first epoch of the default command
(`--lambda 0.4,0.2,0.2,0.2`, seed 0: 16 prompts × 8 images, T = 10):
1. recast.rollout: the old policy (= the base model at epoch 1) samples, keeping every step
   prediction x̂0_i (DESIGN §2) → steps.png, one prompt group's predictions at every step;
2. recast.score_all and recast.score_steps (trajectory_scores): every reward scores every step
   prediction and the final image (DESIGN §4) → scores.png, the group's scores along the steps,
   and the step from which each reward's ranking of the group is settled (its Spearman ρ with the
   final ranking stays ≥ SETTLED from there on, mean over all groups);
3. recast_kernels.renyi.renyi_gains, gain_profiles, recast_weights: D, gains, profiles, W and its
   marginals (DESIGN §4-5) → gains.png;
4. recast.unit_joint_optimality (recast.optimality, --normalize unit-joint, the default): r per
   reward and group (DESIGN §3), and the mixed optimality r̄ = Σ_k W_k,i r_k / Σ_k W_k,i, clamped
   to [0, 1], that the NFT loss trains each (image, timestep) pair toward (DESIGN §6), under
   ReCAST's W and under W = λ/T (the flat ablation: the unit-free summed reward's) → mix.png.
"""

import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import harness  # noqa: E402
import recast  # noqa: E402
from plumbing import cli  # noqa: E402
from plumbing.checkpoints import write_whole  # noqa: E402
from plumbing.plots import grid, timestep_centroid  # noqa: E402
from recast import gain_profiles, group_optimality, recast_weights  # noqa: E402
from recast_kernels.renyi import renyi_gains  # noqa: E402
from studies.summarize import spearman  # noqa: E402

SETTLED = 0.8  # a ranking is settled from the first step whose ρ with the final one stays ≥ this


def settled_step(scores: torch.Tensor) -> int:
    """(T+1, G) scores of one group along the steps → the first step i ≥ 1 from which every
    step's ranking has Spearman ρ ≥ SETTLED with the final ranking (T if none before it)."""
    T = scores.shape[0] - 1
    step = T
    for i in range(T - 1, 0, -1):
        if not spearman(scores[i], scores[T]) >= SETTLED:  # nan (a constant row) counts as not
            break
        step = i
    return step


def anatomy(args) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    flags = ["--lambda", args.lam, "--device", "cpu", "--seed", str(args.seed)]
    run = harness.setup(recast.Args, flags, recast.__doc__)
    names, G, T, lam = run.names, run.args.group_size, run.args.steps, run.lam
    _, my_prompts, x0, preds = recast.rollout(run, 1)
    per_image = [p for p in my_prompts for _ in range(G)]
    final = recast.score_all(run.reward_fns, run.world.decode(x0), per_image)  # (K, N)
    scores = recast.score_steps(run, preds, final, per_image)  # (K, T+1, N); column 0 unscored
    unit_free = recast.gain_scores(run, scores, final)  # as recast.py's gains read them
    D, gains = renyi_gains(unit_free, G, run.args.alpha, run.args.adv_clip_max)
    a = run.args  # recast.py's defaults: --tau, --floor and --gain-shift included
    profiles = gain_profiles(gains, a.floor, a.gain_shift)
    W = recast_weights(gains, lam, a.tau, a.floor, a.gain_shift).double()
    r = recast.optimality(run, final).double()  # (K, N): --normalize unit-joint, the default
    K, N = final.shape
    groups = N // G
    # the group to show: the one whose rewards disagree most within it (largest summed spread of
    # each reward's own r, --normalize per-reward's, which measures every reward on one scale)
    own = group_optimality(final, G, run.args.adv_clip_max).double()
    g = int(own.view(K, groups, G).std(2).sum(0).argmax())
    members = slice(g * G, (g + 1) * G)
    settled = torch.tensor([[settled_step(scores[k, :, h * G : (h + 1) * G]) for h in range(groups)]
                            for k in range(K)], dtype=torch.float64)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)

    # 1. steps.png: the group's step predictions, one row per image, one column per step
    images = torch.cat([run.world.decode(preds[:, members].flatten(0, 1)).view(T, G, 3, 32, 32),
                        run.world.decode(x0[members])[None]])  # (T+1, G, ...)  # fmt: skip
    fig, ax = plt.subplots(figsize=(1.0 + 0.62 * (T + 1), 0.62 * G + 0.9))
    ax.imshow(grid(images.transpose(0, 1).flatten(0, 1), T + 1).numpy(), interpolation="nearest")
    ax.set_xticks([16.5 + 33 * i for i in range(T + 1)],
                  [f"x̂0_{i}\nt={float(run.sigmas[i]):.2f}" for i in range(T)] + ["x0"],
                  fontsize=7)  # fmt: skip
    ax.set_yticks([16.5 + 33 * j for j in range(G)], [f"image {j}" for j in range(G)], fontsize=7)
    ax.set_title(f"prompt “{my_prompts[g]}”: the step predictions x̂0_i = x_t_i − t_i·v of its "
                 f"{G} images (recast.rollout)", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "steps.png"), dpi=110)
    plt.close(fig)

    # 2. scores.png: each reward's scores of the group's images along the steps
    fig, axes = plt.subplots(1, K, figsize=(3.3 * K, 3.0))
    for k, ax in enumerate(axes):
        for j in range(G):
            ax.plot(range(1, T + 1), scores[k, 1:, g * G + j].numpy(), lw=1, marker="o", ms=2)
        s = int(settled[k, g])
        ax.axvline(s, color="grey", ls=":", lw=1)
        ax.set_title(f"{names[k]}: ranking settled at step {s}\n(all groups: mean "
                     f"{settled[k].mean():.1f})", fontsize=8)  # fmt: skip
        ax.set_xticks(range(1, T + 1), [*map(str, range(1, T)), "x0"], fontsize=7)
        ax.set_xlabel("step prediction i (x0: final)", fontsize=8)
    axes[0].set_ylabel("reward score of x̂0_i (one line per image)", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "scores.png"), dpi=110)
    plt.close(fig)

    # 3. gains.png: D, gains, profiles and W with its marginals
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.3), width_ratios=[1, 1, 1, 1.5])
    for k, n in enumerate(names):
        axes[0].plot(range(T + 1), D[k].numpy(), marker="o", ms=3, label=n)
        axes[1].plot(range(T), gains[k].numpy(), marker="o", ms=3, label=n)
        c = float(timestep_centroid(profiles[k]))
        axes[2].plot(range(T), profiles[k].numpy(), marker="o", ms=3, label=f"{n} ({c:.1f})")
    titles = ["D_k,i: Rényi discriminability\n(renyi_gains, DESIGN §4)",
              "gains g_k,i = D_k,i+1 − D_k,i\n(renyi_gains, DESIGN §4)",
              "profiles p_k,i and centroids\n(gain_profiles, DESIGN §5)"]  # fmt: skip
    for ax, title in zip(axes[:3], titles, strict=True):
        ax.set_title(title, fontsize=8)
        ax.legend(fontsize=6)
        ax.set_xlabel("step i (0 = pure noise)", fontsize=8)
    im = axes[3].imshow(torch.cat([W * T, W.sum(0, keepdim=True) * T]).numpy(), cmap="magma",
                        aspect="auto", vmin=0)  # fmt: skip
    rows = [f"{n} (Σ {float(W[k].sum()):.2f})" for k, n in enumerate(names)] + ["column Σ·T"]
    axes[3].set_yticks(range(K + 1), rows, fontsize=7)
    axes[3].set_title("W·T (recast_weights, DESIGN §5): rows sum to λ,\ncolumns to 1/T",
                      fontsize=8)  # fmt: skip
    axes[3].set_xlabel("training timestep i", fontsize=8)
    fig.colorbar(im, ax=axes[3], fraction=0.03)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "gains.png"), dpi=110)
    plt.close(fig)

    # 4. mix.png: r per reward for the group, and r̄ per (image, timestep) under both W
    flat = lam[:, None].expand(K, T) / T  # --weighting flat: the same r, W = λ/T
    mix = {w: ((Wm.T @ r[:, members]) / Wm.sum(0)[:, None]).clamp(0, 1) for w, Wm in
           (("ReCAST", W), ("flat", flat))}  # (T, G) each; the loss clamps  # fmt: skip
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.2), width_ratios=[1, 1.4, 1.4])
    shown = axes[0].imshow(r[:, members].numpy(), cmap="viridis", aspect="auto")
    for k in range(K):
        for j in range(G):
            axes[0].text(j, k, f"{float(r[k, g * G + j]):.2f}", ha="center", va="center",
                         fontsize=5, color="white")  # fmt: skip
    fig.colorbar(shown, ax=axes[0], fraction=0.05)
    axes[0].set_yticks(range(K), names, fontsize=7)
    axes[0].set_xlabel("image of the group", fontsize=8)
    axes[0].set_title("r_k,n (unit_joint_optimality, DESIGN §3)", fontsize=8)
    for ax, (w, m) in zip(axes[1:], mix.items(), strict=True):
        im = ax.imshow(m.T.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        for i in range(T):
            for j in range(G):
                ax.text(i, j, f"{float(m[i, j]):.2f}", ha="center", va="center", fontsize=5,
                        color="white" if m[i, j] < 0.6 else "black")  # fmt: skip
        ax.set_xlabel("training timestep i", fontsize=8)
        ax.set_ylabel("image", fontsize=8)
        ax.set_title(f"r̄_n,i = Σ_k W_k,i r_k,n / Σ_k W_k,i in [0, 1] under {w} W (DESIGN §6)",
                     fontsize=8)  # fmt: skip
    fig.colorbar(im, ax=axes[2], fraction=0.03)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "mix.png"), dpi=110)
    plt.close(fig)

    report = dict(prompt=my_prompts[g], group=g, names=names, lam=lam.tolist(), D=D.tolist(),
                  gains=gains.tolist(), profiles=profiles.tolist(), W=W.tolist(),
                  centroids=timestep_centroid(profiles).tolist(),
                  settled_mean=settled.mean(1).tolist(),
                  settled_group=settled[:, g].tolist(), r=r[:, members].tolist(),
                  mix={w: m.tolist() for w, m in mix.items()})  # fmt: skip
    write_whole(os.path.join(args.out, "anatomy.json"), report)
    print(f"group {g}: “{my_prompts[g]}”")
    for k, n in enumerate(names):
        print(f"{n:<11} ranking settled at step {settled[k].mean():.1f} (mean over {groups} "
              f"groups; this group {int(settled[k, g])}); profile centroid "
              f"{float(timestep_centroid(profiles[k])):.2f}; W row centroid "
              f"{float(timestep_centroid(W[k])):.2f}")  # fmt: skip
    spread = {w: float((m.max(1).values - m.min(1).values).mean()) for w, m in mix.items()}
    print(
        "r̄'s spread within the group (max − min), mean over timesteps: "
        + ", ".join(f"{w} {v:.3f}" for w, v in spread.items())
    )
    print(f"wrote {args.out}/steps.png, scores.png, gains.png, mix.png, anatomy.json")


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="anatomy.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--lambda", dest="lam", default="0.4,0.2,0.2,0.2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=cli.count, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "anatomy"))
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # before a minute of work
        cli.fail("--out", f"{args.out} is a file, not a folder for the figures: pick a folder",
                 ap.prog)  # fmt: skip
    anatomy(args)


if __name__ == "__main__":
    main()
