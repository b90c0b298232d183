"""Qwen-Image (`QwenImagePipeline`): the family part of the diffusers world.

How Qwen-Image differs from SD3 (worlds/sd3world.py):
- text: one encoder, Qwen2.5-VL (7 B), prompted with the pipeline's chat template; the last
  hidden states of the prompt's own tokens (the template's first tokens dropped), of varying
  length with a mask; no pooled embedding;
- time: the transformer reads σ ∈ [0, 1], not t·1000;
- latents: a video VAE (one frame) with per-channel mean and std instead of a scale and shift,
  and 2×2 patches of its 16 channels packed into tokens of 64, (h/2 · w/2, 64); the image's
  (frame, height, width) is the transformer's img_shapes;
- schedule: σ = linspace(1, 1/T, T) shifted by a μ that grows with the token count (its
  scheduler: use_dynamic_shifting, exponential, with a terminal σ);
- no guidance input; the pipeline samples with true CFG (4.0, a negative prompt), this world
  CFG-free, as DiffusionNFT does.
The transformer has 20 B parameters (41 GB in bf16) and its text encoder 8.3 B: docs/models.md
says what fits where.
"""

import torch

from worlds import diffusersworld
from worlds.diffusersworld import BadInput

PIPELINE, NAME = "QwenImagePipeline", "Qwen-Image"
# the joint attention's image (to_*) and text (add_*, to_add_out) projections and the image and
# text feed-forwards (img_mlp, txt_mlp) of every block: Flow-GRPO's and verl-omni's layers
LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
]  # fmt: skip
MAX_SEQUENCE_LENGTH = 1024  # prompt tokens after the template: the pipeline's limit
DECODE_CHUNK = 4  # a video VAE: twice SD3's decoder activations per image
ENCODE_CHUNK = 8
# the last block's text-stream outputs are discarded (only the image stream reaches norm_out), so
# its to_add_out and txt_mlp adapters never get a gradient
UNUSED_ADAPTERS = True


def check(configs: dict, args) -> None:
    if args.guidance:
        raise BadInput("--guidance", "Qwen-Image has no guidance input (it samples CFG-free "
                       "here): drop --guidance")  # fmt: skip
    vae_scale = 2 ** len(configs["vae"]["temperal_downsample"])
    diffusersworld.check_resolution(args, 2 * vae_scale, NAME)


def advice(configs: dict) -> list[str]:
    return []


def latent_shape(pipe, resolution: int) -> tuple[int, ...]:
    """(tokens, channels): 2×2 patches of the VAE's latents, as the pipeline packs them."""
    return diffusersworld.packed_latent_shape(pipe, resolution)


def schedule(pipe, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The pipeline's: σ = linspace(1, 1/T, T), shifted by its μ for this many image tokens."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    return diffusersworld.token_shifted_sigmas(pipe, steps, latent_shape[0], calculate_shift)


def encode(pipe, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_embeds (B, L, D), mask (B, L)): L is the longest prompt's token count."""
    embeds, mask = pipe.encode_prompt(
        prompts, device=device, max_sequence_length=MAX_SEQUENCE_LENGTH
    )
    if mask is None:  # the pipeline drops a mask that masks nothing
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    return embeds, mask


def inputs(pipe, x: torch.Tensor, cond, t: torch.Tensor, args) -> dict:
    embeds, mask = cond
    side = int(x.shape[1] ** 0.5)
    return dict(hidden_states=x, encoder_hidden_states=embeds, timestep=t,
                encoder_hidden_states_mask=None if mask.all() else mask,  # as the pipeline
                img_shapes=[[(1, side, side)]] * len(x))  # fmt: skip


def decode(pipe, z: torch.Tensor) -> torch.Tensor:
    vae, side = pipe.vae, int(z.shape[1] ** 0.5) * 2 * pipe.vae_scale_factor
    z = pipe._unpack_latents(z, side, side, pipe.vae_scale_factor)  # (B, C, 1 frame, h, w)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(z)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(z)
    return vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
