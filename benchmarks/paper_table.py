"""Does ReCAST help? The paper's comparison, in the toy world.

Five reward budgets λ × three weightings (recast, uniform = λ/T, sum = DiffusionNFT's single reward
Σ λ_k s_k) × several seeds, every run `recast.py` with its defaults and the same number of epochs
(held-out eval every --eval-every epochs, for the learning curves).
Writes, into --out:
  table.md             final eval per budget and weighting: mean ± std over seeds of each reward,
                       each held-out judge, and the λ-weighted fraction of the base → ideal gap
                       closed, with ReCAST's win / tie / loss against each baseline;
  curves.png           λ-weighted gap closed vs epoch, mean ± std band over seeds;
  weights.png          each budget's mean final W·T under ReCAST;
  runs/<budget>-<weighting>-s<seed>/   the runs themselves.
A sweep that was interrupted resumes: finished runs are skipped, unfinished ones `--resume`d.

    python benchmarks/paper_table.py --epochs 8      # 5 × 3 × 3 = 45 runs, 111 min on 2 cores
    python benchmarks/paper_table.py --seeds 1 --epochs 2 --out /tmp/sweep   # a quick look
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.summarize import mean_std  # noqa: E402
from toyworld import ToyWorld  # noqa: E402

BUDGETS = [
    "0.4,0.2,0.2,0.2",
    "0.2,0.4,0.2,0.2",
    "0.2,0.2,0.4,0.2",
    "0.2,0.2,0.2,0.4",
    "0.25,0.25,0.25,0.25",
]
WEIGHTINGS = ["recast", "uniform", "sum"]
REWARDS = list(ToyWorld.reward_names)
JUDGES = list(ToyWorld.judge_names)


def run_one(
    out: str, lam: str, weighting: str, seed: int, epochs: int, eval_every: int, threads: int
) -> str:
    """One recast.py run (resumed if a previous sweep left it unfinished); returns its folder."""
    if os.path.exists(os.path.join(out, "summary.json")):
        return out
    cmd = [sys.executable, os.path.join(ROOT, "recast.py"), "--lambda", lam]
    cmd += ["--weighting", weighting, "--seed", str(seed), "--epochs", str(epochs), "--out", out]
    cmd += ["--eval-every", str(eval_every)]
    if os.path.exists(os.path.join(out, "args.json")):
        cmd.append("--resume")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    with open(out + ".log", "a") as log:
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {done.returncode}); see {out}.log")
    return out


def metrics(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def verdict(a: list[float], b: list[float]) -> str:
    """win / tie / loss of a against b: a difference of means beyond twice its standard error."""
    diff = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return f"{diff:+.3f}"
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    word = "win" if diff > 2 * se else "loss" if diff < -2 * se else "tie"
    return f"{word} ({diff:+.3f} ± {se:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "sweeps", "paper"), help="sweep folder")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per budget and weighting")
    ap.add_argument("--epochs", type=int, default=None, help="epochs per run (recast.py's default)")
    ap.add_argument("--eval-every", type=int, default=2, help="epochs between held-out evals")
    ap.add_argument("--jobs", type=int, default=os.cpu_count(), help="runs at once (one core each)")
    args = ap.parse_args()
    if args.epochs is None:
        from recast import Args

        args.epochs = Args.epochs
    runs_dir = os.path.join(args.out, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    plan = {
        (lam, w, s): os.path.join(runs_dir, f"{lam.replace(',', '_')}-{w}-s{s}")
        for lam in BUDGETS for w in WEIGHTINGS for s in range(args.seeds)
    }  # fmt: skip
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = [
            pool.submit(run_one, out, lam, w, s, args.epochs, args.eval_every, threads)
            for (lam, w, s), out in plan.items()
        ]
        for f in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run"):
            f.result()
    results = {key: metrics(out) for key, out in plan.items()}
    write_table(results, args)
    plot_curves(results, args)
    plot_weights(results, args)
    print(f"wrote {args.out}/table.md, curves.png, weights.png")


def final(lines: list[dict]) -> dict:
    return [m for m in lines if "gap/weighted" in m][-1]


def write_table(results, args) -> None:
    head = [
        "λ",
        "weighting",
        "gap (λ-weighted)",
        *[f"{n}" for n in REWARDS + JUDGES],
        "vs uniform",
        "vs sum",
    ]
    rows = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    for lam in BUDGETS:
        gaps = {
            w: [final(results[lam, w, s])["gap/weighted"] for s in range(args.seeds)]
            for w in WEIGHTINGS
        }
        for w in WEIGHTINGS:
            cells = [lam, w, "{:+.3f} ± {:.3f}".format(*mean_std(gaps[w]))]
            for n in REWARDS + JUDGES:
                cells.append(
                    "{:+.3f} ± {:.3f}".format(
                        *mean_std(
                            [final(results[lam, w, s])[f"eval/{n}"] for s in range(args.seeds)]
                        )
                    )
                )
            cells += [
                verdict(gaps[w], gaps[b]) if w == "recast" else "" for b in ("uniform", "sum")
            ]
            rows.append(f"| {' | '.join(cells)} |")
    base = results[BUDGETS[0], WEIGHTINGS[0], 0][0]
    rows.append(
        "| base model | | 0 | "
        + " | ".join(f"{base[f'eval/{n}']:+.3f}" for n in REWARDS + JUDGES)
        + " | | |"
    )
    rows.append(
        "| ideal rendering | | 1 | "
        + " | ".join(f"{base[f'ideal/{n}']:+.3f}" for n in REWARDS + JUDGES)
        + " | | |"
    )
    note = (
        f"\n{args.seeds} seeds × {args.epochs} epochs per cell, held-out eval with fixed noise. "
        "Rewards and judges: final eval score (higher is better). gap: Σ_k λ_k (eval − base) / "
        "(ideal − base). win / tie / loss: ReCAST's mean gap minus the baseline's, against twice "
        "the standard error of that difference.\n"
    )
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(rows) + "\n" + note)


def plot_curves(results, args) -> None:
    fig, axes = plt.subplots(1, len(BUDGETS), figsize=(3.2 * len(BUDGETS), 3), sharey=True)
    for ax, lam in zip(axes, BUDGETS, strict=True):
        for w in WEIGHTINGS:
            runs = [
                [m for m in results[lam, w, s] if "gap/weighted" in m] for s in range(args.seeds)
            ]
            epochs = [0] + [m["epoch"] for m in runs[0]]
            curves = torch.tensor([[0.0] + [m["gap/weighted"] for m in r] for r in runs])
            mean, std = (
                curves.mean(0),
                (curves.std(0) if len(runs) > 1 else torch.zeros(len(epochs))),
            )
            ax.plot(epochs, mean, label=w)
            ax.fill_between(epochs, mean - std, mean + std, alpha=0.2)
        ax.set_title(f"λ = {lam}", fontsize=9)
        ax.set_xlabel("epoch")
        ax.axhline(0, color="grey", lw=0.5)
    axes[0].set_ylabel("λ-weighted gap closed")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "curves.png"), dpi=110)
    plt.close(fig)


def plot_weights(results, args) -> None:
    Ws = {
        lam: torch.tensor([final(results[lam, "recast", s])["W"] for s in range(args.seeds)]).mean(
            0
        )
        for lam in BUDGETS
    }
    T = next(iter(Ws.values())).shape[1]
    top = max(float(W.max()) * T for W in Ws.values())
    fig, axes = plt.subplots(1, len(BUDGETS), figsize=(3.2 * len(BUDGETS) + 1, 2.4))
    for ax, (lam, W) in zip(axes, Ws.items(), strict=True):
        im = ax.imshow(W * T, cmap="magma", vmin=0, vmax=top, aspect="auto")
        ax.set_yticks(range(len(REWARDS)), REWARDS if ax is axes[0] else [], fontsize=8)
        ax.set_xticks(range(0, T, 3))
        ax.set_title(f"λ = {lam}", fontsize=9)
        ax.set_xlabel("timestep i (0 = noise)")
    fig.suptitle("mean final W·T under ReCAST (rows sum to λ·T, columns to 1)", fontsize=10)
    fig.tight_layout()
    fig.colorbar(im, ax=axes, fraction=0.015)
    fig.savefig(os.path.join(args.out, "weights.png"), dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
