"""A run's latest eval images, kept in its folder so that two runs can be compared image by image.

`OUT/eval_images/` holds one PNG per (held-out prompt, eval seed), `NNNN.png` in the eval set's
order, and `index.json`: the epoch, every prompt in that order, and a SHA-256 of the fixed eval
noise, so a comparison can check that both runs drew from the same prompts and noise
(`python studies/judge.py RUN_A RUN_B`). Every eval replaces the folder whole: each rank writes
its share into `eval_images.tmp/`, and rank 0 swaps it in once all have, so an interrupted run
keeps its previous eval's set. PNG is lossless on 8-bit pixels: the toy world's 128 images take a
few hundred kB.
"""

import hashlib
import json
import os
import shutil

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image

from plumbing import checkpoints

FOLDER = "eval_images"


def noise_digest(noise: torch.Tensor) -> str:
    """SHA-256 of the eval noise (its shape and float32 bytes): equal digests, equal noise."""
    x = noise.detach().float().cpu().contiguous()
    return hashlib.sha256(str(tuple(x.shape)).encode() + x.numpy().tobytes()).hexdigest()


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """Images (B, 3, H, W) in [-1, 1] → (B, H, W, 3) uint8."""
    x = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).cpu().numpy()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(out: str, images: torch.Tensor, start: int, index: dict, rank: int) -> None:
    """This rank's share of the eval images (global positions start, start + 1, …) into
    OUT/eval_images/, replacing the previous eval's; `index` (epoch, prompts, noise digest) is
    written by rank 0. Every rank calls it (it synchronises them)."""
    tmp, final = os.path.join(out, FOLDER + ".tmp"), os.path.join(out, FOLDER)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    name = "index.json"
    try:  # a full disk: the run's one line names the file and the run folder (not the .tmp one)
        for j, pixels in enumerate(to_uint8(images)):
            name = f"{start + j:04d}.png"
            Image.fromarray(pixels).save(os.path.join(tmp, name))
        _barrier()
        if rank == 0:
            name = "index.json"
            with open(os.path.join(tmp, name), "w") as f:
                json.dump(index, f, indent=1)
    except OSError as e:
        raise checkpoints.write_failed(e, f"{FOLDER}/{name}", out) from e
    if rank == 0:
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)


def load(run: str) -> tuple[dict, torch.Tensor]:
    """(index, images (N, 3, H, W) in [-1, 1]) of a run folder's eval_images/; FileNotFoundError
    naming the folder when it has none. A run stopped between save's two renames has none but
    eval_images.old/, the previous eval's set, whole: that one is read."""
    folder = os.path.join(run, FOLDER)
    if not os.path.isfile(os.path.join(folder, "index.json")) and os.path.isfile(
            os.path.join(folder + ".old", "index.json")):  # fmt: skip
        folder += ".old"
    path = os.path.join(folder, "index.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{run} has no saved eval images ({path} is missing): runs keep their latest eval's "
            "images since eval_images/ was added; rerun, or --resume with more --epochs"
        )
    with open(path) as f:
        index = json.load(f)
    pixels = [np.asarray(Image.open(os.path.join(folder, f"{j:04d}.png")).convert("RGB"))
              for j in range(len(index["prompts"]))]  # fmt: skip
    images = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float() / 127.5 - 1
    return index, images
