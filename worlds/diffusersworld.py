"""The diffusers world that `recast.py --model PATH_OR_ID` trains: the same loop as the toy world,
on a diffusers text-to-image pipeline, with a small part per model family.

This file holds what every family shares: prompts, the two LoRA adapters (peft) on the
transformer, "default" the trained policy θ and "old" the sampling policy θ_old (an EMA of θ,
DESIGN §6), the frozen reference (the transformer with its adapters disabled), chunked text
encoding and VAE decoding, and the EMA. VAE and text encoders are frozen. Under --precision bf16
(the default on CUDA) the frozen weights are bf16 and every forward runs under bf16 autocast, while
the adapters and the VAE decode stay fp32; under fp32 (the default elsewhere) everything is fp32.
Sampling is CFG-free Euler on the schedule of the pipeline's own scheduler, and noising is
x_t = (1 - t)·x0 + t·ε, both in the family's own latent layout
(packing 2×2 patches only reorders values, so the NFT loss is the same).

A family part (sd3world.py, fluxworld.py, flux2world.py, qwenimageworld.py; families.py picks one
from model_index.json) is a module that says how its family differs, and nothing else:
    PIPELINE, NAME            the diffusers pipeline class it serves, and a name for messages
    LORA_TARGETS              the transformer's Linear layers that take adapters (name suffixes)
    ENCODE_CHUNK, DECODE_CHUNK  prompts per text-encoder forward, latents per VAE decode
    UNUSED_ADAPTERS           whether some adapters never reach the velocity (no gradient)
    check(configs, args)      flags the family needs or refuses (BadInput), from the configs
    latent_shape(pipe, resolution)  one image's latents in the layout the transformer reads
    encode(pipe, prompts, device)   a tuple of (B, ...) tensors: the condition of each prompt
    schedule(pipe, steps, latent_shape)  t_0 = 1 > ... > t_T = 0, from diffusers' scheduler
    inputs(pipe, x, cond, t, args)  the transformer's keyword arguments (its time convention)
    decode(pipe, z)           latents (B, *latent_shape) fp32 → images (B, 3, H, W) in [-1, 1]
    advice(configs)           notes on defaults that suit the family, printed at load
docs/models.md lists what each family holds and how to add one.
"""

import contextlib
import math
import os

import numpy as np
import torch

from worlds import hub

EVAL_SHARE = 0.1  # held out from --prompts-file when no --eval-prompts-file is given
SCORED_GROUPS = 4  # the fewest prompt groups an epoch whose W stayed within the noise floor of a
# change of seed, in the toy world's scoring study (docs/results.md); 2 groups did not


def scoring_defaults(prompts: int) -> dict:
    """recast.py's defaults for scoring the step predictions of a diffusers model, where that is
    most of an epoch's cost (docs/sd35.md): SCORED_GROUPS prompt groups an epoch, under bf16."""
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
    """A flag a diffusers run cannot use: `flag` names it, the message says the fix."""

    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def check(args) -> None:
    """The flags every diffusers run needs (`args`: recast.py's flags), checked before anything
    is loaded; a BadInput naming the flag. (That its rewards are not the toy world's is
    harness.check_rewards', which knows the rewards.)"""
    if args.lora_rank < 1:  # peft's own refusal would come at load, read as a bad --model
        raise BadInput("--lora-rank", f"must be ≥ 1, got {args.lora_rank}")
    if args.lora_alpha <= 0:  # the adapters' scale alpha / rank: at 0 they get no gradient
        raise BadInput("--lora-alpha", f"must be > 0 (the adapters' scale is alpha / rank: 0 "
                       f"trains nothing), got {args.lora_alpha}")  # fmt: skip
    if not 0 <= args.guidance < math.inf:  # NaN or inf would make every velocity NaN
        raise BadInput("--guidance", f"must be ≥ 0 and finite (0: the family has no guidance "
                       f"input), got {args.guidance}")  # fmt: skip
    if not args.prompts_file:
        raise BadInput(
            "--prompts-file", f"--model {args.model} needs training prompts, one per line"
        )
    files = {"--prompts-file": args.prompts_file, "--eval-prompts-file": args.eval_prompts_file}
    for flag, path in ((f, p) for f, p in files.items() if p):
        if not os.path.isfile(path):
            raise BadInput(flag, f"{path} is not a file")
        try:
            prompts = read_prompts(path)
        except UnicodeDecodeError as e:  # a prompt in another encoding (Latin-1's é): not a crash
            raise BadInput(flag, f"{path} is not UTF-8 text ({e}); save it as UTF-8") from None
        except OSError as e:  # unreadable (permissions, a folder's entry gone)
            raise BadInput(flag, f"{path} cannot be read ({e})") from None
        if not prompts:
            raise BadInput(flag, f"{path} holds no prompts (one per line, blank lines skipped)")
    train, _ = split_prompts(args.prompts_file, args.eval_prompts_file)
    if not train:
        raise BadInput(
            "--prompts-file", "needs ≥ 2 prompts when the held-out ones come from it too"
        )


def packed_latent_shape(pipe, resolution: int) -> tuple[int, ...]:
    """(tokens, channels): 2×2 patches of the VAE's latents, as FLUX.1 and Qwen-Image pack them."""
    side = resolution // pipe.vae_scale_factor
    return ((side // 2) ** 2, pipe.transformer.config.in_channels)


def token_shifted_sigmas(pipe, steps: int, tokens: int, calculate_shift) -> torch.Tensor:
    """σ = linspace(1, 1/T, T) shifted by the μ that the pipeline module's own `calculate_shift`
    gives for this many image tokens (FLUX.1, Qwen-Image), through its scheduler."""
    c = pipe.scheduler.config
    mu = calculate_shift(tokens, c.get("base_image_seq_len", 256),
                         c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5),
                         c.get("max_shift", 1.15))  # fmt: skip
    pipe.scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    return pipe.scheduler.sigmas


def read_configs(source: str) -> dict:
    """{"pipeline": model_index.json, and each of "transformer", "vae", "scheduler": its
    config}, read without loading a weight."""
    import diffusers

    configs = {"pipeline": diffusers.DiffusionPipeline.load_config(source)}
    for name in ("transformer", "vae", "scheduler"):
        cls = getattr(diffusers, configs["pipeline"][name][1])  # e.g. ["diffusers", "…Model"]
        configs[name] = cls.load_config(source, subfolder=name)
    return configs


def check_resolution(args, step: int, family: str) -> None:
    """--resolution must be a multiple of `step` pixels: the VAE's downsampling × the
    transformer's patch side (the 2×2 patches it packs)."""
    if args.resolution < step or args.resolution % step:
        near = max(step, round(args.resolution / step) * step)
        raise BadInput("--resolution", f"{args.resolution} px is not a multiple of {family}'s "
                       f"latent patch, {step} px (VAE × patch side): use e.g. {near}")  # fmt: skip


def lora_targets(transformer: torch.nn.Module, suffixes: list[str]) -> list[str]:
    """The full names of the transformer's Linear layers whose names end with one of `suffixes`
    (at a dot), in module order: what peft adapts. Matching Linear layers only lets a suffix name
    a layer whose name another block type uses for a container (FLUX.2-klein's single-stream
    `attn.to_out` is a Linear, its double-stream `attn.to_out` a ModuleList)."""
    hit = lambda name: any(name == s or name.endswith("." + s) for s in suffixes)  # noqa: E731
    return [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and hit(n)]


def _gathered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sharded tensors (DTensors) gathered whole onto rank 0's host, one at a time; every rank
    must call it, and every other rank gets an empty dict, as torch.distributed.checkpoint's
    full_state_dict with cpu_offload gives it (only rank 0 writes a checkpoint). Each tensor's
    gather is an all-gather, so every rank holds one whole tensor on its device while it runs;
    only rank 0 copies it out. Tensors that are not sharded are returned as they are."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not any(isinstance(t, DTensor) for t in tensors.values()):
        return tensors
    keep, out = dist.get_rank() == 0, {}
    for k, t in tensors.items():
        whole = t.full_tensor()  # a collective: every rank, in the same order
        if keep:
            out[k] = whole.cpu()
    return out


def _like(whole: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`whole` sharded as `t` is, when `t` is a DTensor: each rank cuts its shard from its own
    copy (src_data_rank=None: no scatter from rank 0), for every rank holds the same whole
    tensor (a resumed checkpoint, whose digest the ranks compared before loading it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(t, DTensor):
        return whole
    return distribute_tensor(whole.to(t.device_mesh.device_type), t.device_mesh, t.placements,
                             src_data_rank=None)  # fmt: skip


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the batch, zero-padding dim 1 (tokens) to the longest first: a family
    whose prompts take varying lengths (with a mask) comes in chunks of different lengths."""
    if parts[0].dim() < 2 or len({p.shape[1] for p in parts}) == 1:
        return torch.cat(parts)
    longest = max(p.shape[1] for p in parts)
    pads = [(0, 0) * (p.dim() - 2) + (0, longest - p.shape[1]) for p in parts]
    return torch.cat([torch.nn.functional.pad(p, pad) for p, pad in zip(parts, pads, strict=True)])


SHARDED = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")  # --shard's models


def _lora(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The two adapters' tensors by peft name."""
    params = transformer.named_parameters()
    return {k: p for k, p in params if ".default." in k or ".old." in k}


def add_adapters(transformer: torch.nn.Module, args, family) -> None:
    """The two LoRA adapters on the family's targets, drawn from --seed alone, on any rank and
    whatever drew from the RNG before (DDP would also copy rank 0's at wrap time): lora_A random,
    lora_B zero, so θ = θ_old = base; fp32 (peft makes them the base weights' dtype), "old" a copy
    of "default", and only "default" requires grad. On the meta device (a --shard skeleton) they
    get their shapes and names only."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    targets = lora_targets(transformer, family.LORA_TARGETS)  # before peft wraps them
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        for name in ("default", "old"):
            config = LoraConfig(
                r=args.lora_rank,
                lora_alpha=args.lora_alpha,
                init_lora_weights="gaussian",
                target_modules=targets,
            )
            transformer.add_adapter(config, adapter_name=name)
    transformer.set_adapter("default")  # trainable: only "default" requires grad
    lora = _lora(transformer)
    for p in lora.values():  # adapters and their EMA in fp32 (peft makes them bf16 here)
        p.data = p.data.float()
    with torch.no_grad():
        for k, p in lora.items():
            old = lora.get(k.replace(".default.", ".old."))
            if old is not None and not (p.is_meta or old.is_meta):  # a skeleton's: no values
                old.copy_(p)  # θ_old = θ


def _model_class(spec: list[str]):
    """The class of a pipeline component as model_index.json names it, e.g. ["diffusers",
    "SD3Transformer2DModel"] or ["transformers", "T5EncoderModel"]."""
    import importlib

    return getattr(importlib.import_module(spec[0]), spec[1])


def skeleton(source: str, name: str, spec: list[str], dtype: torch.dtype) -> torch.nn.Module:
    """Component `name` of the pipeline in `source` built from its configuration on the meta
    device, in `dtype`, frozen: its modules, parameter names and shapes, no weight read and
    nothing allocated. Its other tensors are on meta too, the buffers and the plain tensor
    attributes (Qwen-Image's rotary tables pos_freqs and neg_freqs, which QwenEmbedRope keeps
    outside its buffers): load_shards gives each of them rank 0's value."""
    cls = _model_class(spec)
    with torch.device("meta"):
        if spec[0] == "diffusers":
            model = cls.from_config(cls.load_config(source, subfolder=name))
        else:
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(source, subfolder=name))
    torch.nn.Module.to(model, dtype)  # (diffusers' own `to` warns of fp32 modules it has none of)
    return model.requires_grad_(False).eval()


def _tensor_attributes(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's own tensors that are neither parameters nor buffers (plain attributes)."""
    return {k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}


def _own_tensors(module: torch.nn.Module):
    """(kind, attribute, tensor) of every tensor a module holds itself: parameters, buffers and
    plain tensor attributes."""
    for kind, found in (("parameter", module._parameters), ("buffer", module._buffers),
                        ("attribute", _tensor_attributes(module))):  # fmt: skip
        for attr, t in found.items():
            if t is not None:
                yield kind, attr, t


def left_on_meta(model: torch.nn.Module) -> list[str]:
    """Each tensor of `model` still on the meta device, as "module.attribute (kind)": parameters
    (a sharded one's local shard), buffers and plain tensor attributes, module by module."""
    from torch.distributed.tensor import DTensor

    found = []
    for owner, module in model.named_modules():
        for kind, attr, t in _own_tensors(module):
            if (t.to_local() if isinstance(t, DTensor) else t).is_meta:
                found.append(f"{owner + '.' if owner else ''}{attr} ({kind})")
    return found


def check_loaded(model: torch.nn.Module, name: str) -> None:
    """Raise RuntimeError naming each module and attribute of `model` (pipeline component `name`)
    left on the meta device after loading: its first forward would fail on it, far from here."""
    found = left_on_meta(model)
    if found:
        more = f" and {len(found) - 5} more" if len(found) > 5 else ""
        raise RuntimeError(f"{name}: {len(found)} tensors left on the meta device after loading, "
                           f"without values: {', '.join(found[:5])}{more}")  # fmt: skip


def read_whole(source: str, name: str, spec: list[str], dtype: torch.dtype) -> torch.nn.Module:
    """Component `name` read whole onto the host, as the pipeline's from_pretrained reads it."""
    cls = _model_class(spec)
    kind = "torch_dtype" if spec[0] == "diffusers" else "dtype"  # transformers ≥ 5 says dtype
    return cls.from_pretrained(source, subfolder=name, **{kind: dtype}).requires_grad_(False)


def _non_parameters(model: torch.nn.Module) -> dict[tuple[str, str, str], torch.Tensor]:
    """{(module, "buffer" or "attribute", attribute): tensor on the host} of `model`: what
    set_model_state_dict does not give a skeleton (non-persistent buffers, plain attributes)."""
    return {(owner, kind, attr): t.detach().cpu() for owner, module in model.named_modules()
            for kind, attr, t in _own_tensors(module) if kind != "parameter"}  # fmt: skip


class DiffusersWorld:
    """What recast.py needs of a world (toyworld.ToyWorld has the same shape), for a diffusers
    pipeline of the family `family` (a family module, see above)."""

    judge_names = ()  # held-out judges are reward models too: none is scored by default

    def __init__(self, args, device: torch.device, family, pipe=None):
        """`args`: recast.py's flags (model, prompts_file, eval_prompts_file, resolution, seed,
        lora_rank, lora_alpha, grad_checkpointing, guidance, precision, shard are read). `pipe`:
        the family's pipeline already built (benchmarks/memory_plan.py builds one on the meta
        device), used instead of loading --model.

        Under --shard (args.shard, in a process group) the transformer and the text encoders are
        built on the meta device (`skeleton`: no weight read, nothing allocated), the adapters
        added to them, and nothing else is done to them here: harness.setup shards them
        (distributed.shard_models), then load_shards gives each rank its shards' weights, read
        on rank 0 and broadcast, and moves the VAE to the device. Otherwise every model is read
        whole, as from_pretrained reads a pipeline."""
        import diffusers

        self.device, self.family, self.args = device, family, args
        # --precision: bf16, fp32, or auto (bf16 on CUDA), as plumbing.distributed resolves it
        self.bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
        self.train_prompts, self.eval_prompts = split_prompts(
            args.prompts_file, args.eval_prompts_file
        )
        self._skeletons, self._source = {}, None  # --shard's meta models, by component name
        self.dtype = torch.bfloat16 if self.bf16 else torch.float32
        loaded = pipe is None  # not the planner's pipeline on meta
        if loaded:
            source = hub.locate(args.model, "--model", "model_index.json")  # fails fast offline
            configs = read_configs(source)
            family.check(configs, args)  # before a weight is loaded
            # components saved as null (e.g. T5 left out) must be passed as None explicitly
            absent = {k: None for k, v in configs["pipeline"].items() if v == [None, None]}
            if getattr(args, "shard", False) and torch.distributed.is_initialized():
                self._source = source
                self._skeletons = {n: skeleton(source, n, configs["pipeline"][n], self.dtype)
                                   for n in SHARDED if n in configs["pipeline"]
                                   and n not in absent}  # fmt: skip
            pipeline = getattr(diffusers, family.PIPELINE)
            pipe = pipeline.from_pretrained(source, torch_dtype=self.dtype, **absent,
                                            **self._skeletons)  # fmt: skip
        else:
            configs = {"pipeline": dict(pipe.config)}
            configs.update({n: dict(getattr(pipe, n).config) for n in ("transformer", "vae",
                                                                       "scheduler")})  # fmt: skip
            family.check(configs, args)
        pipe.set_progress_bar_config(disable=True)
        pipe.vae.requires_grad_(False).eval()
        if not self._skeletons:  # under --shard: load_shards, once the models are sharded
            pipe.vae.to(device, torch.float32)
        for name in ("text_encoder", "text_encoder_2", "text_encoder_3"):
            encoder = getattr(pipe, name, None)
            if encoder is not None:  # T5 may have been left out
                encoder.requires_grad_(False).eval()
                if name not in self._skeletons:
                    encoder.to(device)
        self.pipe = pipe
        one = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if one:  # the family's notes, said once and not once a rank
            for note in family.advice(configs):
                print(f"note: {family.NAME}: {note}")

        transformer = pipe.transformer
        self.latent_shape = family.latent_shape(pipe, args.resolution)
        add_adapters(transformer, args, family)
        if args.grad_checkpointing:
            transformer.enable_gradient_checkpointing()
        if "transformer" not in self._skeletons:
            transformer = transformer.to(device)
        self.transformer = self.trainable = self.policy = transformer
        self.unused_adapters = family.UNUSED_ADAPTERS  # DDP must look for them (harness.setup)
        if self._source is None and loaded:  # read whole here (--shard's: once load_shards ran)
            for name, model in (("transformer", transformer), *self._encoders()):
                check_loaded(model, name)

    def _encoders(self) -> list[tuple[str, torch.nn.Module]]:
        names = ("text_encoder", "text_encoder_2", "text_encoder_3")
        found = [(n, getattr(self.pipe, n, None)) for n in names]
        return [(n, e) for n, e in found if e is not None]  # T5 may have been left out

    def load_shards(self) -> None:
        """Under --shard, once distributed.shard_models has sharded the meta models (every rank
        calls it, from there): each model in turn is given storage for this rank's shards on the
        device, rank 0 reads it whole onto its host (read_whole; the transformer with the adapters
        of add_adapters, drawn as under DDP) and broadcasts it, tensor by tensor, each rank keeping
        its shards (torch.distributed.checkpoint's set_model_state_dict, full_state_dict and
        broadcast_from_rank0), then its buffers (those outside the state dict too: rotary
        frequencies, position ids) and plain tensor attributes (Qwen-Image's rotary tables, on
        the host as when loaded whole); rank 0 drops the whole copy before reading the next. Rank
        0's host thus holds one model whole at a time, every other rank's only its shards, and no
        GPU more than its shards and one tensor; then the VAE goes to the device (read with the
        pipeline, small). Every model is then checked for a tensor left on meta (check_loaded).
        Without --shard's meta models: nothing to do."""
        if not self._skeletons:
            return
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        rank0 = dist.get_rank() == 0
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        specs = read_configs(self._source)["pipeline"]
        for name, model in self._skeletons.items():
            model.to_empty(device=self.device)  # this rank's shards (and buffers), unset
            whole = read_whole(self._source, name, specs[name], self.dtype) if rank0 else None
            if rank0 and name == "transformer":
                add_adapters(whole, self.args, self.family)
            set_model_state_dict(model, whole.state_dict() if rank0 else {}, options=options)
            others = [_non_parameters(whole) if rank0 else None]
            dist.broadcast_object_list(others, src=0)
            for (owner, kind, attr), t in others[0].items():
                module = model.get_submodule(owner)
                if kind == "buffer":
                    module._buffers[attr] = t.to(self.device)
                else:  # a plain attribute stays where loading whole leaves it: on the host
                    setattr(module, attr, t)
            del whole
            check_loaded(model, name)
        self.pipe.vae.to(self.device, torch.float32)

    @property
    def lora(self) -> dict[str, torch.Tensor]:
        """The two adapters' tensors by peft name, as the transformer holds them now (sharding
        replaces them with their shards)."""
        return _lora(self.transformer)

    @property
    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(θ_old, θ) tensor by tensor."""
        lora = self.lora
        return [(lora[k.replace(".default.", ".old.")], p) for k, p in lora.items()
                if ".default." in k]  # fmt: skip

    def shardable(self) -> list[torch.nn.Module]:
        """What `recast.py --shard` shards layer by layer across the ranks (FSDP2): the
        transformer (its base weights and both adapters) and the text encoders (docs/models.md)."""
        return [self.transformer, *[e for _, e in self._encoders()]]

    def sigmas(self, steps: int) -> torch.Tensor:
        """t_0 = 1 > … > t_T = 0: the family's schedule, from the pipeline's scheduler (§1)."""
        return self.family.schedule(self.pipe, steps, self.latent_shape).float().to(self.device)

    def _autocast(self):
        kind = "cuda" if self.device.type == "cuda" else "cpu"  # "cpu" for the planner's meta too
        return torch.autocast(kind, torch.bfloat16, enabled=self.bf16)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, ...]:
        """The condition of each prompt, a tuple of (B, ...) tensors (the family's), from the
        frozen text encoders, ENCODE_CHUNK prompts per forward."""
        chunks = []
        for s in range(0, len(prompts), self.family.ENCODE_CHUNK):
            with self._autocast():
                chunk = prompts[s : s + self.family.ENCODE_CHUNK]
                chunks.append(self.family.encode(self.pipe, chunk, self.device))
        return tuple(_cat(list(parts)) for parts in zip(*chunks, strict=True))

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, *latent_shape) → images (B, 3, H, W) in [-1, 1], DECODE_CHUNK at a time."""
        images = [
            self.family.decode(self.pipe, z.float())
            for z in latents.split(self.family.DECODE_CHUNK)
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
        model = self.policy if which == "policy" else self.transformer
        inputs = self.family.inputs(self.pipe, x, cond, t, self.args)
        with self._adapters(which), self._autocast():
            v = model(**inputs, return_dict=False)[0]
        return v.float()

    @torch.no_grad()
    def update_old(self, decay: float) -> None:
        """θ_old ← d·θ_old + (1 - d)·θ on the adapters (DESIGN §6)."""
        for p_old, p in self._pairs:
            p_old.lerp_(p, 1 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The two adapters, whole, under peft's parameter names (".default." and ".old."). When
        sharded, every rank must call it: each tensor's shards are gathered onto rank 0's host,
        and the other ranks get an empty dict (_gathered)."""
        return _gathered({k: p.detach() for k, p in self.lora.items()})

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if set(state) != set(self.lora):
            differ = sorted(set(state) ^ set(self.lora))
            raise KeyError(f"checkpoint and adapters differ in {len(differ)} tensors: {differ[:3]}")
        with torch.no_grad():
            for k, p in self.lora.items():
                p.copy_(_like(state[k], p))
