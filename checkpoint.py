"""Run plumbing for recast.py: atomic checkpoints, metrics.jsonl, args.json, start or resume,
SIGINT, the summary, the optional TensorBoard log, and the torchrun ranks (process group, gathers,
the bit-identity check).

A checkpoint is a folder `ckpt/epoch_XXXX/` holding `model.safetensors` (trained and old policy),
`optim.pt` (optimizer), and `state.json` (epoch, gain EMA, step count, RNG states, and the SHA-256
of the two other files). It is written under a temporary name and renamed into place, so a
checkpoint folder either exists whole or not at all; `state.json` is written last and its hashes
catch a file truncated or corrupted later. The newest two are kept: if the newest does not verify,
the one before it is used.
"""

import hashlib
import json
import math
import os
import random
import shutil
import signal
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

KEEP = 2


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


def write_json_atomic(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    """Write ckpt/epoch_{epoch:04d} atomically; prune to the newest KEEP. Returns its path."""
    root = os.path.join(run_dir, "ckpt")
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"epoch_{epoch:04d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()},
        os.path.join(tmp, "model.safetensors"),
    )
    torch.save(optim, os.path.join(tmp, "optim.pt"))
    for name in ("model.safetensors", "optim.pt"):
        with open(os.path.join(tmp, name), "rb+") as f:
            os.fsync(f.fileno())
    state = dict(
        state,
        epoch=epoch,
        rng=rng_state(),
        sha256={
            name: _sha256(os.path.join(tmp, name)) for name in ("model.safetensors", "optim.pt")
        },
    )
    write_json_atomic(os.path.join(tmp, "state.json"), state)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in sorted(
        d for d in os.listdir(root) if d.startswith("epoch_") and not d.endswith(".tmp")
    )[:-KEEP]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def load_latest(run_dir: str, log=print) -> tuple[dict, dict, dict] | None:
    """(tensors, optim, state) of the newest checkpoint that verifies, or None if there is none."""
    root = os.path.join(run_dir, "ckpt")
    if not os.path.isdir(root):
        return None
    for name in sorted(
        (d for d in os.listdir(root) if d.startswith("epoch_") and not d.endswith(".tmp")),
        reverse=True,
    ):
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


def read_metrics(run_dir: str, upto_epoch: float = math.inf) -> list[dict]:
    """metrics.jsonl lines with epoch <= upto_epoch (a line cut by a kill is dropped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    lines = []
    with open(path) as f:
        for line in f:
            try:
                m = json.loads(line)
            except json.JSONDecodeError:
                break
            if m["epoch"] <= upto_epoch:
                lines.append(m)
    return lines


def rewrite_metrics(run_dir: str, lines: list[dict]) -> None:
    tmp = os.path.join(run_dir, "metrics.jsonl.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)
    os.replace(tmp, os.path.join(run_dir, "metrics.jsonl"))


def append_metrics(run_dir: str, m: dict) -> None:
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps(m) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Run bookkeeping for recast.py: start or resume a run folder, SIGINT, the final summary
# ---------------------------------------------------------------------------------------------
def start_or_resume(args, world, optimizer, rank: int, log=print):
    """A new run folder, or the run in args.out continued from its last good checkpoint (weights,
    optimizer, RNG, gain EMA). Returns (first epoch to run, optimizer steps, gain EMA, metrics
    history); rank 0 (re)writes args.json and metrics.jsonl up to the resumed epoch."""
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
        history = read_metrics(args.out, start - 1)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        write_json_atomic(os.path.join(args.out, "args.json"), asdict(args))
        rewrite_metrics(args.out, history)
    return start, opt_steps, gains_ema, history


def stop_on_sigint(log=print) -> list:
    """A list that becomes non-empty at the first SIGINT (the loop finishes its epoch, saves and
    exits); a second SIGINT aborts at once."""
    stop = []

    def on_sigint(signum, frame):
        if stop:
            raise KeyboardInterrupt
        stop.append(signum)
        log("\ninterrupt: finishing this epoch, then saving (Ctrl-C again: abort, lose the epoch)")

    signal.signal(signal.SIGINT, on_sigint)
    return stop


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
def init_processes(args, distributed: bool) -> tuple[int, torch.device]:
    """(rank, device), the process group started under torchrun; seeds set per rank."""
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
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


def epoch_generator(seed: int, epoch: int, purpose: int) -> torch.Generator:
    """Every random draw of an epoch comes from generators seeded by (seed, epoch, purpose): the
    same on every rank and after a resume, which is what makes resume exact."""
    return torch.Generator().manual_seed(((seed * 100_003 + epoch) * 7 + purpose) % 2**63)
