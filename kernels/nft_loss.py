"""Fused per-timestep weighted DiffusionNFT loss: three launches, no host sync (DESIGN §6).

What it computes
----------------
For N images at training timesteps t_n (flattened to (N, D)), with K rewards mixed by a weight
matrix W (K, T) at the image's timestep index i_n = t_index[n]:

    a_n = clamp(Σ_k W[k, i_n] r[n, k], 0, c_n)    c_n = Σ_k W[k, i_n]
    x_t = (1 - t) x0 + t ε                 (ε = noise)
    v⁺ = β vθ + (1 - β) v_old              v⁻ = (1 + β) v_old - β vθ
    e± = (x_t - t v±) - x0                 w± = max(mean_d |e±|, 1e-5)   (no gradient)
    L± = mean_d (e±)² / w±                 ℓ_n = T [a_n L⁺ + (c_n - a_n) L⁻] / β
    loss = A_max · mean_n ℓ_n  +  κ · mean_n mean_d (vθ - v_ref)²      (κ term only with v_ref)

Substituting x_t, the errors are e± = t·f± with f± = u ∓ β δ, u = ε - x0 - v_old and
δ = vθ - v_old. The kernels therefore sum |f±| and (f±)² per row and put t back in per row:
w± = max(t · mean|f±|, 1e-5), mean (e±)² = t² mean (f±)².

Gradient (derivation)
---------------------
w± is a constant (detached). ∂e⁺/∂vθ = -tβ and ∂e⁻/∂vθ = +tβ, elementwise, so
∂L⁺/∂vθ_d = -2tβ e⁺_d / (D w⁺) and ∂L⁻/∂vθ_d = +2tβ e⁻_d / (D w⁻). Multiplying by T/β and the
weights, β cancels:

    ∂loss/∂vθ[n, d] = (A_max / N) (2 t T / D) [-a e⁺/w⁺ + (c - a) e⁻/w⁻] + (2κ / (N D)) (vθ - v_ref)

Everything that multiplies e± is a per-row scalar. With p = -(A_max/N)(2t²T/D) a/w⁺ and
q = (A_max/N)(2t²T/D)(c - a)/w⁻, the bracket is p f⁺ + q f⁻ = (p + q) u + β (q - p) δ: once the
row statistics are known, the gradient is one elementwise pass with two per-row coefficients
c_u = p + q and c_δ = β (q - p).

Launches, memory traffic and synchronisation
--------------------------------------------
Rows are split into chunks so that short batches of long rows (N = 16, D = 2^18) still fill the GPU.
- Forward, launch 1 (grid N × n_chunks): read vθ, v_old, x0, ε (and v_ref) once; write 4 (5) fp32
  partial sums per (row, chunk) into a small (N, 5, n_chunks) buffer.
- Forward, launch 2 (one program): walk the rows in tiles, reduce each row's partial sums, form a,
  c, w±, the row's loss and (c_u, c_δ); write the coefficients to an (N, 2) buffer and the sum of
  the row losses (accumulated in a fixed order: deterministic, no atomics) to the loss scalar.
- Backward, launch 3 (grid N × n_chunks): read the inputs a second time and write
  grad_output · (c_u u + c_δ δ + (2κ/(N D)) (vθ - v_ref)) in vθ's dtype. grad_output is read by the
  kernel from device memory, never on the host. The programs take the (row, chunk) pairs in the
  reverse order of launch 1, so that the data read last by the forward, the likeliest to still be
  in L2, is read first.
Under torch.no_grad(), or when vθ does not require a gradient, nothing is saved and there is no
backward: two launches, the inputs read once, no N×D output. The chunking aims at about 4 programs
per SM: N = 16 rows of D = 2^18 on a 132-SM GPU become 16 × 32 programs of 8192 elements; N in the
thousands gives one chunk per row. Launch 2 is a single program whose work grows with N: small
next to launches 1 and 3 for training batches (N up to thousands), a bottleneck for N in the
millions.
Bytes per element of (N, D): 2·n_in reads + 1 write (n_in = 4, or 5 with v_ref and κ ≠ 0; with
κ = 0 v_ref is never read), against n_in + 1 for reading everything once: the gradient needs w±,
i.e. the whole row, so a single pass would have to hold rows on chip. The second read is served
from L2 when the inputs fit there (an H100/H200 has 50 MB of L2; SD3.5-Medium at 512 px in bf16
reads 5 × 2 MiB, at 1024 px 5 × 8 MiB).
The gradient is written in vθ's dtype: autograd would cast an fp32 gradient to vθ's dtype anyway,
and it halves the bytes written for bf16/fp16. It is computed in fp32 and rounded once. No other
N×D temporary is allocated and nothing is written into the caller's tensors.
No host-device synchronisation on CUDA tensors: no value of any input is read by the host.
Launches run under `torch.cuda.device(v_theta.device)`, on that device's current stream.

Value checks
------------
Shapes (D, the elements per row, from 1 to 2^31 - 1 included), dtypes, devices and the float
arguments are always checked. The values of t_index (in
[0, T)) are checked only where that costs no synchronisation: for CPU tensors, or on CUDA when
CHECK_VALUES is True (set on this module, a debugging switch: each call then blocks the host until
the GPU has caught up), and never while torch.compile traces or on meta and fake tensors, which
have no values to read. Without the check, a row whose t_index lies outside [0, T) gets a NaN loss
and a NaN gradient (W is never read out of bounds), so the loss is NaN.
t is not checked to lie in (0, 1], nor r in [0, 1]: the mix a is clamped to [0, c], so r̄ = a/c
lies in [0, 1] whatever r holds (a no-op for r in [0, 1] and W ≥ 0; DESIGN §3's joint,
unit-joint and batch normalisations, which clip nothing per reward, rely on it).

Tracing, torch.compile and memory plans
---------------------------------------
Launches 1-2 and launch 3 are also wrapped as two torch.library custom operators,
recast::nft_loss_forward (the loss and the (N, 2) coefficients) and recast::nft_loss_backward (the
gradient), each with a fake implementation: the same Python code with the same allocations (copies
of inputs that have no (N, D) view, the (N, 5, n_chunks) partial sums, the coefficients, the loss,
the gradient), minus the launches. A call that is traced rather than run goes through them: under
torch.compile, under a TorchDispatchMode (FakeTensorMode, make_fx, a memory tracer), or on meta or
fake tensors. Hence:
- torch.compile(fullgraph=True) of a step that calls nft_loss has no graph break (Dynamo traces
  the autograd.Function; the operators are nodes of its forward and backward graphs), with dynamic
  shapes too, and the compiled loss and gradient equal the eager ones bit for bit;
- under FakeTensorMode and on meta tensors, forward and backward run the fake implementations:
  shapes and dtypes, no launch, no value read. Meta tensors take this path even where the kernels
  cannot run (no GPU, no TRITON_INTERPRET), so a memory plan made on meta tensors counts the
  kernels' buffers and what the backward keeps (vθ, v_old, x0, ε, v_ref themselves, and the
  coefficients), not the reference's intermediates. (A tracer that watches the dispatcher, such
  as MemTracker, sees an operator's outputs, not the temporaries it frees within the call.) On
  meta, as in the interpreter, rows are chunked as on an 8-SM GPU: the partial sums (at most
  N × 1.25 KiB) are smaller than on a GPU.
An eager call runs the same code without the operators' dispatch, which would add host time to
every forward + backward (the call is host-bound on a GPU: docs/kernels.md). Needs Python >=
3.10 (the operators' `X | None` annotations), torch >= 2.4 (torch.library.custom_op) and triton
>= 3.4 (triton.knobs, read at import). Inductor sees each operator as one opaque call:
torch.library.triton_op would let it see the launches, but under TRITON_INTERPRET its fake
implementation would run the interpreter on tensors without data.

Dtypes and layouts
------------------
vθ, v_old, x0, ε, v_ref: fp32, bf16 or fp16, one dtype and device, any shape (N, ...). They are
viewed as (N, D) with reshape(N, -1), which copies only when no such view exists (e.g. channels-last
tensors); a view whose last dimension is strided (e.g. a transposed tensor) is made contiguous. Such
copies are made in the forward and again in the backward: the inputs, not the copies, are saved.
Rows may be strided (e.g. x[::2]): no copy. All arithmetic is fp32. t: (N,) float, t_index: (N,)
integer of any width (uint8 included: an index, never a mask), r: (N, K) float, W: (K, T) float,
any strides. The loss is returned as an fp32 scalar.
reference_nft_loss computes in vθ's dtype (t, r and W are cast to it), i.e. it is the plain-PyTorch
loss at the inputs' precision, and returns a scalar of that dtype.

Precision on a GPU
------------------
Compiled for NVIDIA, fp32 division is div.full.f32 (within 2 ulp, not correctly rounded); the
kernels divide only per row. Sums are taken in another order than PyTorch's. The tests therefore
hold the kernel to at most twice the error of the reference run at the same precision, plus 16 fp32
ulp of the result's scale, plus rounding to the output dtype.

Where it was checked
--------------------
Checked against reference_nft_loss under TRITON_INTERPRET=1 on CPU (fp32, bf16, fp16; realistic,
odd and multi-chunk shapes; strided views) and compiled ahead of time for sm_80 and sm_90 with
triton.compile; on one H200 (triton 3.6) the same tests pass on CUDA (docs/kernels.md of the
ReCAST repository has the timings). torch.compile (backends eager, aot_eager and inductor),
FakeTensorMode and meta tensors were checked on CPU (torch 2.13) and on one H200 (torch 2.11).

Limits
------
D from 1 to 2^31 - 1 (checked: the column offsets within a row are int32), and N·D beyond 2^31
(int64 row offsets). With v_ref=None, kl_coef is ignored.
"""

import math

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

# Triton reads TRITON_INTERPRET when @triton.jit decorates, i.e. when this module is imported: the
# kernels below are interpreted (and can run on CPU tensors) exactly when this flag is set.
_INTERPRET = triton.knobs.runtime.interpret

# Debugging switch: True checks t_index's values on CUDA too, at the cost of a host-device sync.
CHECK_VALUES = False

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NUM_STATS = 5  # Σ|f⁺|, Σ|f⁻|, Σ(f⁺)², Σ(f⁻)², Σ(vθ - v_ref)²
_MAX_CHUNKS = 64  # launch 2 reduces up to this many partial sums per row
_ROWS_TILE = 1024  # (rows × chunks) elements per tile of launch 2
_NUM_WARPS = 4


def _traced(x: torch.Tensor) -> bool:
    """Whether a call on x is traced rather than run: under torch.compile, under a
    TorchDispatchMode (FakeTensorMode, make_fx, a memory tracer), or on a tensor without data
    (meta, fake). A traced call reads no value (under torch.compile a read is a data-dependent
    guard: a graph break, an error with fullgraph=True; meta and fake tensors have none), so it
    skips the value checks and gets what CUDA gives without CHECK_VALUES; and it launches through
    the custom operators below, which tracing sees and runs as fake implementations."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode() or x.is_meta or is_fake(x)


def _check_inputs(
    v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
) -> tuple[int, int]:
    """Raise ValueError naming the offending argument; return (N, T). Reads no device value
    unless the call runs on CPU tensors or CHECK_VALUES is set, and is not traced (_traced)."""
    if not isinstance(v_theta, torch.Tensor) or v_theta.ndim < 1 or v_theta.shape[0] == 0:
        raise ValueError("v_theta must be a tensor of shape (N, ...) with N > 0")
    if v_theta.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"v_theta must be float32, bfloat16 or float16, got {v_theta.dtype}")
    n, shape, dtype, device = v_theta.shape[0], v_theta.shape, v_theta.dtype, v_theta.device
    d = math.prod(shape[1:])  # the kernels' column offsets within a row are int32
    if not 1 <= d < 2**31:
        raise ValueError(f"v_theta must have 1 to 2^31 - 1 elements per image, got {d}")
    for name, x in (("v_old", v_old), ("x0", x0), ("noise", noise), ("v_ref", v_ref)):
        if x is None and name == "v_ref":
            continue
        if not isinstance(x, torch.Tensor) or x.shape != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have v_theta's shape {tuple(shape)}, got {got}")
        if x.dtype != dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, v_theta has {dtype}")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, v_theta on {device}")
    for name, x, ndim in (("t", t, 1), ("t_index", t_index, 1), ("r", r, 2), ("W", W, 2)):
        if not isinstance(x, torch.Tensor) or x.ndim != ndim:
            raise ValueError(f"{name} must be a {ndim}-d tensor")
        if x.device != device:
            raise ValueError(f"{name} is on {x.device}, v_theta on {device}")
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
    # Comparisons rather than math.isfinite, which torch.compile(dynamic=True) cannot apply to the
    # symbolic floats it passes; NaN fails every comparison.
    if not 0 < beta < math.inf:
        raise ValueError(f"beta must be finite and > 0, got {beta}")
    if not 0 < adv_clip_max < math.inf:
        raise ValueError(f"adv_clip_max must be finite and > 0, got {adv_clip_max}")
    if not 0 <= kl_coef < math.inf:
        raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef}")
    if (device.type == "cpu" or CHECK_VALUES) and not _traced(t_index):  # CUDA: a sync
        if bool(((t_index < 0) | (t_index >= n_steps)).any()):
            raise ValueError(f"t_index must lie in [0, T) with T = W.shape[1] = {n_steps}")
    return n, n_steps


def _reference_loss(v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl):
    """The loss of DESIGN §6 in plain PyTorch at v_theta's precision, without any check."""
    n, n_steps, dtype = v_theta.shape[0], W.shape[1], v_theta.dtype
    v_theta = v_theta.reshape(n, -1)
    v_old, x0, noise = (x.detach().reshape(n, -1) for x in (v_old, x0, noise))
    # .long(): a uint8 t_index would index as a mask, and int8/int16 do not index at all.
    w_cols = W.detach().to(dtype)[:, t_index.long()].T  # (N, K): each image's column of W
    c = w_cols.sum(1)  # (N,)
    a = torch.minimum((w_cols * r.detach().to(dtype)).sum(1).clamp_min(0), c)  # (N,): r̄ ∈ [0, 1]
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
        loss = loss + kl * ((v_theta - v_ref.detach().reshape(n, -1)) ** 2).mean()
    return loss


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
    _check_inputs(v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef)
    return _reference_loss(
        v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
    )


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
def _nft_rows_kernel(
    partial_ptr,  # (N, NUM_STATS, n_chunks) fp32 partial sums from launch 1
    t_ptr,  # (N,) timesteps
    t_index_ptr,  # (N,) timestep indices into W's columns
    r_ptr,  # (N, K) optimality probabilities
    w_ptr,  # (K, T) reward-by-timestep weights
    coef_ptr,  # (N, 2) fp32 output: per-row gradient coefficients (c_u, c_δ)
    loss_ptr,  # () fp32 output: the loss
    N,  # rows
    D,  # elements per row
    K,  # rewards
    n_steps,  # T
    n_chunks,  # chunks per row
    stride_t,  # stride of t
    stride_ti,  # stride of t_index
    stride_rn,  # strides of r
    stride_rk,
    stride_wk,  # strides of W
    stride_wt,
    beta,  # NFT strength β
    adv_clip_max,  # A_max
    kl_coef,  # κ
    NUM_STATS: tl.constexpr,  # slots per (row, chunk) in partial_ptr
    HAS_REF: tl.constexpr,  # whether the κ term is present
    BLOCK_N: tl.constexpr,  # rows per tile
    BLOCK_C: tl.constexpr,  # power of two ≥ n_chunks
    BLOCK_K: tl.constexpr,  # power of two ≥ K
):
    # One program walks all rows in tiles of BLOCK_N; the loss is accumulated in a fixed order.
    c_offs = tl.arange(0, BLOCK_C)
    c_mask = c_offs < n_chunks
    k_offs = tl.arange(0, BLOCK_K)
    k_mask = k_offs < K
    steps_f = n_steps * 1.0  # T as fp32 (n_steps may be specialised to a constexpr 1)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for row0 in range(0, N, BLOCK_N):
        # 1. Reduce each row's partial sums into means of |f±| and (f±)².
        rows = row0 + tl.arange(0, BLOCK_N).to(tl.int64)
        row_ok = rows < N
        part = partial_ptr + rows[:, None] * (NUM_STATS * n_chunks) + c_offs[None, :]
        part_mask = row_ok[:, None] & c_mask[None, :]
        mean_abs_pos = tl.sum(tl.load(part, mask=part_mask, other=0.0), axis=1) / D
        mean_abs_neg = tl.sum(tl.load(part + n_chunks, mask=part_mask, other=0.0), axis=1) / D
        mean_sq_pos = tl.sum(tl.load(part + 2 * n_chunks, mask=part_mask, other=0.0), axis=1) / D
        mean_sq_neg = tl.sum(tl.load(part + 3 * n_chunks, mask=part_mask, other=0.0), axis=1) / D
        # 2. Mixed optimality a = clamp(Σ_k W[k, i] r[n, k], 0, c), c = Σ_k W[k, i]; NaN where
        #    i ∉ [0, T).
        step = tl.load(t_index_ptr + rows * stride_ti, mask=row_ok, other=0)
        step_ok = (step >= 0) & (step < n_steps)
        wk_mask = (row_ok & step_ok)[:, None] & k_mask[None, :]
        w_cols = tl.load(
            w_ptr + k_offs[None, :] * stride_wk + step[:, None] * stride_wt, mask=wk_mask, other=0.0
        ).to(tl.float32)
        r_rows = tl.load(
            r_ptr + rows[:, None] * stride_rn + k_offs[None, :] * stride_rk,
            mask=row_ok[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        c = tl.sum(w_cols, axis=1)
        a = tl.sum(w_cols * r_rows, axis=1)  # NaN in r stays NaN: the loss reports it
        a = tl.minimum(tl.maximum(a, 0.0, tl.PropagateNan.ALL), c, tl.PropagateNan.ALL)
        a = tl.where(step_ok, a, float("nan"))
        # 3. w± = max(t·mean|f±|, 1e-5), L± = t²·mean(f±)²/w±, the row's loss.
        t = tl.load(t_ptr + rows * stride_t, mask=row_ok, other=1.0).to(tl.float32)
        w_pos = tl.maximum(t * mean_abs_pos, 1e-5)
        w_neg = tl.maximum(t * mean_abs_neg, 1e-5)
        loss_pos = t * t * mean_sq_pos / w_pos
        loss_neg = t * t * mean_sq_neg / w_neg
        row_loss = adv_clip_max / N * steps_f * (a * loss_pos + (c - a) * loss_neg) / beta
        if HAS_REF:
            sq_ref = tl.sum(tl.load(part + 4 * n_chunks, mask=part_mask, other=0.0), axis=1)
            row_loss += kl_coef / N * sq_ref / D
        total += tl.where(row_ok, row_loss, 0.0)
        # 4. Gradient coefficients of the header: p f⁺ + q f⁻ = (p + q) u + β (q - p) δ.
        scale = adv_clip_max / N * 2.0 * t * t * steps_f / D
        coef_pos = -scale * a / w_pos
        coef_neg = scale * (c - a) / w_neg
        tl.store(coef_ptr + 2 * rows, coef_pos + coef_neg, mask=row_ok)
        tl.store(coef_ptr + 2 * rows + 1, beta * (coef_neg - coef_pos), mask=row_ok)
    tl.store(loss_ptr, tl.sum(total, axis=0))


@triton.jit
def _nft_grad_kernel(
    v_theta_ptr,  # (N, D) rows of vθ, unit stride along D
    v_old_ptr,  # (N, D) rows of v_old
    x0_ptr,  # (N, D) rows of x0
    noise_ptr,  # (N, D) rows of ε
    v_ref_ptr,  # (N, D) rows of v_ref; unused unless HAS_REF
    coef_ptr,  # (N, 2) fp32 per-row coefficients (c_u, c_δ) from launch 2
    grad_out_ptr,  # () the incoming gradient of the loss
    grad_ptr,  # (N, D) contiguous output: ∂loss/∂vθ in vθ's dtype
    N,  # rows
    D,  # elements per row
    stride_vt,  # row strides of the five inputs, in elements
    stride_vo,
    stride_x0,
    stride_noise,
    stride_ref,
    coef_ref,  # 2κ / (N D)
    chunk_size,  # elements per chunk, a multiple of BLOCK_D
    n_chunks,  # chunks per row
    HAS_REF: tl.constexpr,  # whether the κ term is present
    BLOCK_D: tl.constexpr,  # elements per tile
):
    # 1. (row, chunk) in the reverse order of launch 1: its last reads are likeliest in L2.
    row = N - 1 - tl.program_id(0).to(tl.int64)
    chunk_start = (n_chunks - 1 - tl.program_id(1)) * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, D)
    grad_out = tl.load(grad_out_ptr).to(tl.float32)
    coef_u = tl.load(coef_ptr + 2 * row)
    coef_d = tl.load(coef_ptr + 2 * row + 1)
    # 2. grad = grad_out · (c_u u + c_δ δ + coef_ref (vθ - v_ref)), grad_out applied last.
    offs = tl.arange(0, BLOCK_D)
    for start in range(chunk_start, chunk_end, BLOCK_D):
        cols = start + offs
        mask = cols < chunk_end
        v_theta = tl.load(v_theta_ptr + row * stride_vt + cols, mask=mask, other=0.0).to(tl.float32)
        v_old = tl.load(v_old_ptr + row * stride_vo + cols, mask=mask, other=0.0).to(tl.float32)
        x0 = tl.load(x0_ptr + row * stride_x0 + cols, mask=mask, other=0.0).to(tl.float32)
        noise = tl.load(noise_ptr + row * stride_noise + cols, mask=mask, other=0.0).to(tl.float32)
        grad = coef_u * (noise - x0 - v_old) + coef_d * (v_theta - v_old)
        if HAS_REF:
            v_ref = tl.load(v_ref_ptr + row * stride_ref + cols, mask=mask, other=0.0)
            grad += coef_ref * (v_theta - v_ref.to(tl.float32))
        grad = grad_out * grad
        tl.store(grad_ptr + row * D + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or not torch.cuda.is_available():
        # The interpreter, meta tensors, fake CUDA tensors without a GPU: chunk rows as on a small
        # GPU (so small tests cover chunking).
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv is a jit function: slow to call from Python


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()  # the next power of two ≥ x ≥ 1


_SHAPES: dict[tuple[int, int, int, int], tuple[int, ...]] = {}


def _launch_shape(n: int, d: int, num_sms: int) -> tuple[int, int, int]:
    """(BLOCK_D, chunk_size, n_chunks): about 4 programs per SM, chunks a whole number of tiles."""
    block_d = min(1024, max(128, _pow2(d)))
    n_tiles = _cdiv(d, block_d)
    chunks = min(max(1, _cdiv(4 * num_sms, n)), n_tiles, _MAX_CHUNKS)
    chunk_size = _cdiv(n_tiles, chunks) * block_d
    return block_d, chunk_size, _cdiv(d, chunk_size)


def _rows_tile(n_chunks: int, n_rewards: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_C, BLOCK_K) of launch 2."""
    block_c, block_k = _pow2(n_chunks), _pow2(n_rewards)
    return max(1, _ROWS_TILE // max(block_c, block_k)), block_c, block_k


def _launch_config(n: int, d: int, n_rewards: int, num_sms: int) -> tuple[int, ...]:
    """_launch_shape + _rows_tile, remembered (a few shapes recur through a training run)."""
    key = (n, d, n_rewards, num_sms)
    if key not in _SHAPES:
        if len(_SHAPES) > 4096:
            _SHAPES.clear()
        block_d, chunk_size, n_chunks = _launch_shape(n, d, num_sms)
        _SHAPES[key] = (block_d, chunk_size, n_chunks, *_rows_tile(n_chunks, n_rewards))
    return _SHAPES[key]


def _as_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """(N, D) view with unit stride along D; copies only when no such view exists."""
    x = x.reshape(n, -1)
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


def _guard(x: torch.Tensor):
    """torch.cuda.device(x's device) for CUDA tensors; a no-op (device -1) otherwise."""
    return torch.cuda.device(x.device.index if x.is_cuda else -1)


# Launches 1-2 and launch 3 as torch.library custom operators, each with a fake implementation (the
# same code and allocations, no launch); _NFTLoss goes through them when the call is traced, and
# calls their code directly otherwise (see "Tracing, torch.compile and memory plans" above).


def _nft_forward_impl(
    v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef, launch
):
    """(loss, per-row gradient coefficients): launches 1 and 2, or with launch=False the same
    allocations only (the fake implementation: tensors without data)."""
    n, n_rewards = v_theta.shape[0], r.shape[1]
    rows = [_as_rows(x, n) for x in (v_theta, v_old, x0, noise)]
    has_ref = v_ref is not None and kl_coef != 0.0
    ref_rows = _as_rows(v_ref, n) if has_ref else rows[0]
    d = rows[0].shape[1]
    f32 = dict(device=v_theta.device, dtype=torch.float32)
    coefs = torch.empty((n, 2), **f32)
    loss = torch.empty((), **f32)
    if not isinstance(n * d, int):  # symbolic sizes (torch.compile's dynamic shapes): no chunking
        return loss, coefs  # to mirror, and only the fake implementation ever sees them
    config = _launch_config(n, d, n_rewards, _num_sms(v_theta.device))
    block_d, chunk_size, n_chunks, block_n, block_c, block_k = config
    partial = torch.empty((n, _NUM_STATS, n_chunks), **f32)
    if not launch:
        return loss, coefs
    strides = [x.stride(0) for x in (*rows, ref_rows)]
    with _guard(v_theta):
        _nft_partial_sums_kernel[(n, n_chunks)](
            *rows, ref_rows, partial, d, *strides, beta, chunk_size, n_chunks,
            NUM_STATS=_NUM_STATS, HAS_REF=has_ref, BLOCK_D=block_d,
            num_warps=_NUM_WARPS, enable_fp_fusion=True,
        )  # fmt: skip
        _nft_rows_kernel[(1,)](
            partial, t, t_index, r, W, coefs, loss,
            n, d, n_rewards, W.shape[1], n_chunks, t.stride(0), t_index.stride(0),
            r.stride(0), r.stride(1), W.stride(0), W.stride(1),
            beta, adv_clip_max, kl_coef,
            NUM_STATS=_NUM_STATS, HAS_REF=has_ref,
            BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_K=block_k,
            num_warps=_NUM_WARPS, enable_fp_fusion=True,
        )  # fmt: skip
    return loss, coefs


@torch.library.custom_op("recast::nft_loss_forward", mutates_args=())
def _nft_forward(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    t_index: torch.Tensor,
    r: torch.Tensor,
    W: torch.Tensor,
    beta: float,
    adv_clip_max: float,
    v_ref: torch.Tensor | None,
    kl_coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches 1 and 2 on checked inputs: (loss, (N, 2) gradient coefficients)."""
    return _nft_forward_impl(
        v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef, True
    )


@_nft_forward.register_fake
def _nft_forward_fake(*args):
    return _nft_forward_impl(*args, False)


def _nft_backward_impl(grad_loss, v_theta, v_old, x0, noise, v_ref, coefs, kl_coef, launch):
    """∂loss/∂v_theta in v_theta's dtype and shape (contiguous): launch 3, or with launch=False
    the same allocations only."""
    n = v_theta.shape[0]
    rows = [_as_rows(x, n) for x in (v_theta, v_old, x0, noise)]
    has_ref = v_ref is not None and kl_coef != 0.0
    ref_rows = _as_rows(v_ref, n) if has_ref else rows[0]
    d = rows[0].shape[1]
    grad = torch.empty(v_theta.shape, device=v_theta.device, dtype=v_theta.dtype)
    if not launch:
        return grad
    block_d, chunk_size, n_chunks = _launch_shape(n, d, _num_sms(v_theta.device))
    strides = [x.stride(0) for x in (*rows, ref_rows)]
    with _guard(grad):
        _nft_grad_kernel[(n, n_chunks)](
            *rows, ref_rows, coefs, grad_loss, grad, n, d, *strides, 2.0 * kl_coef / (n * d),
            chunk_size, n_chunks, HAS_REF=has_ref, BLOCK_D=block_d,
            num_warps=_NUM_WARPS, enable_fp_fusion=True,
        )  # fmt: skip
    return grad


@torch.library.custom_op("recast::nft_loss_backward", mutates_args=())
def _nft_backward(
    grad_loss: torch.Tensor,
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    v_ref: torch.Tensor | None,
    coefs: torch.Tensor,
    kl_coef: float,
) -> torch.Tensor:
    """Launch 3: grad_loss · ∂loss/∂v_theta from the forward's coefficients."""
    return _nft_backward_impl(grad_loss, v_theta, v_old, x0, noise, v_ref, coefs, kl_coef, True)


@_nft_backward.register_fake
def _nft_backward_fake(*args):
    return _nft_backward_impl(*args, False)


class _NFTLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip, v_ref, kl, save):
        args = (v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip, v_ref, kl)
        if _traced(v_theta):
            loss, coefs = _nft_forward(*args)
        else:
            loss, coefs = _nft_forward_impl(*args, True)
        ctx.kl_coef = kl if save else None  # None: nothing saved, no backward
        if save:  # the inputs themselves: the backward makes the (N, D) rows again
            ctx.save_for_backward(v_theta, v_old, x0, noise, v_ref, coefs)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        if ctx.kl_coef is None:  # v_theta needs no gradient (another input asked for one)
            return (None,) * 13
        args = (grad_output, *ctx.saved_tensors, ctx.kl_coef)
        grad = _nft_backward(*args) if _traced(grad_output) else _nft_backward_impl(*args, True)
        return (grad,) + (None,) * 12


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
    """Weighted NFT loss of DESIGN §6, differentiable w.r.t. v_theta only: an fp32 scalar from
    the kernels, at v_theta's precision from reference_nft_loss (CPU without TRITON_INTERPRET).

    Runs the fused Triton kernels on CUDA tensors (and on CPU tensors under TRITON_INTERPRET=1),
    reference_nft_loss otherwise. No host-device sync on CUDA (see CHECK_VALUES). Meta tensors
    take the kernels' path without launching them (for memory plans), as do fake tensors where
    the kernels would run; torch.compile(fullgraph=True) traces it without a graph break.
    """
    beta, adv_clip_max, kl_coef = float(beta), float(adv_clip_max), float(kl_coef)  # the ops' types
    _check_inputs(v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef)
    if not (v_theta.is_cuda or v_theta.is_meta or _INTERPRET):
        return _reference_loss(
            v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
        )
    save = torch.is_grad_enabled() and v_theta.requires_grad
    return _NFTLoss.apply(
        v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef, save
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
