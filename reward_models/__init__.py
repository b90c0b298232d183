"""The reward models that need more than a CLIP: one file each, with the released code it follows
named at its top. rewards.py registers them (`ocr`, `vqa`, `imagereward`, `hpsv3`); nothing here
imports rewards.py.

- ocr_reader.py: EasyOCR's English detector and recogniser, and the reader that runs them;
- vlm.py: a local Qwen2-VL-family model (the `vqa` reward's, HPSv3's backbone, the pairwise
  judge's);
- imagereward_model.py: ImageReward's BLIP and head, converted to transformers' classes;
- hpsv3_model.py: HPSv3's Qwen2-VL reward model, converted to transformers' classes.
"""

import torch

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
