"""Triton kernels of ReCAST (DESIGN §7): recast_kernels.nft_loss and recast_kernels.renyi.

Each file is self-contained (torch, triton, math) and can be copied alone. Nothing is re-exported
here, so that `recast_kernels.nft_loss` always names the module, never the function of the same
name. Their tests are recast_kernels/test_*.py; docs/kernels.md documents both, with the benchmark
and the GPU check (benchmarks/bench_kernels.py, benchmarks/gpu_check.py).

The folder is not named `kernels`: that is the import name of Hugging Face's kernels library,
which transformers ≥ 5.25 requires and imports, and a folder of that name at the repository's root
would stand in for it (test_recast.py pins that no top-level name of this repository is taken).
"""
