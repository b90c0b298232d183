"""ReCAST — per-reward, timestep-dependent credit assignment for online diffusion RL.

Several rewards train one image model. The user says how much each reward matters (budgets λ);
ReCAST decides *when* during denoising each reward's feedback is spent. Every epoch:
  1. the old policy samples G images per prompt, keeping the clean prediction x̂0 of every step;
  2. each reward's scores become per-group optimality probabilities r (in [0, 1] per reward on
     its own scale; under the default joint normalisation the loss clamps their mix instead);
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
                                         # (its flags, --to and --overwrite: --export RUN --help)

Paper: "ReCAST: Reward Credit Assignment across Timesteps for Online Diffusion Reinforcement"
(arXiv 2609.13425). Loss and old-policy schedule: DiffusionNFT (arXiv 2509.16117).
"""

import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

from plumbing import cli


# ---------------------------------------------------------------------------------------------
# The flags: every one with the default that runs (--help prints them)
# ---------------------------------------------------------------------------------------------
@dataclass
class Args:
    # --- what to train, on what ---
    lam: str = ""
    """reward budgets λ, one per reward in --rewards order, e.g. 0.4,0.2,0.2,0.2 (normalised)"""
    rewards: str = "position,color,sharpness,background"
    """comma-separated reward names or presets (rewards.PRESETS; default: the toy four)"""
    model: str = "toy"
    """'toy' (the tiny model shipped in worlds/toy_model/), a folder holding another toy-world
    transformer (config.json, no model_index.json), or a diffusers pipeline's folder or hub id
    (SD3/SD3.5, FLUX.1, FLUX.2-klein, Qwen-Image: docs/models.md)"""
    prompts_file: str = ""
    """training prompts, one per line (needed with a diffusers --model; the toy world, with a toy
    model folder too, has its own prompts and reads neither prompts file)"""
    eval_prompts_file: str = ""
    """held-out prompts, one per line, for a diffusers --model (default: the last 10%% of
    --prompts-file, which then trains on the rest)"""
    judges: str = ""
    """held-out judges: reward names or presets (paper1-judges, paper2-judges) scored at eval,
    never trained on (default: the world's own, shape,iou in the toy world, none for a diffusers
    model)"""
    # --- ReCAST ---
    weighting: Literal["recast", "flat", "uniform", "sum", "gdpo", "reversed"] = "recast"
    """recast (W from the gains, DESIGN §5) | flat (ReCAST without its timing: the same r,
    W = λ/T) | uniform (W = λ/T on per-reward r) | sum (one reward Σ λ_k s_k, DiffusionNFT's and
    flow_grpo's) | gdpo (one reward: each z-scored in its group, λ-summed, whitened over the
    batch; Flow-Factory's default) | reversed (ReCAST's W with its timesteps in reverse order: a
    placement control); all but recast and reversed score no step prediction (DiffusionNFT's
    cost). Each baseline differs from the default in this one flag (README)"""
    normalize: Literal["unit-joint", "joint", "per-reward", "batch"] = "unit-joint"
    """unit-joint (each reward divided by its within-group spread pooled over the batch, then
    joint: λ weighs rewards in no units, r unchanged when a reward's units change) | joint (every
    reward's centred score divided by the group spread of the λ-weighted raw sum: λ weighs raw
    units, as the summed reward does) | per-reward (each reward's advantage divided by its own
    group spread) | batch (each reward's centred score divided by its pooled spread): DESIGN §3.
    unit-joint is the default because joint let a reward's units decide its share: in the units
    test's archive unit-joint beat joint in 18 of 20 (setting, units, budget) cells and lost none
    (python studies/comparison.py report --study setting5 --out docs, and setting6)
    default: 'unit-joint'; 'per-reward' with --weighting uniform; with --weighting sum only
    unit-joint may be given (the sum of unit-free scores); gdpo takes none"""
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
    sampler)
    default: 1; 0 with --weighting flat, uniform, sum or gdpo (no gains in W)"""
    gain_ema: float = 0.8
    """EMA of the gains across epochs (0: this epoch's gains only)"""
    gain_every: int = 1
    """epochs between gain updates; step predictions are only scored then"""
    gain_frac: float = 1.0
    """fraction of the epoch's --prompts groups whose step predictions are scored for the gains,
    all ranks together and at least one: round(F·--prompts) groups, the same ones on any number of
    GPUs, so W does not depend on the GPU count (docs/results.md, docs/models.md)
    default: 1.0; min(1, 4/--prompts) with a diffusers --model (4 groups an epoch, docs/sd35.md),
    except under --profile (every group)"""
    score_precision: Literal["fp32", "bf16"] = "fp32"
    """fp32 | bf16: the step predictions' scoring for the gains (decode and reward forwards) under
    bf16 autocast, whose peak matmul rate is about 15x fp32's on an H100 (its data sheet, 989 vs
    67 TFLOP/s: benchmarks/scale_check.py's SPEC_TFLOPS); the final scores that train stay fp32
    default: 'fp32'; 'bf16' with a diffusers --model"""
    score_size: int = 0
    """0 (off) | PX: the step predictions scored for the gains are resized (area) to at most PX on
    the long side first, so that a vision-language reward reads fewer image tokens (docs/sd35.md);
    the final scores that train, eval and the judges read the full image. The toy world's rewards
    measure in its pixels: they read the reduced image brought back to the world's size. Off
    until measured on real reward models: in the toy world it moved W about as far as a change of
    seed (docs/results.md)"""
    reward_scale: str = ""
    """factors, one per reward in --rewards order, that multiply its scores before anything reads
    them: the rewards written in other units (docs/results.md, the units test); eval and the
    judges keep each reward's own units; empty: 1 each"""
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
    """(image, timestep) pairs per forward/backward (micro-batch), all ranks together; also the
    images each rank samples per batch in the rollout and at eval"""
    grad_accum: int = 1
    """micro-batches per optimizer step, whose gradient is the mean over all their pairs"""
    train_frac: float = 0.5
    """fraction of the epoch's (image, timestep) pairs trained on, drawn at random each epoch"""
    kl_coef: float = 1.0
    """weight κ of mean((v_θ - v_ref)²), a KL to the frozen base model (docs/recipe.md;
    DiffusionNFT's SD3.5 LoRA setting is 1e-4)"""
    adv_clip_max: float = 5.0
    """A_max of the optimality map r = 1/2 + A/(2 A_max): A is clipped to ±A_max under
    per-reward, --weighting sum and in the gains' r; under joint, batch and unit-joint it is not,
    and the loss clamps each pair's mix r̄ to [0, 1] instead (DESIGN §3)"""
    grad_clip: float = 1.0
    """gradient-norm clip"""
    decay_rate: float = 0.001
    """old policy EMA: d = min(decay_rate · optimizer steps, decay_cap)"""
    decay_cap: float = 0.5
    """cap of the old-policy decay d"""
    # --- diffusers models only ---
    resolution: int = 512
    """image side in pixels, a multiple of the family's latent patch (VAE × patch side); the toy
    world's images are its own 32 px whatever this says"""
    lora_rank: int = 32
    """LoRA rank r of a diffusers --model's adapters, on the family's LORA_TARGETS: the attention
    projections, and in FLUX.1, FLUX.2-klein and Qwen-Image the feed-forward layers too
    (docs/models.md); the toy world trains its whole model"""
    lora_alpha: int = 64
    """a diffusers --model's LoRA alpha (the adapters' scale is alpha / rank)"""
    grad_checkpointing: bool = False
    """trade compute for memory in a diffusers --model's transformer (gradient checkpointing)"""
    shard: bool = False
    """under torchrun: shard the transformer (base weights and adapters) and the text encoders
    across the ranks, layer by layer (FSDP2), instead of a whole copy on every GPU (DDP); for the
    models that do not fit one GPU (docs/models.md)"""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """bf16 | fp32 | auto (bf16 on CUDA, fp32 elsewhere): a diffusers --model's frozen weights
    and forwards; bf16 loads them in bf16 and runs every forward under bf16 autocast, while the
    adapters, their optimizer state and the VAE decode stay fp32 (under --shard FSDP2 gathers in
    bf16 and reduces gradients in fp32); the toy world computes in fp32"""
    guidance: float = 0.0
    """the guidance-embedding input of a guidance-distilled transformer (FLUX.1-dev: 3.5, its
    model card's value); 0: the family has none"""
    # --- run ---
    seed: int = 0
    """seed of prompts, noise and shuffles, and of a diffusers --model's initial LoRA adapters (eval
    noise is fixed whatever the seed)"""
    out: str = ""
    """run folder (default: runs/<time>-<weighting>-s<seed>, runs/<time>-profile-s<seed> with
    --profile)"""
    resume: bool = False
    """continue the run in --out from its last good checkpoint; the flags not given are the run's
    (its args.json), and only those harness.RESUMABLE names may differ (docs/failure_modes.md)"""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda if available); under torchrun each rank on CUDA takes its
    LOCAL_RANK's GPU, whatever N"""
    eval_every: int = 5
    """epochs between evals (and always the base model before epoch 1, the last epoch, and the
    epoch after which SIGINT or SIGTERM stops the run)"""
    eval_seeds: int = 4
    """images per held-out prompt at eval"""
    ckpt_every: int = 1
    """epochs between checkpoints (and always the last, and the epoch after which SIGINT or SIGTERM
    stops the run)"""
    log: str = "none"
    """none | tensorboard | wandb, or several separated by commas (tensorboard,wandb): also log
    every epoch's numbers and pictures to OUT/tensorboard (pip install tensorboard) or to a wandb
    run that --resume continues (pip install wandb; WANDB_MODE=offline works without network)"""
    profile: bool = False
    """train nothing: one rollout of the base model (or --resume's latest policy), its step
    predictions scored, and where each reward is informative and the W that ReCAST would use
    written to --out (profile.png, profile.json); see docs/anatomy.md"""


# --help answers here, before torch and the models' libraries load (a blink, not seconds);
# with --export, the export's flags (plumbing/export.py), not a run's
if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    if cli.given(None, ["export"]):
        from plumbing import export

        export.parse(sys.argv[1:])
    cli.parse(Args, sys.argv[1:], __doc__)

import math

import torch
import torch.distributed as dist

import harness
import rewards
from harness import Run
from plumbing import checkpoints, distributed, plots, reward_profile, rundir, tblog
from plumbing.distributed import gather, same_on_all_ranks
from plumbing.seeding import epoch_generator
from recast_kernels.nft_loss import nft_loss
from recast_kernels.renyi import renyi_gains

# =============================================================================================
# The method, phase by phase. The run's harness (flags' checks, loading, eval, logging,
# checkpoints) is harness.py; the two fused kernels are kernels/.
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# Phase 1 — rollout (DESIGN §2)
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def sample(velocity, noise: torch.Tensor, cond, sigmas: torch.Tensor):
    """Euler from t_0 = 1 to t_T = 0, keeping the clean prediction x̂0_i = x_t_i - t_i·v at
    every step (it costs nothing extra). Returns x0 (N, *latent) and x̂0 (T, N, *latent), one
    image's latent being (C, H, W) or (tokens, channels) (World.latent_shape)."""
    x, preds = noise, []
    for i in range(len(sigmas) - 1):
        v = velocity(x, cond, sigmas[i].expand(len(x)))
        preds.append(x - sigmas[i] * v)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x, torch.stack(preds)


def rollout(run: Run, epoch: int):
    """P prompts × G images from the old policy; this rank samples its share of the groups.
    Returns every rank's prompts, this rank's prompts, x0 (n, *latent) and x̂0 (T, n, *latent)."""
    args, world, G = run.args, run.world, run.args.group_size
    g_prompts, g_noise = epoch_generator(args.seed, epoch, 0), epoch_generator(args.seed, epoch, 1)
    idx = torch.randint(len(world.train_prompts), (args.prompts,), generator=g_prompts)
    prompts = [world.train_prompts[i] for i in idx]  # every rank's, rank-major
    noise = torch.randn(args.prompts * G, *world.latent_shape, generator=g_noise)
    mine = run.share(args.prompts)  # this rank's prompt groups
    my_noise = noise[mine.start * G : mine.stop * G].to(world.device)
    my_cond = world.encode(prompts[mine])  # per prompt: image n belongs to prompt n // G
    old = lambda x, c, t: world.v("old", x, c, t)  # noqa: E731
    x0, preds, n_images = [], [], len(my_noise)
    for s in run.progress(range(0, n_images, args.batch_size), f"epoch {epoch} rollout"):
        n = torch.arange(s, min(s + args.batch_size, n_images), device=world.device)
        x, pred = sample(old, my_noise[n], tuple(c[n // G] for c in my_cond), run.sigmas)
        x0.append(x)
        preds.append(pred)
    return prompts, prompts[mine], torch.cat(x0), torch.cat(preds, 1)


# ---------------------------------------------------------------------------------------------
# Phase 2 — rewards → optimality probabilities r (DESIGN §3)
# ---------------------------------------------------------------------------------------------
def score_all(reward_fns: dict, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """(K, B) scores, one row per reward; NaN/inf is an error naming the reward and the prompt."""
    return torch.stack([rewards.score(n, fn, images, prompts) for n, fn in reward_fns.items()])


def group_optimality(final: torch.Tensor, group_size: int, adv_clip_max: float = 5.0):
    """--normalize per-reward: r (..., N) of scores (..., N) in groups of G images, each reward
    on its own scale. A = (s - mean_group s) / (std_group s + 1e-4), clipped to ±A_max;
    r = 1/2 + A / (2 A_max) ∈ [0, 1]. A group whose scores are all equal has A = 0, r = 1/2."""
    std = final.unflatten(-1, (-1, group_size)).std(-1, correction=0, keepdim=True)
    adv = (group_centred(final, group_size) / (std + 1e-4)).clamp(-adv_clip_max, adv_clip_max)
    return (0.5 + adv / (2 * adv_clip_max)).flatten(-2)


def joint_optimality(final: torch.Tensor, lam: torch.Tensor, group_size: int,
                     adv_clip_max: float = 5.0) -> torch.Tensor:  # fmt: skip
    """--normalize joint (the default): r (K, N), each reward's centred scores divided by the
    group spread of the λ-weighted sum Σ_k λ_k s_k instead of its own:
    A_k = (s_k - mean_group s_k) / (std_group Σ_k λ_k s_k + 1e-4), r_k = 1/2 + A_k / (2 A_max).
    Not clipped per reward: Σ_k λ_k A_k is the summed reward's advantage, and the loss clamps the
    mix r̄ to [0, 1], so W = λ/T gives the summed reward's r̄ (to float rounding). A group whose
    summed score is constant gets r = 1/2 for every reward, as the summed reward does. λ (K,) is
    read as given, summing to 1 as run.lam does (recast_weights normalises its λ; scaling λ here
    scales the spread that divides)."""
    summed = (lam.to(final) @ final).unflatten(-1, (-1, group_size))  # (M, G)
    s = final.unflatten(-1, (-1, group_size))  # (K, M, G)
    std = summed.std(-1, correction=0, keepdim=True)
    adv = (s - s.mean(-1, keepdim=True)) / (std + 1e-4)
    flat = summed.amax(-1, keepdim=True) == summed.amin(-1, keepdim=True)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return (0.5 + adv / (2 * adv_clip_max)).flatten(-2)


def batch_optimality(final: torch.Tensor, group_size: int, adv_clip_max: float = 5.0):
    """--normalize batch: A_k = (s_k - mean_group s_k) / (σ_k + 1e-4), with σ_k the within-group
    spread of reward k pooled over the whole batch, every rank's groups (`final` is gathered):
    √(mean over groups of the group variance). One scale per reward, so λ weighs rewards brought
    to one scale, and a reward's flat groups stay flat. Not clipped per reward, as under joint."""
    centred = group_centred(final, group_size)  # (K, M, G)
    pooled = centred.pow(2).mean((-2, -1), keepdim=True).sqrt()  # (K, 1, 1): pooled_spread
    return (0.5 + centred / (pooled + 1e-4) / (2 * adv_clip_max)).flatten(-2)


def group_centred(final: torch.Tensor, group_size: int) -> torch.Tensor:
    """(..., M, G) each group's scores less their mean, a group whose scores are all equal exactly
    0 (exact, unlike std == 0: its mean's rounding is no advantage)."""
    s = final.unflatten(-1, (-1, group_size))  # (..., M, G)
    flat = s.amax(-1, keepdim=True) == s.amin(-1, keepdim=True)
    return torch.where(flat, 0, s - s.mean(-1, keepdim=True))


def pooled_spread(final: torch.Tensor, group_size: int) -> torch.Tensor:
    """(K, 1) each reward's within-group spread pooled over the batch, √(mean over groups of the
    group variance), a group whose scores are all equal counting exactly 0: batch's σ_k."""
    return group_centred(final, group_size).pow(2).mean((-2, -1)).sqrt()[:, None]


def unit_free(scores: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """Scores (K, ...) divided by each reward's pooled spread (K, 1): numbers in no units. A
    reward flat in every group (spread 0) becomes 0, so its r is 1/2 (harness notes it)."""
    spread = spread.reshape(-1, *[1] * (scores.dim() - 1)).to(scores)
    return torch.where(spread > 0, scores / torch.where(spread > 0, spread, 1), 0)


def unit_joint_optimality(final: torch.Tensor, lam: torch.Tensor, group_size: int,
                          adv_clip_max: float = 5.0) -> torch.Tensor:  # fmt: skip
    """--normalize unit-joint: joint_optimality of the unit-free scores s_k / σ_k (σ_k: batch's
    pooled spread, every rank's groups). Scaling reward k by c > 0 and shifting it by b scales
    σ_k by c and leaves s_k / σ_k's group deviations, hence r, unchanged; the 1e-4 guard now
    meets numbers in no units: 1e-4 of a reward's own spread."""
    return joint_optimality(unit_free(final, pooled_spread(final, group_size)), lam, group_size,
                            adv_clip_max)  # fmt: skip


def gdpo_optimality(final: torch.Tensor, lam: torch.Tensor, group_size: int,
                    adv_clip_max: float = 5.0) -> torch.Tensor:  # fmt: skip
    """--weighting gdpo: GDPO's one advantage (arXiv 2601.05242; Flow-Factory's default
    aggregation), r (1, N). Each reward z-scored within its group, A_k = (s_k - mean_group s_k) /
    max(std_group s_k, 1e-6), λ-summed, then whitened over the whole batch (every rank's groups):
    A = (Σ_k λ_k A_k - mean_batch) / max(std_batch, 1e-6), clipped to ±A_max;
    r = 1/2 + A / (2 A_max). Without the whitening, and with W = λ/T, it is per-reward uniform."""
    s = final.unflatten(-1, (-1, group_size))  # (K, M, G)
    std = s.std(-1, correction=0, keepdim=True).clamp_min(1e-6)
    mixed = lam.to(final) @ (group_centred(final, group_size) / std).flatten(-2)  # (N,)
    white = (mixed - mixed.mean()) / mixed.std(correction=0).clamp_min(1e-6)
    return (0.5 + white.clamp(-adv_clip_max, adv_clip_max) / (2 * adv_clip_max))[None]


def optimality(run: Run, final: torch.Tensor) -> torch.Tensor:
    """r (K, N) of every rank's final scores (K, N) under --normalize; with --weighting sum,
    DiffusionNFT's single reward Σ_k λ_k s_k, normalised per group (1, N), of the raw scores or,
    under unit-joint, of the unit-free ones (= unit-joint with W = λ/T); with --weighting gdpo,
    GDPO's one advantage (1, N)."""
    G, A = run.args.group_size, run.args.adv_clip_max
    if run.args.weighting == "gdpo":
        return gdpo_optimality(final, run.lam, G, A)
    if run.args.weighting == "sum":
        if run.args.normalize == "unit-joint":
            final = unit_free(final, pooled_spread(final, G))
        return group_optimality((run.lam.to(final) @ final)[None], G, A)
    if run.args.normalize == "unit-joint":
        return unit_joint_optimality(final, run.lam, G, A)
    if run.args.normalize == "joint":
        return joint_optimality(final, run.lam, G, A)
    if run.args.normalize == "batch":
        return batch_optimality(final, G, A)
    return group_optimality(final, G, A)


# ---------------------------------------------------------------------------------------------
# Phase 3 — step scores and their gains (DESIGN §4), the weight matrix W (DESIGN §5)
# ---------------------------------------------------------------------------------------------
def trajectory_scores(reward_fns: dict, decode, preds, final, prompts) -> torch.Tensor:
    """(K, T+1, n): reward k on each step prediction x̂0_i and (column T) the final scores. The
    step-0 column is left 0, unscored: a prediction from pure noise is never read (D_k,0 := 0)."""
    steps = [score_all(reward_fns, decode(p), prompts) for p in preds[1:]]
    return torch.stack([torch.zeros_like(steps[0]), *steps, final], 1)


def score_steps(run: Run, preds, final, per_image) -> torch.Tensor:
    """trajectory_scores of --gain-frac of the epoch's groups (cli.scored_groups: the same groups
    on any number of ranks; a rank may score fewer than another, or none), under bf16 autocast
    with --score-precision bf16, at most --score-size px; every rank's, in the groups' order."""
    args, G = run.args, run.args.group_size
    share = lambda r: cli.scored_share(args.gain_frac, args.prompts, run.world_size, r)  # noqa: E731
    n = torch.tensor([g * G + j for g in share(run.rank) for j in range(G)], dtype=torch.long)
    scores = final.new_zeros(len(final), args.steps + 1, 0)  # none of this rank's groups scored
    bf16 = args.score_precision == "bf16"
    with run.observe("steps"), run.autocast(bf16):
        if len(n):
            mine = preds[:, n.to(preds.device)], final[:, n.to(final.device)]
            scores = trajectory_scores(run.reward_fns, run.decode_step, *mine,
                                       [per_image[i] for i in n])  # fmt: skip
    return distributed.gather_uneven(scores, [len(share(r)) * G for r in range(run.world_size)])


# The gains g_k,i = D_k,i+1 - D_k,i of the Rényi discriminability D_k,i (how far step i's
# prediction already tells the reward-tilted policy from the current one) are renyi_gains, a
# fused Triton kernel (kernels/renyi.py; its docstring and reference_renyi_gains write D out).


def shift_gains(gains: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """The gains as W's columns read them (--gain-shift S): column i holds g_k,i-S; the first S
    columns get no gain and the last S gains are dropped. S = 0 returns `gains` itself."""
    if not 0 <= shift < gains.shape[1]:
        raise ValueError(f"shift must be in [0, T) = [0, {gains.shape[1]}), got {shift}")
    if shift == 0:
        return gains
    return torch.cat([gains.new_zeros(gains.shape[0], shift), gains[:, :-shift]], 1)


def gain_profiles(gains: torch.Tensor, floor: float = 0.1, shift: int = 0) -> torch.Tensor:
    """p_k,i = (1 - ε_f)·g⁺_k,i-S / Σ_i g⁺_k,i-S + ε_f / T (negative gains clipped; a reward
    without positive gain is flat): where reward k's information arrives, a profile over steps."""
    g = shift_gains(gains.double(), shift).clamp(min=0)  # (K, T)
    total = g.sum(1, keepdim=True)
    shape = torch.where(total > 0, g / total.clamp(min=1e-300), 1 / g.shape[1])
    return (1 - floor) * shape + floor / g.shape[1]


def recast_weights(gains: torch.Tensor, lam: torch.Tensor, tau: float = 1.0, floor: float = 0.1,
                   shift: int = 0) -> torch.Tensor:  # fmt: skip
    """W (K, T): the Sinkhorn scaling of M_k,i = λ_k·p_k,i^(1/τ) to row sums λ_k and column sums
    1/T, in the log domain and float64 (returned fp32, on the CPU): the entropic transport plan
    that puts each reward's budget where its gains are. Rows with λ_k = 0 stay 0."""
    K, T = gains.shape
    lam = lam.double().cpu()
    lam = lam / lam.sum()  # in float64: the marginals must agree to 1e-12
    live = lam > 0
    log_m = lam[live].log()[:, None] + gain_profiles(gains.cpu(), floor, shift)[live].log() / tau
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


def gain_scores(run: Run, step_scores: torch.Tensor | None, final: torch.Tensor):
    """The step scores (K, T+1, n) the gains read: as scored, or under unit-joint divided by
    each reward's pooled spread of the epoch's final scores (K, N), so that the gains too are
    the same in any units (their 1e-4 guard then meets numbers in no units). None: none scored."""
    if step_scores is None or run.args.normalize != "unit-joint":
        return step_scores
    return unit_free(step_scores, pooled_spread(final, run.args.group_size))


def weights(run: Run, step_scores, gains_ema, metrics: dict):
    """The gains of this epoch's step scores (None: not scored this epoch; gain_scores' units),
    their EMA across epochs, and W (K, T) for --weighting recast | reversed, λ/T for the others.
    Returns (W, gains_ema)."""
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
            metrics["D/cond"] = harness.gain_conditioning(step_scores[:, -1], args.group_size)
        if args.weighting in ("recast", "reversed"):
            W = recast_weights(gains_ema, run.lam, args.tau, args.floor, args.gain_shift)
            return (W.flip(1) if args.weighting == "reversed" else W), gains_ema
        return (run.lam[:, None] / T).expand(K, T).float(), gains_ema


# ---------------------------------------------------------------------------------------------
# Phase 4 — the NFT update, each (image, timestep) pair with its own r̄ (DESIGN §6)
# ---------------------------------------------------------------------------------------------
def nft_loss_readable(v_theta, v_old, x0, noise, t, t_index, r, W, beta=1.0, adv_clip_max=5.0,
                      v_ref=None, kl_coef=0.0) -> torch.Tensor:  # fmt: skip
    """DESIGN §6 written out: N pairs, image n noised to timestep t_n (W's column i_n), r (N, K).
    The loop trains with its drop-in recast_kernels.nft_loss.nft_loss (same arguments and
    defaults, the value and gradient to float rounding: test_method.py), one fused pass instead of
    these tensors."""
    N, T, dtype = v_theta.shape[0], W.shape[1], v_theta.dtype
    v_theta = v_theta.reshape(N, -1)
    v_old, x0, noise = (x.detach().reshape(N, -1) for x in (v_old, x0, noise))
    w = W.detach().to(dtype)[:, t_index.long()].T  # (N, K): each pair's column of W (.long():
    # a uint8 index would select columns as a mask)
    c = w.sum(1)  # (N,): 1/T when W's columns sum to 1/T
    mix = torch.minimum((w * r.detach().to(dtype)).sum(1).clamp_min(0), c)  # r̄·c, in [0, c]
    t = t.detach().to(dtype)[:, None]  # (N, 1)
    x_t = (1 - t) * x0 + t * noise  # the pair's noised image (flow matching, DESIGN §1)
    v_pos = beta * v_theta + (1 - beta) * v_old  # the positive policy, towards high r
    v_neg = (1 + beta) * v_old - beta * v_theta  # the negative one, its mirror about v_old
    e_pos = (x_t - t * v_pos) - x0  # each policy's error on the clean image
    e_neg = (x_t - t * v_neg) - x0
    w_pos = e_pos.detach().abs().mean(1).clamp_min(1e-5)  # adaptive weights: mean |error|
    w_neg = e_neg.detach().abs().mean(1).clamp_min(1e-5)
    loss_pos = (e_pos**2).mean(1) / w_pos
    loss_neg = (e_neg**2).mean(1) / w_neg
    per_pair = T * (mix * loss_pos + (c - mix) * loss_neg) / beta  # r̄ to +, 1 - r̄ to -
    loss = adv_clip_max * per_pair.mean()
    if v_ref is not None:  # κ·mean((v_θ - v_ref)²): a KL to the frozen base model
        loss = loss + kl_coef * ((v_theta - v_ref.detach().reshape(N, -1)) ** 2).mean()
    return loss


def train_weights(run: Run, W: torch.Tensor) -> torch.Tensor:
    """The W the loss reads, rows matching r: --weighting sum and gdpo train their one reward
    with 1/T."""
    one = run.args.weighting in cli.ONE_REWARD
    return W.new_full((1, run.args.steps), 1 / run.args.steps) if one else W


def pair_loss(run: Run, x0, cond, r, W, n, i, eps, counted: bool = True) -> torch.Tensor:
    """The loss summed over this rank's pairs of a micro-batch: images n of x0 (every rank's)
    noised to their timesteps i with fresh ε (eps), the trained, old and reference policies'
    velocities there. Not `counted` (a rank without a pair, given one to stand in): the same
    forwards (collectives under --shard), and 0 with a zero gradient, for DDP's all-reduce and
    FSDP2's reduce-scatter need every rank's, without the loss's kernel."""
    world, args = run.world, run.args
    t, eps, G = run.sigmas[i], eps.to(world.device), args.group_size
    tt = t.view(-1, *[1] * (x0.dim() - 1))  # any latent layout: images or packed tokens
    x_t = (1 - tt) * x0[n] + tt * eps
    c = tuple(cc[n // G] for cc in cond)
    v_theta = world.v("policy", x_t, c, t)
    with torch.no_grad():
        v_old = world.v("old", x_t, c, t)
        v_ref = world.v("ref", x_t, c, t) if args.kl_coef > 0 else None
    if not counted:
        return v_theta.sum() * 0
    loss = run.nft_loss or nft_loss  # the fused kernel: nft_loss_readable's drop-in
    with run.observe("loss"):
        mean = loss(v_theta, v_old, x0[n], eps, t, i, r[:, n].T, W, args.beta,
                    args.adv_clip_max, v_ref, args.kl_coef)  # fmt: skip
    return mean * len(n)  # both terms are means over the pairs


def nft_update(run: Run, epoch: int, prompts, x0, r, W, opt_steps: int):
    """A random --train-frac of the N·T (image, timestep) pairs, shuffled with their timestep
    index, in micro-batches of --batch-size pairs (each rank its share), --grad-accum of them per
    optimizer step. A step's gradient is the mean over its pairs, whatever the ranks' shares:
    each rank's loss is the sum over its pairs divided by the step's count of pairs (times the
    number of ranks, which DDP's and FSDP2's mean over ranks divides out). Returns (the mean over
    micro-batches of their mean loss over every rank's pairs, a tensor; optimizer steps so far)."""
    args, world, T = run.args, run.world, run.args.steps
    W_train, device = train_weights(run, W).to(world.device), world.device
    g_train = epoch_generator(args.seed, epoch, 2)
    N, sums, sizes = x0.shape[0], [], []  # each micro-batch's loss summed over this rank's pairs
    cond = world.encode(prompts)  # all ranks' prompts: any rank may train on any image
    pairs = torch.randperm(N * T, generator=g_train)  # image = pair // T, timestep = pair % T
    pairs = pairs[: max(1, round(args.train_frac * N * T))]  # a random subset, if asked
    per_step = args.batch_size * args.grad_accum  # pairs per optimizer step
    for s in run.progress(range(0, len(pairs), args.batch_size), f"epoch {epoch} update"):
        batch = pairs[s : s + args.batch_size]
        step_end = min(s - s % per_step + per_step, len(pairs))  # this optimizer step's end
        eps = torch.randn(len(batch), *world.latent_shape, generator=g_train)  # fresh ε
        mine = run.share(len(batch))  # this rank's pairs of the micro-batch
        counted = mine.start < mine.stop  # none (a short last micro-batch): one stands in
        mine = mine if counted else slice(0, 1)  # (a model's forward takes no empty batch)
        n, i = (batch[mine] // T).to(device), (batch[mine] % T).to(device)  # i travels with n
        last = s + len(batch) == step_end  # the step's last micro-batch: the ranks reduce
        with distributed.gradient_sync(world, last):  # their gradients then, once a step
            loss = pair_loss(run, x0, cond, r, W_train, n, i, eps[mine], counted)  # rank's sum
            if not loss.is_meta and not torch.isfinite(loss):  # stop before the step: the last
                # checkpoint stays good (meta tensors, benchmarks/memory_plan.py's: shapes only)
                raise FloatingPointError(
                    f"loss is {loss.item()} at epoch {epoch}, optimizer step {opt_steps}; "
                    f"weights not saved, the last good checkpoint in {args.out}/ckpt is kept"
                )
            with run.observe("backward"):  # the step's gradient: the mean over its pairs
                (loss * run.world_size / (step_end - (s - s % per_step))).backward()
        sums.append(loss.detach())
        sizes.append(len(batch))
        if last:
            with run.observe("step"):
                torch.nn.utils.clip_grad_norm_(run.params, args.grad_clip)
                run.optimizer.step()
                run.optimizer.zero_grad(set_to_none=True)
            opt_steps += 1
    sums = gather(torch.stack(sums)[None], 0).sum(0)  # (micro-batches,): every rank's pairs
    return (sums / sums.new_tensor(sizes)).mean(), opt_steps


# ---------------------------------------------------------------------------------------------
# Phase 5 — the old (sampling) policy follows the trained one (DESIGN §6)
# ---------------------------------------------------------------------------------------------
def update_old(run: Run, opt_steps: int) -> float:
    """θ_old ← d·θ_old + (1 - d)·θ with d = min(--decay-rate · optimizer steps, --decay-cap): the
    old policy starts as a copy and lags more as training goes on. Returns d."""
    decay = min(run.args.decay_rate * opt_steps, run.args.decay_cap)
    run.world.update_old(decay)  # the toy model's weights, or the "old" LoRA adapter
    return decay


# ---------------------------------------------------------------------------------------------
# --profile: one rollout, its step predictions scored, the gains and W, and no training
# ---------------------------------------------------------------------------------------------
def profile(run: Run) -> None:
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
    D, gains = renyi_gains(gain_scores(run, step_scores, gather(final)), G, args.alpha,
                           args.adv_clip_max)  # fmt: skip

    def w_of(g, lam):  # the gains' profiles and W (DESIGN §5), float64
        W = recast_weights(g, lam, args.tau, args.floor, args.gain_shift)
        return gain_profiles(g, args.floor, args.gain_shift), W.double()

    p = reward_profile.report(step_scores, D, gains, run.lam, run.names, args, source, w_of)
    p["normalize"] = harness.signal_rule(args)
    p["share"] = harness.signal_share(step_scores[:, -1], run.lam, G, p["normalize"]).tolist()
    p["seconds"] = time.perf_counter() - tic
    distributed.finish()  # every rank's scores are in; the groups go (rundir.end_process)
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
    run = harness.setup(Args, argv, __doc__)  # flags, processes, world, rewards, optimizer: bad
    run.observe = observe  # input exits 2 before anything is written
    if run.args.profile:  # before training: where is each reward informative?
        return profile(run)
    args, world, names, G = run.args, run.world, run.names, run.args.group_size
    ckpt = rundir.start_or_resume(args, world, run.optimizer, run.rank, run.log, run.resolved())
    start, opt_steps, gains_ema, history = ckpt  # a new run, or the last good checkpoint's
    with distributed.lost_rank_exits(args.out):  # a lost rank: exit 1 naming the checkpoint
        evals = harness.EvalSet(run, history, sample)  # fixed held-out set; base model: epoch 0
        distributed.start_training()  # collectives: RECAST_COLLECTIVE_TIMEOUT from here on
        if tblog.targets(args.log) and run.rank == 0:  # TensorBoard, wandb: metrics.jsonl's views
            run.views = tblog.Views(tblog.targets(args.log), args.out, dict(vars(args)), start)
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
                with_steps = args.weighting not in cli.NO_GAINS  # recast, reversed
                with_steps = with_steps and (epoch - 1) % args.gain_every == 0
                step_scores = score_steps(run, preds, final, per_image) if with_steps else None
                if step_scores is not None:  # --gain-frac of --prompts, on any number of ranks
                    m["groups/scored"] = step_scores.shape[-1] // G
                final, x0 = gather(final), gather(x0, 0)  # every rank now holds every group
                r = optimality(run, final)
                W, gains_ema = weights(run, gain_scores(run, step_scores, final), gains_ema, m)
            m.update({f"reward/{n}": final[k].mean().item() for k, n in enumerate(names)})
            g = final.view(len(names), -1, G)  # a constant group: max = min (DESIGN §4)
            m["groups/constant"] = int((g.amax(2) == g.amin(2)).sum())
            harness.note_flat_rewards(run, g, epoch)
            m["W"] = W.tolist()  # below: clamped pairs, largest |A|, each reward's signal share
            m.update(harness.mix_stats(run, final, r, train_weights(run, W)))
            harness.note_shares(run, m, epoch)
            with run.phase(m, "update"):  # 4. NFT update, rewards mixed by W (DESIGN §6)
                loss, opt_steps = nft_update(run, epoch, prompts, x0, r, W, opt_steps)
                m["loss"] = loss.item()
            m["decay"] = update_old(run, opt_steps)  # 5. the old policy follows (DESIGN §6)
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
            last = last or stop.agreed()  # a signal during the eval: this epoch saves and stops
            with run.observe("save"):  # metrics.jsonl, W.png, checkpoint
                profiles = None if gains_ema is None else gain_profiles(
                    gains_ema, args.floor, args.gain_shift)  # fmt: skip
                harness.save_epoch(run, m, W, gains_ema, profiles, opt_steps, history, last)
            if stop.signum:  # the same on every rank: they stop after the same epoch
                run.log(f"stopped after epoch {epoch}; continue: "
                        f"{checkpoints.resume_command(args.out)}")  # fmt: skip
                break
    if run.rank == 0 and not stop.signum:
        rundir.write_summary(args, history, evals.base, names, run.log)
    if run.views:
        run.views.close()
    distributed.finish()  # every rank waits until rank 0 has saved: once one rank exits,
    # torchrun stops the others; then the process groups go (rundir.run_main ends the process)
    if stop.signum:
        stop.exit()  # 130 after SIGINT, 143 after SIGTERM


FAULTS = (rewards.RewardError, FloatingPointError)  # a run's faults, not the code's: exit 1, a line

if __name__ == "__main__":
    rundir.run_main(main, FAULTS)
