"""Why does joint ReCAST collapse in some seeds? The runs, the figure and the table of
docs/results.md's "Joint's collapses" section.

The hypothesis to test first: under `--normalize joint` a reward's r_k is not clipped on its own,
so where W concentrates a timestep on one reward the mix is that reward's unclipped r_k, and the
loss's clamp of the mix saturates many (image, timestep) pairs. recast.py logs, each epoch,
`clamp/share` (pairs whose mix the loss clamps), `adv/max/<reward>` (largest |A_k|) and
`share/<reward>` (each reward's effective share of the signal, λ_k × its spread under the
normalisation). This study reruns, with that logging:

- setting 3 at λ = 0.2,0.2,0.4,0.2 (the test's cell whose seed 3 collapsed), joint ReCAST, seeds
  0-4, with the test's flags (studies/comparison.py's arm t3-joint, its kernel dispatch and eval
  every 2 epochs): the archive's numbers repeat to the digit;
- the default run (`python recast.py --lambda 0.4,0.2,0.2,0.2`, one thread) at its worst seed for
  `background` (9) and at seed 0.

and, from the test's archive (docs/comparison/runs.jsonl, no run), splits the across-seed variance
of the final λ-weighted gap into each reward's part (Cov(λ_k gap_k, Σ_j λ_j gap_j) summed over
budgets), per arm, in settings 1 and 3 (the two with `background`).

    python studies/collapse.py run --code /tmp/diag   # 7 runs, two at a time; resumable
    python studies/collapse.py report                 # docs/collapse/{collapse.png,table.md}
"""

import argparse
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import cli  # noqa: E402
from plumbing.checkpoints import read_metrics  # noqa: E402
from studies import comparison  # noqa: E402

CELL = "0.2,0.2,0.4,0.2"  # setting 3's collapsed cell
SETTING3 = ["color", "elongation", "background", "outline"]
SETTING1 = ["position", "color", "sharpness", "background"]
DEFAULT = "0.4,0.2,0.2,0.2"
RUNS = {  # name → recast.py flags (with the study's dispatch for the test's cell)
    **{f"t3-joint-s{s}": ["--lambda", CELL, *comparison.ARMS["t3-joint"], "--seed", str(s),
                          "--eval-every", str(comparison.EVAL_EVERY)] for s in range(5)},
    **{f"default-s{s}": ["--lambda", DEFAULT, "--seed", str(s)] for s in (0, 9)},
}  # fmt: skip
ARMS = ("uniform", "sum", "recast", "joint")  # per-reward ReCAST is `recast` in the archive
PROG = "collapse.py"


def run(args) -> None:
    """Every run of RUNS not finished in --out (an unfinished one resumes), two at a time."""
    if not os.path.isfile(os.path.join(args.code, "recast.py")):
        cli.fail("--code", f"{args.code} holds no recast.py: give the checkout whose recast.py "
                 "runs (default: this one)", PROG)  # fmt: skip
    os.makedirs(args.out, exist_ok=True)

    def one(name: str) -> None:
        path = os.path.join(args.out, name)
        if comparison.done(path):
            return
        cmd = [sys.executable, os.path.join(args.code, "recast.py"), *RUNS[name], "--out", path]
        cmd += ["--resume"] if os.path.isfile(os.path.join(path, "args.json")) else []
        dispatch = comparison.DISPATCH if name.startswith("t3") else {"OMP_NUM_THREADS": "1"}
        env = dict(os.environ, **dispatch)  # the test's cell as the test ran it
        print(f"started: {name} (its progress: {path}.log)", flush=True)  # minutes a run
        with open(path + ".log", "a") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=args.code, env=env)
        if rc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed; see {path}.log")
        print(f"done: {name}", flush=True)

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(one, RUNS))


def variance_parts(records: dict, prefix: str, names: list[str]) -> dict[str, dict[str, float]]:
    """arm → reward → its part of the across-seed variance of the final λ-weighted gap, summed
    over the budgets (the parts sum to 1 per arm)."""
    parts = {}
    for arm in ARMS:
        total, part = 0.0, dict.fromkeys(names, 0.0)
        for lam in comparison.BUDGETS:
            runs = [records.get(os.path.basename(comparison.folder("", lam, f"{prefix}-{arm}", s)))
                    for s in range(5)]  # fmt: skip
            if any(r is None for r in runs):
                continue
            budget = [float(x) for x in lam.split(",")]
            c = [[b * r[-1][f"gap/{n}"] for b, n in zip(budget, names, strict=True)] for r in runs]
            w = [sum(row) for row in c]
            mw = statistics.fmean(w)
            total += statistics.variance(w)
            for k, n in enumerate(names):
                ck = [row[k] for row in c]
                mk = statistics.fmean(ck)
                cov = sum((a - mk) * (b - mw) for a, b in zip(ck, w, strict=True))
                part[n] += cov / (len(runs) - 1)  # a sample covariance, as statistics.variance
        parts[arm] = {n: v / total for n, v in part.items()} if total else {}
    return parts


def report(args) -> None:
    if os.path.exists(args.to) and not os.path.isdir(args.to):
        cli.fail("--to", f"{args.to} is a file, not a folder for table.md and collapse.png: pick "
                 "a folder", PROG)  # fmt: skip
    runs = {n: read_metrics(os.path.join(args.out, n)) for n in RUNS
            if comparison.done(os.path.join(args.out, n))}  # fmt: skip
    if not runs:
        cli.fail("--out", f"{args.out} holds none of the study's finished runs ({', '.join(RUNS)}"
                 "): give the --out that `collapse.py run` wrote to", PROG)  # fmt: skip
    records = comparison.read_archive(comparison.ARCHIVE)
    parts = {"setting 1": variance_parts(records, "d1", SETTING1),
             "setting 3": variance_parts(records, "t3", SETTING3)}  # fmt: skip
    os.makedirs(args.to, exist_ok=True)
    lines = ["# Joint ReCAST's collapses: what the loss saw\n",
             "`python studies/collapse.py run --code DIR` then `python studies/collapse.py report`"
             " (studies/collapse.py says which runs). Per run: the largest share of (image, "
             "timestep) pairs whose mix the loss clamped in any epoch, each reward's effective "
             "share of the signal (mean over epochs, λ beside it), the final λ-weighted gap and "
             "background's λ × gap, at the last two evals.\n",
             "| run | max clamp/share | share of the signal (λ) | λ-weighted gap (prev → final) "
             "| background: λ × gap (prev → final) |", "|---|---|---|---|---|"]  # fmt: skip
    for name, lines_ in runs.items():
        names = SETTING3 if name.startswith("t3") else SETTING1
        lam = [float(x) for x in (CELL if name.startswith("t3") else DEFAULT).split(",")]
        ep = [m for m in lines_[1:] if "clamp/share" in m]
        ev = [m for m in lines_ if "gap/weighted" in m]
        share = ", ".join(f"{n} {statistics.fmean(m[f'share/{n}'] for m in ep):.2f} ({b})"
                          for n, b in zip(names, lam, strict=True))  # fmt: skip
        bg = lam[names.index("background")]
        lines.append(f"| {name} | {max(m['clamp/share'] for m in ep):.4f} | {share} | "
                     f"{ev[-2]['gap/weighted']:+.3f} → {ev[-1]['gap/weighted']:+.3f} | "
                     f"{bg * ev[-2]['gap/background']:+.3f} → {bg * ev[-1]['gap/background']:+.3f}"
                     " |")  # fmt: skip
    lines += ["", "Each reward's part of the across-seed variance of the final λ-weighted gap "
              "(the test's archive, 5 budgets × 5 seeds; `recast` is per-reward ReCAST):", "",
              "| setting | arm | each reward's part |", "|---|---|---|"]  # fmt: skip
    for setting, by_arm in parts.items():
        for arm, part in by_arm.items():
            said = ", ".join(f"{n} {v:+.2f}" for n, v in part.items())
            lines.append(f"| {setting} | {arm} | {said} |")
    with open(os.path.join(args.to, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    figure(runs, parts, os.path.join(args.to, "collapse.png"))
    print("\n".join(lines))
    print(f"wrote {args.to}/table.md, {args.to}/collapse.png")


def figure(runs: dict, parts: dict, path: str) -> None:
    fig, ax = plt.subplots(1, 5, figsize=(23, 4.4))
    t3 = {n: v for n, v in runs.items() if n.startswith("t3")}
    for name, lines in t3.items():
        ev = [m for m in lines if "gap/weighted" in m]
        style = dict(lw=2.5, color="C3") if name.endswith("s3") else dict(lw=1, color="0.6")
        ax[0].plot([m["epoch"] for m in ev], [m["gap/weighted"] for m in ev], **style)
        ax[1].plot([m["epoch"] for m in ev], [0.4 * m["gap/background"] for m in ev], **style)
    ax[0].set(title=f"setting 3, λ = {CELL}, joint: λ-weighted gap\n(seed 3 red, 0-2, 4 grey)",
              xlabel="epoch")  # fmt: skip
    ax[1].set(title="background's part of it: 0.4 × gap/background", xlabel="epoch")
    for name, lines in runs.items():
        ep = [m for m in lines[1:] if "clamp/share" in m]
        ax[2].plot([m["epoch"] for m in ep], [100 * m["clamp/share"] for m in ep], label=name,
                   color="C3" if name == "t3-joint-s3" else None)  # fmt: skip
    ax[2].set(title="pairs whose mix the loss clamped (%)\n(the hypothesis: many)", xlabel="epoch",
              ylim=(0, 10))  # fmt: skip
    ax[2].legend(fontsize=7)
    for j, (prefix, names, lam) in enumerate(
        (("t3", SETTING3, CELL), ("default", SETTING1, DEFAULT))
    ):
        ep = [m for n, lines in runs.items() if n.startswith(prefix) for m in lines[1:]
              if "share/" + names[0] in m]  # fmt: skip
        share = [statistics.fmean(m[f"share/{n}"] for m in ep) for n in names]
        x = [k + 5 * j for k in range(4)]
        ax[3].bar([v - 0.2 for v in x], [float(b) for b in lam.split(",")], 0.4, color="0.75",
                  label="λ" if j == 0 else None)  # fmt: skip
        ax[3].bar([v + 0.2 for v in x], share, 0.4, color="C0", label="share" if j == 0 else None)
    ax[3].set_xticks([k + 5 * j for j in range(2) for k in range(4)],
                     [*(f"3:{n[:5]}" for n in SETTING3), *(f"1:{n[:5]}" for n in SETTING1)],
                     rotation=45)  # fmt: skip
    ax[3].set(title="λ and each reward's share of the signal under joint\n(mean over epochs and "
              "seeds; setting 3's cell, the default run)")  # fmt: skip
    ax[3].legend(fontsize=8)
    bars = [(s, a) for s in parts for a in ARMS]
    bg = [parts[s][a].get("background", 0) for s, a in bars]
    ax[4].bar(range(len(bars)), bg, color=["C3" if a == "joint" else "0.6" for _, a in bars])
    ax[4].set_xticks(range(len(bars)), [f"{s[-1]}:{a}" for s, a in bars], rotation=45)
    ax[4].set(title="background's part of the across-seed\nvariance of the final gap (archive)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("command", choices=["run", "report"])
    ap.add_argument("--code", default=ROOT, help="the checkout whose recast.py runs")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "collapse"), help="run folders")
    ap.add_argument("--to", default=os.path.join(ROOT, "docs", "collapse"), help="report folder")
    args = ap.parse_args(argv)
    # recast.py runs in --code: a relative --out (or --code) would be read there by it and here
    # by this script, two different folders
    args.code, args.out, args.to = map(os.path.abspath, (args.code, args.out, args.to))
    run(args) if args.command == "run" else report(args)


if __name__ == "__main__":
    main()
