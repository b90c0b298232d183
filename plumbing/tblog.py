"""--log: views of metrics.jsonl and the run's pictures (rank 0), in TensorBoard and in wandb."""

import importlib
import json
import os
import secrets

import numpy as np

from plumbing import cli
from plumbing.checkpoints import resume_command, write_json_atomic

TARGETS = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb"}  # --log: its module
WANDB_ID = "wandb.json"  # in the run folder: the wandb run that a resumed run continues


def targets(text: str) -> list[str]:
    """--log's value → its targets: "none" (none), or one or more of TARGETS, comma-separated
    (e.g. "tensorboard,wandb"). A ValueError names an unknown one."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in TARGETS]
    if unknown or not names:
        raise ValueError(f"unknown target {', '.join(unknown) or repr(text)}: give none, or one or "
                         f"more of {', '.join(TARGETS)} separated by commas")  # fmt: skip
    return list(dict.fromkeys(names))


def missing(names: list[str]) -> str | None:
    """What to install for the targets `names`, or None when every one's package imports."""
    for name in names:
        try:
            importlib.import_module(TARGETS[name])
        except ImportError:
            return f"{name} is not installed: pip install {name} (or drop it from --log)"
    return None


def _scalars(m: dict) -> dict:
    """The numbers of a metrics.jsonl line, but its epoch (W, D and gains are lists: not here)."""
    return {k: v for k, v in m.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "epoch"}  # fmt: skip


class TensorBoard:
    """--log tensorboard (rank 0): every number of a metrics.jsonl line as a scalar at its epoch,
    and the pictures the run draws (W.png with the gain profiles each epoch, samples.png at each
    eval) as images. metrics.jsonl and the PNGs stay the record; this is a view of them. A resumed
    run whose OUT/tensorboard exists continues it from `first`, the first epoch it runs: what an
    earlier launch logged from that epoch on (epochs past its last checkpoint, which run again)
    is purged from the view (SummaryWriter's purge_step), and the epochs before it are not sent
    again (each epoch once, as metrics.jsonl holds it)."""

    def __init__(self, out: str, first: int = 1):
        from torch.utils.tensorboard import SummaryWriter

        folder = os.path.join(out, "tensorboard")
        self.first = first if os.path.isdir(folder) else 0  # 0: a new log, sent every epoch
        self.writer = SummaryWriter(folder, purge_step=self.first or None)

    def epoch(self, m: dict, out: str, pictures: bool = True) -> None:
        step = m["epoch"]
        if step < self.first:  # resumed: the log holds this epoch already
            return
        for k, v in _scalars(m).items():
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


class WandB:
    """--log wandb (rank 0): the scalars TensorBoard gets, at the same epochs (wandb's step), and
    W.png and samples.png as images at each eval. One wandb run per run folder: its id is kept in
    OUT/wandb.json, so a resumed run continues it from `first`, the first epoch it runs: the
    epochs before it are not sent again (offline, wandb's own step does not know them). Epochs an
    earlier launch logged past its last checkpoint, which run again, keep that launch's numbers
    in wandb: it takes no step below one it holds (metrics.jsonl and TensorBoard hold the rerun's).
    wandb's own variables apply: WANDB_MODE=offline (no network; `wandb sync` uploads later),
    WANDB_PROJECT (default "recast"), WANDB_ENTITY, WANDB_DIR (default: the run folder)."""

    def __init__(self, out: str, config: dict, first: int = 1):
        import wandb

        path = os.path.join(out, WANDB_ID)
        kept = {}
        if os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    kept = json.loads(f.read().decode())
            except ValueError as e:  # torn or another file: a line, not a traceback
                kept = f"{type(e).__name__}: {e}"
            if not isinstance(kept, dict):
                cli.fail("--log", f"{path} is not the run's wandb id ({kept}): restore it from a "
                         "copy, or remove it to log to a new wandb run")  # fmt: skip
        run_id = kept.get("id") or secrets.token_hex(4)
        project = kept.get("project") or os.environ.get("WANDB_PROJECT") or "recast"
        try:
            self.run = wandb.init(project=project, id=run_id, resume="allow", config=config,
                                  name=os.path.basename(os.path.normpath(out)),
                                  dir=os.environ.get("WANDB_DIR") or out)  # fmt: skip
        except wandb.errors.Error as e:  # not logged in, no network: a line, not a traceback
            cli.fail("--log", f"wandb could not start its run ({e}): log in (wandb login) or set "
                     f"WANDB_MODE=offline, then continue: {resume_command(out)}")  # fmt: skip
        self.first = first if kept else 0  # 0: a new wandb run, sent every epoch
        if kept != {"id": run_id, "project": project}:
            write_json_atomic(path, {"id": run_id, "project": project})
        self.image = wandb.Image

    def epoch(self, m: dict, out: str, pictures: bool = True) -> None:
        step = m["epoch"]
        if step < max(self.first, self.run.step):  # resumed: wandb holds this epoch already
            return
        data = _scalars(m)
        if pictures and any(k.startswith("eval/") for k in m):
            for name in ("W", "samples"):
                path = os.path.join(out, f"{name}.png")
                if os.path.isfile(path):
                    data[name] = self.image(path)
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class Views:
    """Every --log target, each fed every metrics.jsonl line (rank 0); `first`: the first epoch
    this launch runs (a resumed run's, after its checkpoint)."""

    def __init__(self, names: list[str], out: str, config: dict, first: int = 1):
        self.views = [TensorBoard(out, first) if n == "tensorboard" else WandB(out, config, first)
                      for n in names]  # fmt: skip

    def epoch(self, m: dict, out: str, pictures: bool = True) -> None:
        for view in self.views:
            view.epoch(m, out, pictures)

    def close(self) -> None:
        for view in self.views:
            view.close()
