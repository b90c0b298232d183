"""pytest set-up shared by every test file: the Triton interpreter for the kernel tests on CPU.

Triton reads TRITON_INTERPRET when @triton.jit decorates a function: ours when kernels/*.py is
imported, and triton.language's own jit helpers (tl.sum, tl.zeros, ...) when triton itself is first
imported; it reads the setting again while launching. An interpreted kernel cannot call a compiled
helper, and a kernel cannot be compiled in a process whose helpers are interpreted. Hence, since
pytest imports this file before any test module:
- it sets TRITON_INTERPRET=1 before the first `import triton` of the process (torch and pytest do
  not import triton), pins the setting for this process with triton.knobs, and restores the
  environment, so that subprocesses (recast.py runs, the ahead-of-time compilation test) are not
  interpreted. Every nft_loss/renyi_gains call on CPU tensors in this pytest process then runs the
  (slow) interpreted kernels, in kernels/test_*.py and in test_recast.py alike (except whole runs
  started with test_recast.main_here, which take the reference path as `python recast.py` does);
- if triton was imported earlier (a plugin, or pytest started from a process that had imported it),
  it stops with a message saying so rather than letting the kernel tests compare the reference
  with itself.

On a GPU machine, `RECAST_TEST_DEVICE=cuda python -m pytest ...` leaves the interpreter off: the
kernel tests then compile the kernels and run them on CUDA tensors, and the tiny-SD3 end-to-end
test trains on CUDA (benchmarks/gpu_check.py does this).
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of `pytest -n N`: N workers share the cores,
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # so one thread each (before torch is imported)

if os.environ.get("RECAST_TEST_DEVICE", "cpu") == "cpu":
    _saved_flag = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton
        import triton.language as tl

        _interpreted = type(tl.zeros).__name__ == "InterpretedFunction"
        if _interpreted:
            # Pins the interpreter for this process from here on. Setting the knob also writes
            # TRITON_INTERPRET into the environment, so the environment is restored after it.
            triton.knobs.runtime.interpret = True
    finally:
        os.environ.pop("TRITON_INTERPRET", None)
        if _saved_flag is not None:
            os.environ["TRITON_INTERPRET"] = _saved_flag
    if not _interpreted:
        raise RuntimeError(
            "triton was imported before conftest.py set TRITON_INTERPRET=1, so the kernel tests "
            "cannot run the Triton interpreter: start pytest in a fresh process, without plugins "
            "or sitecustomize that import triton (or set RECAST_TEST_DEVICE=cuda on a GPU)"
        )
