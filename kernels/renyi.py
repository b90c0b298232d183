"""Batched Rényi discriminability per (reward, sampler step) and its gains, one launch (DESIGN §4).

What it computes
----------------
scores (K, T+1, N): reward k on image n's step-i clean prediction (i < T) and on the final image
(i = T); images come in contiguous groups of G (one prompt each), M = N / G groups. Per reward k:

- Optimality of the final images, per group and per reward (ReCAST's recast.group_optimality):
  A = (s_T - mean) / (std + 1e-4) clipped to ±A_max (population std), r = 1/2 + A / (2 A_max).
  The gains always use each reward's own r, whatever normalisation trains.
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
  other group. Such a group contributes D_group = 0 exactly.
- r at the last column. r can be exactly 0 (A = -A_max), where log r = -inf and the KL term
  0·log 0 needs special-casing. D[k, T] clamps r to [1e-4, 1] exactly as r̂ is clamped. This keeps
  every logarithm finite, and makes the last gain 0 when the last step prediction is the sample
  itself (Euler's last step) and no advantage is clipped, since then r̂ = r to the rounding of
  mean r + b z (the test holds it to that rounding).

Gradient: none (the gains are statistics of the rollout; nothing is differentiated through them).
Scores that require a gradient are read detached: D and the gains never require one, on either
path (the custom operator below has no backward to offer).
What uses them: recast.py turns the gains into the weight matrix W of DESIGN §5 (gain_profiles,
recast_weights: a few lines of PyTorch on K·T numbers, no kernel).

Dtypes, launch and synchronisation
----------------------------------
scores: any float dtype and strides, upcast to fp32 in the kernel; D and gains are fp32.
reference_renyi_gains computes in float64 and returns fp32. One launch, grid (K, T): program (k, i)
computes D[k, i] and D[k, i+1] and writes gains[k, i] and D[k, i+1] (program (k, 0) also writes
D[k, 0] = 0). Each D[k, j] is thus computed twice, by programs j-1 and j, with the same code on the
same data: the written D and the gains agree bit for bit, and no program waits for another. Each
program walks the reward's final scores and the two step rows in tiles of whole groups (BLOCK_M
groups × BLOCK_G members, masked) twice: once for the two pooled slopes, once for the divergences.
Offsets are int64, so any strides work (a strided view may reach far beyond K·(T+1)·N elements).
The launch runs under `torch.cuda.device(scores.device)`; no value is read by the host on CUDA.

Value checks
------------
Shapes, dtypes and the arguments are always checked. That the scores are finite is checked only
where it costs no synchronisation: for CPU tensors, or on CUDA when CHECK_VALUES is True
(set on this module, a debugging switch), and never while torch.compile traces or on meta and fake
tensors, which have no values to read. Without it, a NaN or inf among the final scores or the
scores of step i ≥ 1 of reward k makes D[k, i] NaN, and the gains next to it
(the step-0 scores are never read: D[k, 0] is 0 by definition).

Tracing, torch.compile and memory plans
---------------------------------------
The launch runs inside a torch.library custom operator, recast::renyi_gains, whose fake
implementation makes the same two outputs and launches nothing. torch.compile(fullgraph=True)
keeps it as one node of its graph (no graph break; D and the gains equal eager's bit for bit), and
FakeTensorMode and meta tensors run the fake implementation: D (K, T+1) and gains (K, T), fp32,
no launch, no value read. Meta tensors take this path even where the kernel cannot run (no GPU, no
TRITON_INTERPRET). Needs torch >= 2.4 (torch.library.custom_op) and triton >= 3.4 (triton.knobs,
read at import).

Precision on a GPU
------------------
Compiled for NVIDIA, fp32 division is div.full.f32 (within 2 ulp) and tl.exp is ex2.approx
(about 2 ulp, plus the rounding of x·log2 e); tl.log is libdevice's logf and the group std uses a
correctly rounded square root. The tests hold D and the gains to at most twice the error of the
same algorithm run in fp32 on the CPU, plus 64 fp32 ulp scaled by (1 + α)/|α - 1| (how much the
divergence amplifies a log-ratio error; 1 for KL). Checked against reference_renyi_gains under
TRITON_INTERPRET=1 on CPU and compiled ahead of time for sm_80 and sm_90 with triton.compile; on
one H200 (triton 3.6) the same tests pass on CUDA (docs/kernels.md of the ReCAST repository has
the timings). torch.compile (backends eager, aot_eager and inductor), FakeTensorMode and meta
tensors were checked on CPU (torch 2.13) and on one H200 (torch 2.11).

Limits
------
group_size ≤ 4096 (a group is one tile row). α within about 1e-3 of 1 (but not 1) loses precision
to cancellation in fp32: use α = 1 for KL. The kernel reads the scores in fp32 and squares their
deviations from the group mean: a float64 score beyond fp32's range reads as inf (D NaN, although
the finiteness check passed), and a group whose deviations exceed about 1e19 overflows its spread
to inf, so that it reads as uninformative (D_group = 0) where the float64 reference does not.
Scores in any reward's units are far from either.
"""

import math

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

# Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. when this module is imported: the
# kernel below is interpreted (and can run on CPU tensors) exactly when this flag is set.
_INTERPRET = triton.knobs.runtime.interpret

# Debugging switch: True checks that scores are finite on CUDA too, at the cost of a host sync.
CHECK_VALUES = False

_STD_EPS = 1e-4  # added to the group std (DESIGN §3)
_R_MIN = 1e-4  # lower clamp of r̂ and of r at the last column
_MAX_GROUP = 4096
_TILE = 1024  # elements per (groups × members) tile
_NUM_WARPS = 4


def _traced(x: torch.Tensor) -> bool:
    """Whether a call on x is traced rather than run: under torch.compile, under a
    TorchDispatchMode (FakeTensorMode, make_fx, a memory tracer), or on a tensor without data
    (meta, fake). A traced call reads no value (under torch.compile a read is a data-dependent
    guard: a graph break, an error with fullgraph=True; meta and fake tensors have none), so it
    skips the value checks and gets what CUDA gives without CHECK_VALUES."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or x.is_meta or is_fake(x)


def _check_group_size(n: int, group_size: int) -> None:
    if not isinstance(group_size, int) or not 1 <= group_size <= _MAX_GROUP:
        raise ValueError(f"group_size must be an int in [1, {_MAX_GROUP}], got {group_size!r}")
    if n % group_size != 0:
        raise ValueError(f"N = {n} images are not divisible by group_size = {group_size}")


def _check_adv_clip_max(adv_clip_max: float) -> None:
    if not 0 < adv_clip_max < math.inf:  # not math.isfinite: see _check_inputs
        raise ValueError(f"adv_clip_max must be finite and > 0, got {adv_clip_max}")


def _group_optimality(s: torch.Tensor, group_size: int, adv_clip_max: float) -> torch.Tensor:
    """r (..., N) of the final scores (..., N): each reward's own per-group optimality."""
    s = s.unflatten(-1, (-1, group_size))  # (..., M, G)
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
    if scores.shape[0] == 0 or scores.shape[2] == 0:
        raise ValueError(f"scores must have K >= 1 and N >= 1, got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a float tensor, got {scores.dtype}")
    _check_group_size(scores.shape[2], group_size)
    # Comparisons rather than math.isfinite, which torch.compile(dynamic=True) cannot apply to the
    # symbolic floats it passes; NaN fails every comparison.
    if not 0 < alpha < math.inf:
        raise ValueError(f"alpha must be finite and > 0, got {alpha}")
    _check_adv_clip_max(adv_clip_max)
    if (scores.device.type == "cpu" or CHECK_VALUES) and not _traced(scores):  # CUDA: a sync
        if not bool(torch.isfinite(scores).all()):
            raise ValueError("scores contains NaN or inf")


def _reference_gains(scores, group_size, alpha, adv_clip_max, dtype=torch.float64):
    """DESIGN §4 in plain PyTorch at `dtype`, without checks: D (K, T+1) and gains (K, T), fp32.
    reference_renyi_gains runs it in float64; the tests also run it in float32 to measure what
    fp32 arithmetic costs."""
    n_steps = scores.shape[1] - 1
    s = scores.detach().to(dtype).unflatten(-1, (-1, group_size))  # (K, T+1, M, G)
    final = s[:, -1:]  # (K, 1, M, G)
    r = _group_optimality(scores.detach()[:, -1].to(dtype), group_size, adv_clip_max)
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


def reference_renyi_gains(
    scores: torch.Tensor, group_size: int, alpha: float = 2.0, adv_clip_max: float = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DESIGN §4 in plain PyTorch (float64): D (K, T+1) and gains (K, T), both fp32."""
    _check_inputs(scores, group_size, alpha, adv_clip_max)
    return _reference_gains(scores, group_size, alpha, adv_clip_max)


@triton.jit
def _final_tile(
    final_ptr,  # scores of reward k at the last column, offset to that row
    group0,  # first group of the tile
    n_groups,  # M
    group_size,  # G
    stride_n,  # stride of scores along N
    adv_clip_max,  # A_max
    BLOCK_M: tl.constexpr,  # groups per tile
    BLOCK_G: tl.constexpr,  # power of two ≥ G
):
    """Offsets, masks, r, group mean of r, std + eps and flatness of BLOCK_M groups' final scores;
    also Σ 0·s (0, or NaN when a score is not finite)."""
    # 1. Load the final scores as (groups × members), masked; int64 offsets.
    groups = group0 + tl.arange(0, BLOCK_M)
    members = tl.arange(0, BLOCK_G)
    group_ok = groups < n_groups
    member_ok = members < group_size
    mask = group_ok[:, None] & member_ok[None, :]
    cols = (groups[:, None].to(tl.int64) * group_size + members[None, :]) * stride_n
    final = tl.load(final_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # 2. Group statistics; an all-equal group (max == min) is flat.
    final_mean = tl.sum(final, axis=1) / group_size
    final_centred = tl.where(mask, final - final_mean[:, None], 0.0)
    spread = tl.sqrt_rn(tl.sum(final_centred * final_centred, axis=1) / group_size) + 1e-4
    final_flat = tl.max(tl.where(mask, final, -float("inf")), axis=1) == tl.min(
        tl.where(mask, final, float("inf")), axis=1
    )
    # 3. Optimality r = 1/2 + A / (2 A_max); A = 0 in flat groups.
    adv = final_centred / spread[:, None]
    adv = tl.minimum(tl.maximum(adv, -adv_clip_max), adv_clip_max)
    adv = tl.where(final_flat[:, None], 0.0, adv)
    r = 0.5 + adv / (2.0 * adv_clip_max)
    r_mean = tl.sum(tl.where(mask, r, 0.0), axis=1) / group_size
    poison = tl.sum(tl.sum(final * 0.0, axis=1), axis=0)
    return cols, mask, group_ok, member_ok, r, r_mean, spread, final_flat, poison


@triton.jit
def _step_z(step_ptr, cols, mask, spread, final_flat, group_size):
    """z of one step row: scores centred on their group mean over the final spread; 0 in flat
    groups and padding. Also Σ 0·s (0, or NaN when a score is not finite)."""
    at_step = tl.load(step_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    step_mean = tl.sum(at_step, axis=1) / group_size
    z = (at_step - step_mean[:, None]) / spread[:, None]
    z = tl.where(mask & ~final_flat[:, None], z, 0.0)
    return z, tl.sum(tl.sum(at_step * 0.0, axis=1), axis=0)


@triton.jit
def _group_divergence(
    r, r_mean, z, slope, is_last, member_ok, group_ok, alpha, group_size, IS_KL: tl.constexpr
):
    """Σ over the tile's groups of D_group, with r̂ = clamp(mean r + b z) (r itself if is_last)."""
    fitted = tl.where(is_last, r, r_mean[:, None] + slope * z)
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
        sum_exp = tl.sum(tl.exp(scaled - peak[:, None]), axis=1)
        # log Σ - log G with both logs taken here: exactly 0 for a flat group (Σ = G exactly).
        log_g = tl.log(r_hat_mean * 0.0 + group_size)
        per_group = (peak + (tl.log(sum_exp) - log_g)) / (alpha - 1.0)
    return tl.sum(tl.where(group_ok, per_group, 0.0), axis=0)


@triton.jit(do_not_specialize=["n_steps"])  # a real i32 even when T = 1: .to(tl.int64) below
def _renyi_gains_kernel(
    scores_ptr,  # (K, T+1, N) scores, any float dtype and strides
    divergence_ptr,  # (K, T+1) fp32 output, contiguous
    gains_ptr,  # (K, T) fp32 output, contiguous
    n_steps,  # T
    n_groups,  # M = N / G
    group_size,  # G
    stride_k,  # strides of scores
    stride_i,
    stride_n,
    alpha,  # Rényi order α > 0
    adv_clip_max,  # A_max
    IS_KL: tl.constexpr,  # α == 1: KL limit
    BLOCK_M: tl.constexpr,  # groups per tile
    BLOCK_G: tl.constexpr,  # power of two ≥ G
):
    # 1. This program's reward k and its two columns: a = i (D = 0 when i = 0) and b = i + 1.
    k = tl.program_id(0).to(tl.int64)
    step_a = tl.program_id(1)
    step_b = step_a + 1
    base = scores_ptr + k * stride_k
    final_ptr = base + n_steps.to(tl.int64) * stride_i
    a_ptr = base + step_a.to(tl.int64) * stride_i
    b_ptr = base + step_b.to(tl.int64) * stride_i
    # 2. First walk: the pooled slopes b = Σ z (r - mean r) / Σ z² of both columns.
    num_a = 0.0
    den_a = 0.0
    num_b = 0.0
    den_b = 0.0
    poison_a = 0.0
    poison_b = 0.0
    for group0 in range(0, n_groups, BLOCK_M):
        cols, mask, group_ok, member_ok, r, r_mean, spread, flat, poison = _final_tile(
            final_ptr, group0, n_groups, group_size, stride_n, adv_clip_max, BLOCK_M, BLOCK_G
        )
        mask_a = mask & (cols * 0 < step_a)  # column a is read when i > 0 (a tile, not a scalar:
        z_a, poison_za = _step_z(a_ptr, cols, mask_a, spread, flat, group_size)  # interpreter)
        z_b, poison_zb = _step_z(b_ptr, cols, mask, spread, flat, group_size)
        r_centred = r - r_mean[:, None]
        num_a += tl.sum(tl.sum(z_a * r_centred, axis=1), axis=0)
        den_a += tl.sum(tl.sum(z_a * z_a, axis=1), axis=0)
        num_b += tl.sum(tl.sum(z_b * r_centred, axis=1), axis=0)
        den_b += tl.sum(tl.sum(z_b * z_b, axis=1), axis=0)
        poison_a += poison + poison_za
        poison_b += poison + poison_zb
    slope_a = tl.where(den_a > 0, num_a / tl.where(den_a > 0, den_a, 1.0), 0.0)
    slope_b = tl.where(den_b > 0, num_b / tl.where(den_b > 0, den_b, 1.0), 0.0)
    # 3. Second walk: r̂ (r itself at the last column), log-ratios, divergence per group.
    total_a = 0.0
    total_b = 0.0
    for group0 in range(0, n_groups, BLOCK_M):
        cols, mask, group_ok, member_ok, r, r_mean, spread, flat, poison = _final_tile(
            final_ptr, group0, n_groups, group_size, stride_n, adv_clip_max, BLOCK_M, BLOCK_G
        )
        mask_a = mask & (cols * 0 < step_a)
        z_a, poison_za = _step_z(a_ptr, cols, mask_a, spread, flat, group_size)
        z_b, poison_zb = _step_z(b_ptr, cols, mask, spread, flat, group_size)
        total_a += _group_divergence(
            r, r_mean, z_a, slope_a, step_a == n_steps, member_ok, group_ok, alpha, group_size,
            IS_KL,
        )  # fmt: skip
        total_b += _group_divergence(
            r, r_mean, z_b, slope_b, step_b == n_steps, member_ok, group_ok, alpha, group_size,
            IS_KL,
        )  # fmt: skip
    # 4. Means over groups (NaN if a score read was not finite); D[k, 0] = 0 by definition.
    d_a = tl.where(step_a > 0, total_a / n_groups + poison_a, 0.0)
    d_b = total_b / n_groups + poison_b
    tl.store(divergence_ptr + k * (n_steps + 1) + step_b, d_b)
    tl.store(gains_ptr + k * n_steps + step_a, d_b - d_a)
    if step_a == 0:
        tl.store(divergence_ptr + k * (n_steps + 1), 0.0)


def _launch(scores, group_size, alpha, adv_clip_max, launch):
    """The kernel, without checks; with launch=False the same allocations only (the fake
    implementation: tensors without data)."""
    n_rewards, n_cols, n = scores.shape
    divergence = torch.empty((n_rewards, n_cols), device=scores.device, dtype=torch.float32)
    gains = torch.empty((n_rewards, n_cols - 1), device=scores.device, dtype=torch.float32)
    if not launch:
        return divergence, gains
    block_g = 1 << (group_size - 1).bit_length()  # next powers of two (triton's: slow from Python)
    block_m = min(1 << (n // group_size - 1).bit_length(), max(1, _TILE // block_g))
    with torch.cuda.device(scores.device.index if scores.is_cuda else -1):
        _renyi_gains_kernel[(n_rewards, n_cols - 1)](
            scores, divergence, gains, n_cols - 1, n // group_size, group_size, *scores.stride(),
            alpha, adv_clip_max,
            IS_KL=alpha == 1.0, BLOCK_M=block_m, BLOCK_G=block_g,
            num_warps=_NUM_WARPS, enable_fp_fusion=True,
        )  # fmt: skip
    return divergence, gains


# The launch as a torch.library custom operator with a fake implementation (the same allocations,
# no launch), which meta tensors, FakeTensorMode and torch.compile's tracing run (see the header).
# torch.library.triton_op would let Inductor see into the launch, but under TRITON_INTERPRET its
# fake implementation would run the interpreter on tensors without data.
@torch.library.custom_op("recast::renyi_gains", mutates_args=())
def _renyi_gains_op(
    scores: torch.Tensor, group_size: int, alpha: float, adv_clip_max: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on checked inputs: (D, gains)."""
    return _launch(scores, group_size, alpha, adv_clip_max, True)


@_renyi_gains_op.register_fake
def _renyi_gains_fake(*args):
    return _launch(*args, False)


def renyi_gains(
    scores: torch.Tensor, group_size: int, alpha: float = 2.0, adv_clip_max: float = 5.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """D (K, T+1) and gains (K, T) of DESIGN §4, fp32.

    Runs the Triton kernel on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1),
    reference_renyi_gains otherwise. One launch, no host-device sync on CUDA (see CHECK_VALUES).
    Meta tensors take the kernel's path without launching it (for memory plans), as do fake
    tensors of a device where the kernel runs; torch.compile(fullgraph=True) traces it without a
    break.
    """
    alpha, adv_clip_max = float(alpha), float(adv_clip_max)  # the op's types
    _check_inputs(scores, group_size, alpha, adv_clip_max)
    scores = scores.detach()  # as the reference: outputs without a backward that would fail
    if not (scores.is_cuda or scores.is_meta or _INTERPRET):
        return _reference_gains(scores, group_size, alpha, adv_clip_max)
    return _renyi_gains_op(scores, group_size, alpha, adv_clip_max)


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
