"""Ahead-of-time compilation of every kernel for real GPUs (sm_80, sm_90); no GPU needed.

The test runs this file as a script in a fresh Python process without TRITON_INTERPRET (a process
whose triton was imported under the interpreter cannot compile). The launches are kernels/aot.py's
(`launch_specs`, the specialisation a real launch gives each kernel) and `edge_specs` below.

    python kernels/test_aot.py 80 90     # prints a JSON report
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(KERNELS_DIR))  # aot.py, beside this file, also when run as a script
from aot import BIG, ROW_STRIDES, launch_specs, specialised_source  # noqa: E402


def edge_specs(nft, renyi):
    """The other branches, dtypes and specialisations: 16-bit pointers that are not aligned,
    integers equal to 1 (N = K = D = 1, one chunk, unit strides), no v_ref, no gradient of a
    second reward, α = 1, T = 1 (not specialised: the kernel marks it)."""
    big = dict.fromkeys(BIG, "*fp16")
    ones = dict.fromkeys(ROW_STRIDES, 1)
    ones |= dict(D=1, n_chunks=1, N=1, K=1, chunk_size=128)
    # fmt: off
    return {
        "_nft_partial_sums_kernel": (
            nft._nft_partial_sums_kernel,
            big | ones | dict(partial_ptr="*fp32", beta=0.5),
            dict(NUM_STATS=nft._NUM_STATS, HAS_REF=False, BLOCK_D=128),
        ),
        "_nft_rows_kernel": (
            nft._nft_rows_kernel,
            ones | dict(partial_ptr="*fp32", t_ptr="*fp16", t_index_ptr="*i32", r_ptr="*fp64",
                        w_ptr="*bf16", coef_ptr="*fp32", loss_ptr="*fp32", n_steps=1,
                        stride_t=1, stride_ti=1, stride_rn=1, stride_rk=1, stride_wk=1,
                        stride_wt=1, beta=0.5, adv_clip_max=5.0, kl_coef=0.0),
            dict(NUM_STATS=nft._NUM_STATS, HAS_REF=False, BLOCK_N=1, BLOCK_C=1, BLOCK_K=1),
        ),
        "_nft_grad_kernel": (
            nft._nft_grad_kernel,
            big | ones
            | dict(coef_ptr="*fp32", grad_out_ptr="*fp32", grad_ptr="*fp16", coef_ref=0.0),
            dict(HAS_REF=False, BLOCK_D=128),
        ),
        "_renyi_gains_kernel": (
            renyi._renyi_gains_kernel,
            dict(scores_ptr="*bf16", divergence_ptr="*fp32", gains_ptr="*fp32", n_steps=1,
                 n_groups=1, group_size=1, stride_k=1, stride_i=1, stride_n=1, alpha=1.0,
                 adv_clip_max=5.0),
            dict(IS_KL=True, BLOCK_M=1, BLOCK_G=1),
        ),
    }
    # fmt: on


def load_kernel_modules():
    """kernels/nft_loss.py and kernels/renyi.py, imported from their files."""
    modules = []
    for name in ("nft_loss", "renyi"):
        spec = importlib.util.spec_from_file_location(name, KERNELS_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def compile_report(capabilities: list[int]) -> dict:
    """Compile every kernel for each sm_<cap>: the SD3.5-Medium 1024 px launch (bf16, aligned) as
    "main", and edge_specs as "edge"."""
    import triton
    from triton.backends.compiler import GPUTarget

    nft, renyi = load_kernel_modules()
    kernels = sorted(
        name
        for module in (nft, renyi)
        for name, obj in vars(module).items()
        if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel")
    )
    variants = {
        "main": (launch_specs(nft, renyi, 16, 16 * 128 * 128, "bf16"), True),
        "edge": (edge_specs(nft, renyi), False),
    }
    report = {"kernels": kernels, "compiled": []}
    for variant, (specs, aligned) in variants.items():
        for name, (fn, values, constexprs) in specs.items():
            for cap in capabilities:
                compiled = triton.compile(
                    specialised_source(fn, values, constexprs, aligned),
                    target=GPUTarget("cuda", cap, 32),
                    options={"num_warps": 4, "enable_fp_fusion": True},
                )
                ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
                report["compiled"].append(
                    dict(
                        name=name,
                        variant=variant,
                        cap=cap,
                        ptx_target=f".target sm_{cap}" in ptx,
                        ptx_entry=f".entry {name}" in ptx,
                        cubin_elf=cubin[:4] == b"\x7fELF",
                        cubin_bytes=len(cubin),
                        divisibility_hints=compiled.asm["ttir"].count("tt.divisibility = 16"),
                        vector_loads=ptx.count("ld.global.v4"),
                    )
                )
    return report


def test_kernels_compile_ahead_of_time():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "80", "90"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    kernels = ["_nft_grad_kernel", "_nft_partial_sums_kernel", "_nft_rows_kernel"]
    assert report["kernels"] == [*kernels, "_renyi_gains_kernel"]
    compiled = {(c["name"], c["variant"], c["cap"]): c for c in report["compiled"]}
    assert set(compiled) == {
        (k, v, cap) for k in report["kernels"] for v in ("main", "edge") for cap in (80, 90)
    }
    for c in compiled.values():
        assert c["ptx_target"] and c["ptx_entry"] and c["cubin_elf"], c
        assert c["cubin_bytes"] > 1000, c
    for name, _, cap in compiled:  # the main variant carries the hints a real launch gives
        main, edge = compiled[(name, "main", cap)], compiled[(name, "edge", cap)]
        assert main["divisibility_hints"] > edge["divisibility_hints"], (main, edge)
    for name in ("_nft_partial_sums_kernel", "_nft_grad_kernel"):  # 16-byte loads of bf16 rows
        assert compiled[(name, "main", 90)]["vector_loads"] > 0, compiled[(name, "main", 90)]


if __name__ == "__main__":
    print(json.dumps(compile_report([int(cap) for cap in sys.argv[1:]])))
