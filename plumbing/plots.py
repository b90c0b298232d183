"""Pictures for recast.py runs: the weight matrix W with the gain profiles, and sample grids."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch


def timestep_centroid(weights: torch.Tensor) -> torch.Tensor:
    """Σ_i i·w_i / Σ_i w_i per row: where along the T steps a reward's weight sits."""
    i = torch.arange(weights.shape[-1], dtype=weights.dtype)
    return (weights * i).sum(-1) / weights.sum(-1)


def grid(images: torch.Tensor, cols: int) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] → one (rows·(H+1), cols·(W+1), 3) image in [0, 1], 1-px gutters."""
    B, C, H, W = images.shape
    rows = -(-B // cols)
    out = torch.ones(rows * (H + 1), cols * (W + 1), C)
    for n, img in enumerate(((images.float().cpu().clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1)):
        r, c = divmod(n, cols)
        out[r * (H + 1) : r * (H + 1) + H, c * (W + 1) : c * (W + 1) + W] = img
    return out


def save(fig, path: str) -> None:
    """fig into `path` (110 dpi), closed. A write that fails (a full disk) raises its OSError
    naming `path`: the error of a write to an open file names none, and the run's one-line
    message (rundir.run_main) names the file and the run folder from it."""
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror or str(e), path) from e
        raise
    finally:
        plt.close(fig)


def save_weights_figure(
    path: str, W, profiles, lam, names, sigmas, title: str, spread=None
) -> None:
    """Heatmap of W·T (rewards × timesteps) beside each reward's gain profile p_k (± `spread`, a
    (K, T) standard deviation, drawn as a band when given). `profiles` None (no step scored, as
    with --weighting uniform or sum): the right panel says so."""
    W = torch.as_tensor(W, dtype=torch.float64)
    if profiles is not None:
        profiles = torch.as_tensor(profiles, dtype=torch.float64)
    K, T = W.shape
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(4 + 0.55 * T + 4.5, 1.0 + 0.5 * K + 1.2), width_ratios=[0.55 * T + 2, 4.5]
    )
    im = ax.imshow(W * T, cmap="magma", aspect="auto", vmin=0)
    for k in range(K):
        for i in range(T):
            v = float(W[k, i] * T)
            ax.text(
                i,
                k,
                f"{v:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="white" if v < 0.6 * float((W * T).max()) else "black",
            )
    ax.set_yticks(range(K), [f"{n}  λ={float(lam[k]):.2f}" for k, n in enumerate(names)])
    ax.set_xticks(range(T), [f"{i}\n{float(sigmas[i]):.2f}" for i in range(T)], fontsize=7)
    ax.set_xlabel("training timestep i  (t_i)")
    ax.set_title("W·T  (rows sum to λ·T, columns to 1)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03)
    if profiles is None:
        bx.text(0.5, 0.5, "no step predictions scored\n(W needs no gains)", ha="center",
                va="center", transform=bx.transAxes, fontsize=9)  # fmt: skip
        bx.set_axis_off()
    for k, n in enumerate(names if profiles is not None else []):
        c = float(timestep_centroid(profiles[k]))
        line = bx.plot(
            range(T), profiles[k].numpy(), marker="o", ms=3, label=f"{n} (centroid {c:.1f})"
        )
        bx.axvline(c, color=line[0].get_color(), lw=0.8, ls=":")
        if spread is not None:
            lo, hi = (profiles[k] - spread[k]).numpy(), (profiles[k] + spread[k]).numpy()
            bx.fill_between(range(T), lo, hi, color=line[0].get_color(), alpha=0.2, lw=0)
    bx.set_xlabel("training timestep i  (0 = pure noise)")
    bx.set_ylabel("gain profile p_k,i")
    bx.set_title("where each reward is informative", fontsize=9)
    if profiles is not None:
        bx.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    save(fig, path)


def save_samples_figure(path: str, panels: dict[str, torch.Tensor], prompts: list[str]) -> None:
    """One row per prompt, one panel per entry of `panels`: images (n_prompts · seeds, 3, H, W),
    the seeds of a prompt next to each other (same prompts and noise in every panel)."""
    rows = len(prompts)
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(1.6 + sum(0.42 * len(v) / rows for v in panels.values()), 0.45 * rows + 0.6),
        width_ratios=[len(v) / rows for v in panels.values()],
        squeeze=False,
    )
    for j, (ax, (name, images)) in enumerate(zip(axes[0], panels.items(), strict=True)):
        cols = len(images) // rows
        H = images.shape[-2]
        ax.imshow(grid(images, cols).numpy(), interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks(
            [(H + 1) * r + H / 2 for r in range(rows)], prompts if j == 0 else [], fontsize=7
        )
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
    fig.tight_layout()
    save(fig, path)
