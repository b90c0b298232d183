"""ImageReward (Xu et al., 2023): BLIP's text encoder reads the prompt while attending to the
image, an MLP head scores its [CLS] state. The released ImageReward.pt converted to transformers'
BLIP classes (`imagereward_keys`), the image preprocessed as its own transform does, and scored.

Follows image-reward 1.5 (github.com/THUDM/ImageReward: ImageReward/ImageReward.py, its `_transform`
and `score`; ImageReward/models/BLIP/); its package pins transformers 4.27 and needs torchvision,
so this file reimplements the scoring on this project's stack. benchmarks/reward_parity.py scores
it beside the package itself (docs/your_reward.md#parity).
"""

import os

import torch
import torch.nn.functional as F

from reward_models import CHUNK, affine_chain, read_weights
from reward_models.vlm import to_pil

IMAGEREWARD_FETCH = (
    "hf download THUDM/ImageReward ImageReward.pt med_config.json --local-dir DIR; "
    "hf download google-bert/bert-base-uncased vocab.txt tokenizer_config.json --local-dir DIR"
)
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072  # its standardisation
IMAGEREWARD_TOKENS = 35  # prompts padded or cut to this many tokens, as ImageReward does
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def imagereward_keys(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """ImageReward.pt (BLIP's own names, as released) → {"vision": transformers' BlipVisionModel
    state, "text": BlipTextModel state, "head": the MLP's layers.N weights}. BLIP's ViT names its
    parts as timm does (blocks.N.attn.qkv, norm1, patch_embed.proj, pos_embed, cls_token, norm);
    its text encoder is a BERT with cross-attention, named as transformers' BlipTextModel is."""
    import re

    vision, text, head = {}, {}, {}
    renames = [
        (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
        (r"^pos_embed$", "embeddings.position_embedding"),
        (r"^cls_token$", "embeddings.class_embedding"),
        (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
        (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
        (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
        (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
        (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
        (r"^norm\.", "post_layernorm."),
    ]
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key.removeprefix("blip.visual_encoder.")
            for pattern, new in renames:
                name = re.sub(pattern, new, name)
            vision[name] = value
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            text[key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
    return {"vision": vision, "text": text, "head": head}


def imagereward_models(parts: dict, med: dict) -> tuple:
    """transformers' BlipVisionModel (its sizes read off the weights: BLIP's ViT, 64-wide heads)
    and BlipTextModel (med_config.json's sizes) of `imagereward_keys`' parts, loaded."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    patches = parts["vision"]["embeddings.patch_embedding.weight"]  # (width, 3, p, p)
    width, patch = patches.shape[0], patches.shape[-1]
    side = round((parts["vision"]["embeddings.position_embedding"].shape[1] - 1) ** 0.5) * patch
    layers = 1 + max(int(k.split(".")[2]) for k in parts["vision"] if k.startswith("encoder."))
    vision = BlipVisionModel(
        BlipVisionConfig(
            hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
            num_attention_heads=max(1, width // 64), image_size=side,  # 64-wide heads
            patch_size=patch, layer_norm_eps=1e-6,  # BLIP's ViT
        )
    )  # fmt: skip
    text = BlipTextModel(
        BlipTextConfig(
            vocab_size=med["vocab_size"], hidden_size=med["hidden_size"],
            encoder_hidden_size=width, intermediate_size=med["intermediate_size"],
            num_hidden_layers=med["num_hidden_layers"],
            num_attention_heads=med["num_attention_heads"],
            max_position_embeddings=med["max_position_embeddings"],
            layer_norm_eps=med["layer_norm_eps"], hidden_act=med["hidden_act"],
            pad_token_id=med.get("pad_token_id", 0), bos_token_id=None, sep_token_id=None,
        ),
        add_pooling_layer=False,
    )  # fmt: skip
    vision.load_state_dict(parts["vision"])
    text.load_state_dict(parts["text"])
    return vision, text


def load(device: torch.device):
    """ImageReward (Xu et al., 2023): BLIP's text encoder reads the prompt while attending to the
    image (ViT-L/16, 224 px), an MLP maps its [CLS] state to a score, standardised by the
    training set's mean and std. RECAST_IMAGEREWARD: a folder with the released
    ImageReward.pt and med_config.json, and BERT's uncased tokenizer (vocab.txt), loaded into
    transformers' BLIP classes (`imagereward_keys`)."""
    import json

    from transformers import BertTokenizer

    folder = os.environ.get("RECAST_IMAGEREWARD")
    if not folder:
        raise FileNotFoundError(
            f"reward 'imagereward' needs its model: set RECAST_IMAGEREWARD to a folder made by "
            f"{IMAGEREWARD_FETCH}"
        )
    for name in ("ImageReward.pt", "med_config.json", "vocab.txt"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(
                f"reward 'imagereward': {folder!r} (RECAST_IMAGEREWARD) has no {name}; make it "
                f"with {IMAGEREWARD_FETCH}"
            )
    state = read_weights(
        os.path.join(folder, "ImageReward.pt"), "reward 'imagereward' (RECAST_IMAGEREWARD)"
    )
    parts = imagereward_keys(state)
    if not parts["vision"] or not parts["text"] or not parts["head"]:
        raise ValueError(f"{folder}/ImageReward.pt: not ImageReward's (blip.*, mlp.* weights)")
    try:  # a med_config.json or ImageReward.pt of another model: KeyError, RuntimeError
        with open(os.path.join(folder, "med_config.json")) as f:
            med = json.load(f)
        vision, text = imagereward_models(parts, med)
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"reward 'imagereward': {folder} (RECAST_IMAGEREWARD): ImageReward.pt and "
            f"med_config.json are not ImageReward's ({type(e).__name__}: {str(e)[:300]}); make "
            f"the folder with {IMAGEREWARD_FETCH}"
        ) from None
    head = affine_chain(parts["head"], f"{folder}/ImageReward.pt: no MLP head")
    tokenizer = BertTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    if len(tokenizer) != med["vocab_size"]:
        raise ValueError(
            f"reward 'imagereward': the tokenizer in {folder!r} has {len(tokenizer)} tokens with "
            f"BLIP's [DEC] and [ENC]; the model has {med['vocab_size']}: use bert-base-uncased's"
        )
    for model in (vision, text):
        model.to(device).eval().requires_grad_(False)
    head = [(w.to(device), b.to(device)) for w, b in head]
    return imagereward_scorer(vision, text, tokenizer, head)


def imagereward_pixels(images: torch.Tensor, side: int) -> torch.Tensor:
    """Images in [-1, 1] → ImageReward's input (B, 3, side, side), as its `_transform` makes it
    (ImageReward/ImageReward.py, image-reward 1.5) from the 8-bit PIL image it is given:
    torchvision's Resize(side, BICUBIC) (on a PIL image: PIL's bicubic resize, the shorter side
    to `side`, the longer to int(side × long / short)), CenterCrop(side) (offsets rounded half
    to even, as torchvision's round), ToTensor (÷ 255) and Normalize with CLIP's statistics.
    Done with PIL here: torchvision does not import beside this project's torch."""
    import numpy as np
    from PIL import Image

    out = []
    for image in to_pil(images):
        w, h = image.size
        short, long = min(w, h), max(w, h)
        size = (side, int(side * long / short))  # (short, long)
        image = image.resize(size if w <= h else size[::-1], Image.BICUBIC)
        w, h = image.size
        top, left = round((h - side) / 2), round((w - side) / 2)
        image = image.crop((left, top, left + side, top + side))
        out.append(np.asarray(image, dtype=np.float32) / 255)
    x = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)
    mean, std = torch.tensor(CLIP_MEAN)[:, None, None], torch.tensor(CLIP_STD)[:, None, None]
    return ((x - mean) / std).to(images.device)


def imagereward_scorer(vision, text, tokenizer, head, pixels=imagereward_pixels):
    """ImageReward's score, given transformers' BlipVisionModel and BlipTextModel, the tokenizer
    and the head's (weight, bias) pairs on the models' device. `pixels` (images, side) → (B, 3,
    side, side) is the host's preprocessing (the memory planner, whose images hold no values,
    gives a tensor of its shape instead)."""
    side = vision.config.image_size
    device = next(vision.parameters()).device

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(prompts), CHUNK):
            x = pixels(images[s : s + CHUNK], side).to(device)
            seen = vision(pixel_values=x).last_hidden_state
            tokens = tokenizer(
                prompts[s : s + CHUNK], padding="max_length", truncation=True,
                max_length=IMAGEREWARD_TOKENS, return_tensors="pt",
            ).to(device)  # fmt: skip
            x = text(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                encoder_hidden_states=seen,
                encoder_attention_mask=torch.ones(seen.shape[:2], dtype=torch.long, device=device),
            ).last_hidden_state[:, 0].float()  # fmt: skip
            for w, b in head:
                x = F.linear(x, w, b)
            out.append((x[:, 0] - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
        return torch.cat(out).to(images.device)

    return score
