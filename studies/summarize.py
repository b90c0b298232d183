"""Base vs final eval of one or more recast.py runs (seeds), as markdown tables: mean ± std and
the worst run per reward, and every run's gaps closed; counts of runs that improve each reward;
W's marginals and centroids; where the time goes. The runs are the seeds of one configuration:
they may differ in --seed, --out, the flags --resume may change (harness.RESUMABLE) and the
memory-only ones (--grad-checkpointing, --shard), not in the method's (--lambda's budgets,
--steps, --weighting…), else it exits 2 naming them.

python studies/summarize.py runs/default-s0 runs/default-s1 runs/default-s2

With `--against` and the seeds of a second configuration (the same rewards, judges and seeds; any
method), it prints the two paired by seed instead: per reward, judge and the λ-weighted gap, the
mean ± std of (first − second) over the seeds, the seeds in which the first is higher, and the
smallest difference with its seed; then every seed's differences to 4 decimals:

python studies/summarize.py runs/perreward-s{0..9} --against runs/default-s{0..9}

With `--archive FILE` first, a RUN that is not a folder is read from studies/comparison.py's
archive of finished runs (docs/comparison/runs.jsonl: each run's args, evals, W and times), by
its name there, so the default run's table is rebuilt without its folders:

python studies/summarize.py --archive docs/comparison/runs.jsonl 0.4_0.2_0.2_0.2-def-recast-s{0..9}
"""

import json
import os
import statistics
import sys
from dataclasses import fields

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli
from plumbing.checkpoints import read_metrics
from plumbing.plots import timestep_centroid


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one number)."""
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def ranks(v) -> torch.Tensor:
    """Centred ranks; tied values share their mean rank."""
    v = torch.as_tensor(v, dtype=torch.float64).flatten()
    r = v.argsort().argsort().double()
    for u in v.unique():
        r[v == u] = r[v == u].mean()
    return r - r.mean()


def spearman(x, y) -> float:
    """Rank correlation; tied values share their mean rank; nan when either side is constant."""
    a, b = ranks(x), ranks(y)
    den = float(a.norm() * b.norm())
    return float(a @ b) / den if den > 0 else float("nan")


def spearman_bar(x, level: float = 0.95, perms: int = 100_000) -> float:
    """The one-sided permutation threshold of Spearman ρ against x: the `level` quantile of ρ
    between x (its ties kept) and the gains' ranks in random order (a fixed generator)."""
    a = ranks(x)
    b = torch.arange(len(a), dtype=torch.float64)
    b -= b.mean()
    order = torch.rand(perms, len(a), generator=torch.Generator().manual_seed(0)).argsort(1)
    rho = (b[order] @ a) / float(a.norm() * b.norm())
    return float(rho.quantile(level))


def fmt(xs: list[float]) -> str:
    return "{:+.3f} ± {:.3f}".format(*mean_std(xs))


ARCHIVE: dict[str, list[dict]] = {}  # --archive: run name → its archived lines (comparison.py)


def archived(run: str) -> list[dict] | None:
    """The archived lines of `run` when it is no folder and the --archive holds it by name."""
    return None if os.path.isdir(run) else ARCHIVE.get(run)


def read_args(run: str) -> dict:
    if (lines := archived(run)) is not None:
        return lines[0]["args"]
    with open(os.path.join(run, "args.json")) as f:
        return json.load(f)


def read_lines(run: str) -> list[dict]:
    """A run's metrics lines: its folder's metrics.jsonl, or its archived record."""
    lines = archived(run)
    return read_metrics(run) if lines is None else lines


# Flags that change where memory goes, not what is computed: seeds run with and without them are
# one configuration (--grad-checkpointing recomputes activations; --shard splits the weights).
MEMORY_ONLY = {"grad_checkpointing", "shard"}


def same(name: str, value):
    """A flag's value as the method reads it: --lambda as its budgets normalised to sum 1 (2,1,1,1
    and 0.4,0.2,0.2,0.2 are one λ, cli.parse_lambda), every other flag as written."""
    if name != "lam" or not isinstance(value, str):
        return value
    try:
        lam = [float(x) for x in value.split(",")]
    except ValueError:
        return value
    total = sum(lam)
    return tuple(round(x / total, 12) for x in lam) if total > 0 else value


def other_method(first: dict, run: dict) -> list[str]:
    """Where two runs' args.json differ on a flag that defines the method: every flag but those a
    resumed run may change (harness.RESUMABLE: --out, --epochs, --device…), the memory-only ones
    (MEMORY_ONLY) and --seed, each as "FLAG first's → run's"; --lambda compares its normalised
    budgets (`same`). A flag newer than a run takes its value before it existed
    (harness.BEFORE) or its default, as on --resume; a run older than resolved_precision is said
    to have computed in its explicit --precision, and in an unknown one for auto, which matches
    any (harness.check_resumed_precision)."""
    import harness  # not at the top: the studies that import this file's helpers need neither
    import recast

    default = {f.name: f.default for f in fields(recast.Args)} | harness.BEFORE
    first, run = ({**a, "resolved_precision": a.get("resolved_precision", a.get("precision",
                   "auto"))} for a in (first, run))  # fmt: skip
    was = (first["resolved_precision"], run["resolved_precision"])
    unknown = {"resolved_precision"} if "auto" in was else set()
    names = [*first, *(k for k in run if k not in first)]
    skip = harness.RESUMABLE | MEMORY_ONLY | {"seed"} | unknown
    differ = [
        k
        for k in names
        if k not in skip
        and same(k, first.get(k, default.get(k))) != same(k, run.get(k, default.get(k)))
    ]
    flag = {"resolved_precision": "--precision (resolved)"}
    return [f"{flag.get(k, cli.flag_of(k))} {first.get(k, default.get(k))!r} → "
            f"{run.get(k, default.get(k))!r}" for k in differ]  # fmt: skip


def check_runs(runs: list[str]) -> list[list[dict]]:
    """Each run's metrics.jsonl lines; a folder that is not a run, a run with no eval after
    training yet, or one of other rewards or judges, or another method (flags), than the first
    run's, exits 2 naming it: the runs summarized are the seeds of one configuration."""
    if not runs:
        cli.fail("RUN", "give one or more run folders (recast.py's --out)", "summarize.py")
    lines = []
    for run in runs:
        if archived(run) is not None and "args" not in archived(run)[0]:
            cli.fail("RUN", f"{run} was archived without its args.json (before the default "
                     "run's study): summarize its folder", "summarize.py")  # fmt: skip
        if archived(run) is None and not os.path.isfile(os.path.join(run, "args.json")):
            more = " nor a run of --archive" if ARCHIVE else ""
            cli.fail("RUN", f"{run} is not a run folder (no args.json){more}: give recast.py's "
                     "--out", "summarize.py")  # fmt: skip
        lines.append(read_lines(run))
        if not any("gap/weighted" in m for m in lines[-1][1:]):
            cli.fail("RUN", f"{run} has no eval after training yet (no gap/weighted in its "
                     "metrics.jsonl): summarize it once it has passed its first --eval-every "
                     "epoch", "summarize.py")  # fmt: skip
    setting = [
        ([k[5:] for k in ls[0] if k.startswith("eval/")], len(ls[1].get("W", ()))) for ls in lines
    ]
    for run, (names, k) in zip(runs, setting, strict=True):
        if (names, k) != setting[0]:  # its rows would be looked up in the first run's rewards
            cli.fail("RUN", f"{run} is evaluated on {', '.join(names)} ({k} trained on, W's rows), "
                     f"{runs[0]} on {', '.join(setting[0][0])} ({setting[0][1]}): summarize runs "
                     "of one --rewards and --judges (its seeds)", "summarize.py")  # fmt: skip
    first = read_args(runs[0])
    for run in runs[1:]:
        if differ := other_method(first, read_args(run)):
            cli.fail("RUN", f"{run} is another configuration than {runs[0]}: "
                     f"{', '.join(differ)} ({runs[0]}'s → its): summarize the seeds of one "
                     "configuration (they may differ in --seed, --out, the flags --resume may "
                     "change and the memory-only ones)", "summarize.py")  # fmt: skip
    return lines


def paired(runs: list[str], others: list[str]) -> None:
    """`runs` against `others` (each the seeds of one configuration) paired by --seed: per reward,
    judge and λ-weighted gap closed, mean ± std of the difference and the seeds it is above 0 in,
    then each seed's differences to 4 decimals.
    Exit 2 where the two are not evaluated alike or their seeds differ."""
    finals = []
    for group in (runs, others):
        lines = check_runs(group)
        seeds = [read_args(run)["seed"] for run in group]
        if len(set(seeds)) < len(seeds):
            cli.fail("RUN", f"{', '.join(group)} hold a seed twice: pair one run per seed",
                     "summarize.py")  # fmt: skip
        by_seed = {s: [m for m in ls if "gap/weighted" in m][-1]
                   for s, ls in zip(seeds, lines, strict=True)}  # fmt: skip
        finals.append((by_seed, [k[5:] for k in lines[0][0] if k.startswith("eval/")]))
    (mine, names), (theirs, their_names) = finals
    if names != their_names or sorted(mine) != sorted(theirs):
        cli.fail("--against", f"{runs[0]}'s runs are evaluated on {', '.join(names)} at seeds "
                 f"{sorted(mine)}, {others[0]}'s on {', '.join(their_names)} at seeds "
                 f"{sorted(theirs)}: pair the same rewards, judges and seeds",
                 "summarize.py")  # fmt: skip
    seeds = sorted(mine)
    print(f"{runs[0]}'s configuration − {others[0]}'s, paired by seed ({len(seeds)} seeds): "
          "the gap to the ideal closed at each one's last eval\n")  # fmt: skip
    print("| | first − second, mean ± std | first higher in | smallest (its seed) |\n"
          "|---|---|---|---|")  # fmt: skip
    for n in [*names, "weighted"]:
        d = [mine[s][f"gap/{n}"] - theirs[s][f"gap/{n}"] for s in seeds]
        label = "**λ-weighted**" if n == "weighted" else n
        low = min(range(len(seeds)), key=d.__getitem__)
        print(f"| {label} | {fmt(d)} | {sum(x > 0 for x in d)} of {len(seeds)} | "
              f"{d[low]:+.3f} ({seeds[low]}) |")  # fmt: skip
    print("\nper seed, first − second to 4 decimals (a margin such as ≥ 0.1 read unrounded):\n")
    print("| seed | " + " | ".join([*names, "λ-weighted"]) + " |\n|" + "---|" * (len(names) + 2))
    for s in seeds:
        d = [mine[s][f"gap/{n}"] - theirs[s][f"gap/{n}"] for n in [*names, "weighted"]]
        print(f"| {s} | " + " | ".join(f"{x:+.4f}" for x in d) + " |")


def main(runs: list[str]) -> None:
    if "--against" in runs:
        at = runs.index("--against")
        return paired(runs[:at], runs[at + 1 :])
    lines = check_runs(runs)
    base, finals = lines[0][0], [[m for m in ls if "gap/weighted" in m][-1] for ls in lines]
    names = [k[5:] for k in base if k.startswith("eval/")]
    seeds = [read_args(run)["seed"] for run in runs]
    ends = [m["epoch"] for m in finals]
    if len(set(ends)) > 1:  # a run still training, or one given more --epochs on --resume
        print(f"note: the runs' last evals are at epochs {', '.join(map(str, ends))} (in the "
              "order given): each run's last is summarized")  # fmt: skip
    epochs = f" {ends[0]}" if len(set(ends)) == 1 else f"s {min(ends)}–{max(ends)}"
    print(f"{len(runs)} runs, final epoch{epochs}; mean ± std over runs, and the worst run (its "
          "--seed)\n")  # fmt: skip
    print("| | base model | final | fraction of the gap to the ideal closed | worst | "
          "ideal rendering |\n|---|---|---|---|---|---|")  # fmt: skip
    for n in [*names, "weighted"]:
        gaps = [m[f"gap/{n}"] for m in finals]
        worst = min(range(len(runs)), key=gaps.__getitem__)
        if n == "weighted":
            print(f"| **λ-weighted** | | | **{fmt(gaps)}** | {gaps[worst]:+.3f} (seed "
                  f"{seeds[worst]}) | |")  # fmt: skip
            continue
        final = fmt([m[f"eval/{n}"] for m in finals])
        print(f"| {n} | {base[f'eval/{n}']:+.3f} | {final} | {fmt(gaps)} | {gaps[worst]:+.3f} "
              f"(seed {seeds[worst]}) | {base[f'ideal/{n}']:+.3f} |")  # fmt: skip
    print("\nper run, fraction of the gap to the ideal closed at the final eval:\n")
    print("| seed | " + " | ".join([*names, "λ-weighted"]) + " |\n|" + "---|" * (len(names) + 2))
    for seed, m in sorted(zip(seeds, finals, strict=True), key=lambda x: x[0]):
        print(f"| {seed} | " + " | ".join(f"{m[f'gap/{n}']:+.3f}" for n in [*names, "weighted"])
              + " |")  # fmt: skip
    print("\nabove the base model at the final eval, per reward and judge:")
    for n in names:
        up = [m[f"eval/{n}"] > base[f"eval/{n}"] for m in finals]  # per run: two may share a seed
        down = [s for s, u in zip(seeds, up, strict=True) if not u]
        print(f"  {n} improves in {sum(up)} of {len(runs)} runs"
              + (f" (not in seed {', '.join(map(str, down))})" if down else ""))  # fmt: skip
    # W: its marginals, and where each reward's weight sits (centroid over timesteps)
    Ws = [torch.tensor(m["W"], dtype=torch.float64) for ls in lines for m in ls[1:]]
    lam = Ws[0].sum(1)
    err = max(
        max((W.sum(1) - lam).abs().max(), (W.sum(0) - 1 / W.shape[1]).abs().max()) for W in Ws
    )
    cents = torch.stack([timestep_centroid(W) for W in Ws])  # (E, K)
    from rewards import expand  # a preset (--rewards toy2) is its rewards, as recast.py reads it

    rewards = expand(read_args(runs[0])["rewards"])
    print(f"\nW over {len(Ws)} epochs: rows sum to λ and columns to 1/T within {err:.1e}")
    print(
        "weight centroid (timestep, mean ± std over epochs): "
        + ", ".join(
            "{} {:.2f} ± {:.2f}".format(n, *mean_std(c.tolist()))  # one epoch: ± 0, not nan
            for n, c in zip(rewards, cents.T, strict=True)
        )
    )
    for k in range(1, len(rewards)):
        before = int((cents[:, 0] < cents[:, k]).sum())
        print(f"  {rewards[0]} before {rewards[k]}: {before} of {len(Ws)} epochs")
    # where the time goes: each run's own time/*, summed over its epochs
    times = [{} for _ in lines]
    for t, ls in zip(times, lines, strict=True):
        for m in ls[1:]:
            for k, v in m.items():
                if k.startswith("time/"):
                    t[k[5:]] = t.get(k[5:], 0.0) + v
    phases = dict.fromkeys(k for t in times for k in t)  # a phase one run lacks counts 0 there
    share = {k: [100 * t.get(k, 0.0) / sum(t.values()) for t in times] for k in phases}
    cells = ["{} {:.1f} ± {:.1f} %".format(k, *mean_std(v)) for k, v in share.items()]
    print(f"time (share of each run's time/*, mean ± std over runs): {', '.join(cells)}")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    argv = sys.argv[1:]
    if argv[:1] == ["--archive"]:
        if len(argv) < 2 or not os.path.isfile(argv[1]):
            cli.fail("--archive", f"needs comparison.py's archive file, e.g. "
                     f"docs/comparison/runs.jsonl; got {argv[1:2] or 'nothing'}",
                     "summarize.py")  # fmt: skip
        with open(argv[1]) as f:
            ARCHIVE.update((r["run"], r["lines"]) for r in map(json.loads, f))
        argv = argv[2:]
    main(argv)
