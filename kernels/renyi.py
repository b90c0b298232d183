"""Batched Rényi discriminability per (reward, sampler step) and its gains, one launch (DESIGN §4).

What it computes
----------------
scores (K, T+1, N): reward k on image n's step-i clean prediction (i < T) and on the final image
(i = T); images come in contiguous groups of G (one prompt each), M = N / G groups. Per reward k:

- Optimality of the final images, per group (group_optimality):
  A = (s_T - mean) / (std + 1e-4) clipped to ±A_max (population std), r = 1/2 + A / (2 A_max).
- For each step i, the best linear predictor of r from the step's own scores:
  z = (s_i - mean_group s_i) / (std_group s_T + 1e-4),
  b = Σ z (r - mean_group r) / Σ z²   (pooled over all groups; b = 0 when Σ z² = 0),
  r̂ = clamp(mean_group r + b z, 1e-4, 1).
- Per group, ℓ_j = log r̂_j - log mean_group r̂ and
  D_group = (logsumexp_j(α ℓ_j) - log G) / (α - 1)    (α ≠ 1; any α > 0)
  D_group = mean_j ρ_j log ρ_j,  ρ = r̂ / mean r̂      (α = 1, the KL limit);
  D[k, i] = mean over groups.
- D[k, 0] := 0 exactly (a prediction from pure noise reveals nothing); D[k, T] uses r itself in
  place of r̂, clamped to [1e-4, 1] like r̂ (see below). gains[k, i] = D[k, i+1] - D[k, i], so
  Σ_i gains[k, i] = D[k, T] up to fp32 rounding (the telescoping of DESIGN §4).

Choices beyond DESIGN.md
------------------------
- Zero spread. A group whose final scores are all equal (max == min, which is exact; the computed
  population std of equal numbers need not be exactly 0) has A = 0, r = 1/2, and z = 0 at every
  step: otherwise (s_i - mean)/1e-4 would dominate the pooled Σ z² and zero the slope for every
  other group. Such a group contributes D_group = 0.
- r at the last column. r can be exactly 0 (A = -A_max), where log r = -inf and the KL term
  0·log 0 needs special-casing. D[k, T] clamps r to [1e-4, 1] exactly as r̂ is clamped. This keeps
  every logarithm finite, and makes the last gain exactly 0 when the last step prediction is the
  sample itself (Euler's last step) and no advantage is clipped, since then r̂ = r.

Gradient: none (the gains are statistics of the rollout; nothing is differentiated through them).

Dtypes, launch and where it was checked
---------------------------------------
scores: any float dtype and strides, upcast to fp32 in the kernel; D and gains are fp32.
reference_renyi_gains computes in float64 and returns fp32. The kernel runs one program per
(k, i) pair, grid (K, T+1), in one launch; each program walks its row in tiles of whole groups
(BLOCK_M groups × BLOCK_G members, masked), twice: once for the pooled slope, once for the
divergences. The gains are then one subtraction of shifted views of D.
Checked against reference_renyi_gains under TRITON_INTERPRET=1 on CPU and compiled ahead of time
for sm_80 and sm_90 with triton.compile. Not yet run on a GPU.

Limits
------
group_size ≤ 4096 (a group is one tile row); K·(T+1)·N < 2^31 (int32 offsets). α within about 1e-3
of 1 (but not 1) loses precision to cancellation in fp32: use α = 1 for KL. Non-finite scores are
rejected (a host-device sync).
"""

import math

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. when this module is imported: the
# kernel below is interpreted (and can run on CPU tensors) exactly when this flag is set.
_INTERPRET = triton.knobs.runtime.interpret

_STD_EPS = 1e-4  # added to the group std (DESIGN §3)
_R_MIN = 1e-4  # lower clamp of r̂ and of r at the last column
_MAX_GROUP = 4096
_TILE = 1024  # elements per (groups × members) tile
_NUM_WARPS = 4


def _check_group_size(n: int, group_size: int) -> None:
    if not isinstance(group_size, int) or not 1 <= group_size <= _MAX_GROUP:
        raise ValueError(f"group_size must be an int in [1, {_MAX_GROUP}], got {group_size!r}")
    if n % group_size != 0:
        raise ValueError(f"N = {n} images are not divisible by group_size = {group_size}")


def _check_adv_clip_max(adv_clip_max: float) -> None:
    if not (math.isfinite(adv_clip_max) and adv_clip_max > 0):
        raise ValueError(f"adv_clip_max must be finite and > 0, got {adv_clip_max}")


def group_optimality(
    final_scores: torch.Tensor, group_size: int, adv_clip_max: float = 5.0
) -> torch.Tensor:
    """DESIGN §3: per-group optimality r ∈ [0, 1] of scores (..., N), in the scores' dtype.

    A group whose scores are all equal gets r = 1/2 exactly.
    """
    if not isinstance(final_scores, torch.Tensor) or final_scores.ndim < 1:
        raise ValueError("final_scores must be a tensor of shape (..., N)")
    if not final_scores.is_floating_point():
        raise ValueError(f"final_scores must be a float tensor, got {final_scores.dtype}")
    _check_group_size(final_scores.shape[-1], group_size)
    _check_adv_clip_max(adv_clip_max)
    if not bool(torch.isfinite(final_scores).all()):
        raise ValueError("final_scores contains NaN or inf")
    s = final_scores.unflatten(-1, (-1, group_size))  # (..., M, G)
    centred = s - s.mean(-1, keepdim=True)
    std = s.std(-1, correction=0, keepdim=True)
    adv = (centred / (std + _STD_EPS)).clamp(-adv_clip_max, adv_clip_max)
    flat = s.amax(-1, keepdim=True) == s.amin(-1, keepdim=True)
    adv = torch.where(flat, torch.zeros_like(adv), adv)
    return (0.5 + adv / (2 * adv_clip_max)).flatten(-2)


def _check_inputs(scores, group_size, alpha, adv_clip_max) -> None:
    if not isinstance(scores, torch.Tensor) or scores.ndim != 3 or scores.shape[1] < 2:
        got = tuple(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"scores must be a tensor of shape (K, T+1, N) with T >= 1, got {got}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a float tensor, got {scores.dtype}")
    if scores.numel() >= 2**31:
        raise ValueError("scores must have fewer than 2^31 elements")
    _check_group_size(scores.shape[2], group_size)
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be finite and > 0, got {alpha}")
    _check_adv_clip_max(adv_clip_max)
    if not bool(torch.isfinite(scores).all()):
        raise ValueError("scores contains NaN or inf")


def reference_renyi_gains(
    scores: torch.Tensor, group_size: int, alpha: float = 2.0, adv_clip_max: float = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DESIGN §4 in plain PyTorch (float64): D (K, T+1) and gains (K, T), both fp32."""
    _check_inputs(scores, group_size, alpha, adv_clip_max)
    n_steps = scores.shape[1] - 1
    s = scores.detach().double().unflatten(-1, (-1, group_size))  # (K, T+1, M, G)
    final = s[:, -1:]  # (K, 1, M, G)
    r = group_optimality(scores.detach()[:, -1].double(), group_size, adv_clip_max)
    r = r.unflatten(-1, (-1, group_size))[:, None]  # (K, 1, M, G)
    r_centred = r - r.mean(-1, keepdim=True)
    flat_final = final.amax(-1, keepdim=True) == final.amin(-1, keepdim=True)
    z = (s - s.mean(-1, keepdim=True)) / (final.std(-1, correction=0, keepdim=True) + _STD_EPS)
    z = torch.where(flat_final, 0.0, z)  # (K, T+1, M, G)
    num = (z * r_centred).sum((-2, -1), keepdim=True)
    den = (z * z).sum((-2, -1), keepdim=True)
    slope = torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)  # (K, T+1, 1, 1)
    r_hat = (r.mean(-1, keepdim=True) + slope * z).clamp(_R_MIN, 1.0)
    r_hat[:, n_steps] = r[:, 0].clamp(_R_MIN, 1.0)
    log_ratio = r_hat.log() - r_hat.mean(-1, keepdim=True).log()
    if alpha == 1.0:
        per_group = (log_ratio.exp() * log_ratio).mean(-1)
    else:
        lse = torch.logsumexp(alpha * log_ratio, -1)
        per_group = (lse - math.log(group_size)) / (alpha - 1)
    divergence = per_group.mean(-1)  # (K, T+1)
    divergence[:, 0] = 0.0
    divergence = divergence.float()
    return divergence, divergence[:, 1:] - divergence[:, :-1]


@triton.jit
def _group_tile(
    scores_ptr,  # (K, T+1, N) scores
    k,  # reward
    step,  # sampler step i
    group0,  # first group of the tile
    n_steps,  # T
    n_groups,  # M
    group_size,  # G
    stride_k,  # strides of scores
    stride_i,
    stride_n,
    adv_clip_max,  # A_max
    BLOCK_M: tl.constexpr,  # groups per tile
    BLOCK_G: tl.constexpr,  # power of two ≥ G
):
    """r, group mean of r, z and the masks for BLOCK_M groups; padding stays finite, z = 0 there."""
    # 1. Load final and step scores as (groups × members), masked.
    groups = group0 + tl.arange(0, BLOCK_M)
    members = tl.arange(0, BLOCK_G)
    group_ok = groups < n_groups
    member_ok = members < group_size
    mask = group_ok[:, None] & member_ok[None, :]
    # int32 offsets: the wrapper checks K·(T+1)·N < 2^31.
    cols = (groups[:, None] * group_size + members[None, :]) * stride_n
    final = tl.load(scores_ptr + k * stride_k + n_steps * stride_i + cols, mask=mask, other=0.0)
    final = final.to(tl.float32)
    at_step = tl.load(scores_ptr + k * stride_k + step * stride_i + cols, mask=mask, other=0.0)
    at_step = at_step.to(tl.float32)
    # 2. Group statistics of the final scores; an all-equal group (max == min) is flat.
    final_mean = tl.sum(final, axis=1) / group_size
    final_centred = tl.where(mask, final - final_mean[:, None], 0.0)
    final_std = tl.sqrt(tl.sum(final_centred * final_centred, axis=1) / group_size)
    final_flat = tl.max(tl.where(mask, final, -float("inf")), axis=1) == tl.min(
        tl.where(mask, final, float("inf")), axis=1
    )
    # 3. Optimality r = 1/2 + A / (2 A_max); A = 0 in flat groups.
    adv = final_centred / (final_std[:, None] + 1e-4)
    adv = tl.minimum(tl.maximum(adv, -adv_clip_max), adv_clip_max)
    adv = tl.where(final_flat[:, None], 0.0, adv)
    r = 0.5 + adv / (2.0 * adv_clip_max)
    r_mean = tl.sum(tl.where(mask, r, 0.0), axis=1) / group_size
    # 4. z: step scores centred on their own group mean, scaled by the final scores' std; 0 in flat
    #    groups.
    step_mean = tl.sum(at_step, axis=1) / group_size
    z = (at_step - step_mean[:, None]) / (final_std[:, None] + 1e-4)
    z = tl.where(mask & ~final_flat[:, None], z, 0.0)
    return r, r_mean, z, group_ok, member_ok


@triton.jit
def _renyi_divergence_kernel(
    scores_ptr,  # (K, T+1, N) scores, any float dtype and strides
    divergence_ptr,  # (K, T+1) fp32 output, contiguous
    n_steps,  # T
    n_groups,  # M = N / G
    group_size,  # G
    stride_k,  # strides of scores
    stride_i,
    stride_n,
    alpha,  # Rényi order α > 0
    log_group_size,  # log G
    adv_clip_max,  # A_max
    IS_KL: tl.constexpr,  # α == 1: KL limit
    BLOCK_M: tl.constexpr,  # groups per tile
    BLOCK_G: tl.constexpr,  # power of two ≥ G
):
    # 1. This program's (reward, step); step 0 is 0 by definition.
    k = tl.program_id(0)
    step = tl.program_id(1)
    total = 0.0
    if step > 0:
        # 2. First walk: pooled slope b = Σ z (r - mean r) / Σ z² over all groups.
        num = 0.0
        den = 0.0
        for group0 in range(0, n_groups, BLOCK_M):
            r, r_mean, z, group_ok, member_ok = _group_tile(
                scores_ptr, k, step, group0, n_steps, n_groups, group_size,
                stride_k, stride_i, stride_n, adv_clip_max, BLOCK_M, BLOCK_G,
            )  # fmt: skip
            num += tl.sum(tl.sum(z * (r - r_mean[:, None]), axis=1), axis=0)
            den += tl.sum(tl.sum(z * z, axis=1), axis=0)
        slope = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
        # 3. Second walk: r̂ (r itself at the last column), log-ratios, divergence per group.
        for group0 in range(0, n_groups, BLOCK_M):
            r, r_mean, z, group_ok, member_ok = _group_tile(
                scores_ptr, k, step, group0, n_steps, n_groups, group_size,
                stride_k, stride_i, stride_n, adv_clip_max, BLOCK_M, BLOCK_G,
            )  # fmt: skip
            fitted = tl.where(step == n_steps, r, r_mean[:, None] + slope * z)
            r_hat = tl.minimum(tl.maximum(fitted, 1e-4), 1.0)
            r_hat = tl.where(member_ok[None, :], r_hat, 1.0)  # keeps padding's logs finite
            r_hat_mean = tl.sum(tl.where(member_ok[None, :], r_hat, 0.0), axis=1) / group_size
            log_ratio = tl.log(r_hat) - tl.log(r_hat_mean)[:, None]
            if IS_KL:
                terms = tl.where(member_ok[None, :], tl.exp(log_ratio) * log_ratio, 0.0)
                per_group = tl.sum(terms, axis=1) / group_size
            else:
                scaled = tl.where(member_ok[None, :], alpha * log_ratio, -float("inf"))
                peak = tl.max(scaled, axis=1)
                lse = peak + tl.log(tl.sum(tl.exp(scaled - peak[:, None]), axis=1))
                per_group = (lse - log_group_size) / (alpha - 1.0)
            total += tl.sum(tl.where(group_ok, per_group, 0.0), axis=0)
    # 4. Mean over groups.
    tl.store(divergence_ptr + k * (n_steps + 1) + step, total / n_groups)


def renyi_gains(
    scores: torch.Tensor, group_size: int, alpha: float = 2.0, adv_clip_max: float = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """D (K, T+1) and gains (K, T) of DESIGN §4, fp32.

    Runs the Triton kernel on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1),
    reference_renyi_gains otherwise.
    """
    _check_inputs(scores, group_size, alpha, adv_clip_max)
    if not (scores.is_cuda or _INTERPRET):
        return reference_renyi_gains(scores, group_size, alpha, adv_clip_max)
    n_rewards, n_cols, n = scores.shape
    block_g = triton.next_power_of_2(group_size)
    block_m = min(triton.next_power_of_2(n // group_size), max(1, _TILE // block_g))
    divergence = torch.empty((n_rewards, n_cols), device=scores.device, dtype=torch.float32)
    _renyi_divergence_kernel[(n_rewards, n_cols)](
        scores, divergence, n_cols - 1, n // group_size, group_size, *scores.stride(),
        float(alpha), math.log(group_size), float(adv_clip_max),
        IS_KL=alpha == 1.0, BLOCK_M=block_m, BLOCK_G=block_g,
        num_warps=_NUM_WARPS, enable_fp_fusion=True,
    )  # fmt: skip
    return divergence, divergence[:, 1:] - divergence[:, :-1]


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not _INTERPRET:
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 to check the kernel on CPU")
    gen = torch.Generator().manual_seed(0)
    n_rewards, n_steps, group_size, n_groups = 4, 10, 8, 32
    final = torch.randn(n_rewards, 1, n_groups * group_size, generator=gen)
    fade = torch.linspace(0, 1, n_steps + 1)[None, :, None]  # steps reveal more and more
    noise = torch.randn(n_rewards, n_steps + 1, n_groups * group_size, generator=gen)
    scores = (fade * final + (1 - fade) * noise).to(device)
    for alpha in (2.0, 1.0, 0.5):
        D, gains = renyi_gains(scores, group_size, alpha)
        D_ref, _ = reference_renyi_gains(scores, group_size, alpha)
        profile = " ".join(f"{x:.4f}" for x in D[0].tolist())
        print(f"alpha={alpha}: D[0] = {profile}; max |D - reference| {(D - D_ref).abs().max():.1e}")
    if device.type == "cuda":
        for fn in (renyi_gains, reference_renyi_gains):
            ms = triton.testing.do_bench(lambda fn=fn: fn(scores, group_size))
            print(f"{fn.__name__:22s} K={n_rewards} T={n_steps} N={scores.shape[2]}: {ms:.3f} ms")
