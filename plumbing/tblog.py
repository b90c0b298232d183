"""--log tensorboard: a view of metrics.jsonl and the run's pictures (rank 0)."""

import os

import numpy as np


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
