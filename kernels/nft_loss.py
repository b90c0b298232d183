"""Fused per-timestep weighted DiffusionNFT loss, forward and backward in one pass pair (DESIGN §6).

What it computes
----------------
For N images at training timesteps t_n (flattened to (N, D)), with K rewards mixed by a weight
matrix W (K, T) at the image's timestep index i_n = t_index[n]:

    a_n = Σ_k W[k, i_n] r[n, k]            c_n = Σ_k W[k, i_n]
    x_t = (1 - t) x0 + t ε                 (ε = noise)
    v⁺ = β vθ + (1 - β) v_old              v⁻ = (1 + β) v_old - β vθ
    e± = (x_t - t v±) - x0                 w± = max(mean_d |e±|, 1e-5)   (no gradient)
    L± = mean_d (e±)² / w±                 ℓ_n = T [a_n L⁺ + (c_n - a_n) L⁻] / β
    loss = A_max · mean_n ℓ_n  +  κ · mean_n mean_d (vθ - v_ref)²      (κ term only with v_ref)

Substituting x_t, the errors are e± = t·f± with f± = u ∓ β δ, u = ε - x0 - v_old and
δ = vθ - v_old. The kernel therefore sums |f±| and (f±)² per row and puts t back in per row:
w± = max(t · mean|f±|, 1e-5), mean (e±)² = t² mean (f±)².

Gradient (derivation)
---------------------
w± is a constant (detached). ∂e⁺/∂vθ = -tβ and ∂e⁻/∂vθ = +tβ, elementwise, so
∂L⁺/∂vθ_d = -2tβ e⁺_d / (D w⁺) and ∂L⁻/∂vθ_d = +2tβ e⁻_d / (D w⁻). Multiplying by T/β and the
weights, β cancels:

    ∂loss/∂vθ[n, d] = (A_max / N) (2 t T / D) [-a e⁺/w⁺ + (c - a) e⁻/w⁻] + (2κ / (N D)) (vθ - v_ref)

Everything that multiplies e± is a per-row scalar, so once w± are known the gradient is one
elementwise pass. The kernel computes it during the forward (Liger-Kernel style) and the
backward only scales it by grad_output.

Algorithm and memory traffic
----------------------------
Rows are split into chunks so that short batches of long rows (N = 16, D = 2^18) still fill the GPU.
- Pass 1, grid (N, n_chunks): read vθ, v_old, x0, ε (and v_ref) once, write 4 (5) fp32 partial
  sums per (row, chunk) into a small (N, 5, n_chunks) buffer.
- Pass 2, grid (N, n_chunks): every program reduces its row's partial sums (at most 64 chunks),
  forms a, c, w±, the row's loss and the per-row gradient coefficients; the chunk-0 program writes
  the row's loss, and all programs read the inputs a second time and write the gradient.
The chunking aims at about 4 programs per SM: N = 16 rows of D = 2^18 on a 132-SM GPU become
16 × 32 programs of 8192 elements each; N in the thousands gives one chunk per row.
The loss is the sum of the N row losses (one small torch reduction). Bytes per element of (N, D):
2·n_in reads + 1 write (n_in = 4, or 5 with v_ref and κ ≠ 0; with κ = 0 v_ref is never read),
against n_in + 1 for reading everything once: the gradient needs w±, i.e. the whole row, so a
single pass would have to hold rows on chip. The second read is served from L2 when the inputs fit
there (SD3.5-Medium at 1024 px in bf16: 4 × 8 MiB, within an H100's 50 MB).
The gradient is written in vθ's dtype: autograd would cast an fp32 gradient to vθ's dtype anyway
(an extra pass and an fp32 N×D temporary), and it halves the bytes written for bf16/fp16. It is
computed in fp32 and rounded once. No other N×D temporary is allocated and nothing is written into
the caller's tensors. When vθ does not need a gradient, pass 2 skips the gradient write.
The backward returns the stored gradient as is when grad_output == 1 (the usual loss.backward();
the comparison is a host-device sync) and otherwise returns a scaled copy.

Dtypes and layouts
------------------
vθ, v_old, x0, ε, v_ref: fp32, bf16 or fp16, one dtype and device, any shape (N, ...). They are
viewed as (N, D) with reshape(N, -1), which copies only when no such view exists (e.g. channels-last
tensors); a view whose last dimension is strided (e.g. a transposed tensor) is made contiguous.
Rows may be strided (e.g. x[::2]): no copy. All arithmetic is fp32. t: (N,) float, t_index: (N,)
integer in [0, T), r: (N, K) float, W: (K, T) float, any strides. The loss is returned as an fp32
scalar. reference_nft_loss computes in vθ's dtype (t, r and W are cast to it), i.e. it is the
plain-PyTorch loss at the inputs' precision, and returns a scalar of that dtype.

Where it was checked
--------------------
Checked against reference_nft_loss under TRITON_INTERPRET=1 on CPU (fp32, bf16, fp16; realistic,
odd and multi-chunk shapes; strided views) and compiled ahead of time for sm_80 and sm_90 with
triton.compile. Not yet run on a GPU.

Limits
------
D from 1 to any size (int64 offsets); N up to millions. The validation of t_index is a host-device
sync. t is not checked to lie in (0, 1], nor r in [0, 1]. With v_ref=None, kl_coef is ignored.
"""

import math

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. when this module is imported: the
# kernels below are interpreted (and can run on CPU tensors) exactly when this flag is set.
_INTERPRET = triton.knobs.runtime.interpret

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NUM_STATS = 5  # Σ|f⁺|, Σ|f⁻|, Σ(f⁺)², Σ(f⁻)², Σ(vθ - v_ref)²
_MAX_CHUNKS = 64  # pass 2 re-reduces up to this many partial sums per program
_NUM_WARPS = 4


def _check_inputs(
    v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
) -> tuple[int, int]:
    """Raise ValueError naming the offending argument; return (N, T)."""
    if not isinstance(v_theta, torch.Tensor) or v_theta.ndim < 1 or v_theta.shape[0] == 0:
        raise ValueError("v_theta must be a tensor of shape (N, ...) with N > 0")
    if v_theta.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"v_theta must be float32, bfloat16 or float16, got {v_theta.dtype}")
    n = v_theta.shape[0]
    named = {"v_old": v_old, "x0": x0, "noise": noise}
    if v_ref is not None:
        named["v_ref"] = v_ref
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or x.shape != v_theta.shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have v_theta's shape {tuple(v_theta.shape)}, got {got}")
        if x.dtype != v_theta.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, v_theta has {v_theta.dtype}")
    small = {"t": (t, 1), "t_index": (t_index, 1), "r": (r, 2), "W": (W, 2)}
    for name, (x, ndim) in small.items():
        if not isinstance(x, torch.Tensor) or x.ndim != ndim:
            raise ValueError(f"{name} must be a {ndim}-d tensor")
    for name, x in {**named, **{k: v for k, (v, _) in small.items()}}.items():
        if x.device != v_theta.device:
            raise ValueError(f"{name} is on {x.device}, v_theta on {v_theta.device}")
    if t.shape[0] != n or not t.is_floating_point():
        raise ValueError(f"t must be a float tensor of shape ({n},), got {tuple(t.shape)}")
    if t_index.shape[0] != n or t_index.is_floating_point() or t_index.dtype == torch.bool:
        raise ValueError(f"t_index must be an integer tensor of shape ({n},)")
    if r.shape[0] != n or not r.is_floating_point():
        raise ValueError(f"r must be a float tensor of shape ({n}, K), got {tuple(r.shape)}")
    if not W.is_floating_point() or W.shape[0] != r.shape[1] or W.shape[1] == 0:
        raise ValueError(
            f"W must be a float tensor of shape (K, T), K = {r.shape[1]}, got {W.shape}"
        )
    n_steps = W.shape[1]
    if bool(((t_index < 0) | (t_index >= n_steps)).any()):
        raise ValueError(f"t_index must lie in [0, T) with T = W.shape[1] = {n_steps}")
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta must be finite and > 0, got {beta}")
    if not (math.isfinite(adv_clip_max) and adv_clip_max > 0):
        raise ValueError(f"adv_clip_max must be finite and > 0, got {adv_clip_max}")
    if not (math.isfinite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef}")
    return n, n_steps


def reference_nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    t_index: torch.Tensor,
    r: torch.Tensor,
    W: torch.Tensor,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    v_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """DESIGN §6 in plain PyTorch (autograd), at v_theta's precision; differentiable in v_theta."""
    n, n_steps = _check_inputs(
        v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
    )
    dtype = v_theta.dtype
    v_theta = v_theta.reshape(n, -1)
    v_old, x0, noise = (x.detach().reshape(n, -1) for x in (v_old, x0, noise))
    w_cols = W.detach().to(dtype)[:, t_index].T  # (N, K): each image's column of W
    a = (w_cols * r.detach().to(dtype)).sum(1)  # (N,)
    c = w_cols.sum(1)  # (N,)
    t = t.detach().to(dtype)[:, None]  # (N, 1)
    x_t = (1 - t) * x0 + t * noise
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta
    e_pos = (x_t - t * v_pos) - x0
    e_neg = (x_t - t * v_neg) - x0
    w_pos = e_pos.detach().abs().mean(1).clamp_min(1e-5)
    w_neg = e_neg.detach().abs().mean(1).clamp_min(1e-5)
    loss_pos = (e_pos**2).mean(1) / w_pos
    loss_neg = (e_neg**2).mean(1) / w_neg
    per_image = n_steps * (a * loss_pos + (c - a) * loss_neg) / beta  # (N,)
    loss = adv_clip_max * per_image.mean()
    if v_ref is not None:
        loss = loss + kl_coef * ((v_theta - v_ref.detach().reshape(n, -1)) ** 2).mean()
    return loss


@triton.jit
def _nft_partial_sums_kernel(
    v_theta_ptr,  # (N, D) rows of vθ, unit stride along D
    v_old_ptr,  # (N, D) rows of v_old
    x0_ptr,  # (N, D) rows of x0
    noise_ptr,  # (N, D) rows of ε
    v_ref_ptr,  # (N, D) rows of v_ref; unused unless HAS_REF
    partial_ptr,  # (N, NUM_STATS, n_chunks) fp32 output: per-(row, chunk) sums
    D,  # elements per row
    stride_vt,  # row strides of the five inputs, in elements
    stride_vo,
    stride_x0,
    stride_noise,
    stride_ref,
    beta,  # NFT strength β
    chunk_size,  # elements per chunk, a multiple of BLOCK_D
    n_chunks,  # chunks per row
    NUM_STATS: tl.constexpr,  # slots per (row, chunk) in partial_ptr
    HAS_REF: tl.constexpr,  # whether to sum (vθ - v_ref)²
    BLOCK_D: tl.constexpr,  # elements per tile
):
    # 1. This program's row and chunk. Row offsets are int64: N·D can exceed 2^31 (8192 × 2^18).
    row = tl.program_id(0).to(tl.int64)
    chunk_start = tl.program_id(1) * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, D)
    offs = tl.arange(0, BLOCK_D)
    sum_abs_pos = tl.zeros([BLOCK_D], dtype=tl.float32)
    sum_abs_neg = tl.zeros([BLOCK_D], dtype=tl.float32)
    sum_sq_pos = tl.zeros([BLOCK_D], dtype=tl.float32)
    sum_sq_neg = tl.zeros([BLOCK_D], dtype=tl.float32)
    sum_sq_ref = tl.zeros([BLOCK_D], dtype=tl.float32)
    # 2. Walk the chunk tile by tile, accumulating elementwise in fp32; reduce the tiles at the end.
    for start in range(chunk_start, chunk_end, BLOCK_D):
        cols = start + offs
        mask = cols < chunk_end
        v_theta = tl.load(v_theta_ptr + row * stride_vt + cols, mask=mask, other=0.0).to(tl.float32)
        v_old = tl.load(v_old_ptr + row * stride_vo + cols, mask=mask, other=0.0).to(tl.float32)
        x0 = tl.load(x0_ptr + row * stride_x0 + cols, mask=mask, other=0.0).to(tl.float32)
        noise = tl.load(noise_ptr + row * stride_noise + cols, mask=mask, other=0.0).to(tl.float32)
        u = noise - x0 - v_old  # e± = t·(u ∓ β δ)
        bd = beta * (v_theta - v_old)
        f_pos = u - bd
        f_neg = u + bd
        sum_abs_pos += tl.abs(f_pos)
        sum_abs_neg += tl.abs(f_neg)
        sum_sq_pos += f_pos * f_pos
        sum_sq_neg += f_neg * f_neg
        if HAS_REF:
            v_ref = tl.load(v_ref_ptr + row * stride_ref + cols, mask=mask, other=0.0)
            diff = v_theta - v_ref.to(tl.float32)
            sum_sq_ref += diff * diff
    # 3. Reduce the tiles and store this chunk's partial sums.
    out = partial_ptr + row * NUM_STATS * n_chunks + tl.program_id(1)
    tl.store(out, tl.sum(sum_abs_pos, axis=0))
    tl.store(out + n_chunks, tl.sum(sum_abs_neg, axis=0))
    tl.store(out + 2 * n_chunks, tl.sum(sum_sq_pos, axis=0))
    tl.store(out + 3 * n_chunks, tl.sum(sum_sq_neg, axis=0))
    if HAS_REF:
        tl.store(out + 4 * n_chunks, tl.sum(sum_sq_ref, axis=0))


@triton.jit
def _nft_loss_grad_kernel(
    v_theta_ptr,  # (N, D) rows of vθ, unit stride along D
    v_old_ptr,  # (N, D) rows of v_old
    x0_ptr,  # (N, D) rows of x0
    noise_ptr,  # (N, D) rows of ε
    v_ref_ptr,  # (N, D) rows of v_ref; unused unless HAS_REF
    t_ptr,  # (N,) timesteps
    t_index_ptr,  # (N,) timestep indices into W's columns
    r_ptr,  # (N, K) optimality probabilities
    w_ptr,  # (K, T) reward-by-timestep weights
    partial_ptr,  # (N, NUM_STATS, n_chunks) fp32 partial sums from pass 1
    row_loss_ptr,  # (N,) fp32 output: this row's share of the loss
    grad_ptr,  # (N, D) contiguous output: ∂loss/∂vθ in vθ's dtype; unused unless WRITE_GRAD
    N,  # rows
    D,  # elements per row
    K,  # rewards
    stride_vt,  # row strides of the five inputs, in elements
    stride_vo,
    stride_x0,
    stride_noise,
    stride_ref,
    stride_t,  # stride of t
    stride_ti,  # stride of t_index
    stride_rn,  # strides of r
    stride_rk,
    stride_wk,  # strides of W
    stride_wt,
    n_steps,  # T, as a float
    beta,  # NFT strength β
    adv_clip_max,  # A_max
    kl_coef,  # κ
    chunk_size,  # elements per chunk, a multiple of BLOCK_D
    n_chunks,  # chunks per row
    NUM_STATS: tl.constexpr,  # slots per (row, chunk) in partial_ptr
    HAS_REF: tl.constexpr,  # whether the κ term is present
    WRITE_GRAD: tl.constexpr,  # whether to write the gradient
    BLOCK_D: tl.constexpr,  # elements per tile
    BLOCK_C: tl.constexpr,  # power of two ≥ n_chunks
    BLOCK_K: tl.constexpr,  # power of two ≥ K
):
    # 1. This program's row and chunk (int64 row offsets, as in pass 1).
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunk_start = chunk * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, D)
    # 2. Reduce the row's partial sums into per-row means of |f±| and (f±)².
    c_offs = tl.arange(0, BLOCK_C)
    c_mask = c_offs < n_chunks
    part = partial_ptr + row * NUM_STATS * n_chunks + c_offs
    mean_abs_pos = tl.sum(tl.load(part, mask=c_mask, other=0.0), axis=0) / D
    mean_abs_neg = tl.sum(tl.load(part + n_chunks, mask=c_mask, other=0.0), axis=0) / D
    mean_sq_pos = tl.sum(tl.load(part + 2 * n_chunks, mask=c_mask, other=0.0), axis=0) / D
    mean_sq_neg = tl.sum(tl.load(part + 3 * n_chunks, mask=c_mask, other=0.0), axis=0) / D
    # 3. Mixed optimality: a = Σ_k W[k, i] r[n, k], c = Σ_k W[k, i] for this row's timestep i.
    k_offs = tl.arange(0, BLOCK_K)
    k_mask = k_offs < K
    step = tl.load(t_index_ptr + row * stride_ti)
    w_col = tl.load(w_ptr + k_offs * stride_wk + step * stride_wt, mask=k_mask, other=0.0)
    w_col = w_col.to(tl.float32)
    r_row = tl.load(r_ptr + row * stride_rn + k_offs * stride_rk, mask=k_mask, other=0.0)
    a = tl.sum(w_col * r_row.to(tl.float32), axis=0)
    c = tl.sum(w_col, axis=0)
    # 4. w± = max(t·mean|f±|, 1e-5), L± = t²·mean(f±)²/w±, the row's loss and gradient coefficients.
    t = tl.load(t_ptr + row * stride_t).to(tl.float32)
    w_pos = tl.maximum(t * mean_abs_pos, 1e-5)
    w_neg = tl.maximum(t * mean_abs_neg, 1e-5)
    loss_pos = t * t * mean_sq_pos / w_pos
    loss_neg = t * t * mean_sq_neg / w_neg
    row_loss = adv_clip_max / N * n_steps * (a * loss_pos + (c - a) * loss_neg) / beta
    if HAS_REF:
        sq_ref = tl.sum(tl.load(part + 4 * n_chunks, mask=c_mask, other=0.0), axis=0)
        row_loss += kl_coef / N * sq_ref / D
    # 5. The chunk-0 program stores the row's loss.
    if chunk == 0:
        tl.store(row_loss_ptr + row, row_loss)
    # 6. Second read of the inputs: grad = coef_pos·f⁺ + coef_neg·f⁻ (+ coef_ref·(vθ - v_ref)),
    #    the closed form of the header with e± = t·f± folded into the coefficients.
    if WRITE_GRAD:
        scale = adv_clip_max / N * 2.0 * t * t * n_steps / D
        coef_pos = -scale * a / w_pos
        coef_neg = scale * (c - a) / w_neg
        coef_ref = 2.0 * kl_coef / N / D
        offs = tl.arange(0, BLOCK_D)
        for start in range(chunk_start, chunk_end, BLOCK_D):
            cols = start + offs
            mask = cols < chunk_end
            v_theta = tl.load(v_theta_ptr + row * stride_vt + cols, mask=mask, other=0.0)
            v_theta = v_theta.to(tl.float32)
            v_old = tl.load(v_old_ptr + row * stride_vo + cols, mask=mask, other=0.0).to(tl.float32)
            x0 = tl.load(x0_ptr + row * stride_x0 + cols, mask=mask, other=0.0).to(tl.float32)
            noise = tl.load(noise_ptr + row * stride_noise + cols, mask=mask, other=0.0)
            u = noise.to(tl.float32) - x0 - v_old
            bd = beta * (v_theta - v_old)
            grad = coef_pos * (u - bd) + coef_neg * (u + bd)
            if HAS_REF:
                v_ref = tl.load(v_ref_ptr + row * stride_ref + cols, mask=mask, other=0.0)
                grad += coef_ref * (v_theta - v_ref.to(tl.float32))
            tl.store(grad_ptr + row * D + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter on CPU: chunk rows as on a small GPU, so small tests cover chunking


def _launch_shape(n: int, d: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_D, chunk_size, n_chunks): about 4 programs per SM, chunks a whole number of tiles."""
    block_d = min(1024, max(128, triton.next_power_of_2(d)))
    n_tiles = triton.cdiv(d, block_d)
    chunks = min(max(1, triton.cdiv(4 * _num_sms(device), n)), n_tiles, _MAX_CHUNKS)
    chunk_size = triton.cdiv(n_tiles, chunks) * block_d
    return block_d, chunk_size, triton.cdiv(d, chunk_size)


def _as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """(N, D) view with unit stride along D; copies only when no such view exists."""
    x = x.reshape(n, -1)
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


class _NFTLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl):
        n, n_steps = v_theta.shape[0], W.shape[1]
        rows = [_as_rows(x, n) for x in (v_theta, v_old, x0, noise)]
        has_ref = v_ref is not None and kl != 0.0
        ref_rows = _as_rows(v_ref, n) if has_ref else rows[0]
        d = rows[0].shape[1]
        block_d, chunk_size, n_chunks = _launch_shape(n, d, v_theta.device)
        strides = [x.stride(0) for x in (*rows, ref_rows)]
        partial = v_theta.new_empty((n, _NUM_STATS, n_chunks), dtype=torch.float32)
        row_loss = v_theta.new_empty(n, dtype=torch.float32)
        write_grad = ctx.needs_input_grad[0]
        grad = v_theta.new_empty((n, d) if write_grad else (1,))
        grid = (n, n_chunks)
        _nft_partial_sums_kernel[grid](
            *rows, ref_rows, partial, d, *strides, float(beta), chunk_size, n_chunks,
            NUM_STATS=_NUM_STATS, HAS_REF=has_ref, BLOCK_D=block_d,
            num_warps=_NUM_WARPS, enable_fp_fusion=True,
        )  # fmt: skip
        _nft_loss_grad_kernel[grid](
            *rows, ref_rows, t, t_index, r, W, partial, row_loss, grad,
            n, d, r.shape[1], *strides, t.stride(0), t_index.stride(0), r.stride(0), r.stride(1),
            W.stride(0), W.stride(1), float(n_steps), float(beta), float(adv_clip_max),
            float(kl), chunk_size, n_chunks,
            NUM_STATS=_NUM_STATS, HAS_REF=has_ref, WRITE_GRAD=write_grad, BLOCK_D=block_d,
            BLOCK_C=triton.next_power_of_2(n_chunks), BLOCK_K=triton.next_power_of_2(r.shape[1]),
            num_warps=_NUM_WARPS, enable_fp_fusion=True,
        )  # fmt: skip
        if write_grad:
            ctx.save_for_backward(grad)
            ctx.shape = v_theta.shape
        return row_loss.sum()

    @staticmethod
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        if not bool(grad_output == 1):  # host-device sync; skips an N×D pass in the usual case
            grad = grad * grad_output
        return (grad.view(ctx.shape),) + (None,) * 11


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    t_index: torch.Tensor,
    r: torch.Tensor,
    W: torch.Tensor,
    beta: float = 1.0,
    adv_clip_max: float = 5.0,
    v_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Weighted NFT loss of DESIGN §6 (fp32 scalar), differentiable w.r.t. v_theta only.

    Runs the fused Triton kernels on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1),
    reference_nft_loss otherwise.
    """
    _check_inputs(v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef)
    if not (v_theta.is_cuda or _INTERPRET):
        return reference_nft_loss(
            v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
        )
    return _NFTLoss.apply(
        v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
    )


if __name__ == "__main__":
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not _INTERPRET:
        raise SystemExit("no GPU: run with TRITON_INTERPRET=1 to check the kernel on CPU")
    gen = torch.Generator().manual_seed(0)
    n, shape, n_rewards, n_steps = 16, (16, 64, 64), 4, 10
    if device.type == "cpu":
        shape = (3, 17, 19)  # the interpreter is slow
    inputs = [torch.randn(n, *shape, generator=gen).to(device) for _ in range(5)]
    t = torch.rand(n, generator=gen).clamp_min(0.05).to(device)
    t_index = torch.randint(0, n_steps, (n,), generator=gen).to(device)
    r = torch.rand(n, n_rewards, generator=gen).to(device)
    W = torch.softmax(torch.randn(n_rewards, n_steps, generator=gen), 0).to(device) / n_steps
    args = (t, t_index, r, W, 0.7, 5.0)
    results = []
    for fn in (nft_loss, reference_nft_loss):
        v_theta = inputs[0].clone().requires_grad_()
        loss = fn(v_theta, *inputs[1:4], *args, v_ref=inputs[4], kl_coef=1e-2)
        loss.backward()
        results.append((loss.item(), v_theta.grad))
    grad_err = (results[0][1] - results[1][1]).abs().max().item()
    (loss, _), (loss_ref, _) = results
    print(f"loss: kernel {loss:.6f}, reference {loss_ref:.6f}; max |Δgrad| {grad_err:.1e}")
    if device.type == "cuda":
        for dtype in (torch.float32, torch.bfloat16):
            v_theta = inputs[0].to(dtype).requires_grad_()
            rest = [x.to(dtype) for x in inputs[1:4]]
            for fn in (nft_loss, reference_nft_loss):

                def step(fn=fn, v_theta=v_theta, rest=rest):
                    fn(v_theta, *rest, *args).backward()

                ms = triton.testing.do_bench(step)
                print(f"{fn.__name__:20s} {dtype} N={n} D={math.prod(shape)} fwd+bwd {ms:.3f} ms")
