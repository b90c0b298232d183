"""Tests of kernels/nft_loss.py: the fused kernels against reference_nft_loss, the reference
against DESIGN §6 written out, and the loss traced (torch.compile, FakeTensorMode, meta tensors).

On CPU (the default) the kernels run in the Triton interpreter, switched on by the repository's
conftest.py. With RECAST_TEST_DEVICE=cuda they are compiled and run on the GPU; the tolerances
below hold for both (see `within_rule`).
"""

import os
import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import nft_loss as nft  # the file beside this one (pytest puts this folder on sys.path)

DEVICE = torch.device(os.environ.get("RECAST_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip("RECAST_TEST_DEVICE=cuda but no GPU", allow_module_level=True)

LOW_PRECISION = (torch.bfloat16, torch.float16)
EPS32 = torch.finfo(torch.float32).eps


def error_names(name: str) -> str:
    """Regex: the error message names `name` as a word (at the start or after a space)."""
    return rf"(^|\s){re.escape(name)}\b"


def make_nft_inputs(n, shape, dtype=torch.float32, n_rewards=3, n_steps=10, seed=0):
    """Random inputs on DEVICE with a general W (c ≠ 1/T) and rows of r exactly 0 and exactly 1."""
    gen = torch.Generator().manual_seed(seed)
    big = [torch.randn(n, *shape, generator=gen).to(dtype) for _ in range(5)]
    t = 0.05 + 0.95 * torch.rand(n, generator=gen)
    t_index = torch.randint(0, n_steps, (n,), generator=gen)
    r = torch.rand(n, n_rewards, generator=gen)
    r[0] = 0.0
    r[1] = 1.0
    W = torch.rand(n_rewards, n_steps, generator=gen) / n_steps
    inputs = dict(
        v_theta=big[0], v_old=big[1], x0=big[2], noise=big[3], v_ref=big[4],
        t=t, t_index=t_index, r=r, W=W,
    )  # fmt: skip
    return {k: v.to(DEVICE) for k, v in inputs.items()}


def loss_and_grad(fn, inputs, **kwargs):
    """(loss, ∂loss/∂v_theta) of fn, with v_theta as a fresh leaf of the same dtype."""
    v_theta = inputs["v_theta"].detach().clone().requires_grad_()
    loss = fn(**{**inputs, "v_theta": v_theta}, **kwargs)
    loss.backward()
    return loss.detach(), v_theta.grad


def upcast(inputs, dtype=torch.float64):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


def reference_64(v_theta, v_old, x0, noise, t, t_index, r, W, beta=1.0, adv_clip_max=5.0,
                 v_ref=None, kl_coef=0.0):  # fmt: skip
    """reference_nft_loss without its checks, which admit no float64."""
    return nft._reference_loss(
        v_theta, v_old, x0, noise, t, t_index, r, W, beta, adv_clip_max, v_ref, kl_coef
    )


def within_rule(fn, inputs, **kwargs):
    """flash-attention's rule, against the reference in float64 on the same (rounded) inputs: the
    kernel's error is at most twice that of the reference run at the inputs' precision, plus what
    the kernel may lose that the reference does not: 16 fp32 ulp of the result's scale (fp32
    division on a GPU is div.full.f32, within 2 ulp, and sums run in another order), and for the
    gradient stored in a 16-bit dtype, half an ulp of its largest entry. Returns the kernel's
    (loss, grad)."""
    dtype = inputs["v_theta"].dtype
    loss, grad = loss_and_grad(fn, inputs, **kwargs)
    loss_64, grad_64 = loss_and_grad(reference_64, upcast(inputs), **kwargs)
    loss_lp, grad_lp = loss_and_grad(nft.reference_nft_loss, inputs, **kwargs)
    ref_err_loss = (loss_lp.double() - loss_64).abs().item()
    ref_err_grad = (grad_lp.double() - grad_64).abs().max().item()
    err_loss = (loss.double() - loss_64).abs().item()
    err_grad = (grad.double() - grad_64).abs().max().item()
    loss_scale, grad_scale = loss_64.abs().item(), grad_64.abs().max().item()
    store = 0.5 * torch.finfo(dtype).eps if dtype in LOW_PRECISION else 0.0
    assert err_loss <= 2 * ref_err_loss + 16 * EPS32 * loss_scale, (err_loss, ref_err_loss)
    bound_grad = 2 * ref_err_grad + (16 * EPS32 + store) * grad_scale
    assert err_grad <= bound_grad, (err_grad, ref_err_grad)
    return loss, grad


SHAPES = {"realistic": (16, (3, 32, 32)), "odd": (7, (3, 17, 19))}


@pytest.mark.parametrize("with_ref", [True, False], ids=["v_ref", "no_ref"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float32, *LOW_PRECISION], ids=str)
def test_nft_loss_matches_reference(dtype, shape, with_ref):
    n, image_shape = SHAPES[shape]
    inputs = make_nft_inputs(n, image_shape, dtype)
    kwargs = dict(beta=0.7, adv_clip_max=5.0, kl_coef=0.05 if with_ref else 0.0)
    if not with_ref:
        inputs.pop("v_ref")
    loss, grad = within_rule(nft.nft_loss, inputs, **kwargs)
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.shape == (n, *image_shape)


def test_nft_loss_clamps_the_mix_to_zero_and_c():
    """r outside [0, 1] (joint normalisation, DESIGN §3): the kernel and the reference clamp
    a = Σ_k W r to [0, c], so r̄ = a / c ∈ [0, 1]; rows whose mix stays inside are unchanged."""
    inputs = make_nft_inputs(16, (3, 8, 8), seed=3)
    r = inputs["r"]
    r[2:6] = 3.0  # a > c: clamped to c, as r = 1
    r[6:10] = -2.0  # a < 0: clamped to 0, as r = 0
    kwargs = dict(beta=0.7, adv_clip_max=5.0)
    clamped = {**inputs, "r": r.clamp(0, 1)}
    inputs.pop("v_ref"), clamped.pop("v_ref")
    for fn in (nft.nft_loss, nft.reference_nft_loss):
        loss, grad = loss_and_grad(fn, inputs, **kwargs)
        want, want_grad = loss_and_grad(fn, clamped, **kwargs)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-9)
    within_rule(nft.nft_loss, inputs, **kwargs)  # and the kernel stays the reference


def test_nft_loss_runs_the_kernel():
    """Guards the tests above against comparing the reference with itself."""
    assert nft._INTERPRET or DEVICE.type == "cuda"
    inputs = make_nft_inputs(4, (33,))
    v_theta = inputs.pop("v_theta").clone().requires_grad_()
    loss = nft.nft_loss(v_theta, **inputs)
    assert type(loss.grad_fn).__name__ == "_NFTLossBackward"


class CountLaunches:
    """Stands in for a @triton.jit kernel and counts its launches."""

    def __init__(self, kernel, counts):
        self.kernel, self.counts = kernel, counts

    def __getitem__(self, grid):
        self.counts[self.kernel.__name__] = self.counts.get(self.kernel.__name__, 0) + 1
        return self.kernel[grid]


def test_nft_loss_launches(monkeypatch):
    """Three launches for forward + backward, two under no_grad (no gradient written), none of
    them a torch op: the loss is reduced inside the kernels."""
    counts = {}
    for name in ("_nft_partial_sums_kernel", "_nft_rows_kernel", "_nft_grad_kernel"):
        monkeypatch.setattr(nft, name, CountLaunches(getattr(nft, name), counts))
    inputs = make_nft_inputs(3, (40,), seed=9)
    loss_and_grad(nft.nft_loss, inputs, kl_coef=0.1)
    assert counts == {"_nft_partial_sums_kernel": 1, "_nft_rows_kernel": 1, "_nft_grad_kernel": 1}
    counts.clear()
    with torch.no_grad():
        loss = nft.nft_loss(**{**inputs, "v_theta": inputs["v_theta"].clone().requires_grad_()})
    assert loss.grad_fn is None
    assert counts == {"_nft_partial_sums_kernel": 1, "_nft_rows_kernel": 1}


def test_nft_loss_multi_tile_chunks():
    """Rows split into chunks of several tiles, with a ragged last chunk and tile."""
    n, num_sms = 3, nft._num_sms(DEVICE)
    max_chunks = min(nft._MAX_CHUNKS, -(-4 * num_sms // n))
    d = (2 * max_chunks + 3) * 1024 + 5
    block_d, chunk_size, n_chunks = nft._launch_shape(n, d, num_sms)
    assert chunk_size >= 2 * block_d and n_chunks > 1 and d % chunk_size != 0
    inputs = make_nft_inputs(n, (d,), seed=1)
    within_rule(nft.nft_loss, inputs, beta=1.3, kl_coef=0.1)


def test_nft_loss_several_row_tiles():
    """Launch 2 walks the rows in tiles of BLOCK_N = 1024 / max(BLOCK_C, BLOCK_K): with K = 300
    rewards (BLOCK_K = 512) five rows are three tiles, the last one ragged. (On a GPU, training
    batches of more than 1024 pairs take this path; the other tests' batches fit one tile.)"""
    n = 5
    inputs = make_nft_inputs(n, (3, 5), n_rewards=300, n_steps=4, seed=17)
    n_chunks = nft._launch_shape(n, 15, nft._num_sms(DEVICE))[2]
    assert nft._rows_tile(n_chunks, 300)[0] == 2
    within_rule(nft.nft_loss, inputs, beta=0.7, kl_coef=0.1)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32], ids=str)
@pytest.mark.parametrize("fn_name", ["nft_loss", "reference_nft_loss"])
def test_nft_loss_t_index_of_any_integer_dtype(fn_name, dtype):
    """t_index is an index whatever its integer dtype: the same loss as with int64. N = T, so
    that a uint8 t_index read as a boolean mask over W's columns would give a loss, not an error."""
    fn = getattr(nft, fn_name)
    inputs = make_nft_inputs(4, (5,), n_steps=4, seed=18)
    inputs["t_index"] = torch.tensor([3, 1, 2, 1], device=DEVICE)
    want = fn(**inputs, kl_coef=0.1)
    got = fn(**{**inputs, "t_index": inputs["t_index"].to(dtype)}, kl_coef=0.1)
    # Equal here; on a GPU another pointer type is another compiled kernel (16 ulp, as elsewhere).
    torch.testing.assert_close(got, want, rtol=16 * EPS32, atol=0)


def strided_layouts(x: torch.Tensor, layout: int) -> torch.Tensor:
    """x (N, C, H, W) in one of four layouts: transposed storage (unit stride along N: the wrapper
    copies it), every other row of a larger tensor (no copy), channels-last (copied), and one row
    broadcast to all N (row stride 0, no copy)."""
    if layout == 0:
        return x.reshape(x.shape[0], -1).T.contiguous().T.reshape(x.shape)
    if layout == 1:
        return torch.stack([x, torch.full_like(x, float("nan"))], 1).flatten(0, 1)[::2]
    if layout == 2:
        return x.contiguous(memory_format=torch.channels_last)
    return x[:1].expand(x.shape)


@pytest.mark.parametrize("shift", [0, 1, 2, 3])
def test_nft_loss_non_contiguous_inputs(shift):
    """Each big input in another layout (rotating with `shift`), and strided t, t_index, r, W."""
    n, shape = 6, (3, 7, 5)
    base = make_nft_inputs(2 * n, shape, torch.bfloat16, seed=2)
    names = ["v_theta", "v_old", "x0", "noise", "v_ref"]
    inputs = {k: strided_layouts(base[k][:n], (i + shift) % 4) for i, k in enumerate(names)}
    inputs.update(
        t=base["t"][::2],
        t_index=base["t_index"][::2],
        r=base["r"][:n].T.contiguous().T,  # column-major
        W=base["W"].T.contiguous().T,
    )
    assert not inputs["v_theta"].is_contiguous()
    before = {k: v.clone() for k, v in inputs.items()}
    kwargs = dict(beta=0.5, kl_coef=0.2)
    # v_theta keeps its layout: a view of a copy of its base (a clone of it could be compacted).
    layout = inputs["v_theta"]
    source = layout if layout._base is None else layout._base
    leaf = source.detach().clone().requires_grad_()
    v_theta = leaf.as_strided(layout.shape, layout.stride(), layout.storage_offset())
    assert v_theta.stride() == layout.stride() and torch.equal(v_theta, layout)
    loss = nft.nft_loss(**{**inputs, "v_theta": v_theta}, **kwargs)
    (grad,) = torch.autograd.grad(loss, v_theta)
    contiguous = {k: v.contiguous() for k, v in inputs.items()}
    loss_ref, grad_ref = loss_and_grad(nft.nft_loss, contiguous, **kwargs)
    if DEVICE.type == "cuda":
        # Triton specialises a compiled kernel on pointer alignment and stride divisibility, so
        # another layout is another kernel: rounding may differ (16 fp32 ulp of the loss, and one
        # bf16 ulp of the largest gradient entry where its rounding flips).
        scale = grad_ref.abs().max().item()
        bf16_eps = torch.finfo(torch.bfloat16).eps
        assert (loss.detach() - loss_ref).abs().item() <= 16 * EPS32 * loss_ref.abs().item()
        assert (grad - grad_ref).abs().max().item() <= (16 * EPS32 + bf16_eps) * scale
    else:  # the interpreter runs the same arithmetic whatever the layout
        assert torch.equal(loss.detach(), loss_ref) and torch.equal(grad, grad_ref)
    for k, v in inputs.items():
        assert torch.equal(v, before[k]) or k == "v_theta", f"{k} was written to"


def test_nft_loss_kl_term_alone():
    """With W = 0 only κ·mean((vθ - v_ref)²) is left: checks HAS_REF in every launch."""
    inputs = make_nft_inputs(5, (3, 17, 19), seed=4)
    inputs["W"] = torch.zeros_like(inputs["W"])
    loss, grad = loss_and_grad(nft.nft_loss, inputs, kl_coef=0.3)
    diff = inputs["v_theta"] - inputs["v_ref"]
    torch.testing.assert_close(loss, 0.3 * (diff**2).mean(), rtol=1e-5, atol=0)
    torch.testing.assert_close(grad, 2 * 0.3 * diff / diff.numel(), rtol=1e-5, atol=1e-12)


def test_nft_loss_backward_scaling_and_no_grad():
    inputs = make_nft_inputs(4, (50,), seed=5)
    loss, grad = loss_and_grad(nft.nft_loss, inputs)
    # grad_output ≠ 1 (read by the kernel), twice through the same graph.
    v_theta = inputs["v_theta"].clone().requires_grad_()
    scaled = 2.5 * nft.nft_loss(**{**inputs, "v_theta": v_theta})
    scaled.backward(retain_graph=True)
    scaled.backward()
    torch.testing.assert_close(v_theta.grad, 5.0 * grad, rtol=1e-6, atol=0)
    with torch.no_grad():
        assert torch.equal(nft.nft_loss(**inputs), loss)
    assert torch.equal(nft.nft_loss(**inputs), loss)  # deterministic: no atomics
    # another input asking for a gradient: v_theta gets none, and nothing breaks
    W = inputs["W"].clone().requires_grad_()
    nft.nft_loss(**{**inputs, "W": W}).backward()
    assert W.grad is None


def test_nft_loss_bad_t_index_without_checks_gives_nan():
    """What CUDA does without CHECK_VALUES: no out-of-bounds read of W, a NaN loss and NaN
    gradient rows for the images whose t_index is outside [0, T)."""
    inputs = make_nft_inputs(4, (2, 3), seed=8)
    inputs["t_index"][2] = inputs["W"].shape[1]
    inputs["t_index"][3] = -1
    v_theta = inputs.pop("v_theta").clone().requires_grad_()
    args = [inputs[k] for k in ("v_old", "x0", "noise", "t", "t_index", "r", "W")]
    loss = nft._NFTLoss.apply(v_theta, *args, 1.0, 5.0, inputs["v_ref"], 0.1, True)
    loss.backward()
    assert loss.isnan()
    assert v_theta.grad[2:].isnan().all() and not v_theta.grad[:2].isnan().any()


def closed_form_grad(inputs, beta, adv_clip_max, kl_coef):
    """DESIGN §6's gradient: (A/N)(2tT/D)[-a e⁺/w⁺ + (c-a) e⁻/w⁻] + 2κ(vθ - v_ref)/(ND)."""
    n = inputs["t"].shape[0]
    v_theta, v_old, x0, noise, v_ref = (
        inputs[k].reshape(n, -1).double() for k in ("v_theta", "v_old", "x0", "noise", "v_ref")
    )
    d, n_steps = v_theta.shape[1], inputs["W"].shape[1]
    t = inputs["t"].double()[:, None]
    w_col = inputs["W"].double()[:, inputs["t_index"]].T
    a = (w_col * inputs["r"].double()).sum(1, keepdim=True)
    c = w_col.sum(1, keepdim=True)
    x_t = (1 - t) * x0 + t * noise
    e_pos = x_t - t * (beta * v_theta + (1 - beta) * v_old) - x0
    e_neg = x_t - t * ((1 + beta) * v_old - beta * v_theta) - x0
    w_pos = e_pos.abs().mean(1, keepdim=True).clamp_min(1e-5)
    w_neg = e_neg.abs().mean(1, keepdim=True).clamp_min(1e-5)
    bracket = -a * e_pos / w_pos + (c - a) * e_neg / w_neg
    return (adv_clip_max / n) * (2 * t * n_steps / d) * bracket + 2 * kl_coef / (n * d) * (
        v_theta - v_ref
    )


def test_reference_gradient_matches_closed_form():
    inputs = make_nft_inputs(6, (3, 5, 7), seed=6)
    _, grad = loss_and_grad(nft.reference_nft_loss, inputs, beta=0.6, adv_clip_max=4.0, kl_coef=0.2)
    expected = closed_form_grad(inputs, beta=0.6, adv_clip_max=4.0, kl_coef=0.2).float()
    torch.testing.assert_close(grad.reshape(6, -1), expected, rtol=1e-4, atol=1e-7)


def test_reference_loss_matches_formula():
    """ℓ_n written out image by image; and the r̄ form of ℓ when W's columns sum to 1/T."""
    inputs = {k: v.cpu() for k, v in make_nft_inputs(5, (4, 6), seed=7).items()}
    beta, adv_clip_max, kl_coef = 0.8, 5.0, 0.1
    n_steps = inputs["W"].shape[1]
    terms = []
    for n in range(5):
        t, i = inputs["t"][n].item(), inputs["t_index"][n].item()
        x0, noise, v_old, v = (inputs[k][n].double() for k in ("x0", "noise", "v_old", "v_theta"))
        x_t = (1 - t) * x0 + t * noise
        a = sum(inputs["W"][k, i].item() * inputs["r"][n, k].item() for k in range(3))
        c = inputs["W"][:, i].sum().item()
        errors = [x_t - t * (beta * v + (1 - beta) * v_old) - x0]
        errors.append(x_t - t * ((1 + beta) * v_old - beta * v) - x0)
        losses = [(e**2).mean() / max(e.abs().mean().item(), 1e-5) for e in errors]
        terms.append(n_steps * (a * losses[0] + (c - a) * losses[1]) / beta)
    kl = ((inputs["v_theta"].double() - inputs["v_ref"].double()) ** 2).mean()
    expected = adv_clip_max * sum(terms) / 5 + kl_coef * kl
    got = nft.reference_nft_loss(**inputs, beta=beta, adv_clip_max=adv_clip_max, kl_coef=kl_coef)
    assert abs(got.item() - expected.item()) <= 1e-5 * abs(expected.item())
    # ReCAST / uniform W (columns sum to 1/T): ℓ = [r̄ L⁺ + (1 - r̄) L⁻]/β with r̄ = a / c.
    inputs["W"] = torch.softmax(inputs["W"], 0) / n_steps
    got = nft.reference_nft_loss(**inputs, beta=beta, kl_coef=0.0)
    r_bar = (inputs["W"][:, inputs["t_index"]].T * inputs["r"]).sum(1, keepdim=True) * n_steps
    single_reward = dict(inputs, r=r_bar, W=torch.ones(1, n_steps) / n_steps)
    expected = nft.reference_nft_loss(**single_reward, beta=beta, kl_coef=0.0)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)


BIG_NAMES = ("v_theta", "v_old", "x0", "noise", "v_ref")

# (argument the error must name, how to break the inputs)
BAD_NFT_INPUTS = [
    ("v_theta", lambda i: {"v_theta": i["v_theta"].double()}),
    ("v_theta", lambda i: {k: i[k][:, :0] for k in BIG_NAMES}),  # D = 0
    ("v_old", lambda i: {"v_old": i["v_old"][:, :-1]}),
    ("x0", lambda i: {"x0": i["x0"].half()}),
    ("noise", lambda i: {"noise": i["noise"].to("meta")}),
    ("v_ref", lambda i: {"v_ref": i["v_ref"][:-1]}),
    ("t", lambda i: {"t": i["t"][:-1]}),
    ("t_index", lambda i: {"t_index": i["t_index"] + i["W"].shape[1]}),
    ("t_index", lambda i: {"t_index": i["t_index"] - 100}),
    ("t_index", lambda i: {"t_index": i["t_index"].float()}),
    ("W", lambda i: {"W": i["W"][:, :1]}),  # t_index does not fit W's columns
    ("W", lambda i: {"W": i["W"][:-1]}),  # K differs from r's
    ("r", lambda i: {"r": i["r"][:, 0]}),
    ("beta", lambda i: {"beta": 0.0}),
    ("adv_clip_max", lambda i: {"adv_clip_max": 0.0}),
    ("kl_coef", lambda i: {"kl_coef": -1.0}),
]


@pytest.mark.parametrize("name, breaks", BAD_NFT_INPUTS, ids=[n for n, _ in BAD_NFT_INPUTS])
@pytest.mark.parametrize("fn_name", ["nft_loss", "reference_nft_loss"])
def test_nft_loss_bad_inputs(fn_name, name, breaks, monkeypatch):
    monkeypatch.setattr(nft, "CHECK_VALUES", True)  # t_index's values on CUDA too
    inputs = make_nft_inputs(4, (2, 3), seed=8)
    inputs["t_index"][0] = 5
    bad = {**inputs, **breaks(inputs)}
    with pytest.raises(ValueError, match=error_names(name)):
        getattr(nft, fn_name)(**bad)


def test_nft_loss_refuses_rows_of_2_31_elements():
    """D = 2^31 (meta tensors: no memory) is past the kernels' int32 offsets within a row: a
    ValueError, not an illegal memory access."""
    inputs = {k: v.to("meta") for k, v in make_nft_inputs(2, (1,)).items()}
    inputs.update({k: torch.empty(2, 2**31, device="meta") for k in BIG_NAMES})
    with pytest.raises(ValueError, match=error_names("v_theta")):
        nft.nft_loss(**inputs)


# ---------------------------------------------------------------------------------------------
# Tracing: torch.compile, FakeTensorMode and meta tensors (what a memory plan runs)
# ---------------------------------------------------------------------------------------------
FORWARD_OP = torch.ops.recast.nft_loss_forward.default
BACKWARD_OP = torch.ops.recast.nft_loss_backward.default
ARG_NAMES = ("v_theta", "v_old", "x0", "noise", "t", "t_index", "r", "W")


class RecordGraphs:
    """A torch.compile backend: keeps each graph Dynamo hands it, compiles it with `backend`."""

    def __init__(self, backend: str):
        self.backend, self.graphs = backend, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)


class RecordOps(TorchDispatchMode):
    """Records every operator that reaches the dispatcher below autograd, with its outputs' shapes
    and dtypes (not devices, so that meta and real calls compare)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        shapes = [(tuple(o.shape), o.dtype) for o in outs if isinstance(o, torch.Tensor)]
        self.calls.append((func, shapes))
        return out

    def count(self, op) -> int:
        return sum(func is op for func, _ in self.calls)


def op_nodes(graph: torch.fx.GraphModule, op) -> int:
    """Calls of op in a graph and its subgraphs (Dynamo puts an autograd.Function's forward and
    backward in subgraphs)."""
    modules = [m for m in graph.modules() if isinstance(m, torch.fx.GraphModule)]
    return sum(node.target is op for m in modules for node in m.graph.nodes)


def no_reference(*args, **kwargs):
    raise AssertionError("the reference ran instead of the kernels' operators")


def forbid_launches(monkeypatch):
    for name in ("_nft_partial_sums_kernel", "_nft_rows_kernel", "_nft_grad_kernel"):
        monkeypatch.setattr(nft, name, None)  # a launch would fail: None[grid]


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_nft_loss_compiles_without_graph_break(backend):
    """torch.compile(fullgraph=True) of a step around nft_loss: one graph, with the forward and
    backward operators in it, and the loss and the gradient (grad_output 2.5 through the compiled
    backward) equal eager's bit for bit; under inductor (the default backend, which generates its
    own code around the operators) to float rounding."""

    def step(**inputs):
        return 2.5 * nft.nft_loss(**inputs, beta=0.7, kl_coef=0.1)

    inputs = make_nft_inputs(5, (3, 7, 9), torch.bfloat16, seed=10)
    record = RecordGraphs(backend)
    loss, grad = loss_and_grad(torch.compile(step, backend=record, fullgraph=True), inputs)
    loss_eager, grad_eager = loss_and_grad(step, inputs)
    if backend == "inductor":
        torch.testing.assert_close(loss, loss_eager)
        torch.testing.assert_close(grad, grad_eager)
    else:
        assert torch.equal(loss, loss_eager) and torch.equal(grad, grad_eager)
    (graph,) = record.graphs
    assert op_nodes(graph, FORWARD_OP) == 1 and op_nodes(graph, BACKWARD_OP) == 1


def test_nft_loss_compiles_with_dynamic_shapes():
    """dynamic=True: the second batch size and image size compile nothing new (the fake
    implementation takes symbolic sizes), and both equal eager."""
    record = RecordGraphs("aot_eager")
    compiled = torch.compile(nft.nft_loss, backend=record, fullgraph=True, dynamic=True)
    graphs = []
    for n, shape, seed in ((4, (2, 5, 7), 11), (6, (2, 3, 11), 12)):
        inputs = make_nft_inputs(n, shape, seed=seed)
        loss, grad = loss_and_grad(compiled, inputs, kl_coef=0.2)
        loss_eager, grad_eager = loss_and_grad(nft.nft_loss, inputs, kl_coef=0.2)
        assert torch.equal(loss, loss_eager) and torch.equal(grad, grad_eager)
        graphs.append(len(record.graphs))
    assert graphs[0] == graphs[1] and sum(op_nodes(g, FORWARD_OP) for g in record.graphs) > 0


def test_nft_loss_under_fake_tensor_mode(monkeypatch):
    """FakeTensorMode, forward and backward: the operators' fake implementations give the loss
    and gradient's shapes and dtypes; no value is read (t_index is out of range), no kernel is
    launched, the reference does not run."""
    forbid_launches(monkeypatch)
    monkeypatch.setattr(nft, "_reference_loss", no_reference)
    inputs = make_nft_inputs(5, (3, 7, 9), torch.bfloat16, seed=13)
    inputs["t_index"][0] = 99
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in inputs.items()}
        with RecordOps() as ops:
            loss, grad = loss_and_grad(nft.nft_loss, fake, kl_coef=0.1)
    assert isinstance(loss, FakeTensor) and isinstance(grad, FakeTensor)
    assert loss.shape == () and loss.dtype == torch.float32
    assert grad.shape == inputs["v_theta"].shape and grad.dtype == torch.bfloat16
    assert ops.count(FORWARD_OP) == 1 and ops.count(BACKWARD_OP) == 1


def test_nft_loss_on_meta_runs_the_operators(monkeypatch):
    """A memory plan on meta tensors, in a process without the interpreter (a planner's): the
    kernels' operators run, not the reference, in the forward and in the backward, and launch
    nothing (also without a dispatch mode watching)."""
    monkeypatch.setattr(nft, "_INTERPRET", False)
    monkeypatch.setattr(nft, "_reference_loss", no_reference)
    forbid_launches(monkeypatch)
    inputs = {k: v.to("meta") for k, v in make_nft_inputs(5, (3, 7, 9), seed=14).items()}
    loss_and_grad(nft.nft_loss, inputs, kl_coef=0.1)
    with RecordOps() as ops:
        loss, grad = loss_and_grad(nft.nft_loss, inputs, kl_coef=0.1)
    assert loss.is_meta and loss.shape == () and grad.shape == (5, 3, 7, 9)
    assert ops.count(FORWARD_OP) == 1 and ops.count(BACKWARD_OP) == 1
    with torch.no_grad():  # a plan of an evaluation: the forward alone
        with RecordOps() as ops:
            nft.nft_loss(**inputs)
    assert ops.count(FORWARD_OP) == 1 and ops.count(BACKWARD_OP) == 0


def test_nft_loss_operator_equals_eager():
    """An eager call launches without the operators (their dispatch costs host time); under a
    TorchDispatchMode (here on real tensors, as a memory tracer would watch a GPU run) the call
    goes through them. Both give the same loss and gradient, bit for bit."""
    inputs = make_nft_inputs(6, (3, 5, 11), torch.float16, seed=16)
    with RecordOps() as ops:
        loss, grad = loss_and_grad(nft.nft_loss, inputs, beta=1.3, kl_coef=0.3)
    assert ops.count(FORWARD_OP) == 1 and ops.count(BACKWARD_OP) == 1
    loss_eager, grad_eager = loss_and_grad(nft.nft_loss, inputs, beta=1.3, kl_coef=0.3)
    assert torch.equal(loss, loss_eager) and torch.equal(grad, grad_eager)


class SkipLaunch:
    """Stands in for a @triton.jit kernel: launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_nft_loss_fake_implementations_allocate_what_the_kernels_do(monkeypatch):
    """The operators' fake implementations (here on meta) make the same tensors, in the same
    order, as their real implementations, the kernels' launches aside (the interpreter makes
    tensors of its own): the buffers of launches 1-3 and the copies of inputs that have no (N, D)
    view (channels-last)."""
    for name in ("_nft_partial_sums_kernel", "_nft_rows_kernel", "_nft_grad_kernel"):
        monkeypatch.setattr(nft, name, SkipLaunch())
    inputs = make_nft_inputs(5, (3, 7, 9), torch.float16, seed=15)
    inputs["v_old"] = inputs["v_old"].contiguous(memory_format=torch.channels_last)
    implementations = {
        "cpu": (lambda *a: nft._nft_forward_impl(*a, True), nft._nft_backward_impl),
        "meta": (nft._nft_forward_fake, nft._nft_backward_fake),
    }
    calls = {}
    for device, (forward, backward) in implementations.items():
        on = {k: v.to(device) for k, v in inputs.items()}
        big = [on[k] for k in ARG_NAMES]
        with RecordOps() as ops:
            loss, coefs = forward(*big, 0.7, 5.0, on["v_ref"], 0.1)
            args = (loss, *big[:4], on["v_ref"], coefs, 0.1)
            grad = backward(*args, True) if device == "cpu" else backward(*args)
        assert grad.shape == (5, 3, 7, 9) and grad.dtype == torch.float16
        calls[device] = ops.calls
    assert calls["cpu"] == calls["meta"]
    made = [(func, shapes[0]) for func, shapes in calls["cpu"]]
    copy = (torch.ops.aten.clone.default, ((5, 3, 7, 9), torch.float16))  # v_old's (N, D) rows
    empty = torch.ops.aten.empty.memory_format
    buffers = [(empty, ((5, 2), torch.float32)), (empty, ((), torch.float32))]  # coefs, loss
    buffers += [(empty, ((5, nft._NUM_STATS, 1), torch.float32))]  # launch 1's partial sums
    assert made.count(copy) == 2 and all(buffer in made for buffer in buffers)
    assert made.count((empty, ((5, 3, 7, 9), torch.float16))) == 1  # the gradient
