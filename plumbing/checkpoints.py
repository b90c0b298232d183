"""Checkpoints and metrics.jsonl: every byte recast.py writes into its run folder.

A checkpoint is a folder `ckpt/epoch_XXXX/` holding `model.safetensors` (trained and old policy),
`optim.pt` (optimizer), and `state.json` (epoch, gain EMA, step count, RNG states, and the SHA-256
of the two other files). It is written under a temporary name and renamed into place, so a
checkpoint folder either exists whole or not at all; `state.json` is written last and its hashes
catch a file truncated or corrupted later. The newest two are kept, by epoch number: if the
newest does not verify, the one before it is used (if none does, --resume exits 2:
rundir.start_or_resume). A write that fails (a full disk) removes the temporary folder and stops
the run with WriteFailed; the checkpoints before it are untouched. write_whole replaces a
script's JSON result whole the same way (studies/diagnostic.py, studies/anatomy.py,
benchmarks/decode_memory.py --convs).

What each fault does and which test injects it: docs/failure_modes.md.
"""

import errno
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import sys

import torch
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from plumbing import cli
from plumbing.seeding import rng_state

KEEP = 2
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class WriteFailed(RuntimeError):
    """A write into the run folder failed (a full disk, a quota, an I/O error). recast.py stops
    with exit 1 and this one-line message; what was written before it stays good."""


def _checkpoints(root: str) -> list[str]:
    """The finished checkpoint folders under ckpt/, oldest first: by their epoch's number, not
    their names' order (epoch_10000 comes after epoch_9999)."""
    if not os.path.isdir(root):
        return []
    names = [d for d in os.listdir(root) if re.fullmatch(r"epoch_\d+", d)]
    return sorted(names, key=lambda d: int(d.removeprefix("epoch_")))


def newest(run_dir: str) -> str:
    """The newest finished checkpoint's folder, or "none yet"."""
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


def write_failed(e: OSError, what: str, run_dir: str, then: str | None = None) -> WriteFailed:
    """WriteFailed naming what could not be written, the folder, its disk and the OS error, and
    `then`, what to do once space is freed (default: the newest checkpoint is kept; --resume)."""
    try:
        free = f"{shutil.disk_usage(run_dir).free / 2**30:.2f} GiB free now"
    except OSError:
        free = "free space unknown"
    cause = {errno.ENOSPC: "the disk holding it is full", errno.EDQUOT: "its disk quota is used up"}
    then = then or (f"the newest checkpoint ({newest(run_dir)}) is kept: free space, then "
                    f"continue: {resume_command(run_dir)}")  # fmt: skip
    return WriteFailed(
        f"could not write {what} in {run_dir}: {cause.get(e.errno, 'the OS refused the write')} "
        f"([Errno {e.errno}] {e.strerror or e}; {free}); {then}"
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


def write_json_atomic(path: str, obj, then: str | None = None) -> None:
    """`obj` as JSON, written beside `path` and renamed onto it: the old file or the new, whole.
    A failed write raises WriteFailed (`then`: as in write_failed)."""
    tmp = path + ".tmp"
    try:
        _write_synced(tmp, json.dumps(obj, indent=1).encode())
        os.replace(tmp, path)
    except OSError as e:
        _remove(tmp)
        raise write_failed(e, os.path.basename(path), os.path.dirname(path) or ".", then) from e


def write_whole(path: str, obj) -> None:
    """`obj` as compact JSON, written beside `path` and renamed onto it: a stop or an error while
    writing leaves the earlier file whole, never the end of minutes of work half-written in its
    place. For the scripts' result files (studies/, benchmarks/): unlike write_json_atomic it
    belongs to no run, so an error is raised as it came (OSError, or TypeError for what JSON
    cannot hold), without recast.py's --resume advice, and nothing is fsynced; the part written
    is removed."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def save(
    run_dir: str, epoch: int, tensors: dict[str, torch.Tensor], optim: dict, state: dict
) -> str:
    """Write ckpt/epoch_{epoch:04d} atomically; prune to the newest KEEP. Returns its path. A
    failed write (a full disk) removes the temporary folder and raises WriteFailed: the
    checkpoints before it are untouched, and nothing half-written is left for --resume. The
    checkpoints of later epochs go (load_latest found them unusable, or this run would have
    resumed from them): kept, they counted among the newest KEEP and pruned this one."""
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
    names = _checkpoints(root)
    later = [n for n in names if int(n.removeprefix("epoch_")) > epoch]
    for old in later + [n for n in names if n not in later][:-KEEP]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    for stale in (d for d in os.listdir(root) if d.endswith(".tmp")):  # a crash mid-write
        shutil.rmtree(os.path.join(root, stale), ignore_errors=True)
    return final


STATE = ("epoch", "opt_steps", "gains_ema", "rng", "sha256")  # what state.json holds


def _check_state(state, name: str) -> None:
    """ValueError where `state` (ckpt/`name`/state.json) is not what save wrote for that folder
    (a checkpoint something else wrote): each key, the epoch of the folder's name, and a SHA-256
    of both files, or its hashes would vouch for nothing and a key missing stop the resume in a
    traceback."""
    if not isinstance(state, dict) or any(k not in state for k in STATE):
        raise ValueError(f"state.json lacks {', '.join(k for k in STATE if k not in state)}"
                         if isinstance(state, dict) else "state.json is not an object")  # fmt: skip
    if type(state["epoch"]) is not int or state["epoch"] != int(name.removeprefix("epoch_")):
        raise ValueError(f"its state.json is epoch {state['epoch']!r}'s")
    if not isinstance(state["sha256"], dict) or sorted(state["sha256"]) != [
        "model.safetensors", "optim.pt"]:  # fmt: skip
        raise ValueError("its state.json records no SHA-256 of model.safetensors and optim.pt")


def load_latest(run_dir: str, log=print) -> tuple[dict, dict, dict] | None:
    """(tensors, optim, state) of the newest checkpoint that verifies, or None if there is none."""
    root = os.path.join(run_dir, "ckpt")
    for name in reversed(_checkpoints(root)):
        path = os.path.join(root, name)
        try:
            with open(os.path.join(path, "state.json")) as f:
                state = json.load(f)
            _check_state(state, name)
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


def _record(line: str) -> dict:
    """A metrics.jsonl line as its record: a JSON object with its epoch, a whole number ≥ 0;
    ValueError saying what it is instead."""
    m = json.loads(line)  # json.JSONDecodeError: a ValueError
    epoch = m.get("epoch") if isinstance(m, dict) else None
    if type(epoch) is not int or epoch < 0:
        what = (f"a {type(m).__name__}" if not isinstance(m, dict) else
                f"its epoch is {epoch!r}" if "epoch" in m else "it has no epoch")  # fmt: skip
        raise ValueError(f"JSON, but not an epoch's record: {what}")
    return m


def _parse_metrics(path: str) -> tuple[list[dict], str | None]:
    """metrics.jsonl's whole lines, and its torn last line (None if there is none): what a crash
    in the middle of an append leaves, text without its newline or not JSON. A line that is not
    an epoch's record anywhere else (not JSON, or JSON without a whole-number epoch: a file
    written by something else) is a ValueError naming the file and the line."""
    with open(path, "rb") as f:
        raw = f.read().decode("utf-8", errors="replace").split("\n")
    tail = raw.pop()  # what follows the last newline: "" when the file ends with one
    lines = []
    for i, line in enumerate(raw, 1):
        try:
            lines.append(_record(line))
        except ValueError as e:
            if i == len(raw) and not tail:  # the last line, broken (zeros after a power loss)
                return lines, line
            why = f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)
            raise ValueError(
                f"{path}, line {i}: {why}; a crash can only tear the last line, so the file is "
                "damaged: restore it from a copy"
            ) from e
    return lines, (tail or None)


def _whole(torn: str | None) -> dict | None:
    """The torn last line as a record, when only its newline is missing."""
    try:
        return _record(torn) if torn is not None else None
    except ValueError:
        return None


def _excerpt(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:40] + "…")


def read_metrics(run_dir: str) -> list[dict]:
    """metrics.jsonl's lines, for the readers of a run (benchmarks/, studies/). A torn last line
    (a crash while appending; --resume drops it) is skipped with a warning."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    lines, torn = _parse_metrics(path)
    if _whole(torn) is not None:
        lines.append(_whole(torn))
    elif torn is not None:
        print(f"warning: {path}: its torn last line {_excerpt(torn)} is skipped (a crash while "
              "appending it; --resume drops it)", file=sys.stderr)  # fmt: skip
    return lines


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
