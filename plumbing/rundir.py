"""The run folder: one run per folder (its lock), start or resume from the last good checkpoint,
SIGINT and SIGTERM, summary.json, and the process's exit codes for the faults of a run."""

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from plumbing import cli
from plumbing.checkpoints import (
    DISK_FULL,
    WriteFailed,
    load_latest,
    newest,
    resume_metrics,
    rewrite_metrics,
    write_failed,
    write_json_atomic,
)
from plumbing.distributed import _seconds, exit_if_rank_lost, load_optimizer_state
from plumbing.seeding import set_rng_state

_locks: dict[str, int] = {}  # run folder → the descriptor of its .lock, held for life
_folders: list[str] = []  # this process's run folders, newest last: on every rank (rank 0 locks)


def remember(out: str) -> None:
    """Note `out` as this process's run folder, the one run_main names for a full disk's write
    that names no file: on every rank, though only rank 0 holds the lock."""
    key = os.path.realpath(out)
    if key in _folders:
        _folders.remove(key)
    _folders.append(key)


def lock_run(out: str) -> None:
    """Hold OUT/.lock while this process lives: an exclusive flock, which the OS drops when the
    process ends, however it ends (SIGKILL too), so a stale lock never blocks --resume. Another
    live process holding it: exit 2 naming it (pid, host), having written nothing."""
    remember(out)
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


SHARED_WAIT = 60.0  # seconds a rank looks for rank 0's token: see check_shared_folder


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _sees(path: str, nonce: str, wait_s: float) -> bool:
    """Whether the token file `path` holding `nonce` can be read here within wait_s."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path) as f:
                if json.load(f).get("nonce") == nonce:
                    return True
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def check_shared_folder(args, rank: int) -> None:
    """Under torchrun, before any model loads: the run folder is one folder that every rank sees,
    and every rank runs the same flags. Every rank reads args.json and the checkpoint from it and
    writes eval images into it, so a node whose --out is another folder (a relative or node-local
    path, a stale copy) would train from its own state while rank 0 writes the run. Rank 0 writes
    a token (a fresh random nonce) into --out; every rank reads it back, waiting up to
    RECAST_SHARED_WAIT seconds (default 60: a network filesystem may show another node's new file
    only once its attribute cache expires, 30-60 s on NFS); one all_gather_object tells every rank
    who saw it and a digest of each rank's flags (a resumed run's come from its args.json). A rank
    that did not see it, or other flags: exit 2 on every rank (rank 0 and the ranks at fault say
    why), naming the folder, the ranks and their hosts. Rank 0 then removes the token, and the
    folder if it made it (a new run's, made again by start_or_resume: bad input found while
    loading still leaves nothing written). Also gives every rank rank 0's --out (a default
    runs/<time> name is rank 0's clock's)."""
    if not dist.is_initialized():
        return
    wait = _seconds("RECAST_SHARED_WAIT", SHARED_WAIT).total_seconds()  # a bad one: exit 2
    said = [args.out, secrets.token_hex(16)]
    dist.broadcast_object_list(said, src=0)
    args.out, nonce = said
    token = os.path.join(args.out, f".shared-{nonce[:8]}")
    made = False
    if rank == 0:
        made = not os.path.isdir(args.out)
        os.makedirs(args.out, exist_ok=True)
        write_json_atomic(token, {"nonce": nonce, "host": socket.gethostname(), "pid": os.getpid()})
    dist.barrier()
    mine = (_sees(token, nonce, wait), _digest(asdict(args)), socket.gethostname())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if rank == 0:  # every rank has looked
        os.remove(token)
        if made:
            try:
                os.rmdir(args.out)
            except OSError:  # another process wrote into it meanwhile: leave it
                pass
    blind = [r for r, (seen, _, _) in enumerate(every) if not seen]
    other = [r for r, (_, flags, _) in enumerate(every) if flags != every[0][1]]
    ranks = lambda rs: ", ".join(f"{r} ({every[r][2]})" for r in rs)  # noqa: E731
    if blind:
        message = (f"{args.out} is not one folder that every rank sees: rank {ranks(blind)} did "
                   f"not find the file that rank 0 ({every[0][2]}) wrote into it within {wait:g} "
                   "s; give --out a folder on a filesystem that every node mounts at the same "
                   "path (an absolute path), or raise RECAST_SHARED_WAIT if files written on one "
                   "node reach the others later")  # fmt: skip
        _fail_on_every_rank("--out", message, rank == 0 or rank in blind)
    if other:
        where = f"{args.out}/args.json differs on their nodes" if args.resume else (
            "launched with other flags")  # fmt: skip
        message = f"rank {ranks(other)} run other flags than rank 0 ({where})"
        _fail_on_every_rank("--resume" if args.resume else "--out", message,
                            rank == 0 or rank in other)  # fmt: skip


def _on_any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank calls it at the same point)."""
    if not dist.is_initialized():
        return flag
    said = torch.tensor([int(flag)])
    if dist.get_backend() == "nccl":  # nccl reduces CUDA tensors only
        said = said.cuda()
    dist.all_reduce(said, op=dist.ReduceOp.MAX)
    return bool(said.item())


def _fail_on_every_rank(flag: str, message: str, speak: bool) -> None:
    """Every rank calls it with the same message: those that `speak` print it (cli.fail), and all
    exit 2."""
    if speak:
        cli.fail(flag, message)
    sys.exit(2)


def check_same_checkpoint(out: str, ckpt, history: list[dict], rank: int) -> None:
    """Under torchrun, a resumed run: every rank read the same checkpoint and the same
    metrics.jsonl lines, or exit 2 on every rank naming what each read. Each rank reads the
    checkpoint itself (rank 0 does not read it and broadcast it): load_latest has checked the bytes
    it read against the SHA-256 that state.json records, so one all_gather_object of a digest of
    (its folder's name, its state.json, the lines) proves that every rank loads the same LoRA,
    optimizer state, RNG and gain EMA. That costs no more reading than before and a few bytes on
    the network, under DDP and --shard alike, where a broadcast would move the whole optimizer
    state (GB for the large models) through every GPU; and a node that sees a stale listing of
    ckpt/ (an older checkpoint, or none) is named instead of training on."""
    if not dist.is_initialized():
        return
    name = ckpt[2]["epoch"] if ckpt is not None else None
    mine = (name, _digest([ckpt[2] if ckpt is not None else None, history]), socket.gethostname())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    other = [r for r, (_, d, _) in enumerate(every) if d != every[0][1]]
    if other:
        read = lambda r: "no checkpoint" if every[r][0] is None else (  # noqa: E731
            f"ckpt/epoch_{every[r][0]:04d}")  # fmt: skip
        said = "; ".join(f"rank {r} ({every[r][2]}) read {read(r)}" for r in [0, *other])
        message = (f"the ranks read different states from {out}: {said} (or another "
                   "metrics.jsonl): a node sees a stale copy of the run folder; resume once every "
                   "node sees the same files")  # fmt: skip
        _fail_on_every_rank("--resume", message, rank == 0 or rank in other)


def start_or_resume(args, world, optimizer, rank: int, log=print, resolved: dict | None = None):
    """A new run folder, or the run in args.out continued from its last good checkpoint (weights,
    optimizer, RNG, gain EMA). Returns (first epoch to run, optimizer steps, gain EMA, metrics
    history); rank 0 locks the folder and (re)writes args.json (the flags, and `resolved`: what
    the run resolved at its start, e.g. its precision) and metrics.jsonl up to the resumed
    epoch. A resumed run past --epochs (given lower on --resume) exits 2, having written
    nothing: its summary.json would give a later epoch's eval as that of --epochs, and --export
    would call it unfinished. So does one whose checkpoints are all unusable: it started over
    from the base model, silently cutting metrics.jsonl back to epoch 0."""
    start, gains_ema, opt_steps, history = 1, None, 0, []
    if args.resume:
        ckpt = load_latest(args.out, log)
        history = resume_metrics(args.out, ckpt[2]["epoch"] if ckpt else None, log)
        check_same_checkpoint(args.out, ckpt, history, rank)  # before any rank loads it
        if ckpt is None and _on_any_rank(newest(args.out) != "none yet"):  # all unusable
            _fail_on_every_rank("--resume", f"{args.out} has checkpoints, and none is usable "
                                "(each is said above): restore one from a copy, or move "
                                f"{os.path.join(args.out, 'ckpt')} away to start the run over "
                                "from its base model", rank == 0)  # fmt: skip
        done = ckpt[2]["epoch"] if ckpt is not None else 0
        if done > args.epochs:  # summary.json would call epoch `done`'s eval that of --epochs
            _fail_on_every_rank("--epochs", f"{args.out} has done {done} epochs (its newest "
                                f"checkpoint), more than --epochs {args.epochs}: give --epochs "
                                f"{done} or more", rank == 0)  # fmt: skip
        if ckpt is not None:
            tensors, optim_state, state = ckpt
            world.load_state_dict({k: v.to(world.device) for k, v in tensors.items()})
            load_optimizer_state(world.trainable, optimizer, optim_state, args.shard)
            set_rng_state(state["rng"])
            start, opt_steps = state["epoch"] + 1, state["opt_steps"]
            if state["gains_ema"] is not None:
                gains_ema = torch.tensor(state["gains_ema"], dtype=torch.float64)
            log(f"resuming {args.out} after epoch {state['epoch']}")
    remember(args.out)  # every rank's: a full disk on any rank names this folder (run_main)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        lock_run(args.out)  # a new run's folder exists only now; --resume took it in setup
        # a new run's args.json not written (a full disk): the folder holds no run, and the
        # same command, not --resume, starts it once space is freed (cli.holds_no_run)
        again = None if args.resume else (
            "nothing of the run is written yet: free space, then start it again with the same "
            "command")  # fmt: skip
        saved = {**asdict(args), **(resolved or {})}
        write_json_atomic(os.path.join(args.out, "args.json"), saved, again)
        rewrite_metrics(args.out, history)
        if start <= args.epochs:  # a finished run given more epochs is unfinished again: its
            with contextlib.suppress(FileNotFoundError):  # summary.json (the mark of a finished
                os.remove(os.path.join(args.out, "summary.json"))  # run) returns at its end
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
    numbers may then differ from an uninterrupted run's at float rounding), as does one whose
    environment.json cannot be read (torn, another file's), which is left as it is."""
    path, now = os.path.join(out, "environment.json"), environment()
    if not os.path.isfile(path):
        write_json_atomic(path, now)
        return
    try:
        with open(path, "rb") as f:
            then = json.loads(f.read().decode())
        why = None if isinstance(then, dict) else f"JSON, but a {type(then).__name__}"
    except (OSError, ValueError) as e:  # torn, or another file: the run goes on, said so
        why = f"{type(e).__name__}: {e}"
    if why:
        log(f"note: {path} is unreadable ({why}): the environment {out} was started in is "
            "unknown, so a change since is not noticed; its numbers from here may differ from an "
            "uninterrupted run's at float rounding")  # fmt: skip
        return
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


def end_process(code: int) -> None:
    """Under torchrun, end a rank whose run has returned (everything saved, the process groups
    destroyed: distributed.finish) with `code` at once, without the interpreter's shutdown: there
    the process groups' worker threads, still releasing the last collectives' tensors, were
    ended inside code that may not throw and the rank died of SIGABRT after its work was done
    (docs/failure_modes.md). Its output is flushed first; nothing of the run waits for atexit
    (the TensorBoard and wandb views are closed by then). On one process: returns."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main, faults: tuple[type[BaseException], ...]) -> None:
    """main(), with the faults of a run (not of the code) ending it with exit 1 and one line
    instead of a traceback: `faults` (a reward's NaN, a non-finite loss), WriteFailed, a full disk
    while writing a picture or a log, and under torchrun a lost rank or node."""
    try:
        main()
        end_process(0)
    except SystemExit as e:  # Stop.exit's 130 or 143 after the epoch is saved; a flag's exit 2
        end_process(e.code if isinstance(e.code, int) else 1)
        raise
    except (*faults, WriteFailed) as e:
        print(f"recast.py: stopped: {e}", file=sys.stderr)
        end_process(1)
        sys.exit(1)
    except OSError as e:  # a picture or log that a full disk refused
        if e.errno not in DISK_FULL:
            raise
        run = _folders[-1] if _folders else "."  # this process's newest run folder
        # a write to an open file names none; a bare name (relative to the working folder) no
        # folder: both are said in the run's, whose --resume command is the one to give
        folder = os.path.dirname(e.filename or "") or run
        what = os.path.basename(e.filename) if e.filename else "a file"
        print(f"recast.py: stopped: {write_failed(e, what, folder)}", file=sys.stderr)
        end_process(1)
        sys.exit(1)
    except RuntimeError as e:  # under torchrun: a rank or node lost before the run saved anything
        exit_if_rank_lost(e, None)  # names it and exits 1; returns for any other error
        raise
