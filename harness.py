"""The harness around recast.py's method: what a reader of the method may skip.

The run (`Run`) and what a world gives the loop (`World`); every check of the flags before
anything is loaded or written (`setup`: bad input exits 2 naming the flag); the flags a resumed
run may change and those --profile ignores; the log's diagnostics of the normalisation (each
reward's share of the signal, the loss's clamped pairs); the held-out evaluation with fixed noise,
samples.png, the one log line an epoch and the checkpoint (`save_epoch`). recast.py imports it;
it imports nothing of recast.py: the method's functions it calls (the sampler) are passed in.
"""

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from tqdm import tqdm

import rewards
from plumbing import checkpoints, cli, distributed, eval_images, plots, rundir, tblog
from plumbing.distributed import init_processes, mean_all, resolve_precision, shard_models
from plumbing.plots import timestep_centroid
from plumbing.reward_profile import off_lambda, share_warning
from worlds import hub, toyworld

# A flag's value in runs made before the flag existed (their args.json lacks it).
BEFORE = {
    "gain_shift": 0,
    "normalize": "per-reward",
    "shard": False,
    "precision": "auto",
    "reward_scale": "",
    "score_size": 0,
}

# Flags that may change on --resume; every other one defines the method and must match.
# --precision may be given again, provided it resolves to the run's (check_resumed_precision).
RESUMABLE = {"out", "resume", "device", "epochs", "eval_every", "ckpt_every", "log", "profile",
             "precision"}  # fmt: skip
# Flags of a diffusers --model that the toy world has no use for: given with it, exit 2
DIFFUSERS_ONLY = ["prompts_file", "eval_prompts_file", "guidance", "lora_rank", "lora_alpha",
                  "grad_checkpointing"]  # fmt: skip
# Flags that --profile ignores (it trains and evaluates nothing): a note says so when given
# (--batch-size is not one: its rollout samples in batches of it).
TRAINING_ONLY = ["epochs", "beta", "lr", "grad_accum", "train_frac", "kl_coef",
                 "grad_clip", "decay_rate", "decay_cap", "gain_ema", "gain_every", "eval_every",
                 "eval_seeds", "ckpt_every", "log", "lora_rank", "lora_alpha",
                 "grad_checkpointing"]  # fmt: skip


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

    def decode(self, x0: torch.Tensor) -> torch.Tensor: ...  # (N, 3, H, W) images in [-1, 1]

    def ideal(self, prompts: list[str]) -> torch.Tensor | None: ...  # None: no ideal rendering

    def update_old(self, decay: float) -> None: ...  # θ_old ← d·θ_old + (1-d)·θ

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def shardable(self) -> list[torch.nn.Module]: ...  # --shard's (diffusers worlds only)


@dataclass
class Run:
    """What every phase of recast.py reads: the flags, the rewards and their budgets, this rank,
    the world, the optimizer; and the hooks through which the benchmarks watch or plan the same
    loop (observe, nft_loss, and the methods autocast and progress, which
    benchmarks/memory_plan.py's PlannedRun replaces) instead of copying it."""

    args: object  # recast.Args: the flags
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
    precision: str | None = None  # a diffusers model's, --precision resolved; None: the toy's
    views: tblog.Views | None = None  # rank 0 with --log: TensorBoard, wandb
    said: set = field(default_factory=set)  # notes said once a run (note_flat_rewards, note_shares)
    # A benchmark's hooks. `observe` is entered around each phase and step of the loop by name
    # (rollout, score, recast, steps, weights, update, loss, backward, step, eval, save):
    # benchmarks/scale_check.py times them through it; by default it does nothing. `nft_loss`,
    # when given, replaces the fused loss that recast.pair_loss calls (benchmarks/memory_plan.py's
    # CPU check gives its PyTorch reference, whose memory a CPU allocator can measure).
    observe: Callable[[str], AbstractContextManager] = nullcontext
    nft_loss: Callable[..., torch.Tensor] | None = None

    def resolved(self) -> dict:
        """What the run resolved at its start, kept in args.json beside its flags."""
        return {} if self.precision is None else {"resolved_precision": self.precision}

    def log(self, *a, **k) -> None:  # rank 0 speaks for every rank
        if self.rank == 0:
            print(*a, **k)

    @contextmanager
    def phase(self, metrics: dict, name: str):
        """A phase of the loop: its time (and GPU memory) into metrics, inside the hook."""
        with self.observe(name), timed(metrics, name):
            yield

    def share(self, n: int) -> slice:
        """This rank's share of n items (prompt groups, a micro-batch's pairs, held-out images):
        the ranks' shares in rank order, their sizes one apart at most."""
        return slice(self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size)

    def autocast(self, enabled: bool) -> AbstractContextManager:
        """bf16 autocast on the world's device when `enabled` (--score-precision bf16's scoring);
        benchmarks/memory_plan.py gives its GPU form's, as torch.autocast takes no meta tensors."""
        return torch.autocast(self.world.device.type, torch.bfloat16, enabled=enabled)

    def decode_step(self, x: torch.Tensor) -> torch.Tensor:
        """The images of step predictions x̂0 that the gains' scoring reads: world.decode, at most
        --score-size px on the long side (shrink; the toy world's brought back to its size)."""
        return shrink(self.world.decode(x), self.args.score_size, not is_diffusers(self.args.model))

    def progress(self, starts: range, desc: str):
        """A loop of the method over its batches (their first index): with a progress bar on rank 0.
        benchmarks/memory_plan.py replaces it to run the model on the batches that set a phase's
        peak memory only."""
        return tqdm(starts, desc, leave=False, disable=self.rank > 0)


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


def shrink(images: torch.Tensor, px: int, back: bool = False) -> torch.Tensor:
    """Images (N, 3, H, W) resized by area averaging (a box filter: no aliasing) to at most `px`
    on the long side, the aspect kept; unchanged when px is 0 or they are no larger. `back`:
    then resized bilinearly to (H, W) again, for rewards that measure in the original pixels (the
    toy world's): they read what a px image holds, in their own units."""
    H, W = images.shape[-2:]
    if px <= 0 or max(H, W) <= px:
        return images
    size = (max(1, round(H * px / max(H, W))), max(1, round(W * px / max(H, W))))
    small = torch.nn.functional.interpolate(images, size=size, mode="area")
    if not back:
        return small
    return torch.nn.functional.interpolate(small, size=(H, W), mode="bilinear", align_corners=False)


def is_toy_model(path: str) -> bool:
    """A folder holding a bare SD3 transformer (a retrained toy model), not a whole pipeline."""
    has = lambda name: os.path.isfile(os.path.join(path, name))  # noqa: E731
    return has("config.json") and not has("model_index.json")


def is_diffusers(model: str) -> bool:
    """--model names a diffusers pipeline (a folder or a hub id), not a toy-world model."""
    return model != "toy" and not is_toy_model(model)


def load_world(args, device: torch.device):
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


def check_rewards(args, names: list[str], judges: list[str]) -> None:
    """A diffusers --model is scored by reward models: a toy-world reward or judge exits 2."""
    for flag, given in (("--rewards", names), ("--judges", judges)):
        toy = [n for n in given if n in rewards.TOY]
        real = [p for p, ns in rewards.PRESETS.items() if not set(ns) & rewards.TOY]
        if toy:
            cli.fail(flag, f"{', '.join(toy)} score the toy world's shapes, not {args.model}: "
                     f"choose from {', '.join(rewards.LOADERS)}, or a preset "
                     f"({', '.join(real)})")  # fmt: skip


def check_prompts(args, names: list[str], judges: list[str]) -> None:
    """A reward that reads something from every prompt (rewards.PROMPT_CHECKS: `ocr`, the text in
    double quotes) checks the prompts it will score before any model is loaded: a trained
    reward both files', a judge the held-out ones. One it cannot score exits 2 naming the file's
    flag; it stopped the first scoring (exit 1) once the models had loaded."""
    from worlds import diffusersworld

    train, held = diffusersworld.split_prompts(args.prompts_file, args.eval_prompts_file)
    held_from = ("--eval-prompts-file", args.eval_prompts_file) if args.eval_prompts_file else (
        "--prompts-file", args.prompts_file)  # fmt: skip
    for name, check in rewards.PROMPT_CHECKS.items():
        sets = [("--prompts-file", args.prompts_file, train)] if name in names else []
        if name in names or name in judges:
            sets.append((*held_from, held))
        for flag, path, prompts in sets:
            bad = []
            for prompt in prompts:
                try:
                    check(prompt)
                except rewards.RewardError as e:
                    bad.append(str(e))
            if bad:
                which = "training" if prompts is train else "held-out"
                cli.fail(flag, f"{bad[0]} ({len(bad)} of the {len(prompts)} {which} prompts of "
                         f"{path})")  # fmt: skip


def scoring_defaults(args, argv: list[str] | None) -> dict:
    """A diffusers model's defaults for scoring step predictions (diffusersworld.scoring_defaults)
    on a new run that scores them, for the flags not given; the toy world scores every group in
    fp32 (2 % of its epoch) and --profile every group (that is all it does). Returns what it set.
    The weightings without gains (flat, uniform, sum, gdpo) score nothing: their --gain-shift
    default is 0; uniform's --normalize is per-reward (per-reward uniform), sum's and gdpo's are
    their own (one reward), flat keeps ReCAST's (its ablation)."""
    if args.weighting in cli.NO_GAINS:
        cli.fill_defaults(args, argv, {"gain_shift": 0})
    if args.weighting in ("uniform", *cli.ONE_REWARD):
        cli.fill_defaults(args, argv, {"normalize": "per-reward"})
    if not is_diffusers(args.model) or args.weighting in cli.NO_GAINS:
        return {}
    from worlds import diffusersworld

    values = diffusersworld.scoring_defaults(args.prompts)
    if args.profile:
        values.pop("gain_frac")
    return cli.fill_defaults(args, argv, values)


def setup(flags: type, argv: list[str] | None, doc: str) -> "Run":
    """Flags (the dataclass `flags`, recast.Args; `doc` heads --help), processes, world, rewards,
    optimizer: every check before anything is written (bad input exits 2)."""
    args = cli.parse(flags, argv, doc, BEFORE)
    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if distributed else 1
    if args.weighting == "sum" and cli.given(argv, ["normalize"]) and args.normalize != (
            "unit-joint"):  # fmt: skip
        cli.fail("--normalize", "--weighting sum is one reward, normalised as one: drop "
                 "--normalize for the sum of the raw scores, or give --normalize unit-joint for "
                 "the sum of unit-free ones")  # fmt: skip
    if args.weighting == "gdpo" and cli.given(argv, ["normalize"]):
        cli.fail("--normalize", "--weighting gdpo z-scores each reward in its group and whitens "
                 "their λ-sum over the batch, its own normalisation: drop --normalize")  # fmt: skip
    if args.model != "toy" and is_toy_model(args.model):  # before what it says of the toy world
        not_toy = toyworld.not_a_toy_model(args.model)  # e.g. a pipeline's transformer/ folder
        if not_toy:
            cli.fail("--model", not_toy)
    if args.shard and not is_diffusers(args.model):
        cli.fail("--shard", "the toy world fits any device whole: drop --shard (it is for "
                 "diffusers models, --model)")  # fmt: skip
    if args.precision == "bf16" and not is_diffusers(args.model):
        cli.fail("--precision", "the toy world computes in fp32: drop --precision (it is for "
                 "diffusers models, --model)")  # fmt: skip
    ignored = [] if is_diffusers(args.model) else cli.given(argv, DIFFUSERS_ONLY)
    if ignored:  # e.g. --prompts-file without --model: the toy world would train on its own
        cli.fail(ignored[0], f"is for a diffusers --model; the toy world (--model "
                 f"{args.model}) has its own prompts and trains every weight: give --model "
                 f"PIPELINE, or drop {', '.join(ignored)}")  # fmt: skip
    if args.shard and not distributed:
        cli.fail("--shard", "shards the models across torchrun's processes: launch with "
                 "torchrun --nproc-per-node=N (N ≥ 2), or drop --shard")  # fmt: skip
    chosen = scoring_defaults(args, argv)
    cli.check(args, world_size, RESUMABLE, BEFORE)
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
        check_prompts(args, names, judges)  # what a reward reads from each prompt (ocr's quote)
        _, held_out = diffusersworld.split_prompts(args.prompts_file, args.eval_prompts_file)
        check_held_out(args, len(held_out), world_size)  # before minutes of loading
    if args.resume and not args.profile and rank0:
        rundir.lock_run(args.out)  # another live run in this folder: exit 2, at once
    args.out = args.out or os.path.join(
        "runs",
        time.strftime("%Y%m%d-%H%M%S")
        + f"-{'profile' if args.profile else args.weighting}-s{args.seed}",
    )
    rank, device = init_processes(args, distributed)
    rundir.check_shared_folder(args, rank)  # every rank sees rank 0's --out: else exit 2
    precision = resolve_precision(args, device) if is_diffusers(args.model) else None
    if args.resume and precision is not None:
        check_resumed_precision(args, precision, device, rank0)
    world = load_world(args, device)
    check_held_out(args, len(world.eval_prompts), world_size)  # the toy world's
    if args.shard:  # FSDP2: each rank holds a shard of each layer (docs/models.md); the models
        # were built on the meta device and get their shards' weights once sharded (load_shards)
        shard_models(world.shardable(), device, resolve_precision(args, device),
                     load=world.load_shards)  # fmt: skip
    elif distributed:
        ids = [device.index] if device.type == "cuda" else None
        # find_unused_parameters where some adapters get no gradient (a family's fact; the toy
        # world's parameters all do): DDP would otherwise wait for them at the next forward
        unused = getattr(world, "unused_adapters", False)
        world.policy = torch.nn.parallel.DistributedDataParallel(
            world.trainable, device_ids=ids, find_unused_parameters=unused
        )
    scorers = {}  # the trained rewards, then the held-out judges (default: the world's own)
    for flag, group in (("--rewards", names), ("--judges", judges or world.judge_names)):
        try:  # a reward model missing (file, package, hub access) is bad input too
            scorers.update({n: rewards.get(n, device) for n in group})
        except (ImportError, OSError, ValueError) as e:
            cli.fail(flag, f"could not load a reward model: {e}")
    scale = cli.parse_scale(args.reward_scale, names)
    reward_fns = {n: in_units(scorers[n], f) for n, f in zip(names, scale, strict=True)}
    params = [p for p in world.trainable.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sigmas = world.sigmas(args.steps)
    return Run(args, names, lam, rank, world_size, world, reward_fns, scorers, sigmas, params,
               optimizer, precision)  # fmt: skip


def check_held_out(args, held_out: int, world_size: int) -> None:
    """Every rank evaluates a share of the `held_out` prompts (rank 0 draws its own), and under
    --shard equal shares (its forwards are collectives): else exit 2 naming --eval-prompts-file."""
    if held_out < world_size:
        cli.fail("--eval-prompts-file", f"{held_out} held-out prompts for {world_size} "
                 "processes: hold out at least one per process")  # fmt: skip
    if args.shard and held_out * args.eval_seeds % world_size:
        cli.fail("--eval-prompts-file", f"--shard evaluates equal shares: {held_out} held-out "
                 f"prompts × --eval-seeds {args.eval_seeds} is not a multiple of {world_size} "
                 "processes")  # fmt: skip


def check_resumed_precision(args, precision: str, device: torch.device, rank0: bool) -> None:
    """A resumed diffusers run computes in the precision it was trained in: `precision`, what
    --precision resolves to on `device` now, must be the run's (its args.json's
    resolved_precision), else exit 2 naming both: --precision auto resolves again at every
    launch (bf16 on CUDA, fp32 elsewhere), and --device may change on resume. A run whose
    args.json predates resolved_precision is checked against its explicit --precision, if any."""
    with open(os.path.join(args.out, "args.json")) as f:
        saved = json.load(f)
    was = saved.get("resolved_precision", saved.get("precision", "auto"))
    if was == "auto":  # an older run's auto: the device it ran on is not recorded
        if rank0:
            print(f"note: {args.out}/args.json does not say the precision the run computed in; "
                  f"it continues in {precision} (--precision {args.precision} on "
                  f"{device.type})")  # fmt: skip
        return
    if was != precision:
        cli.fail("--precision", f"the run computed in {was} ({args.out}/args.json) and this "
                 f"launch would compute in {precision} (--precision {args.precision} on "
                 f"{device.type}): add --precision {was} to continue it as it trained, or start "
                 "a new run with another --out")  # fmt: skip


def in_units(fn, factor: float):
    """The reward `fn` with its scores multiplied by `factor` (itself when 1)."""
    if factor == 1:
        return fn
    return lambda images, prompts: fn(images, prompts) * factor


def signal_rule(args) -> str:
    """The normalisation whose signal the loss reads: --normalize, or for --weighting sum (one
    reward Σ λ_k s_k) joint's on raw scores, unit-joint's on unit-free ones, for gdpo per-reward's
    (each reward z-scored in its group before the λ-sum: the batch's whitening scales them all)."""
    if args.weighting == "gdpo":
        return "per-reward"
    if args.weighting == "sum":
        return "unit-joint" if args.normalize == "unit-joint" else "joint"
    return args.normalize


def advantage_ratios(final: torch.Tensor, group_size: int, normalize: str,
                     lam: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """(K, M) reward k's spread in group g over what `normalize` divides its deviations by there
    (joint: the group spread of the λ-weighted sum + 1e-4, 0 where that sum is constant; batch:
    the pooled spread + 1e-4; per-reward: its own + 1e-4; unit-joint: joint's of the unit-free
    scores s_k / σ_k). Since a deviation is at most √(G − 1) spreads (population std),
    |A_k| ≤ √(G − 1) · ratio in every group, before any clip. Under joint and unit-joint the ratio
    is unbounded where the rewards' moves nearly cancel (a small spread of the sum, the rewards'
    own spreads not small): DESIGN §3's bound on the mix."""
    s = final.double().unflatten(-1, (-1, group_size))  # (K, M, G)
    spread = s.std(-1, correction=0)  # (K, M)
    pooled = spread.pow(2).mean(-1, keepdim=True).sqrt()  # (K, 1): batch's σ_k
    if normalize == "unit-joint":  # joint's ratio of the unit-free scores s_k / σ_k
        scale = torch.where(pooled > 0, pooled, 1)  # σ_k = 0: flat in every group, no signal
        s, spread, normalize = s / scale[..., None], spread / scale, "joint"
    if normalize == "joint":  # a group whose λ-sum is constant trains nothing (r = 1/2)
        summed = torch.einsum("k,kmg->mg", lam.to(s), s)
        flat = summed.amax(-1) == summed.amin(-1)  # (M,): its rewards' moves cancel exactly
        return torch.where(flat, 0, spread / (summed.std(-1, correction=0) + 1e-4))
    if normalize == "batch":
        return spread / (pooled + 1e-4)
    return spread / (spread + 1e-4)


def gain_conditioning(final: torch.Tensor, group_size: int) -> float:
    """The largest factor by which a group's z of DESIGN §4 (a step's deviation over the group's
    final spread + 1e-4) exceeds a typical group's: max over rewards and groups that vary of the
    pooled spread σ_k over (the group's spread + 1e-4). A nearly tied group (its final scores
    almost equal, not exactly) has a z that large, dominates the pooled slope, and makes D, the
    gains and W amplify the scores' rounding by about as much (logged as D/cond)."""
    s = final.double().unflatten(-1, (-1, group_size))  # (K, M, G)
    spread = s.std(-1, correction=0)
    pooled = spread.pow(2).mean(-1, keepdim=True).sqrt()
    varies = s.amax(-1) > s.amin(-1)
    ratio = torch.where(varies, pooled / (spread + 1e-4), 0)
    return ratio.max().item() if ratio.numel() else 0.0


def signal_share(final: torch.Tensor, lam: torch.Tensor, group_size: int, normalize: str):
    """Each reward's effective share of the training signal (K,): λ_k times the mean over groups of
    the within-group spread of its advantage A_k under `normalize` (advantage_ratios: joint, its raw
    spread over the λ-weighted sum's; batch, over its pooled spread; per-reward, 1 in every group
    that varies; unit-joint, joint's of the scores over their pooled spreads), summed to 1. The
    signal ReCAST distributes over timesteps is λ's, in no units, under per-reward and batch, and
    λ's of unit-free scores under unit-joint; under joint (and the raw --weighting sum) raw scale
    weighs in too (DESIGN §3). Per-reward's clip of A to ±A_max is not read: it binds only in
    groups of 27 images or more (|A| ≤ √(G − 1))."""
    return share_of(advantage_ratios(final, group_size, normalize, lam), lam)


def share_of(ratios: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """signal_share from advantage_ratios' (K, M): λ_k × the mean over groups, summed to 1."""
    weight = lam.to(torch.float64) * ratios.mean(-1)
    total = weight.sum()
    return weight / total if total > 0 else torch.zeros_like(weight)


def note_flat_rewards(run: "Run", groups: torch.Tensor, epoch: int) -> None:
    """Say once a run that a reward is constant in every group (K, M, G) of an epoch: it trains
    nothing that epoch (r = 1/2 under every normalisation, no NaN: DESIGN §3). Say it too of a
    reward whose within-group spread is out of its scores' dtype's range: its variance under- or
    overflows (fp32: a spread below about 1e-22 or above 2e19), the normalisations read 0 or
    infinity, and it trains nothing as silently; --reward-scale brings it back."""
    same = groups.amax(2) == groups.amin(2)  # (K, M)
    centred = torch.where(same[..., None], 0, groups - groups.mean(2, keepdim=True))
    spread = centred.pow(2).mean((1, 2)).sqrt()  # in the scores' dtype, as the rules compute it
    exact = centred.double().pow(2).mean((1, 2)).sqrt()
    for k, name in enumerate(run.names):
        if ("flat", name) in run.said:
            continue
        if same[k].all():
            run.said.add(("flat", name))
            run.log(f"note: reward {name} is constant in every group at epoch {epoch}: it "
                    "trains nothing while it stays so (said once a run)")  # fmt: skip
        elif not 0 < spread[k] < math.inf and 0 < exact[k] < math.inf:
            run.said.add(("flat", name))
            run.log(f"note: reward {name}'s scores vary by about {exact[k]:.3g} within its groups "
                    f"at epoch {epoch}, a spread whose square {groups.dtype} cannot hold: it reads "
                    "as 0 or infinite and the reward trains nothing; give it --reward-scale to "
                    "bring its spread near 1 (said once a run)")  # fmt: skip


def note_shares(run: "Run", m: dict, epoch: int) -> None:
    """Say once a run, beside λ, each reward's effective share of the signal (mix_stats' share/)
    when one differs from its λ by more than a factor of 2: λ does not say what that reward
    weighs (under joint and the raw summed reward, its raw score scale weighs in: DESIGN §3)."""
    share = [m[f"share/{n}"] for n in run.names]
    off = off_lambda(run.names, run.lam.tolist(), share)
    off = [n for n in off if ("flat", n) not in run.said]  # said already: flat or out of range
    if off and "shares" not in run.said:
        run.said.add("shares")
        pairs = zip(run.names, share, run.lam.tolist(), strict=True)
        run.log(f"epoch {epoch}: each reward's share of the signal (λ): "
                + ", ".join(f"{n} {s:.2f} ({b:.2f})" for n, s, b in pairs))  # fmt: skip
        run.log(share_warning(off, signal_rule(run.args)) + " (said once a run)")


def mix_stats(run: "Run", final: torch.Tensor, r: torch.Tensor, Wt: torch.Tensor) -> dict:
    """What the loss (DESIGN §6) will make of r and W this epoch, for the log: clamp/share, the
    share of (image, timestep) pairs whose mix r̄ = Σ_k W_k,i r_k / Σ_k W_k,i is clamped to
    [0, 1]; adv/max/<reward>, each row's largest |A| = 2 A_max |r - 1/2| (one row 'sum' with
    --weighting sum); share/<reward>, signal_share of the epoch's final scores; adv/cond, the
    largest advantage_ratios entry (|A_k| ≤ √(G − 1) · adv/cond; where it is large, adv/max and the
    spread-divided numbers amplify the scores' rounding by as much: DESIGN §3)."""
    Wt = Wt.to(r)
    mix = (Wt.T @ r) / Wt.sum(0)[:, None]  # (T, N): every pair, trained or not
    out = {"clamp/share": ((mix < 0) | (mix > 1)).double().mean().item()}
    rows = [run.args.weighting] if run.args.weighting in cli.ONE_REWARD else run.names
    adv = (2 * run.args.adv_clip_max * (r - 0.5)).abs().amax(1)
    out.update({f"adv/max/{n}": a.item() for n, a in zip(rows, adv, strict=True)})
    ratios = advantage_ratios(final, run.args.group_size, signal_rule(run.args), run.lam)
    share = share_of(ratios, run.lam)  # signal_share, the ratios computed once
    out.update({f"share/{n}": v.item() for n, v in zip(run.names, share, strict=True)})
    if run.args.weighting not in cli.ONE_REWARD:  # how far a reward's A can exceed the mix's
        out["adv/cond"] = ratios.max().item()
    return out


# ---------------------------------------------------------------------------------------------
# Phase 6 of recast.main: eval on held-out prompts with fixed noise, log, pictures, checkpoint
# ---------------------------------------------------------------------------------------------
EVAL_SEED = 20260929  # the same eval noise for every run, so runs compare on the same images


@torch.no_grad()
def evaluate(sample, world, scorers: dict, prompts: list[str], noise, sigmas, chunk: int,
             which="policy", progress=None):  # fmt: skip
    """Mean score per reward/judge of the policy `which` on (prompts × noise), sampled by
    `sample` (recast.sample) in chunks of `chunk` images, and the images. `progress` (Run's)
    wraps the loop over the chunks."""
    images, starts = [], range(0, len(prompts), chunk)
    for s in progress(starts, "eval") if progress else starts:
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
    ideal rendering's scores where the world has one, and the base model's (epoch 0); images
    drawn by `sample` (recast.sample, the rollout's sampler)."""

    def __init__(self, run: "Run", history: list[dict], sample):
        args, world = run.args, run.world
        self.run, self.sample = run, sample
        prompts = [p for p in world.eval_prompts for _ in range(args.eval_seeds)]
        noise = torch.randn(len(prompts), *world.latent_shape,
                            generator=torch.Generator().manual_seed(EVAL_SEED))  # fmt: skip
        share = run.share(len(prompts))
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
        means, images = evaluate(self.sample, run.world, scorers, self.prompts, self.noise,
                                 run.sigmas, run.args.batch_size, which, run.progress)  # fmt: skip
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


def save_epoch(run: Run, m: dict, W, gains_ema, profiles, opt_steps: int, history: list,
               last: bool):  # fmt: skip
    """Refuse a non-finite metric; append metrics.jsonl, redraw W.png (W and the gain `profiles`,
    None without gains), checkpoint (rank 0)."""
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
