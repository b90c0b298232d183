"""FLUX.2-klein (`Flux2KleinPipeline`): the family part of the diffusers world.

How FLUX.2-klein differs from SD3 (worlds/sd3world.py):
- text: one encoder, Qwen3 (4 B for the 4 B transformer), prompted with its chat template
  (thinking off), 512 tokens; the hidden states of three of its layers (9, 18, 27) side by side
  are the condition; position ids (t, h, w, l) for its tokens; no pooled embedding;
- time: the transformer reads σ ∈ [0, 1], not t·1000;
- latents: 2×2 patches of the VAE's 32 channels (128 per patch), normalised per channel by the
  VAE's batch-norm statistics (no scale or shift), packed into tokens, (h/2 · w/2, 128), with
  (t, h, w, l) position ids;
- schedule: σ = linspace(1, 1/T, T) shifted by diffusers' empirical μ, a function of the token
  count and of T;
- no guidance input. The base checkpoint is not distilled (its pipeline samples with CFG 4.0;
  this world CFG-free, as DiffusionNFT does); the distilled one samples in 4 steps and is a weak
  starting point for RL: train the base (docs/models.md).
"""

import numpy as np
import torch

from worlds import diffusersworld
from worlds.diffusersworld import BadInput

PIPELINE, NAME = "Flux2KleinPipeline", "FLUX.2-klein"
# the double-stream blocks' attention projections (image to_*, text add_*, to_add_out) and
# feed-forwards (ff, ff_context: linear_in, linear_out), and both of the single-stream blocks'
# layers: the fused attention-and-MLP input projection and the output projection attn.to_out
# (DiffSynth-Studio's FLUX.2-klein LoRA layers). Only Linear layers are adapted, so attn.to_out
# names the single blocks' Linear, not the double blocks' ModuleList of the same name
LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out",
    "attn.to_qkv_mlp_proj", "attn.to_out",
]  # fmt: skip
MAX_SEQUENCE_LENGTH = 512  # Qwen3 tokens per prompt: the pipeline's default
DECODE_CHUNK = 8
ENCODE_CHUNK = 8
UNUSED_ADAPTERS = False  # the text stream of the last double block feeds the single blocks


def check(configs: dict, args) -> None:
    if args.guidance:
        raise BadInput("--guidance", "FLUX.2-klein has no guidance input (it samples CFG-free "
                       "here): drop --guidance")  # fmt: skip
    vae_scale = 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
    diffusersworld.check_resolution(args, 2 * vae_scale, NAME)


def advice(configs: dict) -> list[str]:
    if not configs["pipeline"].get("is_distilled", False):
        return []
    return ["a step-distilled checkpoint is a weak starting point for RL; its base checkpoint "
            "(FLUX.2-klein-base) is the better one (docs/models.md)"]  # fmt: skip


def latent_shape(pipe, resolution: int) -> tuple[int, ...]:
    """(tokens, channels): the patchified, normalised latents, as the pipeline packs them."""
    side = resolution // pipe.vae_scale_factor
    return ((side // 2) ** 2, pipe.transformer.config.in_channels)


def schedule(pipe, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The pipeline's: σ = linspace(1, 1/T, T), shifted by its empirical μ (tokens, T)."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    mu = compute_empirical_mu(image_seq_len=latent_shape[0], num_steps=steps)
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return pipe.scheduler.sigmas


def encode(pipe, prompts: list[str], device: torch.device) -> tuple[torch.Tensor]:
    """(prompt_embeds (B, 512, 3·D),): three Qwen3 layers side by side."""
    embeds, _ = pipe.encode_prompt(prompts, device=device, max_sequence_length=MAX_SEQUENCE_LENGTH)
    return (embeds,)


def _grid(pipe, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """The packed grid's side and the (t, h, w, l) position ids of its tokens (B, L, 4)."""
    side = int(x.shape[1] ** 0.5)
    return side, pipe._prepare_latent_ids(x.new_empty(len(x), 0, side, side)).to(x.device)


def inputs(pipe, x: torch.Tensor, cond, t: torch.Tensor, args) -> dict:
    (embeds,) = cond
    _, img_ids = _grid(pipe, x)
    txt_ids = pipe._prepare_text_ids(embeds).to(x.device)
    return dict(hidden_states=x, encoder_hidden_states=embeds, timestep=t, guidance=None,
                img_ids=img_ids, txt_ids=txt_ids)  # fmt: skip


def unpack(z: torch.Tensor) -> torch.Tensor:
    """(B, L, C) tokens → (B, C, h/2, w/2): the pipeline's _unpack_latents_with_ids for the ids
    of _grid, which number the tokens row by row. Done here because that call's signature
    differs across diffusers versions (0.37: (x, ids), later: sizes too) and, without the sizes,
    it reads the ids' maximum on the host (which the memory planner's meta tensors cannot)."""
    side = int(z.shape[1] ** 0.5)
    return z.unflatten(1, (side, side)).permute(0, 3, 1, 2)


def decode(pipe, z: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    z = unpack(z)  # (B, 4·C, h/2, w/2)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z)
    z = pipe._unpatchify_latents(z * std + mean)
    return vae.decode(z, return_dict=False)[0]
