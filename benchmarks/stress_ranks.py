"""Do finished multi-rank runs exit 0 on a busy machine? The 2-rank tests, repeated under load.

    python -m benchmarks.stress_ranks --repeats 20 --load 4      # about an hour on 2 cores

Each repeat runs the 2-rank tests that train to the end under torchrun (the sharded run against
DDP on the tiny SD3, and the toy world's DDP run against one process), and the sharded loading's
host-memory test, with pytest, while `--load` busy processes keep the CPUs loaded; they stop by
themselves after `--load-minutes` (default: the check's own estimate, 4 minutes a repeat) and are
stopped at the end whatever happens. Every rank's output is kept (test_recast.torchrun_args),
under OUT/repeat_NN/; the check counts, per repeat, the tests that failed and the ranks that ended
in `terminate called without an active exception` (SIGABRT after the run's work was done), and
prints a line a repeat and the totals, then each loading rank's host memory over the repeats
(min, median, max: the spread its bounds are set from). It exits 1 if any rank aborted or any
test failed.

--idle runs the same repeats without the load (the memory's spread, busy against idle);
--memory-only runs the loading test alone (its spread in a minute a repeat).
--code DIR runs the tests of another checkout (a worktree of an older commit: the count before
a fix), this file's own by default.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))
from plumbing import cli  # noqa: E402

TESTS = [
    "plumbing/test_shard.py::test_a_sharded_run_equals_ddp[sd3]",
    "test_recast.py::test_torchrun_two_ranks_stay_identical_and_match_one_process",
    "plumbing/test_shard.py::test_sharded_loading_holds_less_than_a_whole_copy_per_rank",
]
MEMORY = ("peak", "file", "hwm")  # the loading test's memory.json, per rank, bytes
ABORT = "terminate called without an active exception"
BUSY = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def busy(n: int, seconds: float) -> list[subprocess.Popen]:
    """n processes that keep a CPU busy each and end by themselves after `seconds`."""
    code = BUSY.format(seconds=seconds)
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(n)]


def aborts(folder: Path) -> list[Path]:
    """The rank logs under `folder` whose process ended in std::terminate."""
    found = []
    for log in folder.rglob("stderr.log"):
        if ABORT in log.read_text(errors="replace"):
            found.append(log)
    return found


def memory(folder: Path) -> dict[str, dict[str, float]]:
    """The loading test's measures under `folder`, {rank: {peak, file, hwm}} in MB ({} if none)."""
    found = sorted(folder.rglob("memory.json"))
    if not found:
        return {}
    said = json.loads(found[0].read_text())
    return {r: {k: x[k] / 1e6 for k in MEMORY if k in x} for r, x in said.items()}


def spread(per_repeat: list[dict]) -> list[str]:
    """Lines 'rank R measure: min / median / max MB over n repeats'."""
    lines = []
    for rank in sorted({r for m in per_repeat for r in m}):
        for k in MEMORY:
            xs = sorted(m[rank][k] for m in per_repeat if rank in m and k in m[rank])
            if xs:
                lines.append(f"rank {rank} {k}: {xs[0]:.1f} / {statistics.median(xs):.1f} / "
                             f"{xs[-1]:.1f} MB over {len(xs)} repeats")  # fmt: skip
    return lines


def repeat(out: Path, tests: list[str], code: Path = HERE) -> tuple[int, list[Path], float]:
    """One pytest run of `tests` in checkout `code`, its temporary folders under `out`: (tests
    failed, the rank logs that show an abort, seconds)."""
    tic = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                           "slow or not slow", f"--basetemp={out}", *tests], cwd=code,
                          capture_output=True, text=True)  # fmt: skip
    (out / "pytest.log").write_text(done.stdout + done.stderr)
    failed = sum(1 for line in done.stdout.splitlines() if line.startswith("FAILED"))
    if done.returncode and not failed:  # an error before any test ran: count it as one
        failed = 1
    return failed, aborts(out), time.monotonic() - tic


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="stress_ranks.py", description=__doc__,
                    formatter_class=cli.HelpFormatter)  # fmt: skip
    ap.add_argument("--repeats", type=cli.count, default=20)
    ap.add_argument("--load", type=int, default=4, help="busy processes beside the tests")
    ap.add_argument(
        "--load-minutes",
        type=float,
        default=0.0,
        help="how long the load lasts at most (default: 4 minutes a repeat)",
    )
    ap.add_argument("--idle", action="store_true", help="no load (a baseline)")
    ap.add_argument("--memory-only", action="store_true", help="the loading test alone")
    ap.add_argument("--out", default=str(HERE / "runs" / "stress_ranks"))
    ap.add_argument("--code", default=str(HERE), help="the checkout whose tests run")
    args = ap.parse_args(argv)
    code = Path(args.code)
    if not (code / "plumbing" / "test_shard.py").is_file():
        cli.fail("--code", f"{code} is not a checkout of this project (no plumbing/test_shard.py)",
                 ap.prog)  # fmt: skip
    if args.load < 0:
        cli.fail("--load", f"must be ≥ 0 busy processes, got {args.load}", ap.prog)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        cli.fail("--out", f"{out} is not empty: give a new folder (every repeat's rank logs are "
                 "kept there)", ap.prog)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    load = 0 if args.idle else args.load
    minutes = args.load_minutes or 4.0 * args.repeats
    hogs = busy(load, 60 * minutes)
    total_failed, total_aborts, measured = 0, 0, []
    tests = TESTS[-1:] if args.memory_only else TESTS
    print(f"{args.repeats} repeats of {len(tests)} tests beside {load} busy processes "
          f"(at most {minutes:g} min); rank logs under {out}", flush=True)  # fmt: skip
    try:
        for i in range(args.repeats):
            failed, aborted, seconds = repeat(out / f"repeat_{i:02d}", tests, code)
            measured.append(memory(out / f"repeat_{i:02d}"))
            total_failed += failed
            total_aborts += len(aborted)
            said = ", ".join(str(p) for p in aborted) or "none"
            print(f"repeat {i}: {failed} failed, {len(aborted)} aborted ranks ({said}); "
                  f"{seconds:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    finally:
        for h in hogs:
            h.kill()
    print(f"total: {total_failed} failed tests, {total_aborts} aborted ranks in {args.repeats} "
          f"repeats")  # fmt: skip
    print("\n".join(["the sharded loading's host memory (min / median / max):", *spread(measured)]))
    sys.exit(1 if total_failed or total_aborts else 0)


if __name__ == "__main__":
    main()
