"""Trace the device memory of PyTorch calls without running them: on meta tensors, as a GPU would.

`StorageTracker` is a TorchDispatchMode that sees every tensor an operator makes, adds its
storage's bytes when it is made and subtracts them when Python frees it, and keeps the peak with
its split into parameters, gradients, optimizer state, data held from earlier phases, activations
(made by forwards) and temporaries (made by backward and the optimizer step). On meta tensors
nothing is allocated, so SD3.5-Medium's real-size models trace on a laptop.

`GpuForm` is a TorchFunctionMode that makes meta calls take the memory path a CUDA GPU takes:
- attention: `F.scaled_dot_product_attention` on meta takes the math path and materialises the
  L × L scores (3× too much in a test); it is routed to the flash kernel a GPU would choose (bf16
  / fp16, head dim ≤ 256, no mask) or else the memory-efficient one; `target="cpu"` routes to the
  CPU's flash kernel instead (for the check against the CPU allocator);
- autocast: `torch.autocast` does nothing on meta, so `autocasting()` applies CUDA autocast's
  casts from outside, above autograd as autocast itself does (so that what backward saves is the
  cast copy): LOWER ops get their fp32 inputs cast to bf16, FP32 ops their bf16/fp16 inputs cast
  to fp32;
- host values: a small host tensor copied to the device (token ids, an attention mask) keeps its
  values beside its meta copy, and calls on such tensors compute them too, so that what reads a
  value on the host (`.item()`, `.tolist()`, `torch.equal`, a boolean mask as an index) gets it:
  transformers' padding masks and Qwen-Image's prompt extraction read their masks so; an op with no
  meta kernel for such inputs (repeat_interleave by counts) runs on the values, its output moved.

Why not torch.distributed._tools.mem_tracker.MemTracker: in torch 2.13 it raises on frozen
parameters (a grad hook on each) and on a root module called twice (world.v calls the transformer 3
times per pair), and deep-copies a snapshot per operator (≈ 100 s for one SD3.5 training step).
What neither counts: the CUDA context, cuBLAS workspaces, the caching allocator's fragmentation
(reserved − allocated); cuDNN's convolution workspaces only with `conv_workspace` (as one H200
measured them).
"""

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

KINDS = ("parameters", "gradients", "optimizer", "data", "activations", "temporaries")
CUDA_ROUND = 512  # the CUDA caching allocator rounds every allocation up to 512 bytes


class StorageTracker(TorchDispatchMode):
    """Live and peak bytes by kind of the tensors on `device` (host tensors are not the GPU's).
    `round_to`: allocation granularity (CUDA_ROUND for a GPU; 1 for the CPU allocator's sizes).
    `conv_workspace`: count what a convolution allocates while it runs beyond its output
    (cuDNN's workspace, as `conv_workspace` below: measured on one GPU) as a temporary; off,
    operators' outputs only."""

    def __init__(self, device: str = "meta", round_to: int = CUDA_ROUND,
                 conv_workspace: bool = False):  # fmt: skip
        super().__init__()
        self.device, self.round_to, self.conv_workspace = device, round_to, conv_workspace
        self._upsampled: set[int] = set()  # live storages an upsampling made (keys of _seen)
        self.kind = "activations"  # of what operators make now
        self.live = dict.fromkeys(KINDS, 0)
        self.peak, self.peak_split = 0, dict(self.live)
        self._seen: dict[int, list] = {}  # storage id → [kind, bytes, weakref]

    def _bytes(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        return -(-n // self.round_to) * self.round_to if n else 0

    def add(self, t: torch.Tensor, kind: str | None = None, nbytes: int | None = None) -> None:
        """Count tensor `t`'s storage (once) as `kind` (default: the current kind); a storage
        already counted is moved to `kind` when one is given. `nbytes`: count this many bytes
        instead of the storage's (a rank's shard of a tensor the trace holds whole)."""
        if t.device.type != self.device:
            return
        st = t.untyped_storage()
        key = st._cdata
        if key in self._seen:
            entry = self._seen[key]
            if kind is not None and entry[0] != kind:
                self.live[entry[0]] -= entry[1]
                self.live[kind] += entry[1]
                entry[0] = kind
            return
        kind = kind or self.kind
        n = self._bytes(st) if nbytes is None else -(-nbytes // self.round_to) * self.round_to
        entry = [kind, n, None]
        entry[2] = weakref.ref(st, lambda _, key=key: self._free(key))
        self._seen[key] = entry
        self.live[kind] += n
        self._update_peak()

    def _free(self, key: int) -> None:
        self._upsampled.discard(key)
        entry = self._seen.pop(key, None)
        if entry is not None:
            self.live[entry[0]] -= entry[1]

    def _update_peak(self) -> None:
        total = sum(self.live.values())
        if total > self.peak:
            self.peak, self.peak_split = total, dict(self.live)

    def add_all(self, tensors, kind: str) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self.add(t, kind)

    def add_module(self, module: torch.nn.Module, share=None) -> None:
        """The module's parameters (`share`: as in add_optimizer) and buffers."""
        for p in module.parameters():
            self.add(p, "parameters", None if share is None else int(p.nbytes * share(p)))
        self.add_all(module.buffers(), "parameters")

    def add_optimizer(self, optimizer: torch.optim.Optimizer, share=None) -> None:
        """The optimizer's state; `share(p)`: the share of parameter p's bytes a rank holds."""
        for p, state in optimizer.state.items():
            for t in state.values():
                if isinstance(t, torch.Tensor):
                    scaled = share is not None and t.dim() > 0
                    self.add(t, "optimizer", int(t.nbytes * share(p)) if scaled else None)

    def watch_grads(self, params, share=None) -> list:
        """Count each parameter's .grad as a gradient once backward has accumulated it (`share`:
        as in add_optimizer)."""

        def count(p):
            if p.grad is None:  # no gradient reached it, yet a full backward hook (--shard's
                return  # plan) fired its hook: Qwen-Image's last text-stream adapters
            self.add(p.grad, "gradients", None if share is None else int(p.grad.nbytes * share(p)))

        return [p.register_post_accumulate_grad_hook(count) for p in params]

    @contextlib.contextmanager
    def making(self, kind: str) -> Iterator[None]:
        """What operators make inside is counted as `kind`."""
        saved, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = saved

    def carry(self) -> None:
        """What earlier phases made and still hold becomes "data" (a new phase starts)."""
        for entry in self._seen.values():
            if entry[0] in ("activations", "temporaries"):
                self.live[entry[0]] -= entry[1]
                self.live["data"] += entry[1]
                entry[0] = "data"

    def reset_peak(self) -> None:
        self.peak, self.peak_split = sum(self.live.values()), dict(self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.add, out)
        if not self.conv_workspace:
            return out
        if func.overloadpacket in UPSAMPLING and out.untyped_storage()._cdata in self._seen:
            self._upsampled.add(out.untyped_storage()._cdata)  # _free forgets it
        elif func.overloadpacket is torch.ops.aten.convolution:
            after = args[0].untyped_storage()._cdata in self._upsampled
            n = conv_workspace(args[0], out, after)
            scratch = -(-n // self.round_to) * self.round_to
            self.live["temporaries"] += scratch  # held while the convolution runs, then freed
            self._update_peak()
            self.live["temporaries"] -= scratch
        return out


UPSAMPLING = {torch.ops.aten.upsample_nearest2d, torch.ops.aten.upsample_nearest3d}


def conv_workspace(x: torch.Tensor, out: torch.Tensor, after_upsampling: bool) -> int:
    """Bytes a cuDNN convolution allocates while it runs, beyond its output, as one NVIDIA H200
    measured them (torch 2.11, cuDNN 9.19; every convolution of each family's VAE decode at 512
    and 1024 px, fp32 and bf16 autocast: `python benchmarks/decode_memory.py --convs FILE`,
    docs/gpu/h200_decode_memory.md and h200_decode_convs.json): a copy of its input and of its
    output (their bytes, within a few %), except where the input comes straight from a nearest
    upsampling (≈ 0)."""
    return 0 if after_upsampling else x.nbytes + out.nbytes


# CUDA autocast's op lists (PyTorch's autocast_mode.cpp / the AMP docs), by the Python name a
# TorchFunctionMode sees (torch.x, Tensor.x, F.x)
LOWER = {
    "linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "baddbmm", "addmm", "addbmm",
    "addmv", "addr", "mv", "einsum", "chain_matmul", "multi_dot", "prelu", "conv1d", "conv2d",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "scaled_dot_product_attention",
}  # fmt: skip
FP32 = {
    "layer_norm", "group_norm", "softmax", "log_softmax", "softmin", "exp", "expm1", "log",
    "log10", "log2", "log1p", "pow", "__pow__", "__rpow__", "__rtruediv__", "__rdiv__", "rsqrt",
    "reciprocal", "sum", "prod", "cumsum", "cumprod", "norm", "normalize", "softplus", "mse_loss",
    "l1_loss", "smooth_l1_loss", "cosine_similarity", "logsumexp", "cdist", "dist", "renorm",
    "acos", "asin", "cosh", "sinh", "tan", "erfinv", "interpolate",
}  # fmt: skip
HALF = (torch.bfloat16, torch.float16)
VALUE = "_host_value"  # the attribute of a meta tensor that holds its values on the host
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "equal"}
HOST_NUMEL = 2**20  # the largest host tensor whose values a meta copy keeps (token ids, masks)


def _values(tree):
    """`tree` with every meta tensor replaced by its host values; None when one has none, or when
    it holds no meta tensor."""
    seen = missing = False

    def value(t: torch.Tensor):
        nonlocal seen, missing
        if t.device.type != "meta":
            return t
        seen, v = True, getattr(t, VALUE, None)
        missing = missing or v is None
        return v

    out = tree_map_only(torch.Tensor, value, tree)
    return out if seen and not missing else None


def _keep_values(out, host) -> None:
    """Attach the host values `host` to the meta tensors of `out`, leaf by leaf."""
    outs, hosts = tree_flatten(out)[0], tree_flatten(host)[0]
    for o, h in zip(outs, hosts, strict=False):
        if isinstance(o, torch.Tensor) and o.device.type == "meta" and isinstance(h, torch.Tensor):
            if h.device.type != "meta":  # not one made on the device (`device=` given)
                setattr(o, VALUE, h)


def _mask_indices(t: torch.Tensor):
    v = getattr(t, VALUE, None)
    if t.dtype != torch.bool or v is None:
        return t
    return tuple(i.to(t.device) for i in v.nonzero(as_tuple=True))


class GpuForm(TorchFunctionMode):
    """Meta calls in the memory form of `target` ("cuda", or "cpu" for the allocator check):
    attention routed to the fused kernel that device runs, and inside `autocasting()` CUDA
    autocast's casts to `dtype` (on "cuda" only: the CPU form runs in fp32 as sd3world does)."""

    def __init__(self, target: str = "cuda", dtype=torch.bfloat16):
        super().__init__()
        self.target, self.autocast, self.dtype = target, False, dtype

    @contextlib.contextmanager
    def autocasting(self) -> Iterator[None]:
        """What torch.autocast("cuda", dtype) does on a GPU, on meta tensors."""
        saved, self.autocast = self.autocast, self.target == "cuda"
        try:
            yield
        finally:
            self.autocast = saved

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if self.autocast and name in LOWER:
            args, kwargs = self._cast((args, kwargs), torch.float32, self.dtype)
        elif self.autocast and name in FP32:
            args, kwargs = self._cast((args, kwargs), HALF, torch.float32)
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        values = _values((args, kwargs))
        if values is not None and name in HOST_READS:
            return func(*values[0], **values[1])
        if name == "__getitem__":  # a boolean mask with values: the indices it selects
            args = (args[0], *tree_map_only(torch.Tensor, _mask_indices, args[1:]))
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):  # no meta kernel without the values
            if values is None:  # (repeat_interleave's counts, a Qwen2-VL image grid's sizes)
                raise
            host = func(*values[0], **values[1])
            out = tree_map_only(torch.Tensor, lambda h: h.to("meta"), host)
            _keep_values(out, host)
            return out
        if values is not None:
            _keep_values(out, func(*values[0], **values[1]))
        elif "device" in kwargs and isinstance(out, torch.Tensor) and out.device.type == "meta":
            leaves = tree_flatten((args, kwargs))[0]
            if out.numel() <= HOST_NUMEL and not any(isinstance(x, torch.Tensor) for x in leaves):
                _keep_values(out, func(*args, **{**kwargs, "device": "cpu"}))  # a small factory
        if name == "to" and isinstance(out, torch.Tensor) and out.device.type == "meta":
            host = getattr(args[0], VALUE, args[0])  # a host tensor copied to the device
            if host.device.type != "meta" and host.numel() <= HOST_NUMEL:
                setattr(out, VALUE, host.to(out.dtype))
        return out

    def checkpoint_function(self) -> Callable:
        """A gradient_checkpointing_func for diffusers' enable_gradient_checkpointing: diffusers'
        default (torch's non-reentrant checkpoint), with this form re-entered, autocast as it was
        in the forward, for the recomputation in backward: torch.utils.checkpoint restores
        torch.autocast there, but backward does not see torch function modes."""

        @contextlib.contextmanager
        def again(autocast: bool):
            with GpuForm(self.target, self.dtype) as form:
                form.autocast = autocast
                yield

        def function(module, *args):
            state = self.autocast
            return torch.utils.checkpoint.checkpoint(
                module.__call__, *args, use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), again(state)),
            )  # fmt: skip

        return function

    @staticmethod
    def _cast(tree, source, to):
        source = source if isinstance(source, tuple) else (source,)

        def cast(t):
            return t.to(to) if t.is_floating_point() and t.dtype in source else t

        return tree_map_only(torch.Tensor, cast, tree)

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):  # fmt: skip
        q, k, v = query, key, value  # F.scaled_dot_product_attention's names: passed by keyword
        if enable_gqa or q.shape[-3] != k.shape[-3]:
            return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
                                                  scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        if self.target == "cpu":
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the CPU's SDPA does
                attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(
                    ~attn_mask, -math.inf
                )
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
            )[0]
        if attn_mask is None and q.dtype in HALF and q.shape[-1] <= 256:
            return torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale
            )[0]
        bias = None
        if attn_mask is not None:  # the efficient kernel takes an additive bias of full shape
            if attn_mask.dtype == torch.bool:
                attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype)
            bias = attn_mask.expand(*q.shape[:-1], k.shape[-2])
        grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, grad, dropout_p, is_causal, scale=scale
        )[0]
