"""SD3 / SD3.5 (`StableDiffusion3Pipeline`): the family part of the diffusers world.

What SD3 holds that diffusersworld.py does not: three text encoders (CLIP-L, CLIP-G, T5-XXL; the
pooled CLIP embeddings are a second input); the transformer reads t·1000 and latents as images
(C, h, w), patching them itself; the VAE's scaling and shift; a static shift of the scheduler (3.0
for SD3.5), set in its config. No guidance input: sampling is CFG-free, as in DiffusionNFT.
DiffusionNFT trains SD3.5 with LoRA r = 32, α = 64 and κ = 1e-4 (pass --kl-coef 1e-4).

A pipeline saved without T5 (`text_encoder_3` null in model_index.json) is loaded without it, and
diffusers' `encode_prompt` feeds zeros in place of the T5 tokens, as the pipeline itself does.
"""

import sys

import torch

from worlds import diffusersworld
from worlds.diffusersworld import BadInput, scoring_defaults  # noqa: F401 (read via sd3world)

PIPELINE, NAME = "StableDiffusion3Pipeline", "SD3"
# DiffusionNFT's and Flow-GRPO's LoRA targets for SD3: the joint attention's image (to_*) and
# context (add_*, to_add_out) projections. peft matches them as name suffixes, so SD3.5's second
# image-only attention (attn2) keeps its base weights, as in those codebases.
LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
]  # fmt: skip
MAX_SEQUENCE_LENGTH = 256  # T5 tokens per prompt: encode_prompt's default
DECODE_CHUNK = 8  # latents per VAE decode: bounds the decoder's activations at 512-1024 px
ENCODE_CHUNK = 8  # prompts per text-encoder forward: T5-XXL's activations don't grow with --prompts
UNUSED_ADAPTERS = False  # every adapter reaches the velocity


def check(configs: dict, args) -> None:
    if configs["scheduler"].get("use_dynamic_shifting", False):
        raise BadInput("--model", "its scheduler shifts by resolution (use_dynamic_shifting): "
                       "unsupported for SD3")  # fmt: skip
    if args.guidance:
        raise BadInput("--guidance", "SD3 has no guidance input (it samples CFG-free here): "
                       "drop --guidance")  # fmt: skip
    vae_scale = 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
    step = vae_scale * configs["transformer"]["patch_size"]
    diffusersworld.check_resolution(args, step, NAME)


def advice(configs: dict) -> list[str]:
    return []


def latent_shape(pipe, resolution: int) -> tuple[int, ...]:
    side = resolution // pipe.vae_scale_factor
    return (pipe.transformer.config.in_channels, side, side)


def schedule(pipe, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The scheduler's own static shift (its config)."""
    pipe.scheduler.set_timesteps(steps)
    return pipe.scheduler.sigmas


def encode(pipe, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds (B, 77 + 256, D): CLIP-L ‖ CLIP-G beside T5, pooled (B, D'))."""
    embeds, _, pooled, _ = pipe.encode_prompt(
        prompts, None, None, device=device, do_classifier_free_guidance=False,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
    )  # fmt: skip
    return embeds, pooled


def inputs(pipe, x: torch.Tensor, cond, t: torch.Tensor, args) -> dict:
    embeds, pooled = cond
    return dict(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
                timestep=1000 * t)  # fmt: skip


def decode(pipe, z: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    shift = vae.config.shift_factor or 0.0
    return vae.decode(z / vae.config.scaling_factor + shift, return_dict=False)[0]


class SD3World(diffusersworld.DiffusersWorld):
    """The diffusers world with the SD3 family part."""

    def __init__(self, args, device: torch.device, pipe=None):
        """`pipe`: a StableDiffusion3Pipeline already built (benchmarks/memory_plan.py builds one
        on the meta device), used instead of loading --model."""
        super().__init__(args, device, sys.modules[__name__], pipe)
