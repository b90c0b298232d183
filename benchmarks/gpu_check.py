"""Everything that needs a GPU, in one command, with one report: run it on a CUDA machine.

    python benchmarks/gpu_check.py [--out gpu_check_out]      # from the repository root

No network (the Hugging Face libraries are put offline; the tiny SD3 test builds its own models),
about 6 minutes and at most 10 on one H100/H200 (each step has a time limit within that budget).
Steps, in order:
1. in the background, the 2-epoch toy run on the CPU:
   python recast.py --lambda 0.4,0.2,0.2,0.2 --epochs 2 --device cpu --out OUT/toy_cpu
2. the kernel tests on CUDA: RECAST_TEST_DEVICE=cuda python -m pytest -q kernels
   (the kernels compiled and run on the GPU, with the same tolerances as under the interpreter);
3. no host sync: torch.cuda.set_sync_debug_mode("error") around nft_loss forward and backward (also
   with grad_output ≠ 1, and under no_grad) and renyi_gains; and a control showing the mode does
   catch the sync that CHECK_VALUES = True adds;
4. the benchmark (once the CPU run is done, on a quiet machine):
   python benchmarks/bench_kernels.py --json OUT/bench.json, targets included;
5. the same toy run on CUDA (NVIDIA_TF32_OVERRIDE=0, so that cuBLAS/cuDNN compute in fp32 as the
   CPU does), compared with the CPU run epoch by epoch from their metrics.jsonl: at epochs 0
   (eval of the base model) and 1 (rollout of the base model, its gains, W and one epoch's loss)
   only rounding differs, so each reward and eval score must agree within 1% + 1e-3, W within
   2e-3 (its entries are λ_k/T ≈ 0.02-0.04) and the loss within 1%; at epoch 2, after one update
   on each side, within 3% + 3e-3, 5e-3 and 3%;
6. the tiny-SD3 end-to-end test on CUDA: RECAST_TEST_DEVICE=cuda python -m pytest -q
   test_recast.py -k test_sd3_trains_one_epoch_end_to_end
7. the tiny SD3 sharded on CUDA (FSDP2 on nccl, --precision bf16 by default on CUDA, the models
   built on the meta device and loaded into their shards): `torchrun --nproc-per-node 1 recast.py
   --shard` for two epochs, RECAST_TEST_DEVICE=cuda python -m pytest -q -m slow
   plumbing/test_shard.py -k test_one_rank_shards_two_epochs
It writes OUT/gpu_check_report.md (a summary table, then each step's output) and the logs beside
it, and exits 0 when every step passed (the benchmark's speed targets are reported, not enforced).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere
from plumbing import cli  # noqa: E402 (after the path)

BUDGET_S = 10 * 60
STEP_S = 10  # a step with fewer seconds of the budget left is skipped
PROG = "gpu_check.py"
LAMBDA = "0.4,0.2,0.2,0.2"
# (epochs, relative + absolute tolerance of rewards and evals, W's absolute tolerance, loss's rel.)
TOLERANCES = {0: (0.01, 1e-3, 2e-3, 0.01), 1: (0.01, 1e-3, 2e-3, 0.01), 2: (0.03, 3e-3, 5e-3, 0.03)}


def offline_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(TOKENIZERS_PARALLELISM="false", TRITON_DEFAULT_FP_FUSION="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


class Steps:
    """Runs commands within the overall time budget and records what they did."""

    def __init__(self, out: Path, budget: float = BUDGET_S):
        self.out, self.start, self.rows, self.budget = out, time.monotonic(), [], budget

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)

    def record(self, name, status, seconds, command, text) -> None:
        """A step's row of the report, and its line on stderr as it ends (the steps take
        minutes; stdout holds the verdict alone)."""
        self.rows.append((name, status, seconds, command, text))
        print(f"gpu_check: {name}: {status} ({seconds:.0f} s)", file=sys.stderr, flush=True)

    def run(self, name, command, limit, env=None) -> tuple[bool, str]:
        log = self.out / f"{name}.log"
        limit = min(limit, self.left())
        if limit < STEP_S:
            self.record(name, "skipped: time budget spent", 0.0, command, "")
            return False, ""
        tic = time.monotonic()
        try:
            done = subprocess.run(
                command, cwd=ROOT, env=env or offline_env(), capture_output=True, text=True,
                timeout=limit,
            )  # fmt: skip
            text, ok = done.stdout + done.stderr, done.returncode == 0
            status = "passed" if ok else f"FAILED (exit {done.returncode})"
        except subprocess.TimeoutExpired as e:
            text = "".join(
                x.decode(errors="replace") if isinstance(x, bytes) else x
                for x in (e.stdout or "", e.stderr or "")
            )
            ok, status = False, f"FAILED (over its {limit:.0f} s)"
        log.write_text(text)
        self.record(name, status, time.monotonic() - tic, command, text)
        return ok, text


def no_sync_check() -> None:
    """Step 3, in its own process: raises if either public function synchronises."""
    import torch

    sys.path.insert(0, str(ROOT))
    from recast_kernels import nft_loss as nft
    from recast_kernels import renyi

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    n, shape = 16, (16, 64, 64)
    big = [torch.randn(n, *shape, generator=gen).to(device, torch.bfloat16) for _ in range(5)]
    small = dict(
        t=(0.05 + 0.95 * torch.rand(n, generator=gen)).to(device),
        t_index=torch.randint(0, 10, (n,), generator=gen).to(device),
        r=torch.rand(n, 4, generator=gen).to(device),
        W=torch.full((4, 10), 1 / 40, device=device),
    )
    scores = torch.randn(4, 11, 24 * 48, generator=gen).to(device)

    def calls():
        v_theta = big[0].clone().requires_grad_()
        loss = nft.nft_loss(v_theta, *big[1:4], **small, v_ref=big[4], kl_coef=1e-4)
        loss.backward()  # grad_output = 1
        (2.5 * nft.nft_loss(v_theta, *big[1:4], **small)).backward()  # grad_output ≠ 1
        with torch.no_grad():
            nft.nft_loss(v_theta, *big[1:4], **small)
        D, gains = renyi.renyi_gains(scores, 24)
        return loss, v_theta.grad, D, gains

    calls()  # compile and warm up the caching allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, grad, D, gains = calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(x).all() for x in (loss, grad, D, gains))
    print("nft_loss forward + backward (grad_output 1 and 2.5), nft_loss under no_grad, and")
    print("renyi_gains ran under torch.cuda.set_sync_debug_mode('error'): no host sync")
    nft.CHECK_VALUES = True  # control: the value check is a sync, and the mode must catch it
    torch.cuda.set_sync_debug_mode("error")
    try:
        calls()
    except RuntimeError as e:
        print(f"control: with CHECK_VALUES = True the mode raised as it should: {e}")
    else:
        raise AssertionError("set_sync_debug_mode('error') caught no sync with CHECK_VALUES = True")
    finally:
        torch.cuda.set_sync_debug_mode("default")
        nft.CHECK_VALUES = False


def compare_toy_runs(cpu_dir: Path, cuda_dir: Path) -> tuple[bool, str]:
    """Step 5's comparison of the two runs' metrics.jsonl, as a markdown table."""
    sys.path.insert(0, str(ROOT))
    from plumbing.checkpoints import read_metrics  # skips a torn last line, with a warning

    runs = []
    for folder in (cpu_dir, cuda_dir):
        path = folder / "metrics.jsonl"
        if not path.is_file():
            return False, f"{path} is missing"
        runs.append({m["epoch"]: m for m in read_metrics(str(folder))})
    cpu, cuda = runs
    lines = ["| epoch | metric | CPU | CUDA | abs. difference | tolerance | |", "|---" * 7 + "|"]
    ok = set(cpu) == set(cuda) == set(TOLERANCES)
    if not ok:
        lines.append(f"epochs differ: CPU {sorted(cpu)}, CUDA {sorted(cuda)}, expected 0, 1, 2")
    for epoch in sorted(set(cpu) & set(cuda) & set(TOLERANCES)):
        rel, atol, w_tol, loss_rel = TOLERANCES[epoch]
        a, b = cpu[epoch], cuda[epoch]
        keys = sorted(k for k in a if k.startswith(("reward/", "eval/")) and k in b)
        checks = [(k, a[k], b[k], rel * abs(a[k]) + atol) for k in keys]
        if "loss" in a and "loss" in b:
            checks.append(("loss", a["loss"], b["loss"], loss_rel * abs(a["loss"])))
        if "W" in a and "W" in b:
            diff = max(abs(x - y) for ra, rb in zip(a["W"], b["W"], strict=True)
                       for x, y in zip(ra, rb, strict=True))  # fmt: skip
            checks.append(("W (max over entries)", 0.0, diff, w_tol))
        for key, x, y, tol in checks:
            diff = abs(x - y) if not key.startswith("W") else y
            good = diff <= tol
            ok &= good
            shown = ("", "") if key.startswith("W") else (f"{x:.5g}", f"{y:.5g}")
            lines.append(
                f"| {epoch} | {key} | {shown[0]} | {shown[1]} | {diff:.3g} | {tol:.3g} | "
                f"{'ok' if good else 'DIFFERS'} |"
            )
    return ok, "\n".join(lines)


def write_report(out: Path, steps: Steps, extra: dict[str, str]) -> bool:
    passed = all(status == "passed" for _, status, *_ in steps.rows)
    total = time.monotonic() - steps.start
    lines = [
        "# GPU check",
        "",
        f"`python benchmarks/gpu_check.py --out {out}`: "
        f"{'every step passed' if passed else 'SOME STEPS FAILED'}, {total:.0f} s in all.",
        "",
        "| step | result | seconds |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {name} | {status} | {secs:.0f} |" for name, status, secs, *_ in steps.rows]
    for title, text in extra.items():
        lines += ["", f"## {title}", "", text]
    for name, status, _, command, text in steps.rows:
        shown = " ".join(command) if isinstance(command, list) else command
        tail = text[-12000:] if len(text) > 12000 else text
        lines += ["", f"## {name}: {status}", "", f"`{shown}`", "", "```", tail.rstrip(), "```"]
    (out / "gpu_check_report.md").write_text("\n".join(lines) + "\n")
    return passed


def main(argv=None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu_check_out", help="folder for the report and logs")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all the steps")
    ap.add_argument("--no-sync-step", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.no_sync_step:
        no_sync_check()
        return 0
    if not args.budget >= STEP_S:  # before the CUDA check: a wrong flag is said on any machine
        cli.fail("--budget", f"must be a number of seconds ≥ {STEP_S} (a step with less left is "
                 f"skipped), got {args.budget}", PROG)  # fmt: skip
    if Path(args.out).exists() and not Path(args.out).is_dir():
        cli.fail("--out", f"{args.out} is a file, not a folder for the report: pick another", PROG)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; run this on a GPU machine", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = Steps(out, args.budget)
    py = sys.executable
    extra = {}
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    extra["environment"] = (
        f"{smi or torch.cuda.get_device_name()}; torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}; python {sys.version.split()[0]}"
    )
    toy = ["recast.py", "--lambda", LAMBDA, "--epochs", "2"]
    cpu_dir, cuda_dir = out / "toy_cpu", out / "toy_cuda"
    for folder in (cpu_dir, cuda_dir):
        if folder.exists():
            cli.fail("--out", f"{folder} exists: use another --out", PROG)
    # 1. the CPU toy run, in the background
    cpu_log = (out / "toy_cpu.log").open("w")
    cpu_command = [py, *toy, "--device", "cpu", "--out", str(cpu_dir)]
    cpu_tic = time.monotonic()
    cpu_run = subprocess.Popen(
        cpu_command, cwd=ROOT, env=offline_env(OMP_NUM_THREADS="4", CUDA_VISIBLE_DEVICES=""),
        stdout=cpu_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    # 2. kernel tests on CUDA
    cuda_tests = offline_env(RECAST_TEST_DEVICE="cuda")
    steps.run("kernel tests on CUDA", [py, "-m", "pytest", "-q", "kernels"], 240, cuda_tests)
    # 3. no host sync
    steps.run("no host sync", [py, __file__, "--no-sync-step"], 90)
    # 4. the benchmark, once the CPU run is done
    try:
        cpu_run.wait(timeout=max(1.0, min(240.0, steps.left() - 200)))
    except subprocess.TimeoutExpired:
        cpu_run.kill()
        cpu_run.wait()
    cpu_log.close()
    cpu_text = (out / "toy_cpu.log").read_text()
    cpu_status = "passed" if cpu_run.returncode == 0 else f"FAILED (exit {cpu_run.returncode})"
    cpu_secs = time.monotonic() - cpu_tic
    steps.record("toy run on CPU (background)", cpu_status, cpu_secs, cpu_command, cpu_text)
    bench = [py, "benchmarks/bench_kernels.py", "--json", str(out / "bench.json")]
    steps.run("benchmark", bench, 240)
    # 5. the toy run on CUDA, compared with the CPU run
    cuda_command = [py, *toy, "--device", "cuda", "--out", str(cuda_dir)]
    ran, _ = steps.run("toy run on CUDA", cuda_command, 150, offline_env(NVIDIA_TF32_OVERRIDE="0"))
    if ran and cpu_run.returncode == 0:
        same, table = compare_toy_runs(cpu_dir, cuda_dir)
        extra["toy run: CUDA against CPU"] = table
        steps.record("toy runs agree (CPU vs CUDA)", "passed" if same else "FAILED", 0.0, "", table)
    # 6. the tiny-SD3 end-to-end test on CUDA
    sd3 = [py, "-m", "pytest", "-q", "test_recast.py", "-k", "test_sd3_trains_one_epoch_end_to_end"]
    steps.run("tiny SD3 end to end on CUDA", sd3, 180, cuda_tests)
    # 7. the tiny SD3 sharded on one GPU (torchrun, nccl)
    shard = [py, "-m", "pytest", "-q", "-m", "slow", "plumbing/test_shard.py", "-k",
             "test_one_rank_shards_two_epochs"]  # fmt: skip
    steps.run("tiny SD3 --shard on CUDA (torchrun, 1 rank, 2 epochs)", shard, 180, cuda_tests)
    bench_json = out / "bench.json"
    if bench_json.is_file():
        met = json.loads(bench_json.read_text()).get("targets", [])
        extra["benchmark targets"] = "\n".join(
            f"- {'met' if t['met'] else 'NOT MET'}: {t['target']} ({t['measured']})" for t in met
        )
    passed = write_report(out, steps, extra)
    print(f"gpu_check: {'passed' if passed else 'FAILED'}; report in {out / 'gpu_check_report.md'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
