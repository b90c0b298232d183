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


def read_weights(path: str, who: str, map_location="cpu", safetensors: bool | None = None) -> dict:
    """The tensors saved in the file `path`: a safetensors file (`safetensors`; unset, by the name
    .safetensors), else a torch.save file read as data only (weights_only). `who` (the reward and
    the variable that named the file) starts the error a wrong file gets: a FileNotFoundError if
    there is no such file, a ValueError naming it if it is damaged or of another kind, where torch
    and safetensors raise KeyError, EOFError, RuntimeError, pickle's or their own errors, which a
    run would not report as bad input (harness.setup: exit 2 naming the flag)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{who}: {path!r} is not a file here")
    if safetensors is None:
        safetensors = path.endswith(".safetensors")
    try:
        if safetensors:
            from safetensors.torch import load_file

            state = load_file(path, device=str(map_location))
        else:
            state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # whatever reading it raised: the file is not what was asked for
        kind = "safetensors" if safetensors else "torch.save (data only)"
        raise ValueError(
            f"{who}: {path} is not a {kind} file of weights, or is damaged "
            f"({type(e).__name__}: {str(e)[:200]})"
        ) from None
    if not isinstance(state, dict):
        raise ValueError(f"{who}: {path} holds a {type(state).__name__}, not a dict of weights")
    return state


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
