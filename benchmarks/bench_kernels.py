"""Benchmark of the ReCAST Triton kernels against their PyTorch references.

    python benchmarks/bench_kernels.py [--json results.json]

On a GPU:
- nft_loss forward+backward, with v_ref and κ = 1e-4 (DiffusionNFT's SD3.5 setting), at three sizes:
  toy (N = 128 images of 3×32×32, fp32), SD3.5-Medium at 512 px (N = 16 latents of 16×64×64, bf16)
  and at 1024 px (16 × 16×128×128, bf16). Each size is first checked for correctness on the GPU
  (loss and gradient against the float64 reference, with the tests' rule). Then, for the kernel, the
  eager reference, torch.compile(dynamic=False) of the reference (a fresh compilation per size, of
  the reference without its input checks) and a same-size copy (a copy_ moving the bytes that must
  move: each input read once, the gradient written once): the median time with p20–p80 from
  triton.testing.do_bench, the kernel-only time per call from torch.profiler (the sum of the device
  time of the kernels launched, and their number), GB/s against the bytes that must move, the
  fraction of the copy's bandwidth, speed-ups over eager and compiled, host syncs per call
  (torch.cuda.set_sync_debug_mode) and peak extra memory.
- renyi_gains against the eager (float64) reference for K = 4, T ∈ {10, 25, 40}, N ∈ {512, 4096}
  (rounded up to whole groups), G ∈ {8, 24}, after a correctness check of each.
- the targets (nft_loss ≥ 5× eager and ≥ 1.5× compiled at every size, ≥ 80 % of the copy's
  bandwidth at 1024 px, renyi_gains ≥ 20× eager, no host sync), each marked met or not.
On a CPU it times the PyTorch reference only. Either way it compiles every kernel for sm_90 ahead
of time, with the specialisation (tt.divisibility = 16 on aligned pointers and on integers
divisible by 16) a real launch at each size gives it, and prints registers and spills.
"""

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere
from plumbing import cli
from recast_kernels import nft_loss as nft_module
from recast_kernels import renyi as renyi_module
from recast_kernels.aot import launch_specs, specialised_source

QUANTILES = [0.5, 0.2, 0.8]
SIZES = [  # (label, N, per-image shape, dtype)
    ("toy", 128, (3, 32, 32), torch.float32),
    ("SD3.5 512px", 16, (16, 64, 64), torch.bfloat16),
    ("SD3.5 1024px", 16, (16, 128, 128), torch.bfloat16),
]
N_REWARDS, N_STEPS, KL_COEF = 4, 10, 1e-4
RENYI_T, RENYI_N, RENYI_G = (10, 25, 40), (512, 4096), (8, 24)
TARGETS = dict(vs_eager=5.0, vs_compile=1.5, copy_fraction_1024=0.8, renyi_vs_eager=20.0)
EPS32 = torch.finfo(torch.float32).eps


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


def reference_core(v_theta, v_old, x0, noise, t, t_index, r, W, v_ref, kl_coef):
    """reference_nft_loss without its input checks: what torch.compile is given."""
    return nft_module._reference_loss(
        v_theta, v_old, x0, noise, t, t_index, r, W, 1.0, 5.0, v_ref, kl_coef
    )


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


def host_syncs(fn, label: str = "") -> int:
    """Host-device synchronisations in one call of fn (torch.cuda.set_sync_debug_mode); each one
    is printed with the line that caused it."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # PyTorch's own one-time notice that the mode is a prototype is not a sync.
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    for w in syncs:
        print(f"host sync in {label}: {str(w.message)[:200]} ({w.filename}:{w.lineno})")
    return len(syncs)


def kernel_only(fn, iters: int = 20) -> tuple[float, float]:
    """(device ms per call summed over the kernels, memcpys and memsets it launched; launches per
    call), from torch.profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy_us = sum(e.time_range.elapsed_us() for e in device_events)
    return busy_us / 1e3 / iters, len(device_events) / iters


def timed(fn) -> dict:
    fn()  # compile / warm up
    ms, lo, hi = triton.testing.do_bench(fn, quantiles=QUANTILES)
    kernel_ms, launches = kernel_only(fn)
    return dict(ms=ms, p20=lo, p80=hi, kernel_ms=kernel_ms, launches=launches)


def check_nft(inputs) -> dict:
    """The kernel's loss and gradient against the float64 reference on the GPU, with the tests'
    rule (kernels/test_nft_loss.py::within_rule)."""
    dtype = inputs["v_theta"].dtype

    def loss_grad(fn, args):
        v_theta = args["v_theta"].detach().clone().requires_grad_()
        loss = fn(**{**args, "v_theta": v_theta})
        (grad,) = torch.autograd.grad(loss, v_theta)
        return loss.detach().double(), grad.double()

    upcast = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in inputs.items()}  # fmt: skip
    loss, grad = loss_grad(nft_module.nft_loss, inputs)
    loss_64, grad_64 = loss_grad(reference_core, upcast)
    loss_lp, grad_lp = loss_grad(nft_module.reference_nft_loss, inputs)
    err = dict(
        loss=(loss - loss_64).abs().item(),
        grad=(grad - grad_64).abs().max().item(),
        ref_loss=(loss_lp - loss_64).abs().item(),
        ref_grad=(grad_lp - grad_64).abs().max().item(),
    )
    store = 0.5 * torch.finfo(dtype).eps if dtype != torch.float32 else 0.0
    bound_loss = 2 * err["ref_loss"] + 16 * EPS32 * loss_64.abs().item()
    bound_grad = 2 * err["ref_grad"] + (16 * EPS32 + store) * grad_64.abs().max().item()
    err["ok"] = err["loss"] <= bound_loss and err["grad"] <= bound_grad
    return err


def nft_tables(device, name) -> list[dict]:
    results = []
    for label, n, shape, dtype in SIZES:
        inputs = nft_inputs(n, shape, dtype, device)
        d = inputs["v_theta"][0].numel()
        # each of the 5 inputs read once, the gradient written once
        must_move = 6 * n * d * inputs["v_theta"].element_size()
        print(
            f"\nnft_loss forward+backward on {name}, {label}: N={n}, per image {shape} (D={d}), "
            f"{dtype}, K={N_REWARDS}, T={N_STEPS}, with v_ref; bytes that must move: "
            f"{must_move / 2**20:.1f} MiB"
        )
        check = check_nft(inputs)
        verdict = "ok" if check["ok"] else "FAILED"
        print(
            f"correctness on the GPU ({verdict}): |Δloss| {check['loss']:.2e} (reference at "
            f"{dtype}: {check['ref_loss']:.2e}), max |Δgrad| {check['grad']:.2e} (reference: "
            f"{check['ref_grad']:.2e})"
        )
        row = dict(size=label, n=n, shape=list(shape), dtype=str(dtype), must_move=must_move)
        row["check"] = check
        if not check["ok"]:
            results.append(row)
            continue
        torch._dynamo.reset()  # a fresh compilation for this size, shapes static
        compiled = torch.compile(reference_core, dynamic=False)
        impls = [
            ("triton nft_loss", nft_module.nft_loss),
            ("eager reference", nft_module.reference_nft_loss),
            ("torch.compile(reference)", compiled),
        ]
        rows = {}
        for impl, fn in impls:

            def run(fn=fn, inputs=inputs):
                return forward_backward(fn, inputs)

            rows[impl] = timed(run)
            rows[impl]["syncs"] = host_syncs(run, f"{impl}, {label}")
            rows[impl]["peak_mib"] = peak_extra_mib(run)
        src = torch.empty(must_move // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        rows["same-size copy"] = timed(lambda src=src, dst=dst: dst.copy_(src))
        rows["same-size copy"].update(syncs=0, peak_mib=0.0)
        eager = rows["eager reference"]["ms"]
        compiled_ms = rows["torch.compile(reference)"]["ms"]
        copy = rows["same-size copy"]
        print(
            f"{'implementation':26s} {'median ms':>9s} {'p20-p80 ms':>15s} {'kernel ms':>9s} "
            f"{'launch':>6s} {'GB/s':>6s} {'copy %':>6s} {'vs eager':>8s} {'vs compile':>10s} "
            f"{'syncs':>5s} {'peak MiB':>8s}"
        )
        for impl, m in rows.items():
            m["gbps"] = must_move / m["ms"] / 1e6
            m["copy_fraction"] = copy["ms"] / m["ms"]
            m["copy_fraction_kernel"] = copy["kernel_ms"] / m["kernel_ms"]
            m["vs_eager"], m["vs_compile"] = eager / m["ms"], compiled_ms / m["ms"]
            print(
                f"{impl:26s} {m['ms']:9.3f} {m['p20']:7.3f}-{m['p80']:<7.3f} "
                f"{m['kernel_ms']:9.3f} {m['launches']:6.1f} {m['gbps']:6.0f} "
                f"{100 * m['copy_fraction']:5.0f}% {m['vs_eager']:7.2f}x {m['vs_compile']:9.2f}x "
                f"{m['syncs']:5d} {m['peak_mib']:8.1f}"
            )
        row["impls"] = rows
        results.append(row)
    return results


def renyi_scores(n_rewards, n_steps, n, device):
    gen = torch.Generator().manual_seed(0)
    final = torch.randn(n_rewards, 1, n, generator=gen)
    mix = torch.linspace(0, 1, n_steps + 1)[None, :, None]
    noise = torch.randn(n_rewards, n_steps + 1, n, generator=gen)
    return (mix * final + (1 - mix) * noise).to(device)


def check_renyi(scores, group_size) -> tuple[bool, float, float]:
    """(ok, max |ΔD|, max |Δgains|) of the kernel against the float64 reference on the GPU, with
    the tests' rule at α = 2 (kernels/test_renyi.py::tolerance)."""
    D, gains = renyi_module.renyi_gains(scores, group_size)
    D_64, gains_64 = renyi_module.reference_renyi_gains(scores, group_size)
    D_32, gains_32 = renyi_module._reference_gains(scores, group_size, 2.0, 5.0, torch.float32)
    slack = 64 * EPS32 * 3
    err_D = (D - D_64).abs().max().item()
    err_gains = (gains - gains_64).abs().max().item()
    ok = err_D <= 2 * (D_32 - D_64).abs().max().item() + slack
    ok = ok and err_gains <= 2 * (gains_32 - gains_64).abs().max().item() + 2 * slack
    return ok, err_D, err_gains


def renyi_tables(device, name) -> list[dict]:
    print(f"\nrenyi_gains on {name}: K={N_REWARDS}, fp32 scores, alpha=2")
    print(
        f"{'T':>3s} {'N':>5s} {'G':>3s} {'check':>6s} {'triton ms':>9s} {'kernel ms':>9s} "
        f"{'launch':>6s} {'eager ms':>9s} {'vs eager':>8s} {'syncs':>5s}"
    )
    results = []
    for n_steps in RENYI_T:
        for n_target in RENYI_N:
            for group_size in RENYI_G:
                n = group_size * math.ceil(n_target / group_size)
                scores = renyi_scores(N_REWARDS, n_steps, n, device)
                ok, err_D, err_gains = check_renyi(scores, group_size)
                row = dict(t=n_steps, n=n, g=group_size, ok=ok, err_D=err_D, err_gains=err_gains)
                if ok:

                    def run_kernel(s=scores, g=group_size):
                        return renyi_module.renyi_gains(s, g)

                    def run_eager(s=scores, g=group_size):
                        return renyi_module.reference_renyi_gains(s, g)

                    kernel, eager = timed(run_kernel), timed(run_eager)
                    syncs = host_syncs(run_kernel, f"renyi_gains T={n_steps} N={n_target}")
                    row.update(kernel=kernel, eager=eager, syncs=syncs)
                    row["vs_eager"] = eager["ms"] / kernel["ms"]
                    print(
                        f"{n_steps:3d} {n:5d} {group_size:3d} {'ok':>6s} {kernel['ms']:9.4f} "
                        f"{kernel['kernel_ms']:9.4f} {kernel['launches']:6.1f} "
                        f"{eager['ms']:9.3f} {row['vs_eager']:7.1f}x {syncs:5d}"
                    )
                else:
                    print(f"{n_steps:3d} {n:5d} {group_size:3d} {'FAILED':>6s} |ΔD| {err_D:.2e}")
                results.append(row)
    return results


def targets(nft_rows, renyi_rows) -> list[tuple[str, bool, str]]:
    """(target, met, measured) for each target of the kernels."""
    out = []
    timed_rows = [r for r in nft_rows if "impls" in r]
    correct = all(r["check"]["ok"] for r in nft_rows) and all(r["ok"] for r in renyi_rows)
    out.append(("correct on the GPU (every size, both kernels)", correct, ""))
    for key, label in (("vs_eager", "eager"), ("vs_compile", "torch.compile")):
        speedups = {r["size"]: r["impls"]["triton nft_loss"][key] for r in timed_rows}
        met = len(speedups) == len(SIZES) and min(speedups.values()) >= TARGETS[key]
        measured = ", ".join(f"{k} {v:.2f}x" for k, v in speedups.items())
        out.append((f"nft_loss fwd+bwd >= {TARGETS[key]}x {label} at every size", met, measured))
    big = [r for r in timed_rows if r["size"] == SIZES[-1][0]]
    fraction = big[0]["impls"]["triton nft_loss"]["copy_fraction"] if big else float("nan")
    out.append(
        (
            f"nft_loss at 1024 px >= {TARGETS['copy_fraction_1024']:.0%} of copy bandwidth",
            fraction >= TARGETS["copy_fraction_1024"],
            f"{fraction:.0%}",
        )
    )
    speedups = [r["vs_eager"] for r in renyi_rows if "vs_eager" in r]
    met = bool(speedups) and len(speedups) == len(renyi_rows)
    met = met and min(speedups) >= TARGETS["renyi_vs_eager"]
    measured = f"min {min(speedups):.1f}x, max {max(speedups):.1f}x" if speedups else "not timed"
    out.append((f"renyi_gains >= {TARGETS['renyi_vs_eager']}x eager", met, measured))
    syncs = [r["impls"]["triton nft_loss"]["syncs"] for r in timed_rows]
    syncs += [r["syncs"] for r in renyi_rows if "syncs" in r]
    no_sync = ("no host sync in nft_loss fwd+bwd or renyi_gains", sum(syncs) == 0, str(sum(syncs)))
    out.append(no_sync)
    launches = [r["impls"]["triton nft_loss"]["launches"] for r in timed_rows]
    launches_renyi = [r["kernel"]["launches"] for r in renyi_rows if "kernel" in r]
    out.append(
        (
            "launches: nft_loss fwd+bwd 3 (+1 autograd fill of grad_output), renyi_gains 1",
            all(x == 4 for x in launches) and all(x == 1 for x in launches_renyi),
            f"nft_loss {sorted(set(launches))}, renyi_gains {sorted(set(launches_renyi))}",
        )
    )
    return out


def gpu_tables() -> dict:
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(f"device: {name}, torch {torch.__version__}, triton {triton.__version__}")
    nft_rows = nft_tables(device, name)
    renyi_rows = renyi_tables(device, name)
    met = targets(nft_rows, renyi_rows)
    print("\ntargets")
    for target, ok, measured in met:
        print(f"  [{'met' if ok else 'NOT MET'}] {target}: {measured}")
    return dict(
        device=name,
        torch=torch.__version__,
        triton=triton.__version__,
        nft_loss=nft_rows,
        renyi_gains=renyi_rows,
        targets=[dict(target=t, met=ok, measured=m) for t, ok, m in met],
    )


def cpu_tables() -> dict:
    threads = torch.get_num_threads()
    print(
        "no GPU: measuring the PyTorch reference only (the Triton kernels need CUDA), "
        f"on {threads} CPU threads, torch {torch.__version__}"
    )
    rows = []
    for label, n, shape, dtype in SIZES[:2]:  # 1024 px in bf16 takes seconds per call on a CPU
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
        rows.append(dict(size=label, ms=ms, p20=lo, p80=hi))
    return dict(device="cpu", torch=torch.__version__, reference_nft_loss=rows)


def aot_register_table(capability: int = 90) -> list[dict]:
    print(
        f"\nsm_{capability} ahead-of-time build (triton {triton.__version__}, num_warps=4, "
        "specialised as a real launch at each size: tt.divisibility=16 on aligned pointers and on "
        "integers divisible by 16, integers equal to 1 constant); registers and local memory per "
        "thread from cuobjdump --dump-resource-usage (these kernels have no local arrays, so "
        "local memory = spills)"
    )
    print(f"{'kernel':26s} {'size':13s} {'regs':>5s} {'spill B':>8s} {'shared B':>9s}")
    rows = []
    for label, n, shape, dtype in SIZES:
        dtype_name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
        specs = launch_specs(nft_module, renyi_module, n, math.prod(shape), dtype_name)
        if label != SIZES[-1][0]:
            specs.pop("_renyi_gains_kernel")  # its launch does not depend on the image size
        for name, (fn, values, constexprs) in specs.items():
            compiled = triton.compile(
                specialised_source(fn, values, constexprs),
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
            size = "any" if name == "_renyi_gains_kernel" else label
            print(f"{name:26s} {size:13s} {fields['REG']:>5s} {fields['LOCAL']:>8s} "
                  f"{fields['SHARED']:>9s}")  # fmt: skip
            usage = {k.lower(): int(v) for k, v in fields.items()}
            rows.append(dict(kernel=name, size=size, **usage))
    return rows


def main(argv=None) -> int:
    ap = cli.Parser(prog="bench_kernels.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        cli.fail("--json", f"{args.json}'s folder does not exist: give a file in an existing "
                 "folder (it is written after the whole benchmark has run)", ap.prog)  # fmt: skip
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: this benchmark times and compiles real kernels")
    results = gpu_tables() if torch.cuda.is_available() else cpu_tables()
    results["sm90_registers"] = aot_register_table()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    failed = [t for t in results.get("targets", []) if t["target"].startswith("correct")]
    return 1 if failed and not failed[0]["met"] else 0


if __name__ == "__main__":
    sys.exit(main())
