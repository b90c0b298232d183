"""How the training recipe was chosen: is each optimizer step signal, and how fast does it learn?

Every measurement here uses `--weighting uniform` (W = λ/T), never ReCAST's own W, so that the
recipe it picks favours neither arm of a later comparison.

    python studies/recipe.py signal            # repeatability of the update on the base model
    python studies/recipe.py sweep             # learning speed of a few recipes (resumable)

`signal`: one epoch's rollout from the base model (the default --prompts × --group-size images, all
T timesteps of each, r from group-standardised rewards mixed by W = λ/T), then the NFT gradient
(DESIGN §6, at θ = θ_old) of every micro-batch of --batch-size pairs. The gradient of an optimizer
step over m micro-batches is their mean; the cosine between two disjoint such steps says how much of
a step is signal (1: all signal; ≈ 0: noise). Printed for m = 1, 2, 5, half the epoch, with the
mean over every disjoint pair of steps.

`sweep`: the recipes in RECIPES below, each a recast.py run with --weighting uniform for each of
--seeds (default 0), two at a time with one thread each; a finished run is skipped, an interrupted
one resumed. Prints the λ-weighted gap closed at each eval, per reward and judge at the end, and per
minute of the run's own time (sum of its time/*: two runs share the 2 cores, so minutes compare
across rows); with several seeds, also each recipe's mean ± std over them.
"""

import argparse
import itertools
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import harness  # noqa: E402
import recast  # noqa: E402
import rewards  # noqa: E402
from plumbing import cli  # noqa: E402
from plumbing.checkpoints import read_metrics  # noqa: E402
from recast import group_optimality  # noqa: E402
from recast_kernels.nft_loss import reference_nft_loss  # noqa: E402
from studies.summarize import fmt  # noqa: E402

LAMBDA = "0.4,0.2,0.2,0.2"
# name → (β, lr, --grad-accum, --train-frac, --kl-coef, epochs); other flags: recast.py's defaults
RECIPES = {
    # round 1: the NFT strength β, the KL term, fewer and larger steps, half the pairs
    "beta1-lr5e-5": (1.0, 5e-5, 1, 1.0, 0.0, 8),
    "beta0.1-lr5e-5": (0.1, 5e-5, 1, 1.0, 0.0, 8),
    "beta0.1-lr5e-5-frac0.5": (0.1, 5e-5, 1, 0.5, 0.0, 8),
    "beta0.1-lr5e-5-kl1e-4": (0.1, 5e-5, 1, 1.0, 1e-4, 8),
    "beta0.1-lr1.5e-4-accum4": (0.1, 1.5e-4, 4, 1.0, 0.0, 8),
    # round 2: two optimizer steps of 320 pairs an epoch
    "beta0.1-lr1.5e-4-accum5-frac0.5": (0.1, 1.5e-4, 5, 0.5, 0.0, 8),
    "beta0.1-lr3e-4-accum5-frac0.5": (0.1, 3e-4, 5, 0.5, 0.0, 8),
    # round 3: the two best per minute of round 1, run longer
    "beta0.1-lr5e-5-frac0.5-16ep": (0.1, 5e-5, 1, 0.5, 0.0, 16),
    "beta0.1-lr1.5e-4-accum4-16ep": (0.1, 1.5e-4, 4, 1.0, 0.0, 16),
    # round 4: the default length (20 epochs) with a KL to the base strong enough to matter
    "beta0.1-lr5e-5-frac0.5-20ep": (0.1, 5e-5, 1, 0.5, 0.0, 20),
    "beta0.1-lr5e-5-frac0.5-kl0.3-20ep": (0.1, 5e-5, 1, 0.5, 0.3, 20),
    "beta0.1-lr5e-5-frac0.5-kl1-20ep": (0.1, 5e-5, 1, 0.5, 1.0, 20),
    "beta0.1-lr5e-5-frac0.5-kl3-20ep": (0.1, 5e-5, 1, 0.5, 3.0, 20),
}


def flags(recipe: tuple) -> list[str]:
    beta, lr, accum, frac, kl, epochs = recipe
    return [f"--beta={beta}", f"--lr={lr}", f"--grad-accum={accum}", f"--train-frac={frac}",
            f"--kl-coef={kl}", f"--epochs={epochs}"]  # fmt: skip


def signal(args) -> None:
    torch.set_num_threads(args.threads)
    a = recast.Args(lam=LAMBDA, weighting="uniform", seed=args.seed)
    world = harness.load_world(a, torch.device("cpu"))
    names = rewards.expand(a.rewards)
    lam = cli.parse_lambda(LAMBDA, names)
    T, G, P = a.steps, a.group_size, a.prompts
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(len(world.train_prompts), (P,), generator=gen)
    prompts = [world.train_prompts[i] for i in idx]
    per_image = [p for p in prompts for _ in range(G)]
    cond = world.encode(per_image)
    sigmas = world.sigmas(T)
    noise = torch.randn(P * G, *world.latent_shape, generator=gen)
    x0, _ = recast.sample(lambda x, c, t: world.v("old", x, c, t), noise, cond, sigmas)
    fns = {n: rewards.get(n, world.device) for n in names}
    r = group_optimality(recast.score_all(fns, x0, per_image), G, a.adv_clip_max)  # (K, N)
    W = (lam[:, None] / T).expand(len(names), T).float()
    params = [p for p in world.trainable.parameters() if p.requires_grad]
    pairs = torch.randperm(P * G * T, generator=gen)
    grads = []
    for s in range(0, len(pairs), a.batch_size):
        batch = pairs[s : s + a.batch_size]
        n, i = batch // T, batch % T
        t = sigmas[i]
        eps = torch.randn(len(batch), *world.latent_shape, generator=gen)
        x_t = (1 - t.view(-1, 1, 1, 1)) * x0[n] + t.view(-1, 1, 1, 1) * eps
        c = tuple(cc[n] for cc in cond)
        v_theta = world.v("policy", x_t, c, t)
        with torch.no_grad():
            v_old = world.v("old", x_t, c, t)
        loss = reference_nft_loss(v_theta, v_old, x0[n], eps, t, i, r[:, n].T, W, a.beta)
        world.trainable.zero_grad(set_to_none=True)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    grads = torch.stack(grads)  # (micro-batches, parameters)
    M = len(grads)
    print(f"{P} prompts × {G} images × {T} timesteps = {len(pairs)} pairs, {M} micro-batches of "
          f"{a.batch_size}; base model; W = λ/T with λ = {LAMBDA}")  # fmt: skip
    print("| pairs per optimizer step | steps per epoch | cosine of two disjoint steps |")
    print("|---|---|---|")
    for m in sorted({1, 2, 5, M // 2}):
        steps = grads[: (M // m) * m].view(M // m, m, -1).mean(1)
        unit = steps / steps.norm(dim=1, keepdim=True)
        cos = [float(unit[i] @ unit[j]) for i, j in itertools.combinations(range(len(unit)), 2)]
        print(f"| {m * a.batch_size} | {M // m} | {sum(cos) / len(cos):+.3f} ({len(cos)} pairs) |")


def run_one(out: str, recipe: tuple, seed: int) -> str:
    if os.path.exists(os.path.join(out, "summary.json")):
        return out
    cmd = [sys.executable, os.path.join(ROOT, "recast.py"), "--lambda", LAMBDA, "--weighting"]
    cmd += ["uniform", "--seed", str(seed), "--eval-every", "2", *flags(recipe), "--out", out]
    cmd += ["--resume"] if os.path.isfile(os.path.join(out, "args.json")) else []  # a run
    with open(out + ".log", "a") as log:
        subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True, cwd=ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    return out


def final_metrics(out: str) -> dict:
    return [m for m in read_metrics(out) if "gap/weighted" in m][-1]


def sweep_plan(only: str, seeds: str) -> tuple[list[str], list[int]]:
    """--only's recipes (all when empty) and --seeds' seeds; an unknown recipe, or a seed that is
    not a whole number ≥ 0 or is named twice, exits 2 naming the flag."""
    if bad := [n for n in only.split(",") if only and n not in RECIPES]:
        cli.fail("--only", f"no recipe {', '.join(bad)}; the recipes: {', '.join(RECIPES)}",
                 "recipe.py")  # fmt: skip
    if not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*", seeds):  # "0,1" or "0, 1"
        cli.fail("--seeds", f"takes seeds ≥ 0 separated by commas, e.g. 0,1,2; got {seeds!r}",
                 "recipe.py")  # fmt: skip
    recipes = [n for n in RECIPES if not only or n in only.split(",")]
    numbers = [int(s) for s in seeds.split(",")]
    if len(set(numbers)) < len(numbers):  # one run counted twice: a mean of one seed, a std of 0
        cli.fail("--seeds", f"names a seed twice ({seeds!r}): give each seed once", "recipe.py")
    return recipes, numbers


def sweep(args) -> None:
    recipes, seeds = sweep_plan(args.only, args.seeds)
    out = os.path.abspath(args.out)  # recast.py runs in ROOT: a relative --out is read from here
    if os.path.exists(out) and not os.path.isdir(out):
        cli.fail("--out", f"{args.out} is a file, not a folder for the sweep's runs: pick a folder",
                 "recipe.py")  # fmt: skip
    os.makedirs(out, exist_ok=True)
    runs = {f"{n}-s{s}" if s else n: (n, s) for n in recipes for s in seeds}  # seed 0: no suffix
    outs = {name: os.path.join(out, name) for name in runs}
    done = {o for o in outs.values() if os.path.exists(os.path.join(o, "summary.json"))}
    bar = tqdm(total=len(runs), initial=len(done), unit="run", smoothing=0)  # on stderr
    with ThreadPoolExecutor(2) as pool, bar:
        jobs = [pool.submit(run_one, outs[name], RECIPES[n], s) for name, (n, s) in runs.items()]
        try:
            for f in as_completed(jobs):
                bar.update(f.result() not in done)  # a finished run was counted from the start
        except BaseException:  # a run failed (or ^C): start no other, say so when the two stop
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    names = list(runs)
    print(f"--weighting uniform --lambda {LAMBDA} --seed S (-sS) --eval-every 2")
    print("| recipe | λ-weighted gap closed at each eval | per reward at the end | minutes | "
          "gap per minute |\n|---|---|---|---|---|")  # fmt: skip
    for n in names:
        ms = read_metrics(outs[n])
        secs = sum(v for m in ms for k, v in m.items() if k.startswith("time/"))
        curve = " / ".join(f"{m['gap/weighted']:.3f}" for m in ms if "gap/weighted" in m)
        last = ms[-1]
        per = ", ".join(f"{k[4:]} {v:+.2f}" for k, v in last.items()
                        if k.startswith("gap/") and k != "gap/weighted")  # fmt: skip
        gap = last["gap/weighted"]
        print(f"| {n} | {curve} | {per} | {secs / 60:.1f} | {gap / (secs / 60):.3f} |")
    if len(seeds) > 1:
        print(f"\nmean ± std over seeds {args.seeds}, at the end (gap closed; ≥ 0: not below base)")
        print("| recipe | λ-weighted | shape | iou |\n|---|---|---|---|")
        for n in recipes:
            ends = [final_metrics(outs[name]) for name, (r, _) in runs.items() if r == n]
            cells = [fmt([m[f"gap/{k}"] for m in ends]) for k in ("weighted", "shape", "iou")]
            print(f"| {n} | {' | '.join(cells)} |")


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(
        prog="recipe.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sg = sub.add_parser("signal", help="repeatability of the update on the base model")
    sg.add_argument("--seed", type=int, default=0)
    sg.add_argument("--threads", type=cli.count, default=1)
    sw = sub.add_parser("sweep", help="learning speed of the recipes (resumable)")
    sw.add_argument("--seeds", default="0", help="comma-separated seeds; folder NAME-sS for S ≠ 0")
    sw.add_argument("--only", default="", help="comma-separated recipe names (default: all)")
    sw.add_argument("--out", default="sweeps/recipe")
    args = ap.parse_args(argv)
    signal(args) if args.cmd == "signal" else sweep(args)


if __name__ == "__main__":
    main()
