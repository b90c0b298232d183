"""The multi-GPU check: what DDP, --shard, HSDP, a resume on fewer GPUs and a lost rank do on N
GPUs of one machine (nccl), in one command with one report. Run it on a machine with N GPUs:

    python benchmarks/multi_gpu_check.py --gpus N --out multi_gpu_check_out   # N CUDA GPUs
    python benchmarks/multi_gpu_check.py --gpus 2 --device cpu --out /tmp/mgc # 2 gloo processes
    python benchmarks/multi_gpu_check.py --gpus 1 --plan                      # the steps, no run

It builds the tiny SD3 pipeline and tiny reward models itself (random weights, nothing
downloaded; diffusers and transformers must be installed) and launches recast.py with torchrun
(--prompts and --batch-size rounded up to multiples of N, which recast.py needs: per_ranks).
Steps, each passed, FAILED, or skipped with the reason (N: --gpus):
1. toy (N ≥ 2): the toy world for 2 epochs on N ranks (DDP) and in one process, the same global
   batch: W, every reward and eval score and the loss agree (the toy world has nothing to shard:
   recast.py --shard refuses it);
2. shard (N ≥ 1): the tiny SD3 for 3 epochs on N ranks under --shard (FSDP2) and under DDP:
   W, rewards, evals and loss agree, and the adapters: ‖B_shard − B_ddp‖ / ‖B_ddp‖ over the
   LoRA B matrices (which start at zero, so they are what training changed);
3. hsdp (N ≥ 4): the same run on 4 GPUs posing as 2 nodes × 2 (two torchrun launchers, GPUs 0-1
   and 2-3) takes HSDP's 2-D mesh and agrees with one flat mesh of the 4;
4. kill (N ≥ 1): the same run with --epochs 20 on N ranks; once epoch 1's checkpoint is written,
   the last rank is SIGKILLed in epoch 2. Recorded: each survivor's last lines and seconds to exit,
   whether their message names the --resume command (on nccl rank 0 names it when the process
   group starts: docs/failure_modes.md#on-nccl), the flight recorder's dumps, the checkpoint kept.
   Passes when every survivor is gone within KILL_LIMIT_S, the command is named and a checkpoint
   is kept; with N = 1 the only rank is killed: no survivor, the launcher's exit and the
   checkpoint are what it checks;
5. resume (N ≥ 1): the killed run resumed on 1 GPU (torchrun, 1 rank) to epoch 3 agrees with step
   2's unbroken N-rank sharded run: a checkpoint written by N ranks continues on one.

One GPU runs steps 2, 4 and 5: FSDP2 on one rank (its bf16 gathers and fp32 reduction, nccl)
against DDP on one rank, a crash at a random point of an epoch on the GPU, and the resume that
must continue it. What needs two GPUs or more, no single GPU can stand in for: the N-rank DDP
average (1), the shards' reduce-scatter and all-gathers across GPUs (2 with N ≥ 2), HSDP (3), the
survivors of a lost rank (4) and a checkpoint that changes its number of ranks (5 with N ≥ 2).
With --device cpu every step runs on gloo processes (--gpus is then the number of processes):
that is how it is tested (benchmarks/test_multi_gpu_check.py).

Tolerances (TOLERANCES): on the CPU the tests' own (fp32; the runs differ only in the order
floats are summed): plumbing/test_shard.py's SHARD_ATOL and 1e-4 relative, test_recast.py's
torchrun test for the toy world; the tiny SD3's absolute 1e-3 is 1e-4 of its rewards' scale
(random-weight PickScore and aesthetic score ±10 to ±60 an image, so a batch mean near 0 carries
its terms' rounding, not its own: reward/pickscore 0.6244 resumed against 0.6243 unbroken,
7.6e-5 apart, failed 1e-4 relative). On CUDA not yet measured on several GPUs: the toy world runs in
fp32 (NVIDIA_TF32_OVERRIDE=0), so ten times the CPU's (cuBLAS picks its kernels by shape, and an
N-rank forward runs on 1/N of the batch); the tiny SD3 runs in bf16 (weights, forwards, FSDP2's
gathers), whose 8-bit significand rounds by up to 2⁻⁸ ≈ 4e-3 and whose differences the updates
carry: gpu_check.py's tolerances after one update on each side (3 % + 3e-3, W 5e-3), and 5 % for
the adapters (AdamW's first steps move each element by ±lr whatever its gradient's size, so an
element whose gradient is within rounding of zero may step either way). A wrong shard (a rank's
gradient dropped or counted twice) moves weights by ~1e-2 (plumbing/test_shard.py), against LoRA
B elements of 0.018 on average after step 2's 3 epochs (on 2 gloo processes). The report prints
each measured difference beside its tolerance, so the first run can tighten them.

Budget: --budget, default 480 s on CUDA, within a 10-minute command limit; the one-GPU steps took
156 s on one gloo process of a 2-core CPU and are not yet timed on a GPU. A GPU machine without
diffusers and without network needs its wheel brought along (docs/gpu/README.md gives the
commands). It writes OUT/report.md and OUT/report.json (a summary table, then each step's
figures and the commands it ran; the runs' logs in OUT/logs) and exits 0 when every step that
ran passed, 1 otherwise, 2 on bad input.
"""

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere
from benchmarks.gpu_check import offline_env  # noqa: E402 (after the path)
from plumbing import cli  # noqa: E402

PROG = "multi_gpu_check.py"
RECAST = str(ROOT / "recast.py")
BUDGET_S = {"cuda": 480, "cpu": 1800}  # default --budget: within a 10-minute command limit
KILL_LIMIT_S = 60  # survivors must be gone within this (the gloo tests' bound)
WAIT_S = 120  # then the launcher is stopped, and the step failed
EPOCHS = 3  # the unbroken runs; the killed one is resumed up to this epoch
TOY = ["--lambda", "0.4,0.2,0.2,0.2", "--epochs", "2", "--prompts", "4", "--group-size", "4",
       "--batch-size", "32", "--eval-seeds", "1", "--eval-every", "1"]  # fmt: skip
# groups of 4: in a group of 2 whose two summed scores nearly tie, the advantages divide by a
# spread near zero (--normalize joint), and the runs' rounding differences (1e-7) grew into a 6.7 %
# difference of the adapters by epoch 3 (measured on 4 gloo processes, sharded against DDP, with
# --group-size 2: adv/max 71.381 against 71.384 at epoch 2)
SD3 = ["--rewards", "pickscore,aesthetic", "--lambda", "0.5,0.5", "--group-size", "4", "--steps",
       "3", "--batch-size", "4", "--eval-seeds", "2", "--resolution", "32", "--lora-rank", "4",
       "--lora-alpha", "8", "--lr", "1e-2", "--eval-every", "1"]  # fmt: skip


def per_ranks(flags: list[str], n: int) -> list[str]:
    """`flags` with --prompts and --batch-size rounded up to multiples of n: recast.py splits both
    among the ranks and refuses a remainder (TOY's 4 prompts and SD3's --batch-size 4 on 3 or 8
    GPUs). On 1, 2 and 4 they are as written."""
    out = list(flags)
    for flag in ("--prompts", "--batch-size"):
        if flag in out:
            i = out.index(flag) + 1
            out[i] = str(n * math.ceil(int(out[i]) / n))
    return out


@dataclass(frozen=True)
class Tolerance:
    """How far two runs may differ."""

    rel: float  # rewards and evals: |a − b| ≤ rel·|b| + abs
    abs: float
    w: float  # W, entry by entry, absolute
    loss: float  # the loss, relative
    lora: float  # the adapters' LoRA B matrices: ‖a − b‖ / ‖b‖


TOLERANCES = {  # (world, device): see the docstring for where each comes from
    ("toy", "cpu"): Tolerance(1e-4, 1e-6, 1e-5, 1e-4, math.nan),
    ("toy", "cuda"): Tolerance(1e-3, 1e-5, 1e-4, 1e-3, math.nan),
    ("sd3", "cpu"): Tolerance(1e-4, 1e-3, 1e-5, 1e-4, 1e-3),
    ("sd3", "cuda"): Tolerance(3e-2, 3e-3, 5e-3, 3e-2, 5e-2),
}

# name, the ranks it needs, what it checks, why it is skipped with fewer
STEPS = [
    ("toy", 2, "toy world: N ranks (DDP) against one process",
     "needs 2 GPUs: on one, the N-rank run is the one-process run"),
    ("shard", 1, "tiny SD3: --shard against DDP on N ranks", ""),
    ("hsdp", 4, "tiny SD3: HSDP 2×2 (2 nodes posed on one machine) against a flat mesh of 4",
     "needs 4 GPUs: 2 nodes × 2 ranks"),
    ("kill", 1, "tiny SD3 --shard: the last rank SIGKILLed mid-epoch", ""),
    ("resume", 1, "tiny SD3: the killed run resumed on 1 GPU, against the unbroken run", ""),
]  # fmt: skip


def plan(n: int) -> list[tuple[str, str, str]]:
    """(step, what it checks, "to run" or "skipped: why") for n GPUs, in the order they run."""
    return [(name, what, "to run" if n >= need else f"skipped: {why}")
            for name, need, what, why in STEPS]  # fmt: skip


@dataclass
class Step:
    name: str
    what: str
    status: str = "not run"
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)  # what the report shows, also in its JSON
    table: str = ""  # the figures as markdown
    runs: list = field(default_factory=list)  # {command, exit, seconds, log}


class Check:
    """The runs of every step, within the budget, each logged under OUT/logs."""

    def __init__(self, args, out: Path):
        self.args, self.out, self.device = args, out, args.device
        self.start, self.logs = time.monotonic(), out / "logs"
        self.logs.mkdir(parents=True)
        self.env = offline_env()
        self.py = sys.executable

    def left(self) -> float:
        return self.args.budget - (time.monotonic() - self.start)

    def environment(self, **extra) -> dict:
        env = {**self.env, **extra}
        if self.device == "cpu":  # gloo processes: no GPU, one thread each
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        return env

    def torchrun(self, ranks: int, *more: str) -> list[str]:
        return [self.py, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={ranks}", *more]  # fmt: skip

    def run(self, step: Step, name: str, command: list[str], env: dict | None = None) -> bool:
        """One command to its end (or the budget's): True when it exited 0."""
        log = self.logs / f"{name}.log"
        tic, limit = time.monotonic(), self.left()
        if limit < 10:
            step.runs.append({"command": shown(command), "exit": "not run: budget spent",
                              "seconds": 0.0, "log": ""})  # fmt: skip
            return False
        with log.open("w") as f:
            proc = subprocess.Popen(command, cwd=ROOT, env=env or self.environment(), stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers
                proc.wait()
                code = f"killed after {limit:.0f} s (the budget)"
        step.runs.append({"command": shown(command), "exit": code,
                          "seconds": round(time.monotonic() - tic, 1),
                          "log": str(log.relative_to(self.out))})  # fmt: skip
        return code == 0


def shown(command: list[str]) -> str:
    """A command as a person would type it (python for the interpreter's path, paths short)."""
    words = ["python" if w == sys.executable else w for w in command]
    return " ".join(os.path.relpath(w, ROOT) if w.startswith(str(ROOT)) else w for w in words)


# ---------------------------------------------------------------------------------------------
# Comparing two runs: their metrics.jsonl and their adapters
# ---------------------------------------------------------------------------------------------
def compare(a_dir: Path, b_dir: Path, tol: Tolerance, epochs: list[int]) -> tuple[bool, list]:
    """Rows (metric, the worst epoch, a, b, |a − b|, tolerance, ok): per metric its epoch whose
    difference is largest against its tolerance, over `epochs`, which both runs must hold; then
    the LoRA B matrices of the last epoch's checkpoints, when tol.lora is a number."""
    from plumbing.checkpoints import read_metrics  # skips a torn last line, with a warning

    a, b = ({m["epoch"]: m for m in read_metrics(str(d))} if (d / "metrics.jsonl").is_file()
            else {} for d in (a_dir, b_dir))  # fmt: skip
    missing = [e for e in epochs if e not in a or e not in b]
    if missing:
        return False, [("epochs", "", sorted(a), sorted(b), "missing", str(missing), False)]
    worst = {}  # metric: (ratio, row)
    for e in epochs:
        for key in sorted(k for k in b[e] if k.startswith(("reward/", "eval/")) and k in a[e]):
            x, y = a[e][key], b[e][key]
            worst_row(worst, key, e, x, y, abs(x - y), tol.rel * abs(y) + tol.abs)
        if "loss" in a[e] and "loss" in b[e]:
            x, y = a[e]["loss"], b[e]["loss"]
            worst_row(worst, "loss", e, x, y, abs(x - y), tol.loss * abs(y))
        if "W" in a[e] and "W" in b[e]:
            diff = max(abs(x - y) for ra, rb in zip(a[e]["W"], b[e]["W"], strict=True)
                       for x, y in zip(ra, rb, strict=True))  # fmt: skip
            worst_row(worst, "W (largest entry difference)", e, "", "", diff, tol.w)
    rows = [row for _, row in worst.values()]
    if not math.isnan(tol.lora):
        rows.append(compare_lora(a_dir, b_dir, epochs[-1], tol.lora))
    return bool(rows) and all(r[-1] for r in rows), rows


def worst_row(worst: dict, key: str, epoch: int, x, y, diff: float, bound: float) -> None:
    ratio = diff / bound if bound > 0 else (0.0 if diff == 0 else math.inf)
    if key not in worst or ratio > worst[key][0]:
        worst[key] = (ratio, (key, epoch, x, y, diff, bound, diff <= bound))


def compare_lora(a_dir: Path, b_dir: Path, epoch: int, tol: float) -> tuple:
    """‖B_a − B_b‖ / ‖B_b‖ over the trained adapter's lora_B matrices at `epoch`'s checkpoints
    (their largest element difference shown beside it)."""
    import torch
    from safetensors.torch import load_file

    name = "LoRA B: ‖a − b‖ / ‖b‖ (largest element difference)"
    paths = [d / "ckpt" / f"epoch_{epoch:04d}" / "model.safetensors" for d in (a_dir, b_dir)]
    if not all(p.is_file() for p in paths):
        return (name, epoch, "", "", "no checkpoint", tol, False)
    x, y = (load_file(p) for p in paths)
    keys = sorted(k for k in y if "lora_B.default" in k)
    if not keys or sorted(x) != sorted(y):
        return (name, epoch, "", "", "other tensors", tol, False)
    a, b = (torch.cat([t[k].double().flatten() for k in keys]) for t in (x, y))
    rel = ((a - b).norm() / b.norm()).item() if b.norm() > 0 else math.inf
    largest = (a - b).abs().max().item()
    shown_diff = f"{rel:.3g} ({largest:.2g})"
    return (name, epoch, f"{a.norm().item():.3g}", f"{b.norm().item():.3g}", shown_diff, tol,
            rel <= tol)  # fmt: skip


def rows_table(rows: list) -> str:
    lines = ["| metric | worst epoch | a | b | difference | tolerance | |", "|---" * 7 + "|"]
    for key, epoch, x, y, diff, bound, ok in rows:
        cells = [f"{v:.6g}" if isinstance(v, float) else str(v) for v in (x, y, diff, bound)]
        lines.append(f"| {key} | {epoch} | {' | '.join(cells)} | {'ok' if ok else 'DIFFERS'} |")
    return "\n".join(lines)


def record_comparison(step: Step, a_name: str, b_name: str, ok: bool, rows: list) -> bool:
    step.figures["compared"] = f"a = {a_name}, b = {b_name}"
    step.figures["rows"] = [dict(zip(("metric", "epoch", "a", "b", "difference", "tolerance",
                                      "ok"), r, strict=True)) for r in rows]  # fmt: skip
    step.table = f"a = {a_name}; b = {b_name}\n\n{rows_table(rows)}"
    return ok


# ---------------------------------------------------------------------------------------------
# The tiny SD3 and its rewards, built here
# ---------------------------------------------------------------------------------------------
def build_models(folder: Path, n: int) -> tuple[list[str], dict]:
    """The tiny SD3 pipeline, tiny reward models and prompt files under `folder`: (recast.py's
    flags for them but --prompts, the reward models' environment variables)."""
    import torch

    from benchmarks import modelzoo

    torch.manual_seed(0)
    sd3 = modelzoo.tiny_family("sd3", folder / "sd3")
    torch.manual_seed(1)
    env = modelzoo.tiny_reward_models(folder / "rewards")
    colours, things = ("red", "green", "blue", "gold"), ("cat", "boat", "tree")
    (folder / "prompts.txt").write_text("\n".join(f"a {c} {t}" for c in colours for t in things))
    # --shard evaluates equal shares: held-out prompts × --eval-seeds 2 a multiple of the ranks
    # (n, and HSDP's 4), and at least one prompt a rank
    count = math.lcm(max(2, n), 2)
    held = [f"a {c} {t}" for c in ("purple", "silver", "orange") for t in things]
    held = (held * math.ceil(count / len(held)))[:count]
    (folder / "held_out.txt").write_text("\n".join(held) + "\n")
    flags = ["--model", sd3, "--prompts-file", str(folder / "prompts.txt"), "--eval-prompts-file",
             str(folder / "held_out.txt"), *SD3]  # fmt: skip
    return flags, env


# ---------------------------------------------------------------------------------------------
# Step 4: a rank killed mid-epoch
# ---------------------------------------------------------------------------------------------
def workers(launcher: int) -> dict[int, int]:
    """{rank: pid} of the workers a torchrun launcher started (its children with RANK set)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if ppid == launcher and rank:
            found[int(rank[0])] = int(pid)
    return found


def gone(pid: int) -> bool:
    """The process has ended (a zombie, not yet reaped by its launcher, has too)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def last_lines(path: Path, n: int) -> list[str]:
    """The last n non-empty lines of a log, progress bars' carriage returns resolved."""
    if not path.is_file():
        return []
    text = path.read_bytes().decode(errors="replace")  # not read_text: it turns \r into \n
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]  # a bar's last frame
    return [line for line in lines if line.strip()][-n:]


def kill_mid_epoch(check: Check, step: Step, flags: list[str], env: dict, run: Path,
                   ranks: int) -> bool:  # fmt: skip
    """Step 4: launch, wait for epoch 1's checkpoint, SIGKILL the last rank in epoch 2, time
    each survivor's exit, read their last lines."""
    ranks_logs = check.logs / "kill_ranks"
    dump = check.out / "kill_nccl_trace_rank_"
    command = check.torchrun(ranks, "--tee=3", f"--log-dir={ranks_logs}", RECAST, *flags,
                             "--epochs", "20", "--out", str(run))  # fmt: skip
    env = {**env, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(dump)}  # kept beside the report
    log = check.logs / "kill.log"
    tic = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    figures = step.figures
    try:
        deadline = time.monotonic() + min(check.left(), 600)
        while not (run / "ckpt" / "epoch_0001").is_dir():  # epoch 1 done and saved
            if proc.poll() is not None or time.monotonic() > deadline:
                figures["error"] = "the run ended or the budget ran out before epoch 1's checkpoint"
                return False
            time.sleep(0.05)
        time.sleep(0.3)  # into epoch 2
        pids = workers(proc.pid)
        victim = max(pids)
        in_epoch = len((run / "metrics.jsonl").read_text().splitlines())
        os.kill(pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        figures.update(killed=f"rank {victim} (pid {pids[victim]})", in_epoch=in_epoch)
        survivors = {r: p for r, p in pids.items() if r != victim}
        exits = {}
        while time.monotonic() - killed_at < WAIT_S and (
            len(exits) < len(survivors) or proc.poll() is None
        ):
            for r, p in survivors.items():
                if r not in exits and gone(p):
                    exits[r] = round(time.monotonic() - killed_at, 2)
            time.sleep(0.05)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        figures["launcher"] = {"exit": code, "seconds after the kill":
                               round(time.monotonic() - killed_at, 2)}  # fmt: skip
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        step.runs.append({"command": shown(command), "exit": proc.returncode,
                          "seconds": round(time.monotonic() - tic, 1),
                          "log": str(log.relative_to(check.out))})  # fmt: skip
    resume = f"recast.py --out {run} --resume"
    said, ok = {}, True
    for r in sorted(survivors):
        folder = next(ranks_logs.glob(f"*/attempt_0/{r}"), None)
        err = last_lines(folder / "stderr.log", 6) if folder else []
        out = last_lines(folder / "stdout.log", 3) if folder else []
        stopped = [x for x in err if x.startswith("recast.py: stopped:")]
        said[r] = {"seconds to exit": exits.get(r), "last stderr lines": err,
                   "last stdout lines": out,
                   "names --resume": any(resume in x for x in stopped)}  # fmt: skip
        ok &= exits.get(r) is not None and exits[r] <= KILL_LIMIT_S
    figures["survivors"] = said
    first = next(ranks_logs.glob("*/attempt_0/0"), None)
    note = [x for x in last_lines(first / "stdout.log", 10**6) if x.startswith("note: nccl")] if (
        first) else []  # fmt: skip
    figures["rank 0's start note names --resume"] = any(resume in x for x in note)
    figures["flight recorder dumps"] = sorted(p.name for p in check.out.glob(dump.name + "*"))
    from plumbing.checkpoints import newest

    figures["checkpoint kept"] = os.path.relpath(newest(str(run)), check.out)
    named = any(s["names --resume"] for s in said.values()) or figures[
        "rank 0's start note names --resume"]  # fmt: skip
    ok &= proc.returncode != 0 and "none yet" not in figures["checkpoint kept"]
    ok &= named or not survivors
    step.table = kill_table(figures, bool(survivors))
    return ok


def kill_table(f: dict, survivors: bool) -> str:
    note = f["rank 0's start note names --resume"]
    lines = [f"- killed: {f['killed']}, in epoch {f['in_epoch']}",
             f"- launcher: exit {f['launcher']['exit']}, "
             f"{f['launcher']['seconds after the kill']} s after the kill",
             f"- checkpoint kept: {f['checkpoint kept']}",
             f"- rank 0's start note names --resume: {note}",
             f"- flight recorder dumps: {', '.join(f['flight recorder dumps']) or 'none'}",
             ]  # fmt: skip
    if not survivors:
        lines.append("- survivors: none (one rank)")
    for r, s in f["survivors"].items():
        lines += [f"- rank {r}: exited {s['seconds to exit']} s after the kill; its message names "
                  f"--resume: {s['names --resume']}; the last lines of its stdout, then of its "
                  "stderr:", "", "```", *s["last stdout lines"], "```", "", "```",
                  *s["last stderr lines"], "```", ""]  # fmt: skip
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The steps
# ---------------------------------------------------------------------------------------------
def toy_step(check: Check, step: Step, n: int) -> bool:
    """Step 1: the toy world on n ranks (DDP) and in one process."""
    device = ["--device", check.device]
    env = check.environment(NVIDIA_TF32_OVERRIDE="0")  # fp32 on CUDA, as on the CPU
    many, one = check.out / "runs" / f"toy_{n}ranks", check.out / "runs" / "toy_1process"
    toy = per_ranks(TOY, n)  # the same global batch in both runs
    ok = check.run(step, "toy_ranks", check.torchrun(n, RECAST, *toy, *device, "--out",
                                                     str(many)), env)  # fmt: skip
    ok &= check.run(step, "toy_1process", [check.py, RECAST, *toy, *device, "--out", str(one)],
                    env)  # fmt: skip
    tol = TOLERANCES["toy", check.device]
    same, rows = compare(many, one, tol, [0, 1, 2])
    return record_comparison(step, f"{n} ranks", "1 process", same, rows) and ok


def shard_step(check: Check, step: Step, flags: list[str], env: dict, n: int) -> bool:
    """Step 2: --shard against DDP on n ranks, EPOCHS epochs."""
    shard, ddp = check.out / "runs" / "sd3_shard", check.out / "runs" / "sd3_ddp"
    common = [*flags, "--epochs", str(EPOCHS), "--device", check.device]
    ok = check.run(step, "sd3_shard", check.torchrun(n, RECAST, *common, "--shard", "--out",
                                                     str(shard)), env)  # fmt: skip
    ok &= check.run(step, "sd3_ddp", check.torchrun(n, RECAST, *common, "--out", str(ddp)), env)
    same, rows = compare(shard, ddp, TOLERANCES["sd3", check.device], list(range(EPOCHS + 1)))
    on = f"{n} rank{'s' * (n > 1)}"
    return record_comparison(step, f"--shard, {on}", f"DDP, {on}", same, rows) and ok


def hsdp_step(check: Check, step: Step, flags: list[str], env: dict) -> bool:
    """Step 3: 2 launchers of 2 ranks (GPUs 0-1 and 2-3) as 2 nodes, against a flat mesh of 4."""
    hsdp, flat = check.out / "runs" / "sd3_hsdp", check.out / "runs" / "sd3_flat4"
    common = [*flags, "--epochs", str(EPOCHS), "--device", check.device, "--shard"]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs, tic = [], [], time.monotonic()
    # the first 4 GPUs this process sees: CUDA_VISIBLE_DEVICES' own where it names them
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpus = visible or [str(i) for i in range(4)]
    for node in (0, 1):
        command = [check.py, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                   f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}",
                   RECAST, *common, "--out", str(hsdp)]  # fmt: skip
        node_env = dict(env)
        if check.device == "cuda":
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[2 * node : 2 * node + 2])
        logs.append((check.logs / f"sd3_hsdp_node{node}.log").open("w"))
        procs.append((command, subprocess.Popen(command, cwd=ROOT, env=node_env, stdout=logs[-1],
                                                stderr=subprocess.STDOUT,
                                                start_new_session=True)))  # fmt: skip
    ok = True
    for (command, proc), log in zip(procs, logs, strict=True):
        try:
            code = proc.wait(timeout=max(1.0, check.left()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = "killed: the budget ran out"
        log.close()
        ok &= code == 0
        step.runs.append({"command": shown(command), "exit": code,
                          "seconds": round(time.monotonic() - tic, 1),
                          "log": str(Path(log.name).relative_to(check.out))})  # fmt: skip
    said = (check.logs / "sd3_hsdp_node0.log").read_text(errors="replace")
    step.figures["HSDP's mesh taken"] = "(HSDP)" in said
    ok &= "(HSDP)" in said
    ok &= check.run(step, "sd3_flat4", check.torchrun(4, RECAST, *common, "--out", str(flat)), env)
    same, rows = compare(hsdp, flat, TOLERANCES["sd3", check.device], list(range(EPOCHS + 1)))
    return record_comparison(step, "HSDP 2×2", "flat mesh of 4", same, rows) and ok


def resume_step(check: Check, step: Step, env: dict, killed: Path, n: int) -> bool:
    """Step 5: the killed run on 1 rank to EPOCHS, against step 2's unbroken sharded run."""
    ok = check.run(step, "resume_1rank", check.torchrun(1, RECAST, "--out", str(killed),
                                                        "--resume", "--epochs", str(EPOCHS)),
                   env)  # fmt: skip
    reference = check.out / "runs" / "sd3_shard"
    same, rows = compare(killed, reference, TOLERANCES["sd3", check.device],
                         list(range(EPOCHS + 1)))  # fmt: skip
    on = f"{n} rank{'s' * (n > 1)}"
    return record_comparison(step, f"killed on {on}, resumed on 1", f"--shard, {on}, unbroken",
                             same, rows) and ok  # fmt: skip


def run_steps(check: Check, n: int) -> list[Step]:
    steps = {name: Step(name, what, status) for name, what, status in plan(n)}
    killed = check.out / "runs" / "sd3_killed"

    def timed(step: Step, body) -> None:
        tic = time.monotonic()
        try:
            passed = body()
        except Exception as e:  # the step failed; the others still run
            passed, step.figures["error"] = False, f"{type(e).__name__}: {e}"
        step.seconds = round(time.monotonic() - tic, 1)
        step.status = "passed" if passed else "FAILED"
        print(f"{PROG}: {step.name}: {step.status} ({step.seconds:.0f} s)", flush=True)

    if steps["toy"].status == "to run":
        timed(steps["toy"], lambda: toy_step(check, steps["toy"], n))
    tic = time.monotonic()
    flags, models_env = build_models(check.out / "models", n)
    hsdp_flags = [*flags, "--prompts", "4"]  # a group a rank: --shard's forwards are collectives
    flags = per_ranks([*flags, "--prompts", str(max(2, n))], n)
    env = check.environment(**models_env)
    print(f"{PROG}: tiny models built ({time.monotonic() - tic:.0f} s)", flush=True)
    timed(steps["shard"], lambda: shard_step(check, steps["shard"], flags, env, n))
    if steps["hsdp"].status == "to run":
        timed(steps["hsdp"], lambda: hsdp_step(check, steps["hsdp"], hsdp_flags, env))
    sharded = [*flags, "--device", check.device, "--shard"]
    timed(steps["kill"], lambda: kill_mid_epoch(check, steps["kill"], sharded, env, killed, n))
    timed(steps["resume"], lambda: resume_step(check, steps["resume"], env, killed, n))
    return list(steps.values())


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def environment_line(device: str) -> str:
    import diffusers
    import torch

    if device == "cuda":
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        where = smi.strip().replace("\n", "; ") or torch.cuda.get_device_name()
        backend = f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}"
    else:
        where, backend = f"CPU ({os.cpu_count()} cores)", "gloo"
    return (f"{where}; {backend}; torch {torch.__version__}, diffusers {diffusers.__version__}, "
            f"python {sys.version.split()[0]}")  # fmt: skip


def write_report(check: Check, steps: list[Step], n: int, argv: list[str]) -> bool:
    ran = [s for s in steps if not s.status.startswith("skipped")]
    passed = all(s.status == "passed" for s in ran)
    total = time.monotonic() - check.start
    command = shown([check.py, str(Path(__file__)), *argv])
    env = environment_line(check.device)
    verdict = "every step that ran passed" if passed else "SOME STEPS FAILED"
    lines = ["# Multi-GPU check", "", f"`{command}`: {verdict}, {total:.0f} s in all. {env}.",
             "", "| step | what it checks | result | seconds |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    lines += [f"| {s.name} | {s.what} | {s.status} | {s.seconds:.0f} |" for s in steps]
    for s in ran:
        lines += ["", f"## {s.name}: {s.status}", "", s.what, ""]
        if "error" in s.figures:
            lines += [f"error: {s.figures['error']}", ""]
        if s.table:
            lines += [s.table, ""]
        lines += ["| command | exit | seconds | log |", "| --- | --- | --- | --- |"]
        lines += [f"| `{r['command']}` | {r['exit']} | {r['seconds']} | {r['log']} |"
                  for r in s.runs]  # fmt: skip
        for r in s.runs:
            if r["exit"] != 0 and r["log"]:
                tail = last_lines(check.out / r["log"], 30)
                lines += ["", f"The end of {r['log']}:", "", "```", *tail, "```"]
    (check.out / "report.md").write_text("\n".join(lines) + "\n")
    summary = {"command": command, "environment": env, "gpus": n, "device": check.device,
               "seconds": round(total, 1), "passed": passed,
               "tolerances": {f"{w}/{d}": asdict(t) for (w, d), t in TOLERANCES.items()},
               "steps": [asdict(s) for s in steps]}  # fmt: skip
    (check.out / "report.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return passed


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])  # an error: one line
    ap.add_argument("--gpus", type=int, required=True,
                    help="GPUs to use (with --device cpu: gloo processes)")  # fmt: skip
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cuda: nccl on the GPUs; cpu: gloo processes (as tested)")  # fmt: skip
    ap.add_argument("--out", default="multi_gpu_check_out", help="folder for the report and logs")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for all the steps (default: cuda 480, cpu 1800)")  # fmt: skip
    ap.add_argument("--plan", action="store_true", help="say which steps would run, run none")
    args = ap.parse_args(argv)
    if args.gpus < 1:
        cli.fail("--gpus", f"must be ≥ 1, got {args.gpus}", PROG)
    if args.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        if have == 0 and not args.plan:
            cli.fail("--device", "cuda: no CUDA device is visible; use --device cpu to run the "
                     "steps on gloo processes", PROG)  # fmt: skip
        if args.gpus > have and not args.plan:
            cli.fail("--gpus", f"{args.gpus} asked for, {have} visible on this machine: "
                     f"use --gpus {have} or fewer", PROG)  # fmt: skip
    args.budget = BUDGET_S[args.device] if args.budget is None else args.budget
    if not args.budget > 0:
        cli.fail("--budget", f"must be a number of seconds > 0, got {args.budget}", PROG)
    out = Path(args.out)
    if not args.plan and out.exists() and (not out.is_dir() or any(out.iterdir())):
        cli.fail("--out", f"{out} exists and is not an empty folder: use another", PROG)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse(argv)
    n = args.gpus
    if args.plan:
        for name, what, status in plan(n):
            print(f"{name:<7} {what}: {status}")
        return 0
    out = Path(args.out).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
        check = Check(args, out)
    except OSError as e:
        shutil.rmtree(out, ignore_errors=True)
        cli.fail("--out", f"cannot write there ({e}): use another folder", PROG)
    steps = run_steps(check, n)
    passed = write_report(check, steps, n, argv)
    print(f"{PROG}: {'passed' if passed else 'FAILED'}; report in {out / 'report.md'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
