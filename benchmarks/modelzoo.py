"""Models built from configurations, for benchmarks and tests: nothing is downloaded.

- SD3.5-Medium and its `paper1` reward backbones at their real sizes, from benchmarks/configs/*.json
  (each value's source is written there): `load_configs`, and `sd35m_models` to build them (with
  random weights, on whatever device is current: a GPU, the CPU, or meta for a count or a trace).
- FLUX.1-dev and -schnell, FLUX.2-klein 4B and Qwen-Image at their real sizes, from the same
  folder: `family_configs`, `family_models` (transformer, VAE, text encoders) and
  `family_pipeline` (the diffusers pipeline, generated tokenizers), for the cost model and the
  memory planner.
- `--shrink F`: the same structure with every width ÷ F and every depth ÷ SHRINK_DEPTH
  (`shrink_configs`), for runs on a CPU.
- Small generated tokenizers with the real sequence lengths: `clip_tokenizer` (one token per byte,
  77 tokens), `t5_tokenizer` (one token per printable character); `prompts` long enough to fill
  CLIP's 77 tokens with them.
- The rewards that do not sit on CLIP (`ocr`, `vqa`, `imagereward`, `hpsv3`) at their real sizes,
  one configuration file each (REWARD_CONFIGS): `reward_config`, `reward_models` to build them,
  `vlm_inputs` for a vision-language model's inputs at the image token count it sees.
- `tiny_sd3_pipeline`: the tiny SD3 pipeline (T5 left out) that the tests train.
- `tiny_vlm`: a tiny random Qwen2.5-VL saved as a local model folder (weights, a generated
  byte-level tokenizer with the chat template, the image processor), for the VLM judge's tests
  and Qwen-Image's text encoder.
- `tiny_flux_pipeline`, `tiny_flux2_klein_pipeline` (with `qwen3_tokenizer`, Qwen3's chat
  template), `tiny_qwenimage_pipeline`: a tiny pipeline of each other diffusers family, saved to a
  folder (the family parts' `tiny()`); `tiny_reward_models`: tiny CLIP rewards, aesthetic head,
  VLM (vqa), ImageReward and HPSv3.

A leaf: imports torch, diffusers and transformers only (lazily), never the training script.
"""

import copy
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent / "configs"
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


# The other families at their real sizes: the configurations in benchmarks/configs of each
FAMILY_CONFIGS = {
    "FLUX.1-dev": ("flux1_transformer", "flux1_vae", "flux1dev_scheduler"),
    "FLUX.1-schnell": ("flux1_transformer", "flux1_vae", "flux1schnell_scheduler"),
    "FLUX.2-klein 4B": ("flux2klein4b_transformer", "flux2_vae", "flux2klein_scheduler"),
    "Qwen-Image": ("qwenimage_transformer", "qwenimage_vae", "qwenimage_scheduler"),
}


def family_configs(c: dict, family: str) -> dict:
    """{"transformer", "vae", "scheduler": its configuration} of a family in FAMILY_CONFIGS (or
    SD3.5-Medium): what a family part's check(configs, args) reads, as from a pipeline folder."""
    keys = FAMILY_CONFIGS.get(family, ("sd35m_transformer", "sd35m_vae", "sd35m_scheduler"))
    parts = zip(("transformer", "vae", "scheduler"), keys, strict=True)
    configs = {"pipeline": {}, **{part: dict(c[key]) for part, key in parts}}
    if family == "FLUX.1-schnell":  # -dev's transformer without the guidance embedding
        configs["transformer"]["guidance_embeds"] = False
    return configs


def family_vae(c: dict, family: str):
    """The VAE of a family in FAMILY_CONFIGS (or SD3.5-Medium), built on the current device."""
    import diffusers

    kind = {"FLUX.2-klein 4B": "AutoencoderKLFlux2", "Qwen-Image": "AutoencoderKLQwenImage"}
    return getattr(diffusers, kind.get(family, "AutoencoderKL"))(**family_configs(c, family)["vae"])


def family_models(c: dict, family: str) -> dict:
    """{"transformer", "vae", "text": [(encoder, tokens per prompt)]} of a family in
    FAMILY_CONFIGS, built on the current device (meta for a count) from benchmarks/configs."""
    from diffusers import (
        Flux2Transformer2DModel,
        FluxTransformer2DModel,
        QwenImageTransformer2DModel,
    )
    from transformers import (
        CLIPTextModel,
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3Config,
        Qwen3ForCausalLM,
        T5EncoderModel,
    )

    cfg = family_configs(c, family)
    if family.startswith("FLUX.1"):
        texts = [(CLIPTextModel(clip_text_config(c["clip_l_text"])), 77),
                 (T5EncoderModel(t5_config(c["t5xxl_encoder"])), 512)]  # fmt: skip
        return {"transformer": FluxTransformer2DModel(**cfg["transformer"]),
                "vae": family_vae(c, family), "text": texts}  # fmt: skip
    if family == "FLUX.2-klein 4B":
        qwen3 = Qwen3ForCausalLM(Qwen3Config(**c["qwen3_4b_text"]))
        return {"transformer": Flux2Transformer2DModel(**cfg["transformer"]),
                "vae": family_vae(c, family), "text": [(qwen3, 512)]}  # fmt: skip
    qwen25 = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**c["qwen25vl7b"]))
    return {"transformer": QwenImageTransformer2DModel(**cfg["transformer"]),
            "vae": family_vae(c, family), "text": [(qwen25, 111)]}  # fmt: skip


def family_pipeline(c: dict, family: str, tokenizers: Path):
    """The diffusers pipeline of a family in FAMILY_CONFIGS (family_models, its scheduler) with
    generated tokenizers saved under the folder `tokenizers`."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        FluxPipeline,
        QwenImagePipeline,
    )

    m = family_models(c, family)
    parts = dict(transformer=m["transformer"], vae=m["vae"], text_encoder=m["text"][0][0],
                 scheduler=FlowMatchEulerDiscreteScheduler(**family_configs(c, family)[
                     "scheduler"]))  # fmt: skip
    if family.startswith("FLUX.1"):
        return FluxPipeline(**parts, tokenizer=clip_tokenizer(tokenizers / "clip"),
                            text_encoder_2=m["text"][1][0],
                            tokenizer_2=t5_tokenizer(tokenizers / "t5"))  # fmt: skip
    tok = qwen3_tokenizer(tokenizers / "qwen")  # Qwen2.5-VL and Qwen3 share Qwen2's tokenizer
    if family == "FLUX.2-klein 4B":
        return Flux2KleinPipeline(**parts, tokenizer=tok)
    return QwenImagePipeline(**parts, tokenizer=tok)


def reward_image_processor(size: int):
    """CLIP's image processor at `size` px (shortest side resized, centre crop)."""
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )


# ---------------------------------------------------------------------------------------------
# The rewards that do not sit on CLIP: one configuration file each (kind, config, source)
# ---------------------------------------------------------------------------------------------
REWARD_CONFIGS = {"ocr": "easyocr", "vqa": "vqa_qwen25vl7b", "imagereward": "imagereward_blip",
                  "hpsv3": "hpsv3_qwen2vl7b"}  # fmt: skip
REWARD_KINDS = ("clip", "ocr", "blip", "vlm")  # what a reward's configuration file may build
REWARD_KEYS = {  # what each kind's models and inputs read from "config" (reward_models,
    # vlm_inputs, memory_plan.model_reward); vision_config.x: a key of "vision_config"
    "clip": ("text_config", "vision_config", "vision_config.image_size", "projection_dim"),
    "ocr": ("recogniser_width", "line_height", "boxes_per_image", "box_width"),
    "blip": ("text_config", "vision_config"),
    "vlm": ("text_config", "vision_config", "vision_config.patch_size",
            "vision_config.spatial_merge_size", "vision_config.temporal_patch_size",
            "image_token_id", "vision_start_token_id", "vision_end_token_id", "min_pixels",
            "max_pixels", "text_tokens"),
}  # fmt: skip


def reward_config(path: str | os.PathLike) -> dict:
    """A reward's configuration file as benchmarks/configs holds them: {"kind": one of
    REWARD_KINDS, "config": its sizes (REWARD_KEYS[kind] at least), ...}; ValueError naming what
    is wrong (a missing key was a KeyError once the plan had begun)."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(spec, dict) or spec.get("kind") not in REWARD_KINDS:
        raise ValueError(f'{path}: needs "kind" (one of {", ".join(REWARD_KINDS)}) and "config"')
    if not isinstance(spec.get("config"), dict):
        raise ValueError(f'{path}: needs "config", the model\'s sizes')
    missing = []
    for key in REWARD_KEYS[spec["kind"]]:
        outer, _, inner = key.partition(".")
        part = spec["config"].get(outer)
        if part is None or inner and not (isinstance(part, dict) and inner in part):
            missing.append(key)
    if missing:
        raise ValueError(f'{path}: its "config" lacks {", ".join(missing)}, which a '
                         f'"{spec["kind"]}" reward\'s models are built from')  # fmt: skip
    return spec


def reward_models(spec: dict) -> dict[str, torch.nn.Module]:
    """The models of a reward configuration (reward_config), random weights, fp32, on the current
    device: "ocr" {"detector", "recogniser"} (ocr_reader.TextDetector, TextRecogniser), "blip"
    {"vision", "text"} (ImageReward's BlipVisionModel, BlipTextModel), "vlm" {"model"} (a
    Qwen2-VL-family model: Qwen2_5_VL when its vision config has out_hidden_size, else Qwen2VL),
    "clip" {"model"} (CLIPModel, clip_config)."""
    with torch.device("cpu"):  # its first import makes tensors, never on meta
        from reward_models import ocr_reader

    kind, c = spec["kind"], spec["config"]
    if kind == "ocr":
        return {"detector": ocr_reader.TextDetector(),
                "recogniser": ocr_reader.TextRecogniser(c["recogniser_width"])}  # fmt: skip
    if kind == "blip":
        from transformers import BlipTextConfig, BlipVisionConfig
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        text = BlipTextConfig(**c["text_config"], pad_token_id=0, bos_token_id=None,
                              sep_token_id=None)  # fmt: skip
        return {"vision": BlipVisionModel(BlipVisionConfig(**c["vision_config"])),
                "text": BlipTextModel(text, add_pooling_layer=False)}  # fmt: skip
    if kind == "vlm":
        import transformers

        qwen25 = "out_hidden_size" in c["vision_config"]
        name = "Qwen2_5_VL" if qwen25 else "Qwen2VL"
        keys = ("text_config", "vision_config", "image_token_id", "video_token_id",
                "vision_start_token_id", "vision_end_token_id")  # fmt: skip
        config = getattr(transformers, f"{name}Config")(**{k: c[k] for k in keys if k in c})
        return {"model": getattr(transformers, f"{name}ForConditionalGeneration")(config)}
    return {"model": __import__("transformers").CLIPModel(clip_config(c))}


def vlm_grid(c: dict, height: int, width: int) -> tuple[int, int]:
    """(rows, columns) of patches a Qwen2-VL-family image processor makes of an image of that
    size under the configuration's min_pixels and max_pixels (transformers' smart_resize)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    v = c["vision_config"]
    factor = v["patch_size"] * v["spatial_merge_size"]
    h, w = smart_resize(height, width, factor, c["min_pixels"], c["max_pixels"])
    return h // v["patch_size"], w // v["patch_size"]


def vlm_inputs(c: dict, n: int, height: int, width: int, device) -> dict[str, torch.Tensor]:
    """A Qwen2-VL-family model's inputs for n images of that size, each in a sequence of
    c["text_tokens"] text tokens around its merged patches (left-padded rows of one length, as
    rewards.VLM.inputs makes them): input_ids, attention_mask, mm_token_type_ids and
    image_grid_thw made on the host and moved (the model reads their values), pixel_values
    (fp32, as the image processor returns them) made on `device`."""
    v = c["vision_config"]
    rows, cols = vlm_grid(c, height, width)
    merged = rows * cols // v["spatial_merge_size"] ** 2
    ids = torch.zeros(n, c["text_tokens"] + merged, dtype=torch.long)  # text: token 0
    ids[:, 8] = c["vision_start_token_id"]
    ids[:, 9 : 9 + merged] = c["image_token_id"]
    ids[:, 9 + merged] = c["vision_end_token_id"]
    channels = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device),
            "mm_token_type_ids": (ids == c["image_token_id"]).int().to(device),
            "image_grid_thw": torch.tensor([[1, rows, cols]] * n).to(device),
            "pixel_values": torch.zeros(n * rows * cols, channels, device=device)}  # fmt: skip


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
def _saved(folder, save) -> None:
    """save(tmp) writes files into a fresh folder beside them, each then renamed into `folder`
    (os.replace): a process that reads `folder` while another writes the same tokenizer into it
    reads each file whole, the old or the new (equal), never one being written. Processes that
    built one pipeline in a shared folder (memory_plan.py's gloo ranks, which now build theirs in
    folders of their own) read a vocab.json that the other had just truncated: "Error while
    initializing BPE: EOF while parsing a value"."""
    os.makedirs(folder, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".writing-", dir=folder)
    try:
        save(tmp)
        for name in os.listdir(tmp):
            os.replace(os.path.join(tmp, name), os.path.join(folder, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def clip_vocabulary() -> dict[str, int]:
    """`clip_tokenizer`'s vocabulary: one token per byte and per end-of-word byte, then
    <|startoftext|> and <|endoftext|> (CLIP_IDS)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte → char map
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)]
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": 256 + i for i, c in enumerate(chars)}
    return vocab | {"<|startoftext|>": 512, "<|endoftext|>": 513}


def clip_tokenizer(folder):
    """A CLIP tokenizer with `clip_vocabulary`, no merges, 77 tokens; saved to `folder` and loaded
    from it."""
    from transformers import CLIPTokenizer

    def save(tmp: str) -> None:
        with open(os.path.join(tmp, "vocab.json"), "w") as f:
            json.dump(clip_vocabulary(), f)
        with open(os.path.join(tmp, "merges.txt"), "w") as f:
            f.write("#version: 0.2\n")

    _saved(folder, save)
    return CLIPTokenizer.from_pretrained(folder, model_max_length=77)


def t5_tokenizer(folder):
    """A T5 tokenizer (SentencePiece-style unigram) with one token per printable character."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(chr(c), -2.0) for c in range(33, 127)]
    tok = T5TokenizerFast(vocab=pieces, extra_ids=0)
    _saved(folder, tok.save_pretrained)
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


def byte_vocabulary() -> dict[str, int]:
    """`tiny_vlm`'s vocabulary: <|endoftext|>, the 256 byte-level symbols, VLM_SPECIAL_TOKENS."""
    from tokenizers import pre_tokenizers

    vocab = {"<|endoftext|>": 0}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    for token in VLM_SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    return vocab


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
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2Tokenizer,
        Qwen2VLImageProcessorPil,
    )

    folder = os.fspath(folder)
    vocab = byte_vocabulary()
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


# ---------------------------------------------------------------------------------------------
# Tiny pipelines of the other diffusers families, and the Qwen3 tokenizer FLUX.2-klein uses
# ---------------------------------------------------------------------------------------------
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|image_pad|>", "<|video_pad|>", "<think>",
                "</think>"]  # fmt: skip
# Qwen3's chat format: ChatML; with add_generation_prompt and enable_thinking=False an empty
# think block follows, as Qwen3's own template writes it (FLUX.2-klein encodes prompts so)
QWEN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}"
)


def qwen3_tokenizer(folder):
    """A byte-level BPE tokenizer in Qwen2's format, as Qwen3 uses it: one token per byte, no
    merges, Qwen's special tokens after the 256 bytes, and Qwen3's chat template (thinking can
    be switched off); saved to `folder` and loaded from it."""
    from transformers import Qwen2Tokenizer

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]  # GPT-2's byte → char map
    others = [b for b in range(256) if b not in printable]
    chars = [chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)]
    vocab = {c: i for i, c in enumerate(chars)} | {s: 256 + i for i, s in enumerate(QWEN_SPECIAL)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], errors="replace")
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL[1:]})
    tok.chat_template = QWEN_CHAT_TEMPLATE
    _saved(folder, tok.save_pretrained)
    return Qwen2Tokenizer.from_pretrained(folder)


QWEN_VOCAB = 256 + len(QWEN_SPECIAL)


def tiny_flux_pipeline(folder, guidance_embeds: bool) -> str:
    """A tiny FLUX.1 pipeline saved to `folder`: -dev's shape with `guidance_embeds` (and its
    resolution-dependent shift), -schnell's without (a static shift of 1). 32 px images, 4 × 16 ×
    16 latents packed into 64 tokens of 16, one double- and one single-stream block, a tiny CLIP
    (pooled) and a tiny T5. Random weights from the global RNG."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok5 = t5_tokenizer(Path(folder) / "t5_tokenizer")
    shift = dict(shift=1.0)  # -schnell: unshifted; -dev: shifted by resolution
    if guidance_embeds:
        shift = dict(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                     base_image_seq_len=256, max_image_seq_len=4096, shift=3.0)  # fmt: skip
    FluxPipeline(
        transformer=FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
            guidance_embeds=guidance_embeds, axes_dims_rope=(4, 4, 8),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(**shift),
        vae=AutoencoderKL(
            down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
            block_out_channels=[8, 16], layers_per_block=1, latent_channels=4, norm_num_groups=4,
            sample_size=32, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
            use_post_quant_conv=False,
        ),
        text_encoder=CLIPTextModel(CLIPTextConfig(**TINY_TEXT)),
        tokenizer=clip_tokenizer(Path(folder) / "clip_tokenizer"),
        text_encoder_2=T5EncoderModel(T5Config(
            vocab_size=len(tok5), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
        tokenizer_2=tok5,
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


def tiny_qwenimage_pipeline(folder) -> str:
    """A tiny Qwen-Image pipeline saved to `folder`: 32 px images; its video VAE's 4 latent
    channels (per-channel mean and std) × 4 × 4, packed into 16 tokens of 16; two MMDiT blocks;
    the text encoder and tokenizer of tiny_vlm (a 32-wide Qwen2.5-VL). Random weights."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    vlm = tiny_vlm(Path(folder) / "vlm", seed=int(torch.randint(2**31, ())))
    QwenImagePipeline(
        transformer=QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 4, 4),
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
            max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
        ),
        vae=AutoencoderKLQwenImage(
            base_dim=8, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
            temperal_downsample=[False, True], latents_mean=[0.1, -0.2, 0.3, 0.0],
            latents_std=[1.5, 0.8, 1.2, 2.0],
        ),
        text_encoder=Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm),
        tokenizer=Qwen2Tokenizer.from_pretrained(vlm),
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


def tiny_flux2_klein_pipeline(folder, distilled: bool = False) -> str:
    """A tiny FLUX.2-klein pipeline saved to `folder` (the base checkpoint's shape; `distilled`
    marks it step-distilled): 32 px images, 4 latent channels patchified to 16 (batch-norm
    statistics per channel) × 8 × 8, packed into 64 tokens; a tiny Qwen3 of 28 layers (the
    pipeline stacks layers 9, 18 and 27) with a generated qwen3_tokenizer. Random weights."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vae = AutoencoderKLFlux2(
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[8, 16], layers_per_block=1, latent_channels=4, norm_num_groups=4,
        sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
    )  # fmt: skip
    with torch.no_grad():  # per-channel statistics that are not 0 and 1, so that they matter
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, 16))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, 16))
    text = Qwen3Config(vocab_size=QWEN_VOCAB, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=28, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=8, max_position_embeddings=1024, bos_token_id=256,
                       eos_token_id=258)  # fmt: skip
    Flux2KleinPipeline(
        transformer=Flux2Transformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
            axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
        ),
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, shift=3.0, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        ),
        vae=vae, text_encoder=Qwen3ForCausalLM(text),
        tokenizer=qwen3_tokenizer(Path(folder) / "qwen_tokenizer"), is_distilled=distilled,
    ).save_pretrained(folder)  # fmt: skip
    return str(folder)


def aesthetic_head(widths: list[int], real: bool = False) -> dict[str, torch.Tensor]:
    """LAION's aesthetic MLP's state dict (its layer names) with random weights from the global
    RNG for layer widths `widths`: scaled like a trained layer's with zero biases (`real`, the
    scale check's full-size head), or plain normal weights and biases (the tests' tiny one)."""
    head = {}
    for layer, i, o in zip([0, 2, 4, 6, 7], widths[:-1], widths[1:], strict=True):
        head[f"layers.{layer}.weight"] = torch.randn(o, i) / (math.sqrt(i) if real else 1.0)
        head[f"layers.{layer}.bias"] = torch.zeros(o) if real else torch.randn(o)
    return head


def tiny_reward_models(root) -> dict[str, str]:
    """A tiny random CLIP (with a clip_tokenizer processor, 32 px images), a tiny LAION-style
    aesthetic head, a tiny Qwen2.5-VL (`tiny_vlm`, for `vqa`), a tiny ImageReward and a tiny HPSv3
    saved under `root`; returns the environment variables that point rewards.py's model rewards
    at them (`ocr` runs its real weights, from their package). Random weights from the global RNG
    (the VLM's, ImageReward's and HPSv3's from their seeds)."""
    from safetensors.torch import save_file
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    root = Path(root)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(
        text_config=TINY_TEXT,
        vision_config=dict(vision, image_size=32, patch_size=8),
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(root / "clip")
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = CLIPProcessor(image_processor=images, tokenizer=clip_tokenizer(root / "tok"))
    processor.save_pretrained(root / "clip")
    head = aesthetic_head([8, 6, 5, 4, 3, 1])  # LAION's MLP is 768 → 1024 → 128 → 64 → 16 → 1
    save_file(head, root / "head.safetensors")
    torch.save(head, root / "head.pth")
    clip = str(root / "clip")
    return {
        "RECAST_PICKSCORE": clip, "RECAST_PICKSCORE_PROCESSOR": clip, "RECAST_CLIPSCORE": clip,
        "RECAST_AESTHETIC": clip, "RECAST_AESTHETIC_HEAD": str(root / "head.safetensors"),
        "RECAST_VQA": tiny_vlm(root / "vlm"), "RECAST_IMAGEREWARD": tiny_imagereward(root / "ir"),
        **tiny_hpsv3(root / "hpsv3"),
    }  # fmt: skip


TINY_IMAGEREWARD_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                          *"abcdefghijklmnopqrstuvwxyz0123456789"]  # fmt: skip
TINY_IMAGEREWARD_MED = dict(
    architectures=["BertModel"],
    hidden_act="gelu",
    hidden_size=32,
    intermediate_size=64,
    layer_norm_eps=1e-12,
    max_position_embeddings=64,
    model_type="bert",
    num_attention_heads=2,
    num_hidden_layers=1,
    pad_token_id=0,
    type_vocab_size=2,
    vocab_size=len(TINY_IMAGEREWARD_VOCAB) + 2,
    encoder_width=32,
    add_cross_attention=True,
)  # fmt: skip  (the vocabulary and BLIP's [DEC] and [ENC])


def tiny_imagereward_parts(seed: int = 0, image_size: int = 32):
    """The tiny ImageReward's parts, built with transformers' BLIP classes: (BlipVisionModel on
    `image_size` px, BlipTextModel, the MLP head's state dict). Same seed, same weights; the
    caller's random state is left as it was."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vision = BlipVisionModel(BlipVisionConfig(
            hidden_size=128, intermediate_size=512, num_hidden_layers=1, num_attention_heads=2,
            image_size=image_size, patch_size=8, layer_norm_eps=1e-6,
        ))  # fmt: skip
        text = BlipTextModel(BlipTextConfig(
            vocab_size=TINY_IMAGEREWARD_MED["vocab_size"], hidden_size=32, encoder_hidden_size=128,
            intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=64, layer_norm_eps=1e-12, pad_token_id=0,
            bos_token_id=None, sep_token_id=None,
        ), add_pooling_layer=False)  # fmt: skip
        head = aesthetic_head([32, 16, 8, 6, 4, 1])  # ImageReward's: 768 → 1024 → 128 → 64 → 16 → 1
    return vision.eval(), text.eval(), head


def tiny_imagereward(folder: str | os.PathLike, seed: int = 0, image_size: int = 32) -> str:
    """A tiny random ImageReward saved into `folder` as released (ImageReward.pt with BLIP's own
    parameter names, med_config.json) beside a BERT-style vocab.txt: `tiny_imagereward_parts`
    (a 1-layer BLIP ViT 128 wide on `image_size` px images of 8 px patches, a 1-layer text
    encoder with cross-attention, an MLP head), renamed to BLIP's names. Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(TINY_IMAGEREWARD_VOCAB) + "\n")
    (folder / "med_config.json").write_text(json.dumps(TINY_IMAGEREWARD_MED, indent=2))
    vision, text, head = tiny_imagereward_parts(seed, image_size)
    blip_names = [  # transformers' BLIP names → BLIP's (ImageReward's checkpoint)
        ("embeddings.patch_embedding.", "patch_embed.proj."),
        ("embeddings.position_embedding", "pos_embed"), ("embeddings.class_embedding", "cls_token"),
        ("encoder.layers.", "blocks."), (".layer_norm1.", ".norm1."), (".layer_norm2.", ".norm2."),
        (".self_attn.projection.", ".attn.proj."), (".self_attn.qkv.", ".attn.qkv."),
        ("post_layernorm.", "norm."),
    ]  # fmt: skip
    state = {}
    for key, value in vision.state_dict().items():
        for hf, blip in blip_names:
            key = key.replace(hf, blip)
        state[f"blip.visual_encoder.{key}"] = value
    state |= {f"blip.text_encoder.{k}": v for k, v in text.state_dict().items()}
    state |= {f"mlp.{k}": v for k, v in head.items()}
    torch.save(state, folder / "ImageReward.pt")
    return str(folder)


TINY_HPSV3_PROMPT = (  # a stand-in for hpsv3's dataset/data_collator_qwen.py: its two strings
    'INSTRUCTION = """\nRate this image from 0 to 10 for the prompt: {text_prompt}\n"""\n'
    'prompt_with_special_token = """\nRating: <|Reward|>\n\nEND\n"""\n'
)


def tiny_hpsv3(folder: str | os.PathLike, seed: int = 0) -> dict[str, str]:
    """A tiny random HPSv3 under `folder`: a base Qwen2-VL folder (`tiny_vlm`'s tokenizer, chat
    template and image processor with a 2-layer, 32-wide Qwen2-VL), HPSv3.safetensors as HPSv3
    saved it (transformers 4.45's names: visual.*, model.*, lm_head.*, with one more token,
    <|Reward|>, and a reward head rm_head.{0,3,5}: 32 → 16 → 8 → (μ, σ), HPSv3's is 3584 →
    1024 → 16 → 2) and a stand-in prompt file. Returns the environment variables for `hpsv3`."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    folder = Path(folder)
    base = tiny_vlm(folder / "base", seed)  # its tokenizer, image processor and template
    vocab = AutoTokenizer.from_pretrained(base).get_vocab()
    text = dict(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]},
        eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], bos_token_id=None,
        initializer_range=0.2,  # 10 x Qwen's: attention that sees where a token is (its position)
    )  # fmt: skip
    config = Qwen2VLConfig(
        text_config=text,
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
        model.save_pretrained(base)  # the base model's own weights, unused by the reward
        model.resize_token_embeddings(len(vocab) + 1, mean_resizing=False)  # <|Reward|>, as HPSv3
        head = {"0.weight": torch.randn(16, 32) / 6, "0.bias": torch.randn(16),
                "3.weight": torch.randn(8, 16) / 4, "3.bias": torch.randn(8),
                "5.weight": torch.randn(2, 8) / 3, "5.bias": torch.randn(2)}  # fmt: skip
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.visual."):
            key = key.removeprefix("model.")
        elif key.startswith("model.language_model."):
            key = "model." + key.removeprefix("model.language_model.")
        state[key] = value.contiguous()
    state |= {f"rm_head.{k}": v for k, v in head.items()}
    save_file(state, folder / "HPSv3.safetensors")
    (folder / "data_collator_qwen.py").write_text(TINY_HPSV3_PROMPT)
    return {
        "RECAST_HPSV3": str(folder / "HPSv3.safetensors"), "RECAST_HPSV3_BASE": base,
        "RECAST_HPSV3_PROMPT": str(folder / "data_collator_qwen.py"),
    }  # fmt: skip


# The tests' tiny pipeline of each family variant: recast.py flags it needs, and its builder.
TINY_FAMILIES = {
    "sd3": [],
    "flux-dev": ["--guidance", "3.5"],
    "flux-schnell": [],
    "qwen-image": [],
    "flux2-klein": [],
}


def tiny_family(variant: str, folder: str | os.PathLike) -> str:
    """A tiny random pipeline of a TINY_FAMILIES variant saved in `folder`; returns the folder."""
    folder = str(folder)
    if variant == "sd3":  # T5 left out
        tokenizer = clip_tokenizer(os.path.join(folder, "tok"))
        tiny_sd3_pipeline(tokenizer).save_pretrained(folder)
        return folder
    if variant in ("flux-dev", "flux-schnell"):  # -dev's guidance input, or -schnell's distilled
        return tiny_flux_pipeline(folder, guidance_embeds=variant == "flux-dev")
    if variant == "qwen-image":
        return tiny_qwenimage_pipeline(folder)
    if variant == "flux2-klein":
        return tiny_flux2_klein_pipeline(folder)
    raise ValueError(f"unknown tiny family {variant!r}; choose from {', '.join(TINY_FAMILIES)}")
