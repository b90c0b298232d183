"""The reward models that need more than a CLIP: one file each, with the released code it follows
named at its top. rewards.py registers them (`ocr`, `vqa`, `imagereward`, `hpsv3`); nothing here
imports rewards.py.

- ocr_reader.py: EasyOCR's English detector and recogniser, and the reader that runs them;
- paddle_reader.py: PaddleOCR's PP-OCRv6 detector and recogniser as rapidocr ships and runs them
  (the `ocr` reward's other reader: `load_ocr_reader`);
- vlm.py: a local Qwen2-VL-family model (the `vqa` reward's, HPSv3's backbone, the pairwise
  judge's);
- imagereward_model.py: ImageReward's BLIP and head, converted to transformers' classes;
- hpsv3_model.py: HPSv3's Qwen2-VL reward model, converted to transformers' classes.
"""

import os

import torch

from reward_models import ocr_reader, paddle_reader

CHUNK = 32  # images per reward-model forward (rewards.py's CLIP scorers too)


def affine_chain(state: dict[str, torch.Tensor], bad: str) -> list[tuple]:
    """(weight, bias) pairs, in layer order, of an MLP head whose layers are all affine (keys
    layers.N.weight/bias, or weight/bias): LAION's aesthetic predictor's and ImageReward's, whose
    ReLUs are commented out in their code. A ValueError starting with `bad` otherwise."""
    prefixes = {k.removesuffix("weight") for k in state if k.endswith("weight")}
    if not prefixes or any(p + "bias" not in state for p in prefixes):
        raise ValueError(f"{bad} (want layers.N.weight/bias, weight/bias)")
    order = sorted(prefixes, key=lambda p: int(p.split(".")[-2]) if p else 0)
    return [(state[p + "weight"].float(), state[p + "bias"].float()) for p in order]


OCR_READERS = {"easyocr": ocr_reader.load_reader, "paddle": paddle_reader.load_reader}
OCR_READER = "easyocr"  # the default: docs/your_reward.md#two-readers says why


def load_ocr_reader(device: torch.device):
    """The `ocr` reward's reader named by RECAST_OCR_READER (default OCR_READER), loaded; a
    ValueError listing the known readers for another name. Each has `read(image (3, H, W) uint8)
    -> str`."""
    name = os.environ.get("RECAST_OCR_READER") or OCR_READER
    if name not in OCR_READERS:
        raise ValueError(
            f"RECAST_OCR_READER={name!r} is not an OCR reader: choose from "
            f"{', '.join(OCR_READERS)} (unset: {OCR_READER})"
        )
    return OCR_READERS[name](device)
