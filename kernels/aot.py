"""The kernels' launches as a GPU specialises them, for compiling them ahead of time without a GPU.

`launch_specs` describes each kernel as the wrappers launch it, with the specialisation a real
launch gives it: pointers and integers divisible by 16 carry tt.divisibility = 16 (so loads can be
vectorised), integers equal to 1 become constants; `specialised_source` turns one into the source
`triton.compile` takes. kernels/test_aot.py compiles every kernel for sm_80 and sm_90 from them,
and benchmarks/bench_kernels.py builds its sm_90 register table from the same specs.
"""

DIVISIBLE = [["tt.divisibility", 16]]
BIG = ["v_theta_ptr", "v_old_ptr", "x0_ptr", "noise_ptr", "v_ref_ptr"]  # nft_loss's (N, D) inputs
ROW_STRIDES = ["stride_vt", "stride_vo", "stride_x0", "stride_noise", "stride_ref"]


def specialised_source(fn, values: dict, constexprs: dict, aligned: bool = True):
    """triton.compiler.ASTSource of `fn` as a launch with these argument values specialises it.

    values: pointer arguments as type strings ("*bf16"), integers and floats as Python numbers.
    aligned: whether the pointers are 16-byte aligned (fresh torch allocations are).
    """
    from triton.compiler import ASTSource

    signature, attrs, constants = {}, {}, dict(constexprs)
    for i, param in enumerate(fn.params):
        name = param.name
        if name in constants:
            signature[name] = "constexpr"
            continue
        value = values[name]
        if isinstance(value, str):
            signature[name] = value
            if aligned:
                attrs[(i,)] = DIVISIBLE
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and not param.do_not_specialize:
            signature[name] = "constexpr"
            constants[name] = 1
        else:
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0 and not param.do_not_specialize:
                attrs[(i,)] = DIVISIBLE
    return ASTSource(fn, signature, constants, attrs)


def launch_specs(nft, renyi, n, d, dtype, num_sms=132, n_rewards=4, n_steps=10):
    """{kernel name: (JITFunction, argument values, constexprs)} of nft_loss forward + backward
    on contiguous (n, d) inputs of `dtype` ("bf16", "fp16", "fp32") with v_ref and κ ≠ 0, and of
    renyi_gains on contiguous (K, T+1, 24·48) fp32 scores with G = 24, as the wrappers launch
    them on a GPU with num_sms SMs."""
    block_d, chunk_size, n_chunks = nft._launch_shape(n, d, num_sms)
    block_n, block_c, block_k = nft._rows_tile(n_chunks, n_rewards)
    big = dict.fromkeys(BIG, "*" + dtype)
    strides = dict.fromkeys(ROW_STRIDES, d)
    chunks = dict(D=d, chunk_size=chunk_size, n_chunks=n_chunks)
    group_size, n_groups = 24, 48
    block_g = 32
    # fmt: off
    return {
        "_nft_partial_sums_kernel": (
            nft._nft_partial_sums_kernel,
            big | strides | chunks | dict(partial_ptr="*fp32", beta=1.0),
            dict(NUM_STATS=nft._NUM_STATS, HAS_REF=True, BLOCK_D=block_d),
        ),
        "_nft_rows_kernel": (
            nft._nft_rows_kernel,
            dict(partial_ptr="*fp32", t_ptr="*fp32", t_index_ptr="*i64", r_ptr="*fp32",
                 w_ptr="*fp32", coef_ptr="*fp32", loss_ptr="*fp32", N=n, D=d, K=n_rewards,
                 n_steps=n_steps, n_chunks=n_chunks, stride_t=1, stride_ti=1,
                 stride_rn=n_rewards, stride_rk=1, stride_wk=n_steps, stride_wt=1,
                 beta=1.0, adv_clip_max=5.0, kl_coef=1e-4),
            dict(NUM_STATS=nft._NUM_STATS, HAS_REF=True, BLOCK_N=block_n, BLOCK_C=block_c,
                 BLOCK_K=block_k),
        ),
        "_nft_grad_kernel": (
            nft._nft_grad_kernel,
            big | strides | chunks
            | dict(coef_ptr="*fp32", grad_out_ptr="*fp32", grad_ptr="*" + dtype, N=n, coef_ref=0.1),
            dict(HAS_REF=True, BLOCK_D=block_d),
        ),
        "_renyi_gains_kernel": (
            renyi._renyi_gains_kernel,
            dict(scores_ptr="*fp32", divergence_ptr="*fp32", gains_ptr="*fp32", n_steps=n_steps,
                 n_groups=n_groups, group_size=group_size, stride_k=(n_steps + 1) * 24 * 48,
                 stride_i=24 * 48, stride_n=1, alpha=2.0, adv_clip_max=5.0),
            dict(IS_KL=False, BLOCK_M=min(64, renyi._TILE // block_g), BLOCK_G=block_g),
        ),
    }
    # fmt: on
