"""The SD3 / SD3.5 world that `recast.py --model PATH_OR_ID` trains: the same loop as the toy world.

`StableDiffusion3Pipeline` from a local folder (or a hub id where the network allows) with two LoRA
adapters on the transformer's attention projections (peft, DiffusionNFT's setting r = 32, α = 64):
"default" is the trained policy θ, "old" the sampling policy θ_old (an EMA of θ, DESIGN §6), and the
frozen reference is the transformer with its adapters disabled. VAE and text encoders are frozen.
On CUDA the frozen weights are bf16 and every forward runs under bf16 autocast, while the adapters
(θ and θ_old) and the VAE decode stay fp32; on CPU everything is fp32. Sampling is CFG-free
with the pipeline's own scheduler (its shift), as in DiffusionNFT.

Prompts come from `--prompts-file` (one per line); the held-out ones from `--eval-prompts-file`, or
by default the last 10% of the prompts file (at least one). A pipeline saved without T5
(`text_encoder_3` null in model_index.json) is loaded without it, and diffusers' `encode_prompt`
feeds zeros in place of the T5 tokens, as the pipeline itself does.
"""

import contextlib
import os

import torch

import hub
import rewards

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
EVAL_SHARE = 0.1  # held out from --prompts-file when no --eval-prompts-file is given
SCORED_GROUPS = 4  # the fewest prompt groups an epoch whose W stayed within the noise floor of a
# change of seed, in the toy world's scoring study (docs/results.md); 2 groups did not


def scoring_defaults(prompts: int) -> dict:
    """recast.py's defaults for scoring the step predictions on SD3, where that is most of an
    epoch's cost (docs/sd35.md): SCORED_GROUPS prompt groups an epoch, under bf16 autocast."""
    return {"gain_frac": min(1.0, SCORED_GROUPS / prompts), "score_precision": "bf16"}


def read_prompts(path: str) -> list[str]:
    """The non-blank lines of a text file, stripped."""
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def split_prompts(prompts_file: str, eval_prompts_file: str = "") -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts): the two files, or the prompts file's last 10%."""
    prompts = read_prompts(prompts_file)
    if eval_prompts_file:
        return prompts, read_prompts(eval_prompts_file)
    n_eval = max(1, round(EVAL_SHARE * len(prompts)))
    return prompts[:-n_eval], prompts[-n_eval:]


class BadInput(ValueError):
    """A flag an SD3 run cannot use: `flag` names it, the message says the fix."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def check(args, names: list[str], judges: list[str] = ()) -> None:
    """The flags an SD3 run needs (`args`: recast.py's flags; `names`, `judges`: the reward and
    judge names), checked before anything is loaded; a BadInput naming the flag otherwise."""
    for flag, given in (("--rewards", names), ("--judges", judges)):
        toy = [n for n in given if n in rewards.TOY]
        real = [p for p, ns in rewards.PRESETS.items() if not set(ns) & rewards.TOY]
        if toy:
            raise BadInput(
                flag,
                f"{', '.join(toy)} score the toy world's shapes, not {args.model}: choose from "
                f"{', '.join(rewards.LOADERS)}, or a preset ({', '.join(real)})",
            )
    if not args.prompts_file:
        raise BadInput(
            "--prompts-file", f"--model {args.model} needs training prompts, one per line"
        )
    files = {"--prompts-file": args.prompts_file, "--eval-prompts-file": args.eval_prompts_file}
    for flag, path in files.items():
        if path and not os.path.isfile(path):
            raise BadInput(flag, f"{path} is not a file")
        if path and not read_prompts(path):
            raise BadInput(flag, f"{path} holds no prompts (one per line, blank lines skipped)")
    train, _ = split_prompts(args.prompts_file, args.eval_prompts_file)
    if not train:
        raise BadInput(
            "--prompts-file", "needs ≥ 2 prompts when the held-out ones come from it too"
        )


class SD3World:
    """What recast.py needs of a world (toyworld.ToyWorld has the same shape), for SD3 / SD3.5."""

    reward_names = rewards.PRESETS["paper1"]
    judge_names = ()  # held-out judges are reward models too: none is scored by default

    def __init__(self, args, device: torch.device, pipe=None):
        """`args`: recast.py's flags (model, prompts_file, eval_prompts_file, resolution, seed,
        lora_rank, lora_alpha, grad_checkpointing are read). `pipe`: a StableDiffusion3Pipeline
        already built (benchmarks/memory_plan.py builds one on the meta device), used instead of
        loading --model."""
        from diffusers import StableDiffusion3Pipeline
        from peft import LoraConfig

        self.device = device
        self.train_prompts, self.eval_prompts = split_prompts(
            args.prompts_file, args.eval_prompts_file
        )
        if pipe is None:  # components saved as null (e.g. T5 left out) are passed as None
            source = hub.locate(args.model, "--model", "model_index.json")  # fails fast offline
            index = StableDiffusion3Pipeline.load_config(source)
            absent = {k: None for k, v in index.items() if v == [None, None]}
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            pipe = StableDiffusion3Pipeline.from_pretrained(source, torch_dtype=dtype, **absent)
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError(
                "its scheduler shifts by resolution (use_dynamic_shifting): unsupported"
            )
        pipe.set_progress_bar_config(disable=True)
        pipe.vae.to(device, torch.float32).requires_grad_(False).eval()
        for encoder in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
            if encoder is not None:  # T5 may have been left out
                encoder.to(device).requires_grad_(False).eval()
        self.pipe, self.scheduler = pipe, pipe.scheduler

        transformer = pipe.transformer.requires_grad_(False)
        step = pipe.vae_scale_factor * transformer.config.patch_size
        if args.resolution % step:
            raise ValueError(f"--resolution {args.resolution} must be a multiple of {step}")
        side = args.resolution // pipe.vae_scale_factor
        self.latent_shape = (transformer.config.in_channels, side, side)
        # Adapters drawn from --seed alone, on any rank and whatever drew from the RNG before (DDP
        # would also copy rank 0's at wrap time): lora_A random, lora_B zero, so θ = θ_old = base.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            for name in ("default", "old"):
                config = LoraConfig(
                    r=args.lora_rank,
                    lora_alpha=args.lora_alpha,
                    init_lora_weights="gaussian",
                    target_modules=LORA_TARGETS,
                )
                transformer.add_adapter(config, adapter_name=name)
        transformer.set_adapter("default")  # trainable: only "default" requires grad
        params = dict(transformer.named_parameters())
        self.lora = {k: p for k, p in params.items() if ".default." in k or ".old." in k}
        for p in self.lora.values():  # adapters and their EMA in fp32 (peft makes them bf16 here)
            p.data = p.data.float()
        self._pairs = [  # (θ_old, θ) tensor by tensor
            (params[k.replace(".default.", ".old.")], p)
            for k, p in params.items()
            if ".default." in k
        ]
        with torch.no_grad():
            for p_old, p in self._pairs:
                p_old.copy_(p)  # θ_old = θ
        if args.grad_checkpointing:
            transformer.enable_gradient_checkpointing()
        self.transformer = self.trainable = self.policy = transformer.to(device)

    def sigmas(self, steps: int) -> torch.Tensor:
        """t_0 = 1 > … > t_T = 0: the pipeline scheduler's shifted schedule (DESIGN §1)."""
        self.scheduler.set_timesteps(steps)
        return self.scheduler.sigmas.float().to(self.device)

    def _autocast(self):
        return torch.autocast("cuda", torch.bfloat16, enabled=self.device.type == "cuda")

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds (B, L, D), pooled_prompt_embeds (B, D')) from the frozen text encoders,
        ENCODE_CHUNK prompts per forward."""
        embeds, pooled = [], []
        for s in range(0, len(prompts), ENCODE_CHUNK):
            with self._autocast():
                e, _, p, _ = self.pipe.encode_prompt(
                    prompts[s : s + ENCODE_CHUNK],
                    None,
                    None,
                    device=self.device,
                    do_classifier_free_guidance=False,
                    max_sequence_length=MAX_SEQUENCE_LENGTH,
                )
            embeds.append(e)
            pooled.append(p)
        return torch.cat(embeds), torch.cat(pooled)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, h, w) → images (B, 3, H, W) in [-1, 1], in chunks of DECODE_CHUNK."""
        vae = self.pipe.vae
        shift = vae.config.shift_factor or 0.0
        images = [
            vae.decode(z.float() / vae.config.scaling_factor + shift, return_dict=False)[0]
            for z in latents.split(DECODE_CHUNK)
        ]
        return torch.cat(images).clamp(-1, 1)

    def ideal(self, prompts: list[str]) -> None:
        return None  # no ideal rendering of a free-form prompt

    @contextlib.contextmanager
    def _adapters(self, which: str):
        """The adapter a forward pass uses. peft's set_adapter also sets requires_grad (on for
        the active adapter, off for the others), so this is for no-grad passes of "old" and "ref",
        and "default" is trainable again on the way out."""
        if which == "old":
            self.transformer.set_adapter("old")
        elif which == "ref":
            self.transformer.disable_adapters()
        try:
            yield
        finally:
            if which == "old":
                self.transformer.set_adapter("default")
            elif which == "ref":
                self.transformer.enable_adapters()

    def v(self, which: str, x: torch.Tensor, cond, t: torch.Tensor) -> torch.Tensor:
        """Velocity (fp32) of the trained ("policy"), old ("old") or reference ("ref") model."""
        if which not in ("policy", "old", "ref"):
            raise ValueError(f"unknown model {which!r}: policy, old or ref")
        embeds, pooled = cond
        model = self.policy if which == "policy" else self.transformer
        with self._adapters(which), self._autocast():
            v = model(
                hidden_states=x,
                encoder_hidden_states=embeds,
                pooled_projections=pooled,
                timestep=1000 * t,
                return_dict=False,
            )[0]
        return v.float()

    @torch.no_grad()
    def update_old(self, decay: float) -> None:
        """θ_old ← d·θ_old + (1 - d)·θ on the adapters (DESIGN §6)."""
        for p_old, p in self._pairs:
            p_old.lerp_(p, 1 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The two adapters, under peft's parameter names (".default." and ".old.")."""
        return {k: p.detach() for k, p in self.lora.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.lora):
            differ = sorted(set(state) ^ set(self.lora))
            raise KeyError(f"checkpoint and adapters differ in {len(differ)} tensors: {differ[:3]}")
        with torch.no_grad():
            for k, p in self.lora.items():
                p.copy_(state[k])
