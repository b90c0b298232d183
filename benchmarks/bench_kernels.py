"""Benchmark of the ReCAST Triton kernels against their PyTorch references.

    python benchmarks/bench_kernels.py

On a GPU, for nft_loss forward+backward at SD3.5-Medium size (N = 16 latents of 16×64×64, bf16)
and at the toy size (N = 128 images of 3×32×32, fp32), with v_ref and κ = 1e-4 as in training:
median ms with p20–p80 (triton.testing.do_bench), GB/s against the bytes that must move (each
input read once, the gradient written once), speed-up over the eager reference and over
torch.compile of it, and peak extra memory; then renyi_gains at a training-like size. On CPU it
times the PyTorch reference only. Either way it compiles every kernel for sm_90 ahead of time and
prints registers and spills (from the cubin's resource usage; needs no GPU).
"""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from kernels import nft_loss as nft_module  # noqa: E402
from kernels import renyi as renyi_module  # noqa: E402

QUANTILES = [0.5, 0.2, 0.8]
SIZES = [  # (label, N, per-image shape, dtype)
    ("SD3.5-Medium", 16, (16, 64, 64), torch.bfloat16),
    ("toy", 128, (3, 32, 32), torch.float32),
]
N_REWARDS, N_STEPS, KL_COEF = 4, 10, 1e-4


def nft_inputs(n, shape, dtype, device):
    gen = torch.Generator().manual_seed(0)
    big = [torch.randn(n, *shape, generator=gen).to(device, dtype) for _ in range(5)]
    return dict(
        v_theta=big[0].requires_grad_(), v_old=big[1], x0=big[2], noise=big[3], v_ref=big[4],
        t=(0.05 + 0.95 * torch.rand(n, generator=gen)).to(device),
        t_index=torch.randint(0, N_STEPS, (n,), generator=gen).to(device),
        r=torch.rand(n, N_REWARDS, generator=gen).to(device),
        W=torch.full((N_REWARDS, N_STEPS), 1.0 / (N_REWARDS * N_STEPS), device=device),
        kl_coef=KL_COEF,
    )  # fmt: skip


def forward_backward(loss_fn, inputs):
    loss = loss_fn(**inputs)
    return torch.autograd.grad(loss, inputs["v_theta"])


def peak_extra_mib(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def gpu_tables() -> None:
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    impls = [
        ("triton nft_loss", nft_module.nft_loss),
        ("eager reference", nft_module.reference_nft_loss),
        ("torch.compile(reference)", torch.compile(nft_module.reference_nft_loss)),
    ]
    header = ["implementation", "median ms", "p20-p80 ms", "GB/s", "vs eager", "vs compile"]
    for label, n, shape, dtype in SIZES:
        inputs = nft_inputs(n, shape, dtype, device)
        d = inputs["v_theta"][0].numel()
        must_move = 6 * n * d * inputs["v_theta"].element_size()  # read 5 inputs, write 1 gradient
        print(
            f"\nnft_loss forward+backward on {name}, {label}: N={n}, per image {shape} (D={d}), "
            f"{dtype}, K={N_REWARDS}, T={N_STEPS}, with v_ref; bytes that must move: "
            f"{must_move / 2**20:.1f} MiB"
        )
        rows = []
        for impl, fn in impls:

            def run(fn=fn, inputs=inputs):
                return forward_backward(fn, inputs)

            run()  # compile / warm up
            ms, lo, hi = triton.testing.do_bench(run, quantiles=QUANTILES)
            rows.append((impl, ms, lo, hi, peak_extra_mib(run)))
        eager, compiled = rows[1][1], rows[2][1]
        print("{:26s} {:>9s} {:>15s} {:>7s} {:>8s} {:>10s}".format(*header), "peak extra MiB")
        for impl, ms, lo, hi, mib in rows:
            print(
                f"{impl:26s} {ms:9.3f} {lo:7.3f}-{hi:<7.3f} {must_move / ms / 1e6:7.0f} "
                f"{eager / ms:7.2f}x {compiled / ms:9.2f}x {mib:14.1f}"
            )
    n_rewards, n_steps, group_size, n_images = 4, 10, 24, 24 * 48
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(n_rewards, n_steps + 1, n_images, generator=gen).to(device)
    print(
        f"\nrenyi_gains on {name}: K={n_rewards}, T={n_steps}, N={n_images}, G={group_size}, fp32"
    )
    for impl, fn in [
        ("triton renyi_gains", renyi_module.renyi_gains),
        ("eager reference", renyi_module.reference_renyi_gains),
    ]:
        ms, lo, hi = triton.testing.do_bench(
            lambda fn=fn: fn(scores, group_size), quantiles=QUANTILES
        )
        print(f"{impl:26s} {ms:9.3f} ms (p20-p80 {lo:.3f}-{hi:.3f})")


def cpu_tables() -> None:
    threads = torch.get_num_threads()
    print(
        "no GPU: measuring the PyTorch reference only (the Triton kernels need CUDA), "
        f"on {threads} CPU threads, torch {torch.__version__}"
    )
    for label, n, shape, dtype in SIZES:
        inputs = nft_inputs(n, shape, dtype, torch.device("cpu"))
        times = []
        for _ in range(6):
            start = time.perf_counter()
            forward_backward(nft_module.reference_nft_loss, inputs)
            times.append(1e3 * (time.perf_counter() - start))
        ms, lo, hi = torch.tensor(times[1:]).quantile(torch.tensor(QUANTILES)).tolist()
        print(
            f"reference_nft_loss forward+backward, {label}: N={n}, per image {shape}, {dtype}, "
            f"with v_ref: median {ms:.1f} ms (p20-p80 {lo:.1f}-{hi:.1f}), CPU"
        )


def aot_sources():
    """(name, ASTSource) of every kernel as launched at SD3.5-Medium size (bf16, v_ref, grad)."""
    big = ("v_theta_ptr", "v_old_ptr", "x0_ptr", "noise_ptr", "v_ref_ptr")
    pointers = dict.fromkeys(big, "*bf16") | {"grad_ptr": "*bf16", "t_index_ptr": "*i64"}
    # (kernel, its fp32 scalar arguments, constexprs); other pointers are fp32, other scalars i32
    specs = [
        (
            nft_module._nft_partial_sums_kernel,
            {"beta"},
            dict(NUM_STATS=5, HAS_REF=True, BLOCK_D=1024),
        ),
        (
            nft_module._nft_loss_grad_kernel,
            {"n_steps", "beta", "adv_clip_max", "kl_coef"},
            dict(NUM_STATS=5, HAS_REF=True, WRITE_GRAD=True, BLOCK_D=1024, BLOCK_C=32, BLOCK_K=4),
        ),
        (
            renyi_module._renyi_divergence_kernel,
            {"alpha", "log_group_size", "adv_clip_max"},
            dict(IS_KL=False, BLOCK_M=32, BLOCK_G=32),
        ),
    ]
    sources = []
    for fn, floats, constexprs in specs:
        signature = {}
        for arg in fn.arg_names:
            if arg in constexprs:
                signature[arg] = "constexpr"
            elif arg.endswith("_ptr"):
                signature[arg] = pointers.get(arg, "*fp32")
            else:
                signature[arg] = "fp32" if arg in floats else "i32"
        sources.append((fn.__name__, ASTSource(fn, signature, constexprs)))
    return sources


def aot_register_table(capability: int = 90) -> None:
    print(
        f"\nsm_{capability} ahead-of-time build (triton {triton.__version__}, num_warps=4; "
        "registers and local memory per thread from cuobjdump --dump-resource-usage; these "
        "kernels have no local arrays, so local memory = spills)"
    )
    print(f"{'kernel':28s} {'regs':>5s} {'spill B':>8s} {'shared B':>9s}")
    for name, source in aot_sources():
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", capability, 32),
            options={"num_warps": 4, "enable_fp_fusion": True},
        )
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp) / f"{name}.cubin"
            cubin.write_bytes(compiled.asm["cubin"])
            usage = subprocess.run(
                [triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
                capture_output=True, text=True, check=True,
            ).stdout  # fmt: skip
        fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage))
        print(f"{name:28s} {fields['REG']:>5s} {fields['LOCAL']:>8s} {fields['SHARED']:>9s}")


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this benchmark times and compiles real kernels")
    if torch.cuda.is_available():
        gpu_tables()
    else:
        cpu_tables()
    aot_register_table()
