"""The VAE decode's peak memory: measured on a CUDA GPU beside what the memory planner traces.

    python benchmarks/decode_memory.py            # CUDA GPU: measured and traced, one table
    python benchmarks/decode_memory.py --shrink 16  # CPU: the trace alone, a smaller VAE

The scale check (docs/sd35.md) found the planner's phases that decode latents (score, recast,
eval) below the GPU's max_memory_allocated, by more at 1024 px than at 512, while its rollout
and update phases agree. This isolates the decode: SD3.5-Medium's VAE at its real size
(benchmarks/configs, random weights, fp32 as sd3world.py loads it), and each other family's
(`--family`), decodes one chunk of the world's DECODE_CHUNK latents without gradient, in fp32
(the score and eval phases) and under bf16 autocast (`--score-precision bf16`'s step
predictions), and prints, per resolution:

- traced: the peak above the parameters and the latents that memtrace's tracer counts on meta
  tensors in a CUDA GPU's form (the planner's own tracer and attention routing);
- planned: the same with the workspace the memory plan adds to each convolution
  (memtrace.conv_workspace, fitted to this script's measurements on one H200);
- measured: torch.cuda.max_memory_allocated above the same baseline, as PyTorch chooses its
  kernels (default), and with scaled_dot_product_attention limited to the memory-efficient
  kernel (the tracer's choice for fp32 or head width > 256);
- scratch: the largest memory one operator allocates on the GPU beyond its outputs and frees
  before it returns (a cuDNN convolution's workspace, say), and that operator: the tracer sees
  outputs only.

The difference between the columns names what the tracer does not see.
"""

import contextlib
import os
import sys

import torch
import torch.utils._python_dispatch
import torch.utils._pytree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import memtrace, modelzoo  # noqa: E402
from plumbing import cli  # noqa: E402
from plumbing.checkpoints import write_whole  # noqa: E402
from worlds import flux2world, fluxworld, qwenimageworld, sd3world  # noqa: E402

GIB = 2**30


# family (modelzoo's name) → latents per decode: the world's chunk
FAMILIES = {
    "SD3.5-Medium": sd3world.DECODE_CHUNK,
    "FLUX.1-dev": fluxworld.DECODE_CHUNK,
    "FLUX.2-klein 4B": flux2world.DECODE_CHUNK,
    "Qwen-Image": qwenimageworld.DECODE_CHUNK,
}


def vae_of(c: dict, family: str, device: str):
    with torch.device(device):
        return modelzoo.family_vae(c, family).eval().requires_grad_(False)


def latents(vae, n: int, px: int, device: str) -> torch.Tensor:
    """What the world hands vae.decode: (n, C, h, w), Qwen-Image's video VAE (n, C, 1, h, w)."""
    if hasattr(vae.config, "temperal_downsample"):  # Qwen-Image
        f = 2 ** len(vae.config.temperal_downsample)
        return torch.randn(n, vae.config.z_dim, 1, px // f, px // f, device=device)
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    return torch.randn(n, vae.config.latent_channels, px // f, px // f, device=device)


def traced(c: dict, family: str, n: int, px: int, bf16: bool, workspace: bool = False) -> float:
    """GiB above parameters and latents at the traced peak of one decode (meta, CUDA's form);
    `workspace`: with the convolutions' workspaces, as the memory plan counts them."""
    vae = vae_of(c, family, "meta")
    tracker = memtrace.StorageTracker("meta", memtrace.CUDA_ROUND, workspace)
    tracker.add_module(vae)
    form = memtrace.GpuForm("cuda")
    with tracker, form, torch.no_grad():
        z = latents(vae, n, px, "meta")
        tracker.reset_peak()
        base = tracker.peak
        with form.autocasting() if bf16 else contextlib.nullcontext():
            vae.decode(z, return_dict=False)
    return (tracker.peak - base) / GIB


def measured(vae, n: int, px: int, bf16: bool, mode: str) -> float | str:
    """GiB of max_memory_allocated above what was allocated before one decode on CUDA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    z = latents(vae, n, px, "cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    efficient = sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]) if mode == "efficient" else None
    try:
        with efficient or contextlib.nullcontext(), torch.no_grad(), \
                torch.autocast("cuda", torch.bfloat16, enabled=bf16):  # fmt: skip
            vae.decode(z, return_dict=False)
        torch.cuda.synchronize()
    except RuntimeError as e:  # a kernel the limits leave no choice for
        return f"error: {str(e).splitlines()[0][:60]}"
    return (torch.cuda.max_memory_allocated() - base) / GIB


class Scratch(torch.utils._python_dispatch.TorchDispatchMode):
    """Per operator on CUDA: its peak allocation beyond what was live before it and its outputs;
    `convs` collects each convolution's (input shape, weight shape, dtype, stride, padding,
    scratch bytes)."""

    def __init__(self):
        super().__init__()
        self.most, self.op, self.convs = 0, "", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        made = sum(t.untyped_storage().nbytes() for t in torch.utils._pytree.tree_flatten(out)[0]
                   if isinstance(t, torch.Tensor))  # fmt: skip
        extra = torch.cuda.max_memory_allocated() - before - made
        if extra > self.most:
            self.most, self.op = extra, str(func.overloadpacket.__name__)
        if func.overloadpacket is torch.ops.aten.convolution:
            x, w = args[0], args[1]
            self.convs.append((list(x.shape), list(w.shape), str(x.dtype), list(args[3]),
                               list(args[4]), extra))  # fmt: skip
        return out


def scratch(vae, n: int, px: int, bf16: bool, convs: list) -> str:
    z = latents(vae, n, px, "cuda")
    mode = Scratch()
    with mode, torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=bf16):
        vae.decode(z, return_dict=False)
    convs += mode.convs
    return f"{mode.most / GIB:.2f} ({mode.op})"


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="decode_memory.py", description=__doc__.split("\n")[0])
    shrinks = ", ".join(map(str, modelzoo.SHRINKS))
    ap.add_argument("--shrink", type=int, default=0, help=f"widths ÷ F, one of {shrinks} (CPU: "
                    "the trace alone)")  # fmt: skip
    ap.add_argument("--family", choices=[*FAMILIES, "all"], default="all")
    ap.add_argument("--convs", help="CUDA: write every convolution's scratch bytes here (JSON)")
    args = ap.parse_args(argv)
    if args.shrink and args.shrink not in modelzoo.SHRINKS:  # the zoo's widths divide by these
        cli.fail("--shrink", f"must be one of {shrinks}, got {args.shrink}", ap.prog)
    if args.convs and not os.path.isdir(os.path.dirname(os.path.abspath(args.convs))):
        cli.fail("--convs", f"{os.path.dirname(args.convs)} is not a folder: make it first, or "
                 "write the file elsewhere", ap.prog)  # fmt: skip
    cuda = torch.cuda.is_available() and not args.shrink
    if args.convs and not cuda:  # measured only: the trace alone would write nothing
        fix = "drop --shrink" if args.shrink else "run it on a CUDA GPU"
        cli.fail("--convs", f"the convolutions' scratch is measured on a CUDA GPU at the real "
                 f"sizes: {fix}, or drop --convs", ap.prog)  # fmt: skip
    c = modelzoo.load_configs(args.shrink)
    resolutions = (512, 1024) if not args.shrink else (64, 128)
    if cuda:
        print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}, "
              f"cuDNN {torch.backends.cudnn.version()}\n")  # fmt: skip
    modes = ("default", "efficient") if cuda else ()
    head = ["family", "latents", "px", "precision", "traced GiB", "planned GiB"]
    head += [f"measured GiB ({m})" for m in modes] + (["scratch GiB (operator)"] if cuda else [])
    print(f"VAE decode{f' (widths ÷ {args.shrink})' if args.shrink else ''}, the world's "
          "chunk of latents, no gradient; GiB above parameters and latents\n")  # fmt: skip
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    convs: dict[str, list] = {}
    for family in FAMILIES if args.family == "all" else [args.family]:
        n = FAMILIES[family]
        vae = vae_of(c, family, "cuda") if cuda else None
        for px in resolutions:
            for bf16 in (False, True):
                row = [family, str(n), str(px), "bf16 autocast" if bf16 else "fp32"]
                row.append(f"{traced(c, family, n, px, bf16):.2f}")
                row.append(f"{traced(c, family, n, px, bf16, True):.2f}")
                for m in modes:
                    got = measured(vae, n, px, bf16, m)
                    row.append(got if isinstance(got, str) else f"{got:.2f}")
                if cuda:
                    key = f"{family} {px} {'bf16' if bf16 else 'fp32'}"
                    row.append(scratch(vae, n, px, bf16, convs.setdefault(key, [])))
                print("| " + " | ".join(row) + " |", flush=True)
        del vae
        if cuda:
            torch.cuda.empty_cache()
    if args.convs and cuda:
        write_whole(args.convs, convs)


if __name__ == "__main__":
    main()
