"""Models built from configurations, for benchmarks and tests: nothing is downloaded.

- SD3.5-Medium and its `paper1` reward backbones at their real sizes, from benchmarks/configs/*.json
  (each value's source is written there): `load_configs`, and `sd35m_models` to build them (with
  random weights, on whatever device is current: a GPU, the CPU, or meta for a count or a trace).
- `--shrink F`: the same structure with every width ÷ F and every depth ÷ SHRINK_DEPTH
  (`shrink_configs`), for runs on a CPU.
- Small generated tokenizers with the real sequence lengths: `clip_tokenizer` (one token per byte,
  77 tokens), `t5_tokenizer` (one token per printable character); `prompts` long enough to fill
  CLIP's 77 tokens with them.
- `tiny_sd3_pipeline`: the tiny SD3 pipeline (T5 left out) that the tests train.
- `tiny_vlm`: a tiny random Qwen2.5-VL saved as a local model folder (weights, a generated
  byte-level tokenizer with the chat template, the image processor), for the VLM judge's tests.

A leaf: imports torch, diffusers and transformers only (lazily), never the training script.
"""

import copy
import json
import math
import os
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent / "benchmarks" / "configs"
SHRINKS = (2, 4, 8, 16)
SHRINK_DEPTH = 8  # --shrink also divides every depth by this (at least 1 layer; 2 for the MMDiT)
CLIP_IDS = dict(bos_token_id=512, eos_token_id=513, pad_token_id=513)  # clip_tokenizer's ids


# ---------------------------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------------------------
def load_configs(shrink: int = 0) -> dict:
    """{name: the "config" of benchmarks/configs/NAME.json} (plus the aesthetic head's widths, the
    reward image size and T5's sequence length), every width divided by `shrink` when given."""
    raw = {p.stem: json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))}
    c = {k: copy.deepcopy(v["config"]) for k, v in raw.items()}
    c["aesthetic_head"] = list(raw["clip_vit_l14"]["aesthetic_head"]["widths"])
    c["reward_image_size"] = raw["clip_vit_h14"]["processor"]["crop_size"]
    c["t5_tokens"] = raw["t5xxl_encoder"]["sequence_length"]
    if shrink:
        shrink_configs(c, shrink)
    return c


def shrink_configs(c: dict, f: int) -> None:
    """--shrink F, in place: every width ÷ F (attention: heads ÷ h and head width ÷ F/h, h = 2 or
    4, so that the L² attention scores shrink too), every depth ÷ SHRINK_DEPTH (at least one
    layer, two for the MMDiT; SD3.5's dual-attention share of the blocks kept); sequence lengths,
    vocabularies and the structure unchanged."""
    h = 2 ** math.ceil(math.log2(f) / 2)  # heads ÷ h, head width ÷ f / h

    def depth(n: int, least: int = 1) -> int:
        return max(least, round(n / SHRINK_DEPTH))

    tr = c["sd35m_transformer"]
    dual = len(tr["dual_attention_layers"]) / tr["num_layers"]
    tr["num_attention_heads"] //= h
    tr["attention_head_dim"] //= f // h
    for k in ("caption_projection_dim", "joint_attention_dim", "pooled_projection_dim"):
        tr[k] //= f
    tr["num_layers"] = depth(tr["num_layers"], 2)
    tr["dual_attention_layers"] = list(range(max(1, round(dual * tr["num_layers"]))))
    vae = c["sd35m_vae"]
    vae["block_out_channels"] = [w // f for w in vae["block_out_channels"]]
    vae["norm_num_groups"] = max(1, vae["norm_num_groups"] // f)
    towers = [c["clip_l_text"], c["clip_g_text"]]
    for name in ("clip_vit_h14", "clip_vit_l14"):
        c[name]["projection_dim"] //= f
        towers += [c[name]["text_config"], c[name]["vision_config"]]
    for cfg in towers:
        for k in ("hidden_size", "intermediate_size", "projection_dim"):
            if k in cfg:
                cfg[k] //= f
        cfg["num_attention_heads"] //= h
        cfg["num_hidden_layers"] = depth(cfg["num_hidden_layers"])
    t5 = c["t5xxl_encoder"]
    t5["d_model"] //= f
    t5["d_ff"] //= f
    t5["num_heads"] //= h
    t5["d_kv"] //= f // h
    t5["num_layers"] = depth(t5["num_layers"])
    c["aesthetic_head"] = [max(1, w // f) for w in c["aesthetic_head"][:-1]] + [1]


def clip_text_config(cfg: dict):
    """A transformers CLIPTextConfig with clip_tokenizer's special-token ids."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(**cfg, **CLIP_IDS)


def clip_config(cfg: dict):
    """A transformers CLIPConfig (text and vision towers) with clip_tokenizer's ids."""
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config={**cfg["text_config"], **CLIP_IDS},
        vision_config=cfg["vision_config"],
        projection_dim=cfg["projection_dim"],
    )


def t5_config(cfg: dict):
    from transformers import T5Config

    return T5Config(**cfg)


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sd35m_models(c: dict) -> dict[str, torch.nn.Module]:
    """SD3.5-Medium's transformer, VAE, CLIP-L, CLIP-G and T5-XXL and the reward backbones (CLIP
    ViT-H/14, CLIP ViT-L/14) of configurations `c`, with random weights, fp32, built on the
    current default device (`with torch.device("meta"):` builds them without memory)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPModel, CLIPTextModelWithProjection, T5EncoderModel

    return {
        "transformer": SD3Transformer2DModel(**c["sd35m_transformer"]),
        "vae": AutoencoderKL(**c["sd35m_vae"]),
        "clip_l_text": CLIPTextModelWithProjection(clip_text_config(c["clip_l_text"])),
        "clip_g_text": CLIPTextModelWithProjection(clip_text_config(c["clip_g_text"])),
        "t5xxl_encoder": T5EncoderModel(t5_config(c["t5xxl_encoder"])),
        "clip_vit_h14": CLIPModel(clip_config(c["clip_vit_h14"])),
        "clip_vit_l14": CLIPModel(clip_config(c["clip_vit_l14"])),
    }


def sd35m_pipeline(c: dict, models: dict, tokenizers: Path):
    """A StableDiffusion3Pipeline of `models` (from sd35m_models) with generated tokenizers
    saved under the folder `tokenizers`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    tok = clip_tokenizer(tokenizers / "clip")
    return StableDiffusion3Pipeline(
        transformer=models["transformer"], vae=models["vae"],
        scheduler=FlowMatchEulerDiscreteScheduler(**c["sd35m_scheduler"]),
        text_encoder=models["clip_l_text"], tokenizer=tok,
        text_encoder_2=models["clip_g_text"], tokenizer_2=tok,
        text_encoder_3=models["t5xxl_encoder"], tokenizer_3=t5_tokenizer(tokenizers / "t5"),
    )  # fmt: skip


def reward_image_processor(size: int):
    """CLIP's image processor at `size` px (shortest side resized, centre crop)."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )


class OpenClipLike(torch.nn.Module):
    """A transformers CLIPModel behind open_clip's call: model(image, text) → {"image_features",
    "text_features"}, both L2-normalised (HPS v2.1's model is an open_clip ViT-H-14)."""

    def __init__(self, clip: torch.nn.Module):
        super().__init__()
        self.clip = clip

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> dict[str, torch.Tensor]:
        img = self.clip.visual_projection(self.clip.vision_model(pixel_values=image).pooler_output)
        txt = self.clip.text_projection(self.clip.text_model(input_ids=text).pooler_output)
        return {
            "image_features": torch.nn.functional.normalize(img, dim=-1),
            "text_features": torch.nn.functional.normalize(txt, dim=-1),
        }


# a tiny CLIP text tower for clip_tokenizer
TINY_TEXT = dict(
    vocab_size=514, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    num_attention_heads=2, max_position_embeddings=77, **CLIP_IDS,
)  # fmt: skip


def tiny_sd3_pipeline(tokenizer):
    """A tiny SD3 pipeline (T5 left out) with random weights drawn from the global RNG: 32 px
    images, 4 × 16 × 16 latents, 2 MMDiT blocks, two 16-wide CLIP text encoders sharing
    `tokenizer` (a clip_tokenizer)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    def encoder():
        return CLIPTextModelWithProjection(CLIPTextConfig(**TINY_TEXT, projection_dim=16))

    return StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
            num_attention_heads=2, attention_head_dim=8, joint_attention_dim=32,
            caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=16,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=AutoencoderKL(
            down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
            block_out_channels=[8, 16], layers_per_block=1, latent_channels=4, norm_num_groups=4,
            sample_size=32, scaling_factor=1.5, shift_factor=0.06,
        ),
        text_encoder=encoder(), tokenizer=tokenizer,
        text_encoder_2=encoder(), tokenizer_2=tokenizer,
        text_encoder_3=None, tokenizer_3=None,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Tokenizers (small, generated; real sequence lengths) and prompts
# ---------------------------------------------------------------------------------------------
def clip_tokenizer(folder):
    """A CLIP tokenizer with one token per byte (and per end-of-word byte), no merges, 77 tokens;
    saved to `folder` and loaded from it."""
    from transformers import CLIPTokenizer

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte → char map
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)]
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": 256 + i for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": 512, "<|endoftext|>": 513}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
    return CLIPTokenizer.from_pretrained(folder, model_max_length=77)


def t5_tokenizer(folder):
    """A T5 tokenizer (SentencePiece-style unigram) with one token per printable character."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    tok = T5TokenizerFast(vocab=pieces, extra_ids=0)
    tok.save_pretrained(folder)
    return tok


SUBJECTS = ["a red fox", "an old lighthouse", "a bowl of ramen", "a glass teapot", "two cyclists",
            "a snowy village", "a robot gardener", "a koi pond", "a paper boat", "a jazz trio",
            "a desert canyon", "a city tram"]  # fmt: skip
STYLES = ["oil painting, thick brush strokes", "studio photograph, soft light",
          "watercolour on rough paper", "isometric 3d render", "charcoal sketch"]  # fmt: skip


def prompts(n: int, offset: int = 0) -> list[str]:
    """n distinct prompts of 100+ characters: past CLIP's 77 tokens with a byte tokenizer."""
    out = []
    for i in range(offset, offset + n):
        s, st = SUBJECTS[i % len(SUBJECTS)], STYLES[(i // len(SUBJECTS)) % len(STYLES)]
        out.append(f"{s} at dusk, seen from a low angle, {st}, highly detailed, sharp focus, "
                   f"balanced composition, variant {i}")  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# A tiny vision-language model (Qwen2.5-VL), saved as a model folder
# ---------------------------------------------------------------------------------------------
VLM_SPECIAL_TOKENS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2.5-VL-Instruct's chat format: a default system turn, then <|im_start|>role\n...<|im_end|>\n
# turns, each image a <|vision_start|><|image_pad|><|vision_end|> placeholder that preprocessing
# widens to one <|image_pad|> per merged patch.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def tiny_vlm(folder: str | os.PathLike, seed: int = 0) -> str:
    """Write a tiny random Qwen2.5-VL into `folder` as a released Qwen2.5-VL-Instruct folder is laid
    out (config.json and weights, tokenizer with chat template, preprocessor_config.json), so that
    AutoModelForImageTextToText, AutoTokenizer and AutoImageProcessor load it back offline; returns
    the folder. Two text layers and two vision blocks, all 32 wide; images resized to at most
    56 x 56 px: 4 x 4 patches of 14 px, merged 2 x 2 into 4 tokens an image. The tokenizer is a
    byte-level BPE without merges over the 256 byte symbols (any text encodes; "1" and "2" are
    single tokens, as in Qwen's vocabulary) plus VLM_SPECIAL_TOKENS. Its answers mean nothing;
    loading, preprocessing and the forward are the real model's. Same seed, same weights; the
    caller's random state is left as it was."""
    from tokenizers import pre_tokenizers
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2Tokenizer,
        Qwen2VLImageProcessorPil,
    )

    folder = os.fspath(folder)
    vocab = {"<|endoftext|>": 0}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for token in VLM_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(VLM_SPECIAL_TOKENS),
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(vocab),
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,  # head width 8: 4 rotary frequencies, split (t, h, w) 2, 1, 1
            "num_key_value_heads": 2,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1]},
            "eos_token_id": vocab["<|im_end|>"],
            "pad_token_id": vocab["<|endoftext|>"],
            "bos_token_id": None,
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "out_hidden_size": 32,  # the text width: merged patches become token embeddings
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    return folder
