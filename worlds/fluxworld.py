"""FLUX.1-dev and FLUX.1-schnell (`FluxPipeline`): the family part of the diffusers world.

How FLUX.1 differs from SD3 (worlds/sd3world.py):
- text: CLIP-L's pooled embedding and T5-XXL's 512 tokens (-schnell: 256, as BFL's own sampler
  encodes for it; no CLIP tokens in the sequence), and position ids for the text tokens (zeros);
- time: the transformer reads σ ∈ [0, 1] (it multiplies by 1000 itself), not t·1000;
- latents: 2×2 patches of the VAE's 16 channels packed into tokens of 64, (h/2 · w/2, 64), with
  (row, column) position ids; the VAE's scaling and shift are undone after unpacking;
- guidance: -dev is guidance-distilled: it takes the guidance scale as an input (an embedding,
  not CFG), so --guidance is required (3.5, the value of its model card); -schnell has none;
- schedule: σ = linspace(1, 1/T, T) shifted by μ, which grows with the image's token count
  (-dev's scheduler: use_dynamic_shifting); -schnell's is unshifted (shift 1).
-schnell is timestep-distilled for 1-4 steps: a weak starting point for RL; -dev (itself
guidance-distilled), or a base model where there is one, is the better one (docs/models.md).
"""

import torch

from worlds import diffusersworld
from worlds.diffusersworld import BadInput

PIPELINE, NAME = "FluxPipeline", "FLUX.1"
# the double-stream blocks' attention projections (image to_*, text add_*) and feed-forwards (ff,
# ff_context), and the single-stream blocks' to_q/k/v (their output is fused with the MLP's in
# proj_out): diffusers' FLUX LoRA script's layers, which Flow-GRPO and Flow-Factory adapt too
LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
]  # fmt: skip
# T5 tokens per prompt: the pipeline's default for -dev; -schnell's is 256, which BFL's reference
# sampler encodes for it (black-forest-labs/flux, src/flux/cli.py: load_t5's max_length) and its
# model card passes (diffusers' FluxPipeline allows up to 512 for either)
MAX_SEQUENCE_LENGTH = {"dev": 512, "schnell": 256}
DECODE_CHUNK = 8
ENCODE_CHUNK = 8
UNUSED_ADAPTERS = False  # the text stream of the last double block feeds the single blocks
GUIDANCE = 3.5  # FLUX.1-dev's model card


def check(configs: dict, args) -> None:
    distilled = configs["transformer"]["guidance_embeds"]
    if distilled and not args.guidance:
        raise BadInput(
            "--guidance",
            "this FLUX.1 transformer is guidance-distilled (-dev): it "
            f"needs the guidance scale as an input, e.g. --guidance {GUIDANCE}",
        )
    if args.guidance and not distilled:
        raise BadInput("--guidance", "this FLUX.1 transformer has no guidance input (-schnell): "
                       "drop --guidance")  # fmt: skip
    vae_scale = 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
    diffusersworld.check_resolution(args, 2 * vae_scale, NAME)


def advice(configs: dict) -> list[str]:
    if configs["transformer"]["guidance_embeds"]:
        return []
    return ["a timestep-distilled checkpoint (-schnell) is a weak starting point for RL; "
            "FLUX.1-dev is the better one (docs/models.md)"]  # fmt: skip


def latent_shape(pipe, resolution: int) -> tuple[int, ...]:
    """(tokens, channels): 2×2 patches of the VAE's latents, as the pipeline packs them."""
    return diffusersworld.packed_latent_shape(pipe, resolution)


def schedule(pipe, steps: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The pipeline's: σ = linspace(1, 1/T, T), shifted by its μ for this many image tokens."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    return diffusersworld.token_shifted_sigmas(pipe, steps, latent_shape[0], calculate_shift)


def encode(pipe, prompts: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(T5 prompt_embeds (B, 512 or 256, D), CLIP pooled (B, D'))."""
    tokens = MAX_SEQUENCE_LENGTH["dev" if pipe.transformer.config.guidance_embeds else "schnell"]
    embeds, pooled, _ = pipe.encode_prompt(prompts, None, device=device,
                                           max_sequence_length=tokens)  # fmt: skip
    return embeds, pooled


def inputs(pipe, x: torch.Tensor, cond, t: torch.Tensor, args) -> dict:
    embeds, pooled = cond
    side = int(x.shape[1] ** 0.5)
    img_ids = pipe._prepare_latent_image_ids(len(x), side, side, x.device, x.dtype)
    txt_ids = torch.zeros(embeds.shape[1], 3, device=x.device, dtype=x.dtype)
    guidance = None
    if pipe.transformer.config.guidance_embeds:
        guidance = torch.full((len(x),), args.guidance, device=x.device, dtype=torch.float32)
    return dict(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
                timestep=t, guidance=guidance, img_ids=img_ids, txt_ids=txt_ids)  # fmt: skip


def decode(pipe, z: torch.Tensor) -> torch.Tensor:
    vae, side = pipe.vae, int(z.shape[1] ** 0.5) * 2 * pipe.vae_scale_factor
    z = pipe._unpack_latents(z, side, side, pipe.vae_scale_factor)
    return vae.decode(z / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
