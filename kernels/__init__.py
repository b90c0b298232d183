"""Triton kernels of ReCAST (DESIGN §7): kernels.nft_loss and kernels.renyi.

Each file is self-contained (torch, triton, math) and can be copied alone. Nothing is re-exported
here, so that `kernels.nft_loss` always names the module, never the function of the same name.
Their tests are kernels/test_*.py; docs/kernels.md documents both, with the benchmark and the GPU
check (benchmarks/bench_kernels.py, benchmarks/gpu_check.py). kernels.aot describes their launches
for the ahead-of-time compile tests (kernels/test_aot.py); a trainer copying a kernel needs none.
"""
