"""ReCAST — per-reward, timestep-dependent credit assignment for online diffusion RL.

Several rewards train one image model. The user says how much each reward matters (budgets λ);
ReCAST decides *when* during denoising each reward's feedback is spent. Every epoch:
  1. the old policy samples G images per prompt, keeping the clean prediction x̂0 of every step;
  2. each reward's scores become per-group optimality probabilities r ∈ [0, 1];
  3. for reward k and step i, the Rényi discriminability D_k,i between the reward-tilted
     ("positive") policy and the current one, as far as step i has decided it; its increments are
     the gains g_k,i. Sinkhorn turns them into W (K × T): rows sum to λ, columns to 1/T, and each
     reward's budget goes to the steps where it is informative;
  4. DiffusionNFT's loss at every (image, timestep) pair, rewards mixed by that step's column of W;
  5. the old (sampling) policy moves towards the trained one (EMA);
  6. eval on held-out prompts, log, pictures, checkpoint.
DESIGN.md gives every formula; the phases below carry its section numbers.

    python recast.py --lambda 0.4,0.2,0.2,0.2                       # toy world, laptop CPU, minutes
    python recast.py --lambda 0.4,0.2,0.2,0.2 --weighting uniform   # ablation: W = λ/T
    python recast.py --model ./sd3.5-medium --rewards pickscore,hpsv2,clipscore,aesthetic \\
        --lambda 0.4,0.2,0.2,0.2 --prompts-file prompts.txt          # one GPU
    torchrun --nproc_per_node=8 recast.py --model ./sd3.5-medium ...  # DDP, several GPUs
    torchrun --nproc_per_node=8 recast.py --model ./FLUX.1-dev --shard ...  # FSDP2: sharded
    python recast.py --export runs/NAME --to lora/   # the trained LoRA, for diffusers' pipelines

Paper: "ReCAST: Reward Credit Assignment across Timesteps for Online Diffusion Reinforcement"
(arXiv 2609.13425). Loss and old-policy schedule: DiffusionNFT (arXiv 2509.16117).
"""

import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from plumbing import cli


# ---------------------------------------------------------------------------------------------
# Config: every flag with its default (--help prints them)
# ---------------------------------------------------------------------------------------------
@dataclass
class Args:
    # a flag's value in runs made before the flag existed (their args.json lacks it)
    BEFORE: ClassVar[dict] = {"gain_shift": 0, "normalize": "per-reward", "shard": False,
                              "precision": "auto"}  # fmt: skip
    # --- what to train, on what ---
    lam: str = ""
    """reward budgets λ, one per reward in --rewards order, e.g. 0.4,0.2,0.2,0.2 (normalised)"""
    rewards: str = "position,color,sharpness,background"
    """comma-separated reward names or presets (paper1) from rewards.py (default: the toy four)"""
    model: str = "toy"
    """'toy' (the tiny model shipped in worlds/toy_model/) or a diffusers pipeline's folder or hub
    id (SD3/SD3.5, FLUX.1, FLUX.2-klein, Qwen-Image: docs/models.md)"""
    prompts_file: str = ""
    """training prompts, one per line (needed with --model other than toy)"""
    eval_prompts_file: str = ""
    """held-out prompts, one per line (default for --model: the last 10%% of --prompts-file)"""
    judges: str = ""
    """held-out judges: reward names scored at eval, never trained on (default: the world's own,
    shape,iou in the toy world, none for a diffusers model)"""
    # --- ReCAST ---
    weighting: str = "recast"
    """recast (W from the gains, DESIGN §5) | uniform (W = λ/T) | sum (one reward Σ λ_k s_k) |
    reversed (ReCAST's W with its timesteps in reverse order: a placement control); uniform and sum
    score no step prediction (DiffusionNFT's cost)"""
    normalize: str = "joint"
    """joint (every reward's centred score divided by the group spread of the λ-weighted sum, so
    W = λ/T is --weighting sum exactly) | per-reward (each reward's advantage divided by its own
    group spread) | batch (each reward's centred score divided by its within-group spread pooled
    over the whole batch): DESIGN §3; uniform's default is per-reward (joint with uniform is
    --weighting sum), and sum takes none (one reward)"""
    alpha: float = 2.0
    """Rényi order of the discriminability D (1 = KL)"""
    tau: float = 1.0
    """temperature of the Sinkhorn kernel M = λ·p^(1/τ); large τ tends to W = λ/T (the comparison
    of τ: docs/results.md)"""
    floor: float = 0.1
    """share ε_f of each reward's profile spread evenly over the steps"""
    gain_shift: int = 1
    """W column i uses the gain of step i-S (DESIGN §4, alignment): 1 credits D_i - D_i-1 to
    timestep i (the alignment comparison: docs/results.md), 0 credits D_i+1 - D_i; the first S
    columns get about the static mix λ, the last S gains are dropped (the last is ≈ 0 with an Euler
    sampler). recast/reversed only (uniform and sum run with 0)"""
    gain_ema: float = 0.8
    """EMA of the gains across epochs (0: this epoch's gains only)"""
    gain_every: int = 1
    """epochs between gain updates; step predictions are only scored then"""
    gain_frac: float = 1.0
    """fraction of prompt groups whose step predictions are scored for the gains (toy world: all;
    with a diffusers --model the default scores 4 groups an epoch, min(1, 4/--prompts);
    docs/results.md)"""
    score_precision: str = "fp32"
    """fp32 | bf16: the step predictions' scoring for the gains (decode and reward forwards) under
    bf16 autocast, at about 15x an H100's fp32 rate; the final scores that train stay fp32 (with
    a diffusers --model the default is bf16)"""
    # --- rollout ---
    epochs: int = 20
    """training epochs (rollout + update)"""
    prompts: int = 16
    """prompts per epoch, all ranks together"""
    group_size: int = 8
    """images per prompt (G)"""
    steps: int = 10
    """sampler steps T (also the number of training timesteps)"""
    # --- NFT update ---
    beta: float = 0.1
    """NFT strength β (positive and negative policies are θ_old ± β(θ - θ_old)); the policy moves
    about 1/β times as far per epoch (docs/recipe.md)"""
    lr: float = 5e-5
    """AdamW learning rate"""
    batch_size: int = 64
    """(image, timestep) pairs per forward/backward (micro-batch), all ranks together"""
    grad_accum: int = 1
    """micro-batches whose gradients are summed into one optimizer step"""
    train_frac: float = 0.5
    """fraction of the epoch's (image, timestep) pairs trained on, drawn at random each epoch"""
    kl_coef: float = 1.0
    """weight κ of mean((v_θ - v_ref)²), a KL to the frozen base model (docs/recipe.md;
    DiffusionNFT's SD3.5 LoRA setting is 1e-4)"""
    adv_clip_max: float = 5.0
    """advantage clip A_max of the optimality map r = 1/2 + A/(2 A_max)"""
    grad_clip: float = 1.0
    """gradient-norm clip"""
    decay_rate: float = 0.001
    """old policy EMA: d = min(decay_rate · optimizer steps, decay_cap)"""
    decay_cap: float = 0.5
    """cap of the old-policy decay d"""
    # --- diffusers models only ---
    resolution: int = 512
    """image side in pixels"""
    lora_rank: int = 32
    """LoRA rank r of the adapters on the attention projections"""
    lora_alpha: int = 64
    """LoRA alpha"""
    grad_checkpointing: bool = False
    """trade compute for memory in the transformer"""
    shard: bool = False
    """under torchrun: shard the transformer (base weights and adapters) and the text encoders
    across the ranks, layer by layer (FSDP2), instead of a whole copy on every GPU (DDP); for the
    models that do not fit one GPU (docs/models.md)"""
    precision: str = "auto"
    """bf16 | fp32 | auto (bf16 on CUDA, fp32 elsewhere): a diffusers --model's frozen weights
    and forwards; bf16 loads them in bf16 and runs every forward under bf16 autocast, while the
    adapters, their optimizer state and the VAE decode stay fp32 (under --shard FSDP2 gathers in
    bf16 and reduces gradients in fp32); the toy world computes in fp32"""
    guidance: float = 0.0
    """the guidance-embedding input of a guidance-distilled transformer (FLUX.1-dev: 3.5, its
    model card's value); 0: the family has none"""
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
    """epochs between evals (and always the base model before epoch 1, and the last epoch)"""
    eval_seeds: int = 4
    """images per held-out prompt at eval"""
    ckpt_every: int = 1
    """epochs between checkpoints (and always the last)"""
    log: str = "none"
    """none | tensorboard | wandb, or several separated by commas (tensorboard,wandb): also log
    every epoch's numbers and pictures to OUT/tensorboard (pip install tensorboard) or to a wandb
    run that --resume continues (pip install wandb; WANDB_MODE=offline works without network)"""
    profile: bool = False
    """train nothing: one rollout of the base model (or --resume's latest policy), its step
    predictions scored, and where each reward is informative and the W that ReCAST would use
    written to --out (profile.png, profile.json); see docs/anatomy.md"""


# Flags that may change on --resume; every other one defines the method and must match.
RESUMABLE = {"out", "resume", "device", "epochs", "eval_every", "ckpt_every", "log", "profile"}
# Flags that --profile ignores (it trains and evaluates nothing): a note says so when given.
TRAINING_ONLY = ["epochs", "beta", "lr", "batch_size", "grad_accum", "train_frac", "kl_coef",
                 "grad_clip", "decay_rate", "decay_cap", "gain_ema", "gain_every", "eval_every",
                 "eval_seeds", "ckpt_every", "log", "lora_rank", "lora_alpha",
                 "grad_checkpointing"]  # fmt: skip
CHOICES = {  # flags with a fixed set of values
    "weighting": ["recast", "uniform", "sum", "reversed"],
    "normalize": ["per-reward", "joint", "batch"],
    "score_precision": ["fp32", "bf16"],
    "precision": ["auto", "bf16", "fp32"],
}

# --help answers here, before torch and the models' libraries load (seconds)
if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    cli.parse(Args, sys.argv[1:], __doc__, CHOICES)

import torch
import torch.distributed as dist
from tqdm import tqdm

import rewards
from plumbing import checkpoints, distributed, eval_images, plots, reward_profile, rundir, tblog
from plumbing.distributed import (
    gather,
    init_processes,
    mean_all,
    resolve_precision,
    same_on_all_ranks,
    shard_models,
)
from plumbing.plots import timestep_centroid
from plumbing.seeding import epoch_generator
from recast_kernels.nft_loss import nft_loss
from recast_kernels.renyi import (
    gain_profiles,
    group_optimality,
    joint_optimality,
    recast_weights,
    renyi_gains,
)
from worlds import hub, toyworld


# ---------------------------------------------------------------------------------------------
# Set-up: the world, the run, and every check before anything is written
# ---------------------------------------------------------------------------------------------
class World(Protocol):
    """What a world gives the loop (worlds/toyworld.py's ToyWorld, worlds/diffusersworld.py's
    DiffusersWorld): prompts, the latent layout, the sampler's schedule, the text encoder, the
    velocities of the trained, old and reference policies, the decoder to images, the old
    policy's EMA and the weights a checkpoint keeps."""

    device: torch.device
    train_prompts: list[str]
    eval_prompts: list[str]
    latent_shape: tuple[int, ...]  # one image's latent: (C, H, W), or (tokens, channels)
    judge_names: list[str]  # held-out judges when --judges is not given
    trainable: torch.nn.Module  # what the optimizer trains (the LoRA adapters, or the toy model)
    policy: torch.nn.Module  # the trainable, wrapped in DDP under torchrun (without --shard)

    def sigmas(self, steps: int) -> torch.Tensor: ...  # (T+1,): 1 = noise > … > 0 = image

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, ...]: ...  # per prompt

    def v(self, which: str, x: torch.Tensor, cond, t: torch.Tensor) -> torch.Tensor: ...

    def decode(self, x0: torch.Tensor) -> torch.Tensor: ...  # (N, 3, H, W) images in [0, 1]

    def ideal(self, prompts: list[str]) -> torch.Tensor | None: ...  # None: no ideal rendering

    def update_old(self, decay: float) -> None: ...  # θ_old ← d·θ_old + (1-d)·θ

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def shardable(self) -> list[torch.nn.Module]: ...  # --shard's (diffusers worlds only)


@dataclass
class Run:
    args: Args
    names: list[str]  # reward names, in --lambda order
    lam: torch.Tensor  # (K,) float64, sums to 1
    rank: int
    world_size: int
    world: World
    reward_fns: dict  # the trained rewards
    scorers: dict  # the trained rewards and the held-out judges
    sigmas: torch.Tensor  # (T+1,): t_0 = 1 > … > t_T = 0
    params: list
    optimizer: torch.optim.Optimizer
    views: tblog.Views | None = None  # rank 0 with --log: TensorBoard, wandb
    flat_said: set = field(default_factory=set)  # rewards said to be constant in every group
    # A benchmark's hook, entered around each phase and step of the loop by name (rollout, score,
    # recast, steps, weights, update, loss, backward, eval, save): benchmarks/scale_check.py times
    # them through it. By default it does nothing.
    observe: Callable[[str], AbstractContextManager] = nullcontext

    def log(self, *a, **k) -> None:  # rank 0 speaks for every rank
        if self.rank == 0:
            print(*a, **k)

    @contextmanager
    def phase(self, metrics: dict, name: str):
        """A phase of the loop: its time (and GPU memory) into metrics, inside the hook."""
        with self.observe(name), timed(metrics, name):
            yield

    @property
    def bar(self) -> dict:  # tqdm settings: progress bars on rank 0 only
        return dict(leave=False, disable=self.rank > 0)


@contextmanager
def timed(metrics: dict, name: str):
    """time/<name>: the phase's seconds. Once CUDA is in use, the GPU is synchronised at both ends
    (so the phase is charged its own kernels) and mem/<name> is its peak allocated GiB
    (torch.cuda.max_memory_allocated, reset when the phase starts)."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    tic = time.perf_counter()
    yield
    if cuda:
        torch.cuda.synchronize()
        metrics[f"mem/{name}"] = torch.cuda.max_memory_allocated() / 2**30
    metrics[f"time/{name}"] = time.perf_counter() - tic


def is_toy_model(path: str) -> bool:
    """A folder holding a bare SD3 transformer (a retrained toy model), not a whole pipeline."""
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return has("config.json") and not has("model_index.json")


def is_diffusers(model: str) -> bool:
    """--model names a diffusers pipeline (a folder or a hub id), not a toy-world model."""
    return model != "toy" and not is_toy_model(model)


def load_world(args: Args, device: torch.device):
    """The world: models, prompts, latent shape, sampler schedule (worlds/toyworld.py, or
    worlds/diffusersworld.py with the family part that worlds/families.py picks)."""
    if not is_diffusers(args.model):
        return toyworld.ToyWorld(device, *([] if args.model == "toy" else [args.model]))
    from worlds import diffusersworld, families

    try:
        return families.load(args, device)
    except diffusersworld.BadInput as e:
        cli.fail(e.flag, str(e))
    except (OSError, ValueError) as e:
        cli.fail("--model", f"could not load {args.model!r}: {e}")


def expand_names(flag: str, text: str, known: list[str], allow_none: bool = False) -> list[str]:
    """--rewards / --judges → reward names (presets expanded); an unknown one exits 2."""
    names = rewards.expand(text)
    if (not names and not allow_none) or any(n not in known for n in names):
        bad = ", ".join(n for n in names if n not in known) or "(none)"
        cli.fail(flag, f"unknown reward {bad}; choose from {', '.join([*known, *rewards.PRESETS])}")
    return names


def check_rewards(args: Args, names: list[str], judges: list[str]) -> None:
    """A diffusers --model is scored by reward models: a toy-world reward or judge exits 2."""
    for flag, given in (("--rewards", names), ("--judges", judges)):
        toy = [n for n in given if n in rewards.TOY]
        real = [p for p, ns in rewards.PRESETS.items() if not set(ns) & rewards.TOY]
        if toy:
            cli.fail(flag, f"{', '.join(toy)} score the toy world's shapes, not {args.model}: "
                     f"choose from {', '.join(rewards.LOADERS)}, or a preset "
                     f"({', '.join(real)})")  # fmt: skip


def scoring_defaults(args: Args, argv: list[str] | None) -> dict:
    """A diffusers model's defaults for scoring step predictions (diffusersworld.scoring_defaults)
    on a new run that scores them, for the flags not given; the toy world scores every group in
    fp32 (2 % of its epoch) and --profile every group (that is all it does). Returns what it set.
    Uniform and sum score nothing and have no gains in W: their --gain-shift default is 0, and
    their --normalize per-reward (uniform with joint is sum; sum is one reward)."""
    if args.weighting in ("uniform", "sum"):
        cli.fill_defaults(args, argv, {"gain_shift": 0, "normalize": "per-reward"})
    if not is_diffusers(args.model) or args.weighting in ("uniform", "sum"):
        return {}
    from worlds import diffusersworld

    values = diffusersworld.scoring_defaults(args.prompts)
    if args.profile:
        values.pop("gain_frac")
    return cli.fill_defaults(args, argv, values)


def setup(argv: list[str] | None) -> "Run":
    """Flags, processes, world, rewards, optimizer: every check before anything is written (bad
    input exits 2)."""
    args = cli.parse(Args, argv, __doc__, CHOICES)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if distributed else 1
    if args.weighting == "sum" and cli.given(argv, ["normalize"]):
        cli.fail("--normalize", "--weighting sum is one reward, normalised as one: drop "
                 "--normalize (joint with --weighting uniform is the same loss)")  # fmt: skip
    if args.shard and not is_diffusers(args.model):
        cli.fail("--shard", "the toy world fits any device whole: drop --shard (it is for "
                 "diffusers models, --model)")  # fmt: skip
    if args.precision == "bf16" and not is_diffusers(args.model):
        cli.fail("--precision", "the toy world computes in fp32: drop --precision (it is for "
                 "diffusers models, --model)")  # fmt: skip
    if args.shard and not distributed:
        cli.fail("--shard", "shards the models across torchrun's processes: launch with "
                 "torchrun --nproc-per-node=N (N ≥ 2), or drop --shard")  # fmt: skip
    chosen = scoring_defaults(args, argv)
    cli.check(args, world_size, RESUMABLE)
    rank0 = int(os.environ.get("RANK", "0")) == 0  # before the process group exists
    if chosen and rank0:
        from worlds import diffusersworld

        said = " ".join(f"{cli.flag_of(k)} {v:.4g}" if isinstance(v, float) else
                        f"{cli.flag_of(k)} {v}" for k, v in chosen.items())  # fmt: skip
        print(f"note: scoring defaults: {said} (step predictions of {diffusersworld.SCORED_GROUPS}"
              " prompt groups an epoch, docs/sd35.md); give the flag to override")  # fmt: skip
    ignored = cli.given(argv, TRAINING_ONLY) if args.profile else []
    if ignored and rank0:
        print(f"note: --profile trains nothing: {', '.join(ignored)} ignored")
    known = [*rewards.REWARDS, *rewards.LOADERS]
    names = expand_names("--rewards", args.rewards, known)  # presets become their rewards
    lam = cli.parse_lambda(args.lam, names)  # (K,) float64, sums to 1
    judges = expand_names("--judges", args.judges, [*known, *rewards.JUDGES], allow_none=True)
    if set(judges) & set(names):
        both = ", ".join(n for n in judges if n in names)
        cli.fail("--judges", f"{both} is trained on (--rewards): a judge must be held out")
    try:  # --log's targets, and their packages installed
        missing = tblog.missing(tblog.targets(args.log))
    except ValueError as e:
        missing = str(e)
    if missing:
        cli.fail("--log", missing)
    if args.model != "toy" and not os.path.isdir(args.model) and not hub.is_hub_id(args.model):
        cli.fail("--model", f"{args.model!r} does not exist here, and is not 'toy' or a hub id "
                 "'org/name'")  # fmt: skip
    if is_diffusers(args.model):
        from worlds import diffusersworld

        check_rewards(args, names, judges)  # a diffusers model: no toy reward
        try:
            diffusersworld.check(args)  # --prompts-file, --eval-prompts-file
        except diffusersworld.BadInput as e:
            cli.fail(e.flag, str(e))
    if args.resume and not args.profile and rank0:
        rundir.lock_run(args.out)  # another live run in this folder: exit 2, at once
    args.out = args.out or os.path.join(
        "runs",
        time.strftime("%Y%m%d-%H%M%S")
        + f"-{'profile' if args.profile else args.weighting}-s{args.seed}",
    )
    rank, device = init_processes(args, distributed)
    rundir.check_shared_folder(args, rank)  # every rank sees rank 0's --out: else exit 2
    world = load_world(args, device)
    if len(world.eval_prompts) < world_size:  # every rank evaluates a share; rank 0 draws its own
        cli.fail("--eval-prompts-file", f"{len(world.eval_prompts)} held-out prompts for "
                 f"{world_size} processes: hold out at least one per process")  # fmt: skip
    held = len(world.eval_prompts) * args.eval_seeds
    if args.shard and held % world_size:  # sharded forwards are collectives: equal shares
        cli.fail("--eval-prompts-file", f"--shard evaluates equal shares: {len(world.eval_prompts)}"
                 f" held-out prompts × --eval-seeds {args.eval_seeds} is not a multiple of "
                 f"{world_size} processes")  # fmt: skip
    if args.shard:  # FSDP2: each rank holds a shard of each layer (docs/models.md); the models
        # were built on the meta device and get their shards' weights once sharded (load_shards)
        shard_models(world.shardable(), device, resolve_precision(args, device),
                     load=world.load_shards)  # fmt: skip
    elif distributed:
        ids = [device.index] if device.type == "cuda" else None
        world.policy = torch.nn.parallel.DistributedDataParallel(world.trainable, device_ids=ids)
    scorers = {}  # the trained rewards, then the held-out judges (default: the world's own)
    for flag, group in (("--rewards", names), ("--judges", judges or world.judge_names)):
        try:  # a reward model missing (file, package, hub access) is bad input too
            scorers.update({n: rewards.get(n, device) for n in group})
        except (ImportError, OSError, ValueError) as e:
            cli.fail(flag, f"could not load a reward model: {e}")
    reward_fns = {n: scorers[n] for n in names}
    params = [p for p in world.trainable.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sigmas = world.sigmas(args.steps)
    return Run(args, names, lam, rank, world_size, world, reward_fns, scorers, sigmas, params,
               optimizer)  # fmt: skip


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


def rollout(run: "Run", epoch: int):
    """P prompts × G images from the old policy; this rank samples its share of the groups.
    Returns every rank's prompts, this rank's prompts, x0 (n, C, H, W) and x̂0 (T, n, C, H, W)."""
    args, world, G = run.args, run.world, run.args.group_size
    P_local = args.prompts // run.world_size
    g_prompts, g_noise = epoch_generator(args.seed, epoch, 0), epoch_generator(args.seed, epoch, 1)
    idx = torch.randint(len(world.train_prompts), (args.prompts,), generator=g_prompts)
    prompts = [world.train_prompts[i] for i in idx]  # every rank's, rank-major
    noise = torch.randn(args.prompts * G, *world.latent_shape, generator=g_noise)
    mine = slice(run.rank * P_local, (run.rank + 1) * P_local)
    my_noise = noise[mine.start * G : mine.stop * G].to(world.device)
    my_cond = world.encode(prompts[mine])  # per prompt: image n belongs to prompt n // G
    old = lambda x, c, t: world.v("old", x, c, t)  # noqa: E731
    x0, preds = [], []
    for s in tqdm(range(0, P_local * G, args.batch_size), f"epoch {epoch} rollout", **run.bar):
        n = torch.arange(s, min(s + args.batch_size, P_local * G), device=world.device)
        x, pred = sample(old, my_noise[n], tuple(c[n // G] for c in my_cond), run.sigmas)
        x0.append(x)
        preds.append(pred)
    return prompts, prompts[mine], torch.cat(x0), torch.cat(preds, 1)


# ---------------------------------------------------------------------------------------------
# Phase 2 — rewards → optimality probabilities (DESIGN §3)
# ---------------------------------------------------------------------------------------------
def score_all(reward_fns: dict, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """(K, B) scores, one row per reward; NaN/inf is an error naming the reward and the prompt."""
    return torch.stack([rewards.score(n, fn, images, prompts) for n, fn in reward_fns.items()])


def optimality(run: "Run", final: torch.Tensor) -> torch.Tensor:
    """r (K, N) per reward and group: in [0, 1] with --normalize per-reward, scaled by the
    λ-weighted sum's spread with joint and by each reward's pooled spread with batch (the loss
    clamps the mix); with --weighting sum, DiffusionNFT's single reward Σ_k λ_k s_k (1, N)."""
    G, A = run.args.group_size, run.args.adv_clip_max
    if run.args.weighting == "sum":
        return group_optimality((run.lam.to(final) @ final)[None], G, A)
    if run.args.normalize == "joint":
        return joint_optimality(final, run.lam, G, A)
    if run.args.normalize == "batch":
        return batch_optimality(final, G, A)
    return group_optimality(final, G, A)


def batch_optimality(final: torch.Tensor, group_size: int, adv_clip_max: float) -> torch.Tensor:
    """--normalize batch (DESIGN §3): A_k = (s_k - mean_group s_k) / (σ_k + 1e-4), with σ_k the
    within-group spread of reward k pooled over the whole batch, every rank's groups (`final` is
    gathered): √(mean over groups of the group variance). One scale per reward, so λ weighs
    rewards brought to one scale, and a reward's flat groups stay flat. Not clipped per reward,
    as under joint: with W = λ/T the mix is the advantage of Σ_k λ_k s_k/σ_k, the clamp included."""
    s = final.unflatten(-1, (-1, group_size))  # (K, M, G)
    centred = s - s.mean(-1, keepdim=True)
    pooled = centred.pow(2).mean((-2, -1), keepdim=True).sqrt()  # (K, 1, 1)
    return (0.5 + centred / (pooled + 1e-4) / (2 * adv_clip_max)).flatten(-2)


def signal_share(final: torch.Tensor, lam: torch.Tensor, group_size: int, normalize: str):
    """Each reward's effective share of the training signal (K,): λ_k times the mean over groups of
    the within-group spread of its advantage A_k under `normalize` (joint: its raw spread over the
    λ-weighted sum's; batch: over its pooled spread; per-reward: 1 in every group that varies),
    summed to 1. The signal ReCAST distributes over timesteps is λ's only under per-reward and
    batch; under joint (and --weighting sum) raw scale weighs in too (DESIGN §3)."""
    s = final.double().unflatten(-1, (-1, group_size))  # (K, M, G)
    spread = s.std(-1, correction=0)  # (K, M)
    lam = lam.to(s)
    if normalize == "joint":
        spread = spread / (torch.einsum("k,kmg->mg", lam, s).std(-1, correction=0) + 1e-4)
    elif normalize == "batch":
        spread = spread / (spread.pow(2).mean(-1, keepdim=True).sqrt() + 1e-4)
    else:
        spread = spread / (spread + 1e-4)
    weight = lam * spread.mean(-1)
    total = weight.sum()
    return weight / total if total > 0 else torch.zeros_like(weight)


def note_flat_rewards(run: "Run", groups: torch.Tensor, epoch: int) -> None:
    """Say once a run that a reward is constant in every group (K, M, G) of an epoch: it trains
    nothing that epoch (r = 1/2 under every normalisation, no NaN: DESIGN §3)."""
    flat = (groups.amax(2) == groups.amin(2)).all(1)
    for k in flat.nonzero().flatten().tolist():
        if run.names[k] not in run.flat_said:
            run.flat_said.add(run.names[k])
            run.log(f"note: reward {run.names[k]} is constant in every group at epoch {epoch}: it "
                    "trains nothing while it stays so (said once a run)")  # fmt: skip


def mix_stats(run: "Run", final: torch.Tensor, r: torch.Tensor, W: torch.Tensor) -> dict:
    """What the loss (DESIGN §6) will make of r and W this epoch, for the log: clamp/share, the
    share of (image, timestep) pairs whose mix r̄ = Σ_k W_k,i r_k / Σ_k W_k,i is clamped to
    [0, 1]; adv/max/<reward>, each row's largest |A| = 2 A_max |r - 1/2| (one row 'sum' with
    --weighting sum); share/<reward>, signal_share of the epoch's final scores."""
    Wt = train_weights(run, W).to(r)
    mix = (Wt.T @ r) / Wt.sum(0)[:, None]  # (T, N): every pair, trained or not
    out = {"clamp/share": ((mix < 0) | (mix > 1)).double().mean().item()}
    rows = ["sum"] if run.args.weighting == "sum" else run.names
    adv = (2 * run.args.adv_clip_max * (r - 0.5)).abs().amax(1)
    out.update({f"adv/max/{n}": a.item() for n, a in zip(rows, adv, strict=True)})
    norm = "joint" if run.args.weighting == "sum" else run.args.normalize  # sum: joint's signal
    share = signal_share(final, run.lam, run.args.group_size, norm)
    out.update({f"share/{n}": v.item() for n, v in zip(run.names, share, strict=True)})
    return out


# ---------------------------------------------------------------------------------------------
# Phase 3 — step scores, gains (DESIGN §4) and the weight matrix W (DESIGN §5)
# ---------------------------------------------------------------------------------------------
def trajectory_scores(reward_fns: dict, decode, preds, final, prompts) -> torch.Tensor:
    """(K, T+1, n): reward k on each step prediction x̂0_i and (column T) the final scores. The
    step-0 column is left 0, unscored: a prediction from pure noise is never read (D_k,0 := 0)."""
    steps = [score_all(reward_fns, decode(p), prompts) for p in preds[1:]]
    return torch.stack([torch.zeros_like(steps[0]), *steps, final], 1)


def score_steps(run: "Run", preds, final, per_image) -> torch.Tensor:
    """trajectory_scores of --gain-frac of the epoch's groups (cli.scored_groups: the same groups
    on any number of ranks; a rank may score fewer than another, or none), under bf16 autocast
    with --score-precision bf16; every rank's, in the groups' order."""
    args, G = run.args, run.args.group_size
    share = lambda r: cli.scored_share(args.gain_frac, args.prompts, run.world_size, r)  # noqa: E731
    n = torch.tensor([g * G + j for g in share(run.rank) for j in range(G)], dtype=torch.long)
    scores = final.new_zeros(len(final), args.steps + 1, 0)  # none of this rank's groups scored
    bf16 = args.score_precision == "bf16"
    with run.observe("steps"), torch.autocast(run.world.device.type, torch.bfloat16, enabled=bf16):
        if len(n):
            mine = preds[:, n.to(preds.device)], final[:, n.to(final.device)]
            scores = trajectory_scores(run.reward_fns, run.world.decode, *mine,
                                       [per_image[i] for i in n])  # fmt: skip
    return distributed.gather_uneven(scores, [len(share(r)) * G for r in range(run.world_size)])


def weights(run: "Run", step_scores, gains_ema, metrics: dict):
    """The gains of this epoch's step scores (None: not scored this epoch), their EMA across
    epochs, and W (K, T) for --weighting recast | reversed | uniform | sum. Returns
    (W, gains_ema)."""
    with run.observe("weights"):
        args, K, T = run.args, len(run.names), run.args.steps
        if step_scores is not None:
            D, gains = renyi_gains(step_scores, args.group_size, args.alpha, args.adv_clip_max)
            gains = gains.double().cpu()  # D (K, T+1), gains (K, T)
            gains_ema = (
                gains
                if gains_ema is None
                else args.gain_ema * gains_ema + (1 - args.gain_ema) * gains
            )
            metrics["D"], metrics["gains"] = D.tolist(), gains.tolist()
        if args.weighting in ("recast", "reversed"):
            W = recast_weights(gains_ema, run.lam, args.tau, args.floor, args.gain_shift)
            return (W.flip(1) if args.weighting == "reversed" else W), gains_ema
        return (run.lam[:, None] / T).expand(K, T).float(), gains_ema


# ---------------------------------------------------------------------------------------------
# Phase 4 — the NFT update, each (image, timestep) pair with its own r̄ (DESIGN §6)
# ---------------------------------------------------------------------------------------------
def train_weights(run: "Run", W: torch.Tensor) -> torch.Tensor:
    """The W the loss reads, rows matching r: --weighting sum trains its one reward with 1/T."""
    return W.new_full((1, run.args.steps), 1 / run.args.steps) if run.args.weighting == "sum" else W


def pair_loss(world: World, args: Args, sigmas, x0, cond, r, W, n, i, eps, loss_fn=None,
              observe=nullcontext):  # fmt: skip
    """DESIGN §6 on one micro-batch of (image, timestep) pairs: images n of x0 (every rank's)
    noised to their timesteps i with fresh ε (eps), the trained, old and reference policies'
    velocities, and the loss with each pair's column of W. `loss_fn` is the fused kernel unless
    given (benchmarks/memory_plan.py passes its PyTorch reference where the kernel cannot run);
    `observe` is Run.observe, entered around the loss alone."""
    loss_fn = loss_fn or nft_loss
    t, eps, G = sigmas[i], eps.to(world.device), args.group_size
    tt = t.view(-1, *[1] * (x0.dim() - 1))  # any latent layout: images or packed tokens
    x_t = (1 - tt) * x0[n] + tt * eps
    c = tuple(cc[n // G] for cc in cond)
    v_theta = world.v("policy", x_t, c, t)
    with torch.no_grad():
        v_old = world.v("old", x_t, c, t)
        v_ref = world.v("ref", x_t, c, t) if args.kl_coef > 0 else None
    with observe("loss"):
        return loss_fn(v_theta, v_old, x0[n], eps, t, i, r[:, n].T, W, args.beta,
                       args.adv_clip_max, v_ref, args.kl_coef)  # fmt: skip


def nft_update(run: "Run", epoch: int, prompts, x0, r, W, opt_steps: int):
    """A random --train-frac of the N·T (image, timestep) pairs, shuffled with their timestep
    index, in micro-batches of --batch-size pairs, --grad-accum of them per optimizer step.
    `nft_loss` is the fused kernel; `reference_nft_loss` in kernels/nft_loss.py is the same loss
    in a few lines of PyTorch. Returns (mean loss over every rank, optimizer steps so far)."""
    args, world, T = run.args, run.world, run.args.steps
    W_train, device = train_weights(run, W).to(world.device), world.device
    g_train = epoch_generator(args.seed, epoch, 2)
    N, losses = x0.shape[0], []
    cond = world.encode(prompts)  # all ranks' prompts: any rank may train on any image
    pairs = torch.randperm(N * T, generator=g_train)  # image = pair // T, timestep = pair % T
    pairs = pairs[: max(1, round(args.train_frac * N * T))]  # a random subset, if asked
    per_step = args.batch_size * args.grad_accum  # pairs per optimizer step
    for s in tqdm(range(0, len(pairs), args.batch_size), f"epoch {epoch} update", **run.bar):
        batch = pairs[s : s + args.batch_size]
        step_end = min(s - s % per_step + per_step, len(pairs))  # this optimizer step's end
        step_pairs = step_end - (s - s % per_step)
        eps = torch.randn(len(batch), *world.latent_shape, generator=g_train)  # fresh ε
        mine = slice(run.rank * len(batch) // run.world_size,
                     (run.rank + 1) * len(batch) // run.world_size)  # fmt: skip
        n, i = (batch[mine] // T).to(device), (batch[mine] % T).to(device)  # i travels with n
        loss = pair_loss(world, args, run.sigmas, x0, cond, r, W_train, n, i, eps[mine],
                         observe=run.observe)  # fmt: skip
        if not torch.isfinite(loss):  # stop before the step: the last checkpoint stays good
            raise FloatingPointError(
                f"loss is {loss.item()} at epoch {epoch}, optimizer step {opt_steps}; "
                f"weights not saved, the last good checkpoint in {args.out}/ckpt is kept"
            )
        with run.observe("backward"):  # the step's gradient: mean over its pairs
            (loss * len(batch) / step_pairs).backward()
        losses.append(loss.detach())
        if s + len(batch) == step_end:  # the step's last micro-batch
            torch.nn.utils.clip_grad_norm_(run.params, args.grad_clip)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            opt_steps += 1
    return gather(torch.stack(losses).mean()[None]).mean().item(), opt_steps


# ---------------------------------------------------------------------------------------------
# Phase 5 — the old policy is an EMA of the trained weights (DESIGN §6): world.update_old
# Phase 6 — eval on held-out prompts with fixed noise, log, pictures, checkpoint
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


class EvalSet:
    """The held-out prompts × --eval-seeds with fixed noise (each rank scores a share), the
    ideal rendering's scores where the world has one, and the base model's (epoch 0)."""

    def __init__(self, run: "Run", history: list[dict]):
        args, world, ws = run.args, run.world, run.world_size
        self.run = run
        prompts = [p for p in world.eval_prompts for _ in range(args.eval_seeds)]
        noise = torch.randn(len(prompts), *world.latent_shape,
                            generator=torch.Generator().manual_seed(EVAL_SEED))  # fmt: skip
        share = slice(run.rank * len(prompts) // ws, (run.rank + 1) * len(prompts) // ws)
        self.prompts, self.noise = prompts[share], noise[share]
        self.start, self.index = share.start, {  # what OUT/eval_images/ says of its images
            "prompts": prompts, "eval_seeds": args.eval_seeds, "eval_seed": EVAL_SEED,
            "noise_sha256": eval_images.noise_digest(noise)}  # fmt: skip
        self.ideal = world.ideal(self.prompts)  # None where there is no ideal rendering
        self.ideal_eval = None if self.ideal is None else {
            k: mean_all(rewards.score(k, fn, self.ideal, self.prompts).to(world.device))
            for k, fn in run.scorers.items()
        }  # fmt: skip
        self.base_images = None
        if history:  # resumed: the base model's scores are in the first line of metrics.jsonl
            self.base = {k[5:]: v for k, v in history[0].items() if k.startswith("eval/")}
            return
        self.base, self.base_images = self.score("ref")
        history.append({"epoch": 0, **{f"eval/{k}": v for k, v in self.base.items()}})
        if self.ideal is not None:
            history[0].update({f"ideal/{k}": v for k, v in self.ideal_eval.items()})
        if run.rank == 0:
            checkpoints.append_metrics(args.out, history[0])
        run.log("epoch   0 | " + " ".join(f"eval/{k} {v:+.4f}" for k, v in self.base.items()))

    def score(self, which: str = "policy", scorers: dict | None = None):
        """({name: mean over every rank}, this rank's images) of the policy `which`."""
        run = self.run
        scorers = run.scorers if scorers is None else scorers
        means, images = evaluate(run.world, scorers, self.prompts, self.noise, run.sigmas,
                                 run.args.batch_size, which)  # fmt: skip
        return {k: mean_all(v.to(run.world.device)) for k, v in means.items()}, images

    def __call__(self, epoch: int, metrics: dict) -> None:
        """Eval the trained policy into `metrics` (eval/*, gap/*), keep its images in
        OUT/eval_images/ and draw samples.png."""
        ev, images = self.score()
        index = {"epoch": epoch, **self.index}
        eval_images.save(self.run.args.out, images, self.start, index, self.run.rank)
        metrics.update({f"eval/{k}": v for k, v in ev.items()})
        if self.ideal is not None:  # fraction of the base → ideal-rendering gap closed
            span = {k: self.ideal_eval[k] - self.base[k] for k in ev}  # 0: nothing left to close
            gap = {k: (ev[k] - self.base[k]) / span[k] if span[k] else 0.0 for k in ev}
            metrics.update({f"gap/{k}": v for k, v in gap.items()})
            lam, names = self.run.lam, self.run.names
            metrics["gap/weighted"] = sum(lam[k].item() * gap[n] for k, n in enumerate(names))
        if self.base_images is None and (self.run.rank == 0 or self.run.args.shard):
            _, self.base_images = self.score("ref", {})  # resumed: redraw, unscored (sharded
            # forwards are collectives: every rank draws, rank 0 keeps them)
        if self.run.rank == 0:
            save_samples(self.run.args, self.base_images, images, self.ideal,
                         self.run.world.eval_prompts, epoch)  # fmt: skip


def save_samples(args, base_images, latest_images, ideal, eval_prompts, epoch) -> None:
    """samples.png: base model vs this epoch (same prompts and noise), and the ideal rendering."""
    held = len(latest_images) // args.eval_seeds  # held-out prompts in this rank's share
    rows = min(8, held)  # evenly spaced through the sorted list: several colours, shapes, places
    pick = [round(j * (held - 1) / max(1, rows - 1)) for j in range(rows)]
    seeds = [p * args.eval_seeds + s for p in pick for s in range(args.eval_seeds)]
    panels = {"base model": base_images[seeds], f"epoch {epoch}": latest_images[seeds]}
    if ideal is not None:
        panels["ideal"] = ideal[[p * args.eval_seeds for p in pick]]
    plots.save_samples_figure(
        os.path.join(args.out, "samples.png"), panels, [eval_prompts[p] for p in pick]
    )


def log_line(m: dict, names: list[str], W: torch.Tensor) -> str:
    """The one fixed-format line per epoch."""
    parts = [
        f"epoch {m['epoch']:3d}",
        " ".join(f"reward/{n} {m[f'reward/{n}']:+.4f}" for n in names),
    ]
    parts.append(f"loss {m['loss']:.4f}")
    parts.append(
        "centroid(W) " + " ".join(f"{c:.1f}" for c in timestep_centroid(W.double()).tolist())
    )
    if "gap/weighted" in m:
        parts.append(f"gap/weighted {m['gap/weighted']:+.3f}")
    parts.append(" ".join(f"{k} {v:.1f}s" for k, v in m.items() if k.startswith("time/")))
    return " | ".join(parts)


def save_epoch(run: Run, m: dict, W, gains_ema, opt_steps: int, history: list, last: bool):
    """Refuse a non-finite metric; append metrics.jsonl, redraw W.png, checkpoint (rank 0)."""
    args, epoch = run.args, m["epoch"]
    bad = [k for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise FloatingPointError(
            f"{bad[0]} is {m[bad[0]]} at epoch {epoch}; "
            f"the last good checkpoint in {args.out}/ckpt is kept"
        )
    history.append(m)
    saving = epoch % args.ckpt_every == 0 or last
    if saving:  # every rank: a sharded run gathers the shards here
        tensors = run.world.state_dict()
        optim = distributed.optimizer_state(run.world.trainable, run.optimizer, args.shard)
    if run.rank == 0:
        checkpoints.append_metrics(args.out, m)
        profiles = (
            None if gains_ema is None else gain_profiles(gains_ema, args.floor, args.gain_shift)
        )
        plots.save_weights_figure(
            os.path.join(args.out, "W.png"), W, profiles, run.lam, run.names, run.sigmas.cpu(),
            f"epoch {epoch}  ·  --weighting {args.weighting}",
        )  # fmt: skip
        if run.views:
            run.views.epoch(m, args.out)
        if saving:
            gains_list = gains_ema.tolist() if gains_ema is not None else None
            state = {"opt_steps": opt_steps, "gains_ema": gains_list}
            checkpoints.save(args.out, epoch, tensors, optim, state)
    run.log(log_line(m, run.names, W))


# ---------------------------------------------------------------------------------------------
# --profile: one rollout, its step predictions scored, the gains and W, and no training
# ---------------------------------------------------------------------------------------------
def profile(run: "Run") -> None:
    """--profile: the base model's (or --resume's latest policy's) rollout of one epoch, every
    step prediction scored by every reward (DESIGN §4), and what plumbing/reward_profile.py makes
    of the gains (profiles and W of DESIGN §5 with their bootstrap spread): printed, and written
    to OUT/profile.png and OUT/profile.json."""
    args, world, G = run.args, run.world, run.args.group_size
    tic, source, epoch = time.perf_counter(), "the base model", 1
    if args.resume:
        ckpt = checkpoints.load_latest(args.out, run.log)
        if ckpt is None:
            cli.fail("--resume", f"{args.out} has no usable checkpoint to profile")
        world.load_state_dict({k: v.to(world.device) for k, v in ckpt[0].items()})
        epoch = ckpt[2]["epoch"] + 1  # the prompts and noise its next epoch would draw
        source = f"the policy after epoch {ckpt[2]['epoch']} of {args.out}"
    _, my_prompts, x0, preds = rollout(run, epoch)
    per_image = [p for p in my_prompts for _ in range(G)]
    final = score_all(run.reward_fns, world.decode(x0), per_image)
    step_scores = score_steps(run, preds, final, per_image)  # (K, T+1, every rank's scored)
    D, gains = renyi_gains(step_scores, G, args.alpha, args.adv_clip_max)
    p = reward_profile.report(step_scores, D, gains, run.lam, run.names, args, source)
    p["normalize"] = "joint" if args.weighting == "sum" else args.normalize  # sum: joint's signal
    p["share"] = signal_share(step_scores[:, -1], run.lam, G, p["normalize"]).tolist()
    p["seconds"] = time.perf_counter() - tic
    if dist.is_initialized():
        dist.destroy_process_group()
    if run.rank > 0:
        return
    os.makedirs(args.out, exist_ok=True)
    checkpoints.write_json_atomic(os.path.join(args.out, "profile.json"), p)
    plots.save_weights_figure(
        os.path.join(args.out, "profile.png"), p["W"], p["profiles"], run.lam, run.names,
        run.sigmas.cpu(), f"profile of {source}: {p['images_scored']} images in {p['groups']} "
        f"groups (bands: ± 1 std over {reward_profile.BOOTSTRAP} resamples of the groups)",
        spread=torch.tensor(p["bootstrap"]["profiles"]),
    )  # fmt: skip
    print("\n".join(reward_profile.lines(p)))
    print(f"wrote {args.out}/profile.png, {args.out}/profile.json")


# ---------------------------------------------------------------------------------------------
# main: the table of contents
# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None, observe=nullcontext) -> None:
    """The run of `argv`'s flags. `observe` (name → context manager) is a benchmark's hook around
    each phase and step (Run.observe); by default it does nothing."""
    if cli.given(argv, ["export"]):  # not a run: a finished run's LoRA for diffusers
        from plumbing import export

        return export.main(sys.argv[1:] if argv is None else argv)
    run = setup(argv)  # flags, processes, world, rewards, optimizer: bad input exits 2 first
    run.observe = observe
    if run.args.profile:  # before training: where is each reward informative?
        return profile(run)
    args, world, names, G = run.args, run.world, run.names, run.args.group_size
    ckpt = rundir.start_or_resume(args, world, run.optimizer, run.rank, run.log)
    start, opt_steps, gains_ema, history = ckpt  # a new run, or the last good checkpoint's
    with distributed.lost_rank_exits(args.out):  # a lost rank: exit 1 naming the checkpoint
        evals = EvalSet(run, history)  # fixed held-out set; the base model scored at epoch 0
        distributed.start_training()  # collectives: RECAST_COLLECTIVE_TIMEOUT from here on
        if tblog.targets(args.log) and run.rank == 0:  # TensorBoard, wandb: metrics.jsonl's views
            run.views = tblog.Views(tblog.targets(args.log), args.out, dict(vars(args)))
            run.views.epoch(history[0], args.out, pictures=False)
        stop = rundir.Stop(run.log)  # SIGINT, SIGTERM: finish the epoch, checkpoint, exit
        for epoch in range(start, args.epochs + 1):
            m = {"epoch": epoch}
            with run.phase(m, "rollout"):  # 1. the old policy: G images a prompt (DESIGN §2)
                prompts, my_prompts, x0, preds = rollout(run, epoch)
            with run.phase(m, "score"):  # 2. rewards → optimality r per reward (DESIGN §3)
                per_image = [p for p in my_prompts for _ in range(G)]
                final = score_all(run.reward_fns, world.decode(x0), per_image)  # (K, n)
            with run.phase(m, "recast"):  # 3. step scores, gains, W: ReCAST's cost (DESIGN §4-5)
                with_steps = args.weighting in ("recast", "reversed")  # uniform, sum: no gains
                with_steps = with_steps and (epoch - 1) % args.gain_every == 0
                step_scores = score_steps(run, preds, final, per_image) if with_steps else None
                if step_scores is not None:  # --gain-frac of --prompts, on any number of ranks
                    m["groups/scored"] = step_scores.shape[-1] // G
                final, x0 = gather(final), gather(x0, 0)  # every rank now holds every group
                r = optimality(run, final)
                W, gains_ema = weights(run, step_scores, gains_ema, m)
            m.update({f"reward/{n}": final[k].mean().item() for k, n in enumerate(names)})
            g = final.view(len(names), -1, G)  # a constant group: max = min (DESIGN §4)
            m["groups/constant"] = int((g.amax(2) == g.amin(2)).sum())
            note_flat_rewards(run, g, epoch)
            m["W"] = W.tolist()
            m.update(mix_stats(run, final, r, W))  # clamped pairs, largest |A|, signal shares
            with run.phase(m, "update"):  # 4. NFT update, rewards mixed by W (DESIGN §6)
                m["loss"], opt_steps = nft_update(run, epoch, prompts, x0, r, W, opt_steps)
            m["decay"] = min(args.decay_rate * opt_steps, args.decay_cap)  # 5. old policy (§6)
            world.update_old(m["decay"])
            if dist.is_initialized():  # every rank holds the same W, θ and θ_old, bit for bit
                # (--shard: each element of θ and θ_old lives on one rank only, in its shard, and
                # gathering them would move the whole state every epoch: nothing to compare. What
                # each rank computes for itself is W, from the gain EMA: those are compared.)
                held = {"W": W, **world.state_dict()} if not args.shard else {"W": W} | (
                    {"gains_ema": gains_ema} if gains_ema is not None else {})  # fmt: skip
                m["dist/sha256"] = same_on_all_ranks(held, f"after epoch {epoch}")
            last = epoch == args.epochs or stop.agreed()  # 6. eval, log, pictures, checkpoint
            if epoch % args.eval_every == 0 or last:
                with run.phase(m, "eval"):
                    evals(epoch, m)
            with run.observe("save"):  # metrics.jsonl, W.png, checkpoint
                save_epoch(run, m, W, gains_ema, opt_steps, history, last)
            if stop.signum:  # the same on every rank: they stop after the same epoch
                run.log(f"stopped after epoch {epoch}; continue: "
                        f"{checkpoints.resume_command(args.out)}")  # fmt: skip
                break
    if run.rank == 0 and not stop.signum:
        rundir.write_summary(args, history, evals.base, names, run.log)
    if run.views:
        run.views.close()
    if dist.is_initialized():
        dist.barrier()  # until rank 0 has saved: once one rank exits, torchrun stops the others
        dist.destroy_process_group()
    if stop.signum:
        stop.exit()  # 130 after SIGINT, 143 after SIGTERM


FAULTS = (rewards.RewardError, FloatingPointError)  # a run's faults, not the code's: exit 1, a line

if __name__ == "__main__":
    rundir.run_main(main, FAULTS)
