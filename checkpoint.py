"""Run plumbing for recast.py: atomic checkpoints, metrics.jsonl, args.json, start or resume,
the run folder's lock, SIGINT and SIGTERM, the summary, the optional TensorBoard log, and the
torchrun ranks (process group, gathers, the bit-identity check, a lost rank).

A checkpoint is a folder `ckpt/epoch_XXXX/` holding `model.safetensors` (trained and old policy),
`optim.pt` (optimizer), and `state.json` (epoch, gain EMA, step count, RNG states, and the SHA-256
of the two other files). It is written under a temporary name and renamed into place, so a
checkpoint folder either exists whole or not at all; `state.json` is written last and its hashes
catch a file truncated or corrupted later. The newest two are kept: if the newest does not verify,
the one before it is used. A write that fails (a full disk) removes the temporary folder and stops
the run with WriteFailed; the checkpoints before it are untouched.

What each fault does and which test injects it: docs/failure_modes.md.
"""

import datetime
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

import cli

KEEP = 2
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(RuntimeError):
    """A write into the run folder failed (a full disk, a quota, an I/O error). recast.py stops
    with exit 1 and this one-line message; what was written before it stays good."""


def _checkpoints(root: str) -> list[str]:
    """The finished checkpoint folders under ckpt/, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("epoch_") and not d.endswith(".tmp"))


def _newest(run_dir: str) -> str:
    names = _checkpoints(os.path.join(run_dir, "ckpt"))
    return os.path.join(run_dir, "ckpt", names[-1]) if names else "none yet"


def resume_command(out: str) -> str:
    """The command that continues the run in `out`, launched as this process was."""
    tail = f"recast.py --out {shlex.quote(out)} --resume"
    if "LOCAL_WORLD_SIZE" not in os.environ:  # torchrun sets it in every worker
        return f"python {tail}"
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = int(os.environ["WORLD_SIZE"]) // per_node
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node={per_node} {tail}"
    launch = f"torchrun --nnodes={nodes} --nproc-per-node={per_node} <your --rdzv flags>"
    return f"on each node: {launch} {tail}"


def write_failed(e: OSError, what: str, run_dir: str) -> WriteFailed:
    """WriteFailed naming what could not be written, the folder, its disk and the OS error."""
    try:
        free = f"{shutil.disk_usage(run_dir).free / 2**30:.2f} GiB free now"
    except OSError:
        free = "free space unknown"
    cause = {errno.ENOSPC: "the disk holding it is full", errno.EDQUOT: "its disk quota is used up"}
    return WriteFailed(
        f"could not write {what} in {run_dir}: {cause.get(e.errno, 'the OS refused the write')} "
        f"([Errno {e.errno}] {e.strerror or e}; {free}); the newest checkpoint "
        f"({_newest(run_dir)}) is kept: free space, then continue: {resume_command(run_dir)}"
    )


def _write_synced(path: str, data: bytes, append: bool = False) -> None:
    """`data` into `path` (appended, or replacing what was there), fsynced: every byte of the
    checkpoints, metrics.jsonl and the JSON files goes through here (the tests fill the disk
    here). A failure raises OSError and may leave part of `data` written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view[: 1 << 24]) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def write_json_atomic(path: str, obj) -> None:
    """`obj` as JSON, written beside `path` and renamed onto it: the old file or the new, whole."""
    tmp = path + ".tmp"
    try:
        _write_synced(tmp, json.dumps(obj, indent=1).encode())
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise write_failed(e, os.path.basename(path), os.path.dirname(path) or ".") from e


def rng_state() -> dict:
    """Global RNG states (python, numpy, torch CPU), JSON-serialisable."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, py_gauss = random.getstate()
    return {
        "python": [version, list(mt), py_gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.random.get_rng_state().tolist(),
    }


def set_rng_state(state: dict) -> None:
    version, mt, py_gauss = state["python"]
    random.setstate((version, tuple(mt), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.random.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save(
    run_dir: str, epoch: int, tensors: dict[str, torch.Tensor], optim: dict, state: dict
) -> str:
    """Write ckpt/epoch_{epoch:04d} atomically; prune to the newest KEEP. Returns its path. A
    failed write (a full disk) removes the temporary folder and raises WriteFailed: the
    checkpoints before it are untouched, and nothing half-written is left for --resume."""
    root = os.path.join(run_dir, "ckpt")
    final = os.path.join(root, f"epoch_{epoch:04d}")
    tmp = final + ".tmp"
    optim_bytes = io.BytesIO()
    torch.save(optim, optim_bytes)
    blobs = {
        "model.safetensors": safetensors_bytes(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        ),
        "optim.pt": optim_bytes.getvalue(),
    }
    state = dict(
        state,
        epoch=epoch,
        rng=rng_state(),
        sha256={name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()},
    )
    blobs["state.json"] = json.dumps(state, indent=1).encode()  # last: it vouches for the others
    try:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name, data in blobs.items():
            _write_synced(os.path.join(tmp, name), data)
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # and the space it took
        raise write_failed(e, f"checkpoint {final}", run_dir) from e
    for old in _checkpoints(root)[:-KEEP]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    for stale in (d for d in os.listdir(root) if d.endswith(".tmp")):  # a crash mid-write
        shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    return final


def load_latest(run_dir: str, log=print) -> tuple[dict, dict, dict] | None:
    """(tensors, optim, state) of the newest checkpoint that verifies, or None if there is none."""
    root = os.path.join(run_dir, "ckpt")
    for name in reversed(_checkpoints(root)):
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "state.json")) as f:
                state = json.load(f)
            for file, digest in state["sha256"].items():
                if _sha256(os.path.join(path, file)) != digest:
                    raise ValueError(
                        f"{file} does not match its recorded SHA-256 (truncated or corrupt)"
                    )
            tensors = load_file(os.path.join(path, "model.safetensors"))
            optim = torch.load(os.path.join(path, "optim.pt"), weights_only=True)
        except (
            Exception
        ) as e:  # any unreadable checkpoint: say so and fall back to the previous one
            log(f"checkpoint {path} is unusable ({type(e).__name__}: {e}); trying the previous one")
            continue
        return tensors, optim, state
    return None


def _parse_metrics(path: str) -> tuple[list[dict], str | None]:
    """metrics.jsonl's whole lines, and its torn last line (None if there is none): what a crash
    in the middle of an append leaves, text without its newline or not JSON. A line that is not
    JSON anywhere else is a ValueError naming the file and the line."""
    with open(path, "rb") as f:
        raw = f.read().decode("utf-8", errors="replace").split("\n")
    tail = raw.pop()  # what follows the last newline: "" when the file ends with one
    lines = []
    for i, line in enumerate(raw, 1):
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(raw) and not tail:  # the last line, broken (zeros after a power loss)
                return lines, line
            raise ValueError(
                f"{path}, line {i}: not JSON ({e.msg}); a crash can only tear the last line, so "
                "the file is damaged: restore it from a copy"
            ) from e
    return lines, (tail or None)


def _whole(torn: str | None) -> dict | None:
    """The torn last line as a record, when only its newline is missing."""
    try:
        m = json.loads(torn) if torn is not None else None
    except json.JSONDecodeError:
        return None
    return m if isinstance(m, dict) and "epoch" in m else None


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "…")


def read_metrics(run_dir: str, upto_epoch: float = math.inf) -> list[dict]:
    """metrics.jsonl lines with epoch <= upto_epoch, for the readers of a run (benchmarks/). A
    torn last line (a crash while appending; --resume drops it) is skipped with a warning."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    lines, torn = _parse_metrics(path)
    if _whole(torn) is not None:
        lines.append(_whole(torn))
    elif torn is not None:
        print(f"warning: {path}: its torn last line {_excerpt(torn)} is skipped (a crash while "
              "appending it; --resume drops it)", file=sys.stderr)  # fmt: skip
    return [m for m in lines if m["epoch"] <= upto_epoch]


def resume_metrics(run_dir: str, ckpt_epoch: int | None, log=print) -> list[dict]:
    """metrics.jsonl's lines up to the checkpoint's epoch, each of 0..ckpt_epoch once (None, no
    checkpoint: the base model's line, if any); the lines after it go, as their epochs run again.
    A torn last line is dropped with a note when it comes after the checkpoint; a torn line the
    checkpoint needs, a damaged line, a missing or repeated epoch exit 2 naming the file."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        lines, torn = _parse_metrics(path) if os.path.exists(path) else ([], None)
    except ValueError as e:
        cli.fail("--resume", str(e))
    needed = -1 if ckpt_epoch is None else ckpt_epoch  # the last epoch the checkpoint vouches for
    reached = lines[-1]["epoch"] if lines else -1
    after = f"after the checkpoint's epoch {needed}" if needed >= 0 else "with no checkpoint yet"
    if _whole(torn) is not None:  # only its newline is missing: whole, kept if it is needed
        lines.append(_whole(torn))
        if lines[-1]["epoch"] > needed:
            log(f"note: {path}: dropped its last line (epoch {lines[-1]['epoch']}, torn before "
                f"its newline), written {after}: that epoch runs again")  # fmt: skip
    elif torn is not None and reached >= needed:
        log(f"note: {path}: dropped its torn last line {_excerpt(torn)}, written {after} by a "
            "crash while appending: that epoch runs again")  # fmt: skip
    elif torn is not None:
        cli.fail("--resume", f"{path}: its last line is torn ({_excerpt(torn)}) and the lines "
                 f"before it stop at epoch {reached}, while the checkpoint holds epoch {needed}: "
                 "restore metrics.jsonl from a copy, or move the newest ckpt/epoch_* away to "
                 "resume from an earlier checkpoint")  # fmt: skip
    history = [m for m in lines if m["epoch"] <= max(needed, 0)]
    epochs = [m["epoch"] for m in history]
    if epochs != list(range(needed + 1)) and not (needed == -1 and epochs in ([], [0])):
        cli.fail("--resume", f"{path} holds epochs {epochs} up to the checkpoint's epoch "
                 f"{needed}, not each of 0..{needed} once: restore it from a copy, or use a new "
                 "--out")  # fmt: skip
    return history


def rewrite_metrics(run_dir: str, lines: list[dict]) -> None:
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        _write_synced(path + ".tmp", "".join(json.dumps(m) + "\n" for m in lines).encode())
        os.replace(path + ".tmp", path)
    except OSError as e:
        _remove(path + ".tmp")
        raise write_failed(e, "metrics.jsonl", run_dir) from e


def append_metrics(run_dir: str, m: dict) -> None:
    """One line, appended and fsynced. A failed write is cut back off, so a full disk leaves no
    torn line (a crash in the middle of the write does: --resume drops it)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    size = os.path.getsize(path) if os.path.exists(path) else 0
    try:
        _write_synced(path, (json.dumps(m) + "\n").encode(), append=True)
    except OSError as e:
        try:
            os.truncate(path, size)
        except OSError:
            pass
        raise write_failed(e, f"epoch {m['epoch']} to metrics.jsonl", run_dir) from e


# ---------------------------------------------------------------------------------------------
# Run bookkeeping for recast.py: one run per folder, start or resume, SIGINT and SIGTERM, summary
# ---------------------------------------------------------------------------------------------
_locks: dict[str, int] = {}  # run folder → the descriptor of its .lock, held for life
_run_dir: str | None = None  # the run this process trains (for the message of a lost rank)


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
    global _run_dir
    _run_dir = args.out
    start, gains_ema, opt_steps, history = 1, None, 0, []
    if args.resume:
        ckpt = load_latest(args.out, log)
        if ckpt is not None:
            tensors, optim_state, state = ckpt
            world.load_state_dict({k: v.to(world.device) for k, v in tensors.items()})
            optimizer.load_state_dict(optim_state)
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
    return start, opt_steps, gains_ema, history


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


# ---------------------------------------------------------------------------------------------
# --log tensorboard
# ---------------------------------------------------------------------------------------------
class TensorBoard:
    """--log tensorboard (rank 0): every number of a metrics.jsonl line as a scalar at its epoch,
    and the pictures the run draws (W.png with the gain profiles each epoch, samples.png at each
    eval) as images. metrics.jsonl and the PNGs stay the record; this is a view of them."""

    def __init__(self, out: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(out, "tensorboard"))

    def epoch(self, m: dict, out: str, pictures: bool = True) -> None:
        step = m["epoch"]
        for k, v in m.items():
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "epoch":
                self.writer.add_scalar(k, v, step)
        evaluated = any(k.startswith("eval/") for k in m)
        for name in ("W", "samples") if pictures else ():
            path = os.path.join(out, f"{name}.png")
            if os.path.isfile(path) and (name == "W" or evaluated):
                from PIL import Image

                image = np.asarray(Image.open(path).convert("RGB"))
                self.writer.add_image(name, image, step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


# ---------------------------------------------------------------------------------------------
# Processes: torchrun ranks (identity on one process) and per-epoch generators
# ---------------------------------------------------------------------------------------------
COLLECTIVE_TIMEOUT = 300  # seconds a rank waits inside one collective: see collective_timeout


def collective_timeout() -> datetime.timedelta:
    """How long a rank waits inside one collective for the others before it gives up: seconds in
    RECAST_COLLECTIVE_TIMEOUT, default 300. A rank that dies is noticed at once whatever this is
    (its connections close, and torchrun stops its node's other workers); this bounds a silent
    hang (a node without power or network, a stuck GPU). It must exceed the longest legitimate
    wait: the first collective waits for the slowest rank to load the models, and ranks wait for
    rank 0 to write checkpoints and pictures (docs/failure_modes.md#a-lost-rank-or-node)."""
    text = os.environ.get("RECAST_COLLECTIVE_TIMEOUT", str(COLLECTIVE_TIMEOUT))
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        cli.fail("RECAST_COLLECTIVE_TIMEOUT", f"must be a number of seconds > 0, got {text!r}")
    return datetime.timedelta(seconds=seconds)


def init_processes(args, distributed: bool) -> tuple[int, torch.device]:
    """(rank, device), the process group started under torchrun; seeds set per rank."""
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=collective_timeout())
    rank = dist.get_rank() if distributed else 0
    device = torch.device(("cuda" if use_cuda else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)
    return rank, device


def gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate a tensor across ranks along `dim` (rank order); every rank gets the result."""
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def mean_all(x: torch.Tensor) -> float:
    """Mean of x's elements over every rank; ranks may hold different numbers (eval shares)."""
    total = torch.stack([x.double().sum(), x.new_tensor(x.numel(), dtype=torch.float64)])
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def same_on_all_ranks(tensors: dict[str, torch.Tensor], when: str) -> str:
    """SHA-256 of the tensors' bytes, key by key; a RuntimeError unless every rank's is the same.
    DDP averages gradients whatever each rank holds, so a rank that drifted (its own W, weights
    initialised from its own seed) would train on silently: this is what catches it."""
    digest = hashlib.sha256()
    for k in sorted(tensors):
        digest.update(k.encode())
        digest.update(tensors[k].detach().cpu().contiguous().flatten().view(torch.uint8).numpy())
    mine, digests = digest.hexdigest(), [None] * dist.get_world_size()
    dist.all_gather_object(digests, mine)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"ranks {differ} hold another W or other weights than rank 0 {when}")
    return mine


# What a collective raises when another rank is gone: gloo's RuntimeError (its connection closed,
# or it timed out) names gloo; nccl's, torch's DistBackendError, is a DistError.
LOST = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out")


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
    except RuntimeError as e:  # under torchrun: a rank or node lost
        exit_if_rank_lost(e)  # names it and exits 1; returns for any other error
        raise


def exit_if_rank_lost(e: BaseException) -> None:
    """Under torchrun, when `e` is a collective that failed because another rank died or stopped
    answering: print which ranks do not answer and the --resume command, and end this process at
    once with exit 1 (a broken process group can hang in its destructor). Otherwise return."""
    if not dist.is_initialized() or not (
        isinstance(e, dist.DistError) or any(s in str(e) for s in LOST)
    ):
        return
    me, silent = dist.get_rank(), _silent_ranks()
    if silent == []:  # every rank answers: not a lost rank but an error they all met
        return
    who = f"rank {', '.join(map(str, silent))} stopped answering" if silent else (
        f"the rendezvous store does not answer either: the node hosting it "
        f"({os.environ.get('MASTER_ADDR', '?')}) is lost")  # fmt: skip
    error = (str(e).strip().splitlines() or [type(e).__name__])[0][:240]
    if "Timed out" in error:
        error += (f"; if the ranks were only slow, raise RECAST_COLLECTIVE_TIMEOUT (now "
                  f"{collective_timeout().total_seconds():g} s)")  # fmt: skip
    then = "nothing was saved yet" if _run_dir is None else (
        f"the newest checkpoint ({_newest(_run_dir)}) is kept; once every node is back, "
        f"continue: {resume_command(_run_dir)}")  # fmt: skip
    sys.stdout.flush()
    print(f"recast.py: stopped: rank {me} lost contact: {who} ({error}); {then}",
          file=sys.stderr, flush=True)  # fmt: skip
    os._exit(1)


def _silent_ranks(wait_s: float = 5.0) -> list[int] | None:
    """The other ranks that do not check in through the rendezvous store within wait_s (every
    rank whose collective failed checks in here); None when the store itself does not answer."""
    me, attempt = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = lambda r: f"recast/lost/{attempt}/{r}"  # noqa: E731
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(key(me), socket.gethostname())
        silent = [r for r in range(dist.get_world_size()) if r != me]
        deadline = time.monotonic() + wait_s
        while silent and time.monotonic() < deadline:
            time.sleep(0.2)
            silent = [r for r in silent if not store.check([key(r)])]
        return silent
    except (AttributeError, RuntimeError, OSError):  # DistStoreError is a RuntimeError
        return None


def epoch_generator(seed: int, epoch: int, purpose: int) -> torch.Generator:
    """Every random draw of an epoch comes from generators seeded by (seed, epoch, purpose): the
    same on every rank and after a resume, which is what makes resume exact."""
    return torch.Generator().manual_seed(((seed * 100_003 + epoch) * 7 + purpose) % 2**63)
