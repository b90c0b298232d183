"""ReCAST — per-reward, timestep-dependent credit assignment for online diffusion RL.

Several rewards train one image model. The user says how much each reward matters (budgets λ);
ReCAST decides *when* during denoising each reward's feedback is spent. Every epoch:
  1. the old policy samples G images per prompt, keeping the clean prediction x̂0 of every step;
  2. each reward's scores become per-group optimality probabilities r ∈ [0, 1];
  3. for reward k and step i, the Rényi discriminability D_k,i between the reward-tilted
     ("positive") policy and the current one, as far as step i has decided it; its increments are
     the gains g_k,i. Sinkhorn turns them into W (K × T): rows sum to λ, columns to 1/T, and each
     reward's budget goes to the steps where it is informative;
  4. DiffusionNFT's loss at every (image, timestep) pair, the rewards mixed by that step's column of W;
  5. the old (sampling) policy moves towards the trained one (EMA);
  6. eval on held-out prompts, log, pictures, checkpoint.
DESIGN.md gives every formula; the phases below carry its section numbers.

    python recast.py --lambda 0.4,0.2,0.2,0.2                       # toy world, laptop CPU, minutes
    python recast.py --lambda 0.4,0.2,0.2,0.2 --weighting uniform   # ablation: W = λ/T
    python recast.py --model ./sd3.5-medium --rewards pickscore,hpsv2,clipscore,aesthetic \\
        --lambda 0.4,0.2,0.2,0.2 --prompts-file prompts.txt          # one GPU
    torchrun --nproc_per_node=8 recast.py --model ./sd3.5-medium ...  # DDP, several GPUs

Paper: "ReCAST: Reward Credit Assignment across Timesteps for Online Diffusion Reinforcement"
(arXiv 2609.13425). Loss and old-policy schedule: DiffusionNFT (arXiv 2509.16117).
"""

import argparse
import ast
import inspect
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

import checkpoint
import rewards
from kernels.nft_loss import nft_loss
from kernels.renyi import group_optimality, renyi_gains


@dataclass
class Args:
    # --- what to train, on what ---
    lam: str = ""
    """reward budgets λ, one per reward in --rewards order, e.g. 0.4,0.2,0.2,0.2 (normalised to sum 1)"""
    rewards: str = "position,color,sharpness,background"
    """comma-separated reward names from rewards.py (default: the four toy rewards)"""
    model: str = "toy"
    """'toy' (the tiny model shipped in toy_model/) or an SD3/SD3.5 folder or hub id"""
    prompts_file: str = ""
    """training prompts, one per line (needed with --model other than toy)"""
    eval_prompts_file: str = ""
    """held-out prompts, one per line (default for --model: the last 10%% of --prompts-file)"""
    # --- ReCAST ---
    weighting: str = "recast"
    """recast (W from the gains, DESIGN §5) | uniform (W = λ/T) | sum (one reward Σ λ_k s_k)"""
    alpha: float = 2.0
    """Rényi order of the discriminability D (1 = KL)"""
    tau: float = 1.0
    """temperature of the Sinkhorn kernel M = λ·p^(1/τ); large τ tends to W = λ/T"""
    floor: float = 0.1
    """share ε_f of each reward's profile spread evenly over the steps"""
    gain_ema: float = 0.8
    """EMA of the gains across epochs (0: this epoch's gains only)"""
    gain_every: int = 1
    """epochs between gain updates; step predictions are only scored then"""
    gain_frac: float = 1.0
    """fraction of prompt groups whose step predictions are scored for the gains"""
    # --- rollout ---
    epochs: int = 25
    """training epochs (rollout + update)"""
    prompts: int = 16
    """prompts per epoch, all ranks together"""
    group_size: int = 8
    """images per prompt (G)"""
    steps: int = 10
    """sampler steps T (also the number of training timesteps)"""
    # --- NFT update ---
    beta: float = 1.0
    """NFT strength β (positive and negative policies are θ_old ± β(θ - θ_old))"""
    lr: float = 1e-4
    """AdamW learning rate"""
    batch_size: int = 64
    """(image, timestep) pairs per optimizer step, all ranks together"""
    kl_coef: float = 0.0
    """weight κ of mean((v_θ - v_ref)²), a KL to the frozen base model"""
    adv_clip_max: float = 5.0
    """advantage clip A_max of the optimality map r = 1/2 + A/(2 A_max)"""
    grad_clip: float = 1.0
    """gradient-norm clip"""
    decay_rate: float = 0.001
    """old policy EMA: d = min(decay_rate · optimizer steps, decay_cap)"""
    decay_cap: float = 0.5
    """cap of the old-policy decay d"""
    # --- SD3 / SD3.5 only ---
    resolution: int = 512
    """image side in pixels"""
    lora_rank: int = 32
    """LoRA rank r of the adapters on the attention projections"""
    lora_alpha: int = 64
    """LoRA alpha"""
    grad_checkpointing: bool = False
    """trade compute for memory in the transformer"""
    # --- run ---
    seed: int = 0
    """seed of prompts, noise and shuffles (eval noise is fixed whatever the seed)"""
    out: str = ""
    """run folder (default: runs/<time>-<weighting>-s<seed>)"""
    resume: bool = False
    """continue the run in --out from its last good checkpoint"""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda if available)"""
    eval_every: int = 5
    """epochs between evals (and always the first and last)"""
    eval_seeds: int = 4
    """images per held-out prompt at eval"""
    ckpt_every: int = 1
    """epochs between checkpoints (and always the last)"""


# Arguments that may change on --resume; every other one defines the method and must match.
RESUMABLE = {"out", "resume", "device", "epochs", "eval_every", "ckpt_every"}


def field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field (the help text of its flag)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        a.target.id: b.value.value.strip()
        for a, b in zip(body, body[1:], strict=False)
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
    }


def parse_args(argv: list[str] | None = None) -> Args:
    docs = field_docs(Args)
    ap = argparse.ArgumentParser(
        prog="recast.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for f in fields(Args):
        flag = "--lambda" if f.name == "lam" else "--" + f.name.replace("_", "-")
        kw = dict(dest=f.name, default=f.default, help=f"{docs[f.name]} (default: {f.default!r})")
        if f.type is bool:
            ap.add_argument(flag, action="store_true", **kw)
        elif f.name == "weighting":
            ap.add_argument(flag, choices=["recast", "uniform", "sum"], **kw)
        else:
            ap.add_argument(flag, type=f.type, **kw)
    return Args(**vars(ap.parse_args(argv)))


def fail(flag: str, message: str):
    """Bad input: one line naming the flag and the fix, exit code 2, nothing written."""
    print(f"recast.py: error: {flag}: {message}", file=sys.stderr)
    sys.exit(2)


def parse_lambda(text: str, names: list[str]) -> torch.Tensor:
    example = ",".join(["0.25"] * len(names))
    if not text.strip():
        fail(
            "--lambda", f"give one budget per reward ({', '.join(names)}), e.g. --lambda {example}"
        )
    try:
        lam = torch.tensor([float(x) for x in text.split(",")], dtype=torch.float64)
    except ValueError:
        fail(
            "--lambda",
            f"{text!r} is not a comma-separated list of numbers, e.g. --lambda {example}",
        )
    if len(lam) != len(names):
        fail(
            "--lambda",
            f"{len(lam)} budgets for {len(names)} rewards ({', '.join(names)}); give one each",
        )
    if not torch.isfinite(lam).all() or (lam < 0).any():
        fail("--lambda", f"budgets must be finite and ≥ 0, got {text!r}")
    if lam.sum() == 0:
        fail("--lambda", "all budgets are 0: give at least one reward a positive budget")
    if abs(lam.sum().item() - 1) > 1e-9:
        print(
            f"note: --lambda {text} sums to {lam.sum().item():g}; normalised to {(lam / lam.sum()).tolist()}"
        )
    return lam / lam.sum()


def check_args(args: Args, world_size: int) -> None:
    """Everything that can be checked before a model is loaded or a file written."""
    positive = [
        "prompts",
        "group_size",
        "steps",
        "batch_size",
        "eval_seeds",
        "eval_every",
        "ckpt_every",
        "gain_every",
    ]
    for name in positive:
        if getattr(args, name) < 1:
            fail("--" + name.replace("_", "-"), f"must be ≥ 1, got {getattr(args, name)}")
    if args.epochs < 0:
        fail("--epochs", f"must be ≥ 0, got {args.epochs}")
    if args.group_size < 2:
        fail("--group-size", "needs ≥ 2 images per prompt to compare them within a group")
    if args.steps < 2:
        fail("--steps", "needs ≥ 2 sampler steps")
    for name, lo, hi in [
        ("alpha", 0, math.inf),
        ("tau", 0, math.inf),
        ("beta", 0, math.inf),
        ("lr", 0, math.inf),
        ("adv_clip_max", 0, math.inf),
    ]:
        if not lo < getattr(args, name) < hi:
            fail("--" + name.replace("_", "-"), f"must be > 0, got {getattr(args, name)}")
    for name in ["floor", "gain_frac"]:
        if not 0 < getattr(args, name) <= 1:
            fail("--" + name.replace("_", "-"), f"must be in (0, 1], got {getattr(args, name)}")
    for name in ["gain_ema", "decay_rate", "decay_cap", "kl_coef"]:
        if not 0 <= getattr(args, name) < (1 if name in ("gain_ema", "decay_cap") else math.inf):
            fail("--" + name.replace("_", "-"), f"out of range: {getattr(args, name)}")
    if args.prompts % world_size or args.batch_size % world_size:
        fail(
            "--prompts/--batch-size", f"must be divisible by the number of processes ({world_size})"
        )
    if args.out and os.path.exists(args.out) and not args.resume:
        fail(
            "--out",
            f"{args.out} exists; add --resume to continue that run, or choose another --out",
        )
    if args.resume:
        if not args.out:
            fail("--resume", "needs --out, the run folder to continue")
        saved = os.path.join(args.out, "args.json")
        if not os.path.isfile(saved):
            fail(
                "--resume",
                f"{args.out} is not a run folder (no args.json); start a new run without --resume",
            )
        with open(saved) as f:
            before = json.load(f)
        differ = [k for k, v in asdict(args).items() if k not in RESUMABLE and before.get(k) != v]
        if differ:
            changes = ", ".join(
                f"--{k.replace('_', '-')} {before.get(k)!r} → {getattr(args, k)!r}" for k in differ
            )
            fail(
                "--resume",
                f"method-defining arguments differ from the run's args.json: {changes}; drop them or start a new --out",
            )


# ---------------------------------------------------------------------------------------------
# Phase 1 — rollout (DESIGN §2)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def sample(velocity, noise: torch.Tensor, cond, sigmas: torch.Tensor):
    """Euler from t_0 = 1 to t_T = 0, keeping the clean prediction x̂0_i = x_t_i - t_i·v at
    every step (it costs nothing extra). Returns x0 (N, C, H, W) and x̂0 (T, N, C, H, W)."""
    x, preds = noise, []
    for i in range(len(sigmas) - 1):
        v = velocity(x, cond, sigmas[i].expand(len(x)))
        preds.append(x - sigmas[i] * v)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x, torch.stack(preds)


# ---------------------------------------------------------------------------------------------
# Phase 2 — rewards (DESIGN §3)
# ---------------------------------------------------------------------------------------------
def score_all(reward_fns: dict, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """(K, B) scores, one row per reward; NaN/inf is an error naming the reward and the prompt."""
    return torch.stack([rewards.score(n, fn, images, prompts) for n, fn in reward_fns.items()])


# ---------------------------------------------------------------------------------------------
# Phase 3 — gain profiles and the weight matrix W (DESIGN §5)
# ---------------------------------------------------------------------------------------------
def gain_profiles(gains: torch.Tensor, floor: float = 0.1) -> torch.Tensor:
    """p_k,i = (1 - ε_f)·g⁺_k,i / Σ_i g⁺_k,i + ε_f / T; a reward without positive gain is flat."""
    g = gains.double().clamp(min=0)  # (K, T)
    total = g.sum(1, keepdim=True)
    shape = torch.where(total > 0, g / total.clamp(min=1e-300), 1 / g.shape[1])
    return (1 - floor) * shape + floor / g.shape[1]


def recast_weights(
    gains: torch.Tensor, lam: torch.Tensor, tau: float = 1.0, floor: float = 0.1
) -> torch.Tensor:
    """W (K, T): the Sinkhorn scaling of M_k,i = λ_k·p_k,i^(1/τ) to row sums λ_k and column sums
    1/T, in the log domain — the entropic transport plan that puts each reward's budget where its
    gains are. Rows with λ_k = 0 stay 0."""
    K, T = gains.shape
    lam = lam.double().cpu() / lam.sum()
    live = lam > 0
    log_m = lam[live].log()[:, None] + gain_profiles(gains.cpu(), floor)[live].log() / tau
    log_rows, log_cols = lam[live].log(), torch.full((T,), -math.log(T), dtype=torch.float64)
    u, v = torch.zeros(int(live.sum()), dtype=torch.float64), torch.zeros(T, dtype=torch.float64)
    for _ in range(10_000):  # columns are exact after each sweep; stop when the rows are too
        u = log_rows - torch.logsumexp(log_m + v, 1)
        v = log_cols - torch.logsumexp(log_m + u[:, None], 0)
        if (torch.logsumexp(log_m + u[:, None] + v, 1).exp() - lam[live]).abs().max() < 1e-12:
            break
    W = torch.zeros(K, T, dtype=torch.float64)
    W[live] = (log_m + u[:, None] + v).exp()
    return W.float()


def centroid(weights: torch.Tensor) -> torch.Tensor:
    """Σ_i i·w_i / Σ_i w_i per row: where along the T steps a reward's weight sits."""
    i = torch.arange(weights.shape[-1], dtype=weights.dtype)
    return (weights * i).sum(-1) / weights.sum(-1)


# ---------------------------------------------------------------------------------------------
# Phase 6 — eval on held-out prompts with fixed noise
# ---------------------------------------------------------------------------------------------
EVAL_SEED = 20260929  # the same eval noise for every run, so runs compare on the same images


@torch.no_grad()
def evaluate(
    world,
    scorers: dict,
    prompts: list[str],
    noise: torch.Tensor,
    sigmas,
    chunk: int,
    which="policy",
):
    """Mean score per reward/judge of the given policy on (prompts × noise), and the images."""
    images = []
    for s in range(0, len(prompts), chunk):
        cond = world.encode(prompts[s : s + chunk])
        x0, _ = sample(
            lambda x, c, t: world.v(which, x, c, t),
            noise[s : s + chunk].to(world.device),
            cond,
            sigmas,
        )
        images.append(world.decode(x0))
    images = torch.cat(images)
    return {name: rewards.score(name, fn, images, prompts) for name, fn in scorers.items()}, images


# ---------------------------------------------------------------------------------------------
# Distributed helpers (identity on one process)
# ---------------------------------------------------------------------------------------------
def gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate a tensor across ranks along `dim` (rank order); every rank gets the result."""
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def epoch_generator(seed: int, epoch: int, purpose: int) -> torch.Generator:
    """Every random draw of an epoch comes from generators seeded by (seed, epoch, purpose): the
    same on every rank and after a resume, which is what makes resume exact."""
    return torch.Generator().manual_seed(((seed * 100_003 + epoch) * 7 + purpose) % 2**63)


def is_toy_model(path: str) -> bool:
    """A folder holding a bare SD3 transformer (a retrained toy model), not a whole pipeline."""
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(
        os.path.join(path, "model_index.json")
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if distributed else 1
    check_args(args, world_size)
    names = [n.strip() for n in args.rewards.split(",") if n.strip()]
    unknown = [n for n in names if n not in rewards.REWARDS and n not in rewards.LOADERS]
    if not names or unknown:
        fail(
            "--rewards",
            f"unknown reward {', '.join(unknown) or '(none given)'}; choose from {', '.join([*rewards.REWARDS, *rewards.LOADERS])}",
        )
    lam = parse_lambda(args.lam, names)  # (K,) float64, sums to 1
    K, T, G = len(names), args.steps, args.group_size
    if args.model != "toy" and not os.path.isdir(args.model) and args.model.count("/") != 1:
        fail("--model", f"{args.model!r} is neither 'toy', a folder, nor a hub id 'org/name'")

    # --- processes, device, seeding ---
    if distributed:
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"
        )
    rank = dist.get_rank() if distributed else 0
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    if device.type == "cuda" and distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    log = print if rank == 0 else (lambda *a, **k: None)

    # --- the world: models, prompts, rewards (loaded before anything is written) ---
    if args.model == "toy" or is_toy_model(args.model):
        import toyworld

        world = toyworld.ToyWorld(device, *([] if args.model == "toy" else [args.model]))
    else:
        import sd3world

        try:
            world = sd3world.SD3World(args, device)
        except (OSError, ValueError) as e:
            fail("--model", f"could not load {args.model!r}: {e}")
    reward_fns = {n: rewards.get(n, device) for n in names}
    scorers = {**reward_fns, **{n: rewards.get(n, device) for n in world.judge_names}}
    sigmas = world.sigmas(T)  # (T+1,) t_0 = 1 … t_T = 0
    if distributed:
        world.policy = torch.nn.parallel.DistributedDataParallel(
            world.trainable, device_ids=[device.index] if device.type == "cuda" else None
        )
    optimizer = torch.optim.AdamW(
        [p for p in world.trainable.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0
    )
    Wtrain_rows = 1 if args.weighting == "sum" else K

    # --- run folder ---
    out = args.out or os.path.join(
        "runs", time.strftime("%Y%m%d-%H%M%S") + f"-{args.weighting}-s{args.seed}"
    )
    args.out = out
    start_epoch, gains_ema, opt_steps, history = 1, None, 0, []
    if args.resume:
        ckpt = checkpoint.load_latest(out, log)
        if ckpt is not None:
            tensors, optim_state, state = ckpt
            world.load_state_dict({k: v.to(device) for k, v in tensors.items()})
            optimizer.load_state_dict(optim_state)
            checkpoint.set_rng_state(state["rng"])
            start_epoch, opt_steps = state["epoch"] + 1, state["opt_steps"]
            gains_ema = torch.tensor(state["gains_ema"]) if state["gains_ema"] is not None else None
            log(f"resuming {out} after epoch {state['epoch']}")
        history = checkpoint.read_metrics(out, start_epoch - 1)
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        checkpoint.write_json_atomic(os.path.join(out, "args.json"), asdict(args))
        checkpoint.rewrite_metrics(out, history)
    import plots

    # --- fixed eval set: held-out prompts × eval_seeds, fixed noise; this rank's share ---
    eval_prompts = [p for p in world.eval_prompts for _ in range(args.eval_seeds)]
    eval_noise = torch.randn(
        len(eval_prompts), *world.latent_shape, generator=torch.Generator().manual_seed(EVAL_SEED)
    )
    share = slice(
        rank * len(eval_prompts) // world_size, (rank + 1) * len(eval_prompts) // world_size
    )
    ideal = world.ideal(eval_prompts[share])

    def run_eval(which="policy"):
        means, images = evaluate(
            world, scorers, eval_prompts[share], eval_noise[share], sigmas, args.batch_size, which
        )
        return {k: gather(v.to(device)).mean().item() for k, v in means.items()}, images

    if ideal is not None:
        ideal_scores = {
            k: gather(rewards.score(k, fn, ideal, eval_prompts[share]).to(device)).mean().item()
            for k, fn in scorers.items()
        }
    if history:
        base_eval = {k[5:]: v for k, v in history[0].items() if k.startswith("eval/")}
        base_images = None
    else:  # epoch 0: the base model, before any training
        base_eval, base_images = run_eval("ref")
        first = {"epoch": 0, **{f"eval/{k}": v for k, v in base_eval.items()}}
        if ideal is not None:
            first.update({f"ideal/{k}": v for k, v in ideal_scores.items()})
        if rank == 0:
            checkpoint.append_metrics(out, first)
        history.append(first)
        log("epoch 0 | " + " ".join(f"eval/{k} {v:.4f}" for k, v in base_eval.items()))

    # SIGINT: finish the current epoch, checkpoint, exit; a second SIGINT aborts at once.
    stop = {"asked": False}

    def on_sigint(signum, frame):
        if stop["asked"]:
            raise KeyboardInterrupt
        stop["asked"] = True
        log(
            "\ninterrupt: finishing this epoch, then checkpointing and exiting (Ctrl-C again: abort now, losing this epoch)"
        )

    signal.signal(signal.SIGINT, on_sigint)
    P_local = args.prompts // world_size
    for epoch in range(start_epoch, args.epochs + 1):
        metrics, tic = {"epoch": epoch}, time.perf_counter()
        # ---- 1. rollout: P prompts × G images with the old policy (DESIGN §2) ----
        g_prompts, g_noise, g_train = (epoch_generator(args.seed, epoch, k) for k in range(3))
        idx = torch.randint(len(world.train_prompts), (args.prompts,), generator=g_prompts)
        prompts = [world.train_prompts[i] for i in idx]  # all ranks' prompts, rank-major
        noise = torch.randn(
            args.prompts * G, *world.latent_shape, generator=g_noise
        )  # (N, C, H, W)
        mine = slice(rank * P_local, (rank + 1) * P_local)  # this rank's prompts (whole groups)
        my_prompts = prompts[mine]
        my_noise = noise[rank * P_local * G : (rank + 1) * P_local * G].to(device)
        cond = world.encode(my_prompts)  # per prompt; image n belongs to prompt n // G
        x0_parts, pred_parts = [], []
        for s in tqdm(
            range(0, P_local * G, args.batch_size),
            desc=f"epoch {epoch} rollout",
            leave=False,
            disable=rank > 0,
        ):
            n = torch.arange(s, min(s + args.batch_size, P_local * G), device=device)
            x0, preds = sample(
                lambda x, c, t: world.v("old", x, c, t),
                my_noise[n],
                tuple(c[n // G] for c in cond),
                sigmas,
            )
            x0_parts.append(x0)
            pred_parts.append(preds)
        x0, preds = torch.cat(x0_parts), torch.cat(pred_parts, 1)  # (n, C, H, W), (T, n, C, H, W)
        metrics["time/rollout"] = time.perf_counter() - tic

        # ---- 2. rewards → optimality r per reward and group (DESIGN §3) ----
        tic = time.perf_counter()
        prompts_per_image = [p for p in my_prompts for _ in range(G)]
        images = world.decode(x0)
        final = score_all(reward_fns, images, prompts_per_image)  # (K, n)
        score_gains = (epoch - 1) % args.gain_every == 0
        if (
            score_gains
        ):  # reward k on every step prediction of the first gain_frac of this rank's groups
            n_sub = max(1, round(args.gain_frac * P_local)) * G
            per_step = torch.stack(
                [
                    score_all(reward_fns, world.decode(preds[i, :n_sub]), prompts_per_image[:n_sub])
                    for i in range(T)
                ],
                1,
            )
            scores_all = gather(
                torch.cat([per_step, final[:, None, :n_sub]], 1).to(device)
            )  # (K, T+1, N_sub)
        final = gather(final.to(device))  # (K, N): every rank sees every group from here on
        x0 = gather(x0, 0)
        r = group_optimality(final, G, args.adv_clip_max)  # (K, N) in [0, 1]
        if args.weighting == "sum":  # DiffusionNFT's multi-reward rule: one reward Σ λ_k s_k
            r_train = group_optimality(
                (lam.to(final) @ final)[None], G, args.adv_clip_max
            )  # (1, N)
        else:
            r_train = r
        spread = final.view(K, -1, G).std(2, unbiased=False)
        metrics.update({f"reward/{n}": final[k].mean().item() for k, n in enumerate(names)})
        metrics["groups/constant"] = int((spread == 0).sum())
        metrics["time/score"] = time.perf_counter() - tic

        # ---- 3. gains (DESIGN §4), their EMA, and W (DESIGN §5) ----
        tic = time.perf_counter()
        if score_gains:
            D, gains = renyi_gains(scores_all, G, args.alpha, args.adv_clip_max)  # (K, T+1), (K, T)
            gains = gains.double().cpu()
            gains_ema = (
                gains
                if gains_ema is None
                else args.gain_ema * gains_ema + (1 - args.gain_ema) * gains
            )
            metrics["D"], metrics["gains"] = D.tolist(), gains.tolist()
        if args.weighting == "recast":
            W = recast_weights(gains_ema, lam, args.tau, args.floor)
        else:
            W = (lam[:, None] / T).expand(K, T).float()
        W_train = W.new_full((1, T), 1 / T) if args.weighting == "sum" else W  # (K', T)
        metrics["W"] = W.tolist()
        metrics["time/weights"] = time.perf_counter() - tic

        # ---- 4. NFT update at every (image, timestep) pair, each with its own r̄ (DESIGN §6) ----
        tic = time.perf_counter()
        N = x0.shape[0]
        all_prompts_cond = world.encode(prompts)  # (P, ...) for the images any rank trains on
        pairs = torch.randperm(
            N * T, generator=g_train
        )  # image n = pair // T, timestep i = pair % T
        losses = []
        for s in tqdm(
            range(0, N * T, args.batch_size),
            desc=f"epoch {epoch} update",
            leave=False,
            disable=rank > 0,
        ):
            batch = pairs[s : s + args.batch_size]
            eps = torch.randn(
                len(batch), *world.latent_shape, generator=g_train
            )  # fresh ε per pair
            lo, hi = rank * len(batch) // world_size, (rank + 1) * len(batch) // world_size
            n, i = (
                (batch[lo:hi] // T).to(device),
                (batch[lo:hi] % T).to(device),
            )  # the index travels with its timestep
            t, eps = sigmas[i], eps[lo:hi].to(device)
            x_t = (1 - t.view(-1, 1, 1, 1)) * x0[n] + t.view(-1, 1, 1, 1) * eps
            c = tuple(cc[n // G] for cc in all_prompts_cond)
            v_theta = world.v("policy", x_t, c, t)
            with torch.no_grad():
                v_old = world.v("old", x_t, c, t)
                v_ref = world.v("ref", x_t, c, t) if args.kl_coef > 0 else None
            loss = nft_loss(
                v_theta,
                v_old,
                x0[n],
                eps,
                t,
                i,
                r_train[:, n].T.contiguous(),
                W_train.to(device),
                args.beta,
                args.adv_clip_max,
                v_ref,
                args.kl_coef,
            )
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss.item()} at epoch {epoch}, step {opt_steps}; weights not saved — the last good checkpoint in {out}/ckpt is kept"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(world.trainable.parameters(), args.grad_clip)
            optimizer.step()
            opt_steps += 1
            losses.append(loss.detach())
        metrics["loss"] = gather(torch.stack(losses).mean()[None].to(device)).mean().item()
        metrics["time/update"] = time.perf_counter() - tic

        # ---- 5. old policy ← EMA of the trained weights (DESIGN §6) ----
        decay = min(args.decay_rate * opt_steps, args.decay_cap)
        world.update_old(decay)
        metrics["decay"] = decay

        # ---- 6. eval, log, pictures, checkpoint ----
        last = epoch == args.epochs or stop["asked"]
        if epoch % args.eval_every == 0 or last:
            tic = time.perf_counter()
            ev, latest_images = run_eval()
            metrics.update({f"eval/{k}": v for k, v in ev.items()})
            if ideal is not None:
                gap = {k: (ev[k] - base_eval[k]) / (ideal_scores[k] - base_eval[k]) for k in ev}
                metrics.update({f"gap/{k}": v for k, v in gap.items()})
                metrics["gap/weighted"] = sum(lam[k].item() * gap[n] for k, n in enumerate(names))
            metrics["time/eval"] = time.perf_counter() - tic
            if rank == 0:
                if base_images is None:
                    _, base_images = run_eval("ref")
                rows = min(8, len(latest_images) // args.eval_seeds)  # the first held-out prompts
                shown = rows * args.eval_seeds
                panels = {
                    "base model": base_images[:shown],
                    f"epoch {epoch}": latest_images[:shown],
                }
                if ideal is not None:
                    panels["ideal rendering"] = ideal[: shown : args.eval_seeds]
                plots.save_samples_figure(
                    os.path.join(out, "samples.png"), panels, world.eval_prompts[:rows]
                )
        for k in list(metrics):
            if isinstance(metrics[k], float) and not math.isfinite(metrics[k]):
                raise FloatingPointError(
                    f"{k} is {metrics[k]} at epoch {epoch}; the last good checkpoint in {out}/ckpt is kept"
                )
        if rank == 0:
            checkpoint.append_metrics(out, metrics)
            plots.save_weights_figure(
                os.path.join(out, "W.png"),
                W,
                gain_profiles(gains_ema, args.floor),
                lam,
                names,
                sigmas.cpu(),
                f"epoch {epoch}  ·  --weighting {args.weighting}",
            )
            if epoch % args.ckpt_every == 0 or last:
                state = {
                    "opt_steps": opt_steps,
                    "gains_ema": gains_ema.tolist() if gains_ema is not None else None,
                }
                checkpoint.save(out, epoch, world.state_dict(), optimizer.state_dict(), state)
        history.append(metrics)
        log(
            f"epoch {epoch:3d} | "
            + " ".join(f"reward/{n} {metrics[f'reward/{n}']:+.4f}" for n in names)
            + f" | loss {metrics['loss']:.4f} | centroid(W) "
            + " ".join(f"{c:.1f}" for c in centroid(W).tolist())
            + (
                f" | gap/weighted {metrics['gap/weighted']:+.3f}"
                if "gap/weighted" in metrics
                else ""
            )
            + " | "
            + " ".join(f"{k} {v:.1f}s" for k, v in metrics.items() if k.startswith("time/"))
        )
        if stop["asked"]:
            log(
                f"stopped after epoch {epoch}; continue with: python recast.py --out {out} --resume ..."
            )
            break
    else:
        if rank == 0:
            final_eval = next(m for m in reversed(history) if any(k.startswith("eval/") for k in m))
            summary = {
                "epochs": args.epochs,
                "base": base_eval,
                "final": {k[5:]: v for k, v in final_eval.items() if k.startswith("eval/")},
            }
            summary["gap"] = {k[4:]: v for k, v in final_eval.items() if k.startswith("gap/")}
            checkpoint.write_json_atomic(os.path.join(out, "summary.json"), summary)
            log(f"done: {out}/summary.json")
    if distributed:
        dist.destroy_process_group()
    if stop["asked"]:
        sys.exit(130)


if __name__ == "__main__":
    main()
