"""The run folder: one run per folder (its lock), start or resume from the last good checkpoint,
SIGINT and SIGTERM, summary.json, and the process's exit codes for the faults of a run."""

import fcntl
import json
import os
import signal
import socket
import sys
from dataclasses import asdict

import torch
import torch.distributed as dist

from plumbing import cli
from plumbing.checkpoints import (
    DISK_FULL,
    WriteFailed,
    load_latest,
    resume_metrics,
    rewrite_metrics,
    write_failed,
    write_json_atomic,
)
from plumbing.distributed import exit_if_rank_lost, load_optimizer_state
from plumbing.seeding import set_rng_state

_locks: dict[str, int] = {}  # run folder → the descriptor of its .lock, held for life


def lock_run(out: str) -> None:
    """Hold OUT/.lock while this process lives: an exclusive flock, which the OS drops when the
    process ends, however it ends (SIGKILL too), so a stale lock never blocks --resume. Another
    live process holding it: exit 2 naming it (pid, host), having written nothing."""
    key = os.path.realpath(out)
    if key in _locks:
        return
    path = os.path.join(out, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 256).decode(errors="replace").strip() or "another process"
        os.close(fd)
        cli.fail("--out", f"{out} is in use by {holder}, which holds the lock {path}: wait for "
                 "that run to end (or stop it), or pick another --out")  # fmt: skip
    except OSError as e:  # a filesystem without locks (Lustre mounted without -o flock)
        os.close(fd)
        print(f"note: cannot lock {path} ({e.strerror}): nothing keeps a second run out of {out}")
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
    _locks[key] = fd


def start_or_resume(args, world, optimizer, rank: int, log=print):
    """A new run folder, or the run in args.out continued from its last good checkpoint (weights,
    optimizer, RNG, gain EMA). Returns (first epoch to run, optimizer steps, gain EMA, metrics
    history); rank 0 locks the folder and (re)writes args.json and metrics.jsonl up to the
    resumed epoch."""
    start, gains_ema, opt_steps, history = 1, None, 0, []
    if args.resume:
        ckpt = load_latest(args.out, log)
        if ckpt is not None:
            tensors, optim_state, state = ckpt
            world.load_state_dict({k: v.to(world.device) for k, v in tensors.items()})
            load_optimizer_state(world.trainable, optimizer, optim_state, args.shard)
            set_rng_state(state["rng"])
            start, opt_steps = state["epoch"] + 1, state["opt_steps"]
            if state["gains_ema"] is not None:
                gains_ema = torch.tensor(state["gains_ema"], dtype=torch.float64)
            log(f"resuming {args.out} after epoch {state['epoch']}")
        history = resume_metrics(args.out, start - 1 if ckpt else None, log)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        lock_run(args.out)  # a new run's folder exists only now; --resume took it in setup
        write_json_atomic(os.path.join(args.out, "args.json"), asdict(args))
        rewrite_metrics(args.out, history)
        keep_environment(args.out, log)
    return start, opt_steps, gains_ema, history


# What decides a run's floating-point results besides its flags: the libraries' versions and the
# CPU's kernels (ATen, MKL and oneDNN each pick code by the processor; the variables below force
# one path), or the GPU.
DISPATCH = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
PACKAGES = ("torch", "triton", "diffusers", "transformers", "peft", "numpy", "safetensors")


def environment() -> dict:
    """The run's environment: Python and package versions, the CPU, the kernels torch dispatches
    to, its threads and the dispatch variables set, and the GPU if one is used."""
    import platform
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    gpu = torch.cuda.get_device_name() if torch.cuda.is_initialized() else None
    return {
        "python": platform.python_version(), **{p: version(p) for p in PACKAGES},
        "cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(), "gpu": gpu,
        "variables": {k: os.environ[k] for k in DISPATCH if k in os.environ},
    }  # fmt: skip


def keep_environment(out: str, log=print) -> None:
    """OUT/environment.json for a new run; a resumed run in another environment says so (its
    numbers may then differ from an uninterrupted run's at float rounding)."""
    path, now = os.path.join(out, "environment.json"), environment()
    if not os.path.isfile(path):
        write_json_atomic(path, now)
        return
    with open(path) as f:
        then = json.load(f)
    changed = [k for k in now if then.get(k) != now[k]]
    if changed:
        log(f"note: {out} was started in another environment ({', '.join(changed)} differ: "
            f"{path}); from here its numbers may differ from an uninterrupted run's at float "
            "rounding")  # fmt: skip


class Stop:
    """SIGINT (Ctrl-C) and SIGTERM (how SLURM, Kubernetes and torchrun stop a job) ask the loop
    to finish its epoch, checkpoint and exit with 128 + the signal's number: 130, 143. A second
    SIGINT aborts at once (the epoch is lost, the previous checkpoint stays); a second SIGTERM is
    ignored, as a scheduler may signal both the launcher (which forwards it) and each worker."""

    def __init__(self, log=print):
        self.received: list[int] = []  # this rank's signals, in order
        self.signum = 0  # the one every rank agreed on at the end of an epoch; 0: go on
        self.log = log
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received.append(signum)
        if len(self.received) == 1:
            again = "Ctrl-C again: abort, lose the epoch" if signum == signal.SIGINT else (
                "a SIGKILL before the end loses only this epoch")  # fmt: skip
            try:
                self.log(f"\n{signal.Signals(signum).name}: finishing this epoch, then saving "
                         f"({again})")  # fmt: skip
            except RuntimeError:  # the signal came while stdout was being written: no note
                pass

    def agreed(self) -> bool:
        """Whether any rank was asked to stop (every rank calls this at the same point of each
        epoch, and gets the same answer): ranks that disagreed would wait on each other forever."""
        flag = torch.tensor([self.received[0] if self.received else 0])
        if dist.is_initialized():
            if dist.get_backend() == "nccl":  # nccl reduces CUDA tensors only
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.signum = int(flag.item())
        return bool(self.signum)

    def exit(self) -> None:
        """Exit 128 + the agreed signal, once the epoch is saved. SIGTERM is ignored from here on:
        torchrun signals the ranks still running when one has exited, and Python's default
        handler, back while the interpreter shuts down, would turn a clean 143 into a kill."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.exit(128 + self.signum)


def write_summary(args, history: list[dict], base: dict, names: list[str], log=print) -> None:
    """summary.json: the base model's eval, the last eval, and the gaps closed."""
    evals = [m for m in history if "eval/" + names[0] in m]
    summary = {"epochs": args.epochs, "base": base}
    for key in ("eval", "gap"):
        summary["final" if key == "eval" else key] = {
            k.split("/", 1)[1]: v for k, v in evals[-1].items() if k.startswith(key + "/")
        }
    write_json_atomic(os.path.join(args.out, "summary.json"), summary)
    log(f"done: {args.out}/summary.json")


def run_main(main, faults: tuple[type[BaseException], ...]) -> None:
    """main(), with the faults of a run (not of the code) ending it with exit 1 and one line
    instead of a traceback: `faults` (a reward's NaN, a non-finite loss), WriteFailed, a full disk
    while writing a picture or a log, and under torchrun a lost rank or node."""
    try:
        main()
    except (*faults, WriteFailed) as e:
        print(f"recast.py: stopped: {e}", file=sys.stderr)
        sys.exit(1)
    except OSError as e:  # a picture or log that a full disk refused
        if e.errno not in DISK_FULL:
            raise
        folder = os.path.dirname(e.filename or "") or "."
        what = os.path.basename(e.filename or "a file")
        print(f"recast.py: stopped: {write_failed(e, what, folder)}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as e:  # under torchrun: a rank or node lost before the run saved anything
        exit_if_rank_lost(e, None)  # names it and exits 1; returns for any other error
        raise
