"""Do the gains point where the signal is? The pre-registered diagnostic of docs/results.md.

    python studies/diagnostic.py               # → sweeps/diagnostic/diagnostic.{json,png}
    OMP_NUM_THREADS=1 python studies/diagnostic.py --prompts 2 --group-size 4 \\
        --eval-prompts 4 --eval-seeds 1 --out /tmp/diag       # smoke test, under a minute

On the shipped toy base model (θ = θ_old = base), CPU, deterministic given --seed and --threads:
1. the old policy's rollout (--prompts × --group-size, T = --steps) with step predictions, scored
   as recast.trajectory_scores does → "trajectory gains" renyi_gains (K, T); 2. r (K, N) of §3;
3. g_k,i = -∇θ of reference_nft_loss with W one-hot at (k, i) (recast's β, A_max) over all N images
   at t_i, θ = θ_old, one ε per timestep (drawn from --seed) shared by every k. Minus: g is where a
   gradient step goes, so a positive effect means training (k, i) helps;
4. effect[k, i, j] = (mean R_j(θ⁺) - mean R_j(θ⁻)) / (2δ), θ± = θ ± δ‖θ‖·g_k,i/‖g_k,i‖, every
   policy sampled on the same held-out prompts and noise (EvalSet's: EVAL_SEED);
5. "forward gains": the scores of x̂0 = x_t - t_i·v_old(x_t), x_t = (1 - t_i)x0 + t_i ε, with the ε
   of step 3 (its v_old is reused); column 0 left 0 and column T the final scores, as in
   trajectory_scores;
6. Spearman ρ over i of the own effect effect[k, :, k] with (a) the trajectory gains, (b) the
   trajectory gains one step earlier, effect[k, i+1] against gains[k, i], (b2) two steps earlier,
   effect[k, i+2] against gains[k, i] ((a), (b), (b2): the alignments of --gain-shift 0, 1, 2,
   DESIGN §4), (c) the forward gains.
   Why (b) goes that way: x̂0_i = x_t_i - t_i·v(x_t_i, t_i) already holds the model's output at t_i
   (DESIGN §4), so what the model at t_i decides first shows in D_i, i.e. in g_i-1 = D_i - D_i-1.
   (b') the other way, effect[k, i] against gains[k, i+1], is printed beside it, for comparison.
   Also the cross effects summed over i (row: gradient of reward k; column: reward measured).

δ (--delta, a fraction of ‖θ‖ ≈ 82): 3e-4 moves θ by 0.025, a third of the longest Adam step at
lr 5e-5 (5e-5·√2.3 M ≈ 0.076). At the smoke-test size the own-effect profiles of δ = 1e-4 and 3e-4
had rank correlations ≥ 0.98 for every reward; 1e-3 gave 0.76 and 0.68 for colour and sharpness
(the step against the update hurt more than the step along it helped), 3e-5 was noisy (0.87, 0.79).
Time at the default size: 81 samplings of 32 × 4 = 128 held-out images at 4.3 s each on one thread,
10 × 4 s of gradients; the run of docs/results.md took 9 minutes on one core beside two training
runs.
"""

import argparse
import math
import os
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import harness  # noqa: E402
import recast  # noqa: E402
import rewards  # noqa: E402
from plumbing import cli  # noqa: E402
from plumbing.checkpoints import write_whole  # noqa: E402
from recast import group_optimality  # noqa: E402
from recast_kernels.nft_loss import reference_nft_loss  # noqa: E402
from recast_kernels.renyi import renyi_gains  # noqa: E402
from studies.summarize import spearman  # noqa: E402


def unit_sum(x: torch.Tensor) -> torch.Tensor:
    """x / Σx (x / Σ|x| when Σx ≤ 0), for drawing profiles on one scale."""
    s = x.sum()
    return x / (s if s > 0 else x.abs().sum().clamp(min=1e-30))


def diagnostic(args) -> None:
    torch.set_num_threads(args.threads)
    a = recast.Args()  # β, A_max, α: the training defaults
    world = harness.load_world(a, torch.device("cpu"))
    names = list(world.reward_names)
    fns = {n: rewards.get(n, world.device) for n in names}
    K, T, G, P = len(names), args.steps, args.group_size, args.prompts
    N, sigmas, clock, tic = P * G, world.sigmas(args.steps), {}, time.perf_counter()
    # 1-2. rollout of the old policy, trajectory scores and gains, r (as recipe.py's signal)
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(len(world.train_prompts), (P,), generator=gen)
    per_image = [world.train_prompts[j] for j in idx for _ in range(G)]
    cond = world.encode(per_image)
    noise = torch.randn(N, *world.latent_shape, generator=gen)
    x0, preds = recast.sample(lambda x, c, t: world.v("old", x, c, t), noise, cond, sigmas)
    final = recast.score_all(fns, world.decode(x0), per_image)  # (K, N)
    scores = recast.trajectory_scores(fns, world.decode, preds, final, per_image)  # (K, T+1, N)
    D, gains = renyi_gains(scores, G, a.alpha, a.adv_clip_max)
    r = group_optimality(final, G, a.adv_clip_max)  # (K, N)
    eps = torch.randn(T, N, *world.latent_shape, generator=gen)  # fresh ε per timestep
    clock["rollout"] = time.perf_counter() - tic
    # the held-out set: EvalSet's prompts × seeds and noise, or --eval-prompts of them
    every = [p for p in world.eval_prompts for _ in range(args.eval_seeds)]
    seed = torch.Generator().manual_seed(harness.EVAL_SEED)
    eval_noise = torch.randn(len(every), *world.latent_shape, generator=seed)
    E = len(world.eval_prompts)  # --eval-prompts evenly spaced: several colours, shapes, places
    m = min(args.eval_prompts or E, E)
    rows = [round(j * (E - 1) / max(1, m - 1)) * args.eval_seeds + s
            for j in range(m) for s in range(args.eval_seeds)]  # fmt: skip
    eval_prompts, eval_noise = [every[j] for j in rows], eval_noise[rows]

    def mean_rewards() -> torch.Tensor:  # (K,) of the policy now in world.trainable
        means, _ = harness.evaluate(recast.sample, world, fns, eval_prompts, eval_noise, sigmas,
                                    a.batch_size)  # fmt: skip
        return torch.stack([means[n].double().mean() for n in names])

    params = [p for p in world.trainable.parameters() if p.requires_grad]
    theta = torch.cat([p.detach().flatten() for p in params]).clone()

    @torch.no_grad()
    def load(vec: torch.Tensor) -> None:
        for p, v in zip(params, vec.split([p.numel() for p in params]), strict=True):
            p.copy_(v.view_as(p))

    step = args.delta * theta.norm()
    base = mean_rewards()
    # 3-5. per timestep: one forward, K gradients, the forward-process scores; then θ± for each k
    fwd = torch.cat([torch.zeros(K, T, N), final[:, None]], 1)  # (K, T+1, N)
    plus, minus = torch.zeros(2, K, T, K, dtype=torch.float64)  # R(θ⁺), R(θ⁻)
    grad_norm = torch.zeros(K, T, dtype=torch.float64)
    tic = time.perf_counter()
    bar = tqdm(total=K * T, desc="(reward, timestep): gradient, θ±, eval")
    for i in range(T):
        t = sigmas[i].expand(N)
        x_t = (1 - sigmas[i]) * x0 + sigmas[i] * eps[i]
        v_theta = world.v("policy", x_t, cond, t)
        with torch.no_grad():
            v_old = world.v("old", x_t, cond, t)
            if i > 0:  # column 0 stays 0, unscored, as in recast.trajectory_scores
                x0_hat = world.decode(x_t - sigmas[i] * v_old)
                fwd[:, i] = recast.score_all(fns, x0_hat, per_image)
        grads = []  # all K first: stepping θ in place would spoil the retained graph
        for k in range(K):
            W = torch.zeros(K, T)
            W[k, i] = 1.0
            loss = reference_nft_loss(v_theta, v_old, x0, eps[i], t, torch.full((N,), i), r.T, W,
                                      a.beta, a.adv_clip_max)  # fmt: skip
            g = torch.autograd.grad(loss, params, retain_graph=k < K - 1)
            grads.append(torch.cat([x.flatten() for x in g]))
        for k, g in enumerate(grads):
            grad_norm[k, i] = g.norm()
            load(theta - step * g / g.norm())  # θ⁺: along the update, -∇L
            plus[k, i] = mean_rewards()
            load(theta + step * g / g.norm())
            minus[k, i] = mean_rewards()
            load(theta)
            bar.update()
    bar.close()
    clock["gradients+effects"] = time.perf_counter() - tic
    D_fwd, gains_fwd = renyi_gains(fwd, G, a.alpha, a.adv_clip_max)
    # 6. report
    effect = (plus - minus) / (2 * args.delta)  # (k_dir, i, k_reward)
    own = torch.stack([effect[k, :, k] for k in range(K)])  # (K, T)
    curv = ((plus + minus - 2 * base) / (plus - minus).abs().clamp(min=1e-30)).abs()
    rho = {  # shift S: the effect at timestep i against g_i-S, the alignment of --gain-shift S
        n: {
            "a_same_step": spearman(own[k], gains[k]),
            "b_gains_one_step_earlier": spearman(own[k, 1:], gains[k, :-1]),
            "b2_gains_two_steps_earlier": spearman(own[k, 2:], gains[k, :-2]),
            "b'_gains_one_step_later": spearman(own[k, :-1], gains[k, 1:]),
            "c_forward": spearman(own[k], gains_fwd[k]),
        }
        for k, n in enumerate(names)
    }
    cross = effect.sum(1)  # (K, K)
    share = own / own.sum(1, keepdim=True)
    print(f"\n{P} prompts × {G} images, T = {T}, {len(eval_prompts)} held-out images, "
          f"δ = {args.delta:g}·‖θ‖ = {float(step):.4f}, seed {args.seed}")  # fmt: skip
    own_curv = torch.stack([curv[k, :, k] for k in range(K)]).median(1).values
    print(f"curvature |R⁺ + R⁻ - 2R| / |R⁺ - R⁻|: median {curv.median():.2f}; own effects per "
          f"reward {', '.join(f'{x:.2f}' for x in own_curv.tolist())}")  # fmt: skip
    print("\n| reward | (a) shift 0: ρ(effect_i, g_i) | (b) shift 1: ρ(effect_i, g_i-1) "
          "| (b2) shift 2: ρ(effect_i, g_i-2) | (b') ρ(effect_i, g_i+1) "
          "| (c) ρ(effect_i, forward g_i) |\n|---|---|---|---|---|---|")  # fmt: skip
    for n, v in rho.items():
        print(f"| {n} | " + " | ".join(f"{x:+.2f}" for x in v.values()) + " |")
    print("\ncross effect Σ_i effect[k, i, j] (row k: gradient of reward k; column j: reward j)")
    print("| | " + " | ".join(names) + " |\n" + "|---" * (K + 1) + "|")
    for k, n in enumerate(names):
        print(f"| {n} | " + " | ".join(f"{x:+.3g}" for x in cross[k].tolist()) + " |")
    print("\nper timestep: own-effect share effect[k,i,k]/Σ_i; trajectory and forward gains")
    print("| reward | | " + " | ".join(map(str, range(T))) + " |\n" + "|---" * (T + 2) + "|")
    for k, n in enumerate(names):
        for what, row in (("own share", share[k]), ("gains", gains[k]), ("fwd", gains_fwd[k])):
            print(f"| {n} | {what} | " + " | ".join(f"{x:+.3f}" for x in row.tolist()) + " |")
    print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in clock.items()))
    os.makedirs(args.out, exist_ok=True)
    out = dict(args=vars(args), names=names, sigmas=sigmas, theta_norm=theta.norm(), step=step,
               prompts=per_image, eval_prompts=eval_prompts, r=r, scores=scores, D=D, gains=gains,
               forward_scores=fwd, D_forward=D_fwd, gains_forward=gains_fwd, grad_norm=grad_norm,
               base=base, plus=plus, minus=minus, effect=effect, own_effect=own, share=share,
               cross=cross, curvature=curv, spearman=rho, seconds=clock)  # fmt: skip
    out = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    write_whole(os.path.join(args.out, "diagnostic.json"), out)
    fig, axes = plt.subplots(1, K, figsize=(3.6 * K, 3.2), sharey=True)
    for k, (n, ax) in enumerate(zip(names, axes, strict=True)):
        for row, label in ((own[k], "own effect"), (gains[k], "trajectory gains"),
                           (gains_fwd[k], "forward gains")):  # fmt: skip
            ax.plot(range(T), unit_sum(row.double()).numpy(), marker="o", ms=3, label=label)
        ax.axhline(0, color="grey", lw=0.5)
        v = list(rho[n].values())
        ax.set_title(f"{n}\nρ shift 0 {v[0]:+.2f}, 1 {v[1]:+.2f}, 2 {v[2]:+.2f}; fwd {v[4]:+.2f}",
                     fontsize=8)  # fmt: skip
        ax.set_xlabel("training timestep i (0 = pure noise)")
    axes[0].set_ylabel("profile (sums to 1)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "diagnostic.png"), dpi=110)
    print(f"wrote {args.out}/diagnostic.json, {args.out}/diagnostic.png")


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(
        prog="diagnostic.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--prompts", type=cli.count, default=16, help="rollout prompts")
    ap.add_argument("--group-size", type=int, default=8, help="images per prompt (G)")
    ap.add_argument("--steps", type=cli.count, default=10, help="sampler steps T")
    ap.add_argument("--eval-prompts", type=int, default=0, help="held-out prompts (0: all 32)")
    ap.add_argument("--eval-seeds", type=cli.count, default=4, help="images per held-out prompt")
    ap.add_argument("--delta", type=float, default=3e-4, help="step δ as a fraction of ‖θ‖")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=cli.count, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "sweeps", "diagnostic"))
    args = ap.parse_args(argv)
    if args.group_size < 2:  # G = 1: every gain 0 and every r 1/2, nothing compared in a group
        cli.fail("--group-size", f"needs ≥ 2 images per prompt to compare them within a group, "
                 f"got {args.group_size}", ap.prog)  # fmt: skip
    if args.steps < 2:  # recast.py's minimum: ρ over the timesteps needs two of them
        cli.fail("--steps", f"needs ≥ 2 sampler steps (ρ over timesteps), got {args.steps}",
                 ap.prog)  # fmt: skip
    if args.eval_prompts < 0:
        cli.fail("--eval-prompts", f"must be ≥ 0 (0: all), got {args.eval_prompts}", ap.prog)
    if not 0 < args.delta < math.inf:  # effect divides by 2δ
        cli.fail("--delta", f"must be > 0 and finite, got {args.delta}", ap.prog)
    if os.path.exists(args.out) and not os.path.isdir(args.out):  # before minutes of work
        cli.fail("--out", f"{args.out} is a file, not a folder for diagnostic.json and .png: "
                 "pick a folder", ap.prog)  # fmt: skip
    if args.steps < 4:  # (b) pairs T - 1 timesteps, (b2) T - 2: ρ of fewer than 2 is nan
        print(f"note: --steps {args.steps}: ρ (b) and (b2) are over T - 1 = {args.steps - 1} "
              f"and T - 2 = {args.steps - 2} timesteps, nan below 2; --steps 4 or more fills "
              "every column")  # fmt: skip
    diagnostic(args)


if __name__ == "__main__":
    main()
