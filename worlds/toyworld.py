"""The toy world that `python recast.py` trains on: one coloured shape at a named place.

Images are 32×32 RGB in [-1, 1] (pixel space, no VAE) of one shape (circle, square, triangle) of a
named colour at a named position on a plain dark background. A prompt is "<color> <shape>
<position>", e.g. "red circle left". The text encoder is frozen and trivial: a fixed seeded vector
per word. The base model is a tiny diffusers `SD3Transformer2DModel` trained here with rectified
flow matching (DESIGN.md §1) on pictures of the world that carry four defects, one per reward
(misplacement, colour cast, blur, specks), each absent with probability 1/3 (DESIGN.md §8);
its weights ship in `worlds/toy_model/` and this file retrains them:

    python -m worlds.toyworld train     # ~30 min on a 2-core CPU, deterministic given --seed
    python studies/base_model.py        # its figures and pictures (docs/toy_world.md)
"""

import argparse
import copy
import json
import math
import os

import torch
import torch.nn.functional as F

SIZE = 32
COLORS = {  # RGB in [0, 1]
    "red": (0.90, 0.15, 0.15),
    "green": (0.15, 0.80, 0.20),
    "blue": (0.20, 0.35, 0.95),
    "yellow": (0.95, 0.85, 0.15),
    "magenta": (0.90, 0.20, 0.85),
    "cyan": (0.15, 0.85, 0.90),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = {  # object centre (x, y) in pixels
    "left": (9.5, 16.0),
    "right": (22.5, 16.0),
    "top": (16.0, 9.5),
    "bottom": (16.0, 22.5),
    "center": (16.0, 16.0),
}
BACKGROUND = (0.08, 0.08, 0.10)
AREA = 113.0  # canonical object area in pixels (a circle of radius 6)
SIZE_JITTER = 0.2  # scale ~ U(1 - j, 1 + j) in the world; the ideal rendering has none
# The world's pictures (what the base model learns from) carry four defects, one per reward, drawn
# independently per image and each absent with probability CLEAN: the ideal is inside what the base
# model draws, as in real text-to-image RL, and reinforcement has something to move toward.
CLEAN = 1 / 3
OFFSET = (1.0, 5.0)  # misplacement: pixels from the named place, in a random direction
CAST = (0.15, 0.6)  # colour cast: fraction of the way toward another palette colour
BLUR = (0.5, 1.5)  # soft edges: σ in pixels of a Gaussian blur of the shape's mask
SPECKS = (1, 5)  # clutter: 2×2-pixel specks on the background, ≥ 3 px from the shape
SPECK_BRIGHTNESS = 0.6  # specks differ from the background orthogonally to the object's colour
N_HELDOUT = 32
MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy_model")

PROMPTS = [f"{c} {s} {p}" for c in COLORS for s in SHAPES for p in POSITIONS]  # 90 prompts
_split = torch.randperm(len(PROMPTS), generator=torch.Generator().manual_seed(1234)).tolist()
HELDOUT_PROMPTS = sorted(PROMPTS[i] for i in _split[:N_HELDOUT])
TRAIN_PROMPTS = sorted(PROMPTS[i] for i in _split[N_HELDOUT:])


def parse(prompts: list[str]) -> list[tuple[str, str, str]]:
    """'red circle left' -> ('red', 'circle', 'left'); an unknown word is a ValueError."""
    out = []
    for p in prompts:
        words = p.split()
        if len(words) != 3 or words[0] not in COLORS or words[1] not in SHAPES:
            raise ValueError(f"not a toy-world prompt: {p!r} (want '<color> <shape> <position>')")
        if words[2] not in POSITIONS:
            raise ValueError(f"not a toy-world prompt: {p!r} (unknown position {words[2]!r})")
        out.append((words[0], words[1], words[2]))
    return out


# ---------------------------------------------------------------------------------------------
# Rendering: signed distance fields, one pixel of anti-aliasing
# ---------------------------------------------------------------------------------------------
def shape_sdf(shape: str, cx: torch.Tensor, cy: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Signed distance (pixels, < 0 inside) of `shape` of area AREA·scale² centred at (cx, cy).

    cx, cy, scale: (B,). Returns (B, SIZE, SIZE). The triangle points up and is centred on its
    incentre (= centroid); the square is axis-aligned.
    """
    yy, xx = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    dx = xx - cx[:, None, None]  # (B, H, W)
    dy = yy - cy[:, None, None]
    s = scale[:, None, None]
    if shape == "circle":
        return torch.sqrt(dx**2 + dy**2) - s * math.sqrt(AREA / math.pi)
    if shape == "square":
        return torch.maximum(dx.abs(), dy.abs()) - s * math.sqrt(AREA) / 2
    if shape == "triangle":  # equilateral: area = 3·√3·inradius²
        inradius = s * math.sqrt(AREA / (3 * math.sqrt(3)))
        c30 = math.cos(math.pi / 6)
        edges = [dy, -c30 * dx - 0.5 * dy, c30 * dx - 0.5 * dy]  # outward normals · offset
        return torch.stack(edges).amax(0) - inradius
    raise ValueError(f"unknown shape {shape!r}")


def blur(a: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur (σ in pixels, edges replicated) of masks a (B, H, W)."""
    r = max(1, int(3 * sigma))
    k = torch.exp(-((torch.arange(-r, r + 1, device=a.device, dtype=a.dtype) / sigma) ** 2) / 2)
    k = k / k.sum()
    x = F.conv2d(F.pad(a[:, None], (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1))[:, 0]


def _uniform(lo: float, hi: float, n: int, gen: torch.Generator) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=gen)


DEFECTS = ("misplacement", "colour cast", "blur", "specks")  # in the order of the rewards


def render(
    prompts: list[str],
    generator: torch.Generator | None = None,
    defects: torch.Tensor | None = None,
) -> torch.Tensor:
    """Images (B, 3, SIZE, SIZE) in [-1, 1]: the ideal rendering if no generator is given, else a
    picture of the world, with size jitter and each of the four DEFECTS present with probability
    1 - CLEAN (magnitudes above), or where `defects` (B, 4) bool says so."""
    B, gen = len(prompts), generator
    words = parse(prompts)
    bg = torch.tensor(BACKGROUND)
    colour = torch.tensor([COLORS[c] for c, _, _ in words])  # (B, 3)
    centre = torch.tensor([POSITIONS[p] for _, _, p in words])  # (B, 2) x, y
    scale, sigma, n_specks = torch.ones(B), torch.zeros(B), torch.zeros(B, dtype=torch.long)
    if gen is not None:
        has = torch.rand(B, 4, generator=gen) >= CLEAN  # (B, defect); drawn even when `defects`
        has = has if defects is None else defects.bool()  # is given: the same draws follow
        scale = 1 + SIZE_JITTER * (2 * torch.rand(B, generator=gen) - 1)
        radius, angle = _uniform(*OFFSET, B, gen), _uniform(0, 2 * math.pi, B, gen)
        centre = centre + has[:, :1] * radius[:, None] * torch.stack([angle.cos(), angle.sin()], 1)
        other = (torch.tensor([list(COLORS).index(c) for c, _, _ in words])
                 + torch.randint(1, len(COLORS), (B,), generator=gen)) % len(COLORS)  # fmt: skip
        cast = has[:, 1] * _uniform(*CAST, B, gen)
        palette = torch.tensor(list(COLORS.values()))
        colour = colour + cast[:, None] * (palette[other] - colour)
        sigma = has[:, 2] * _uniform(*BLUR, B, gen)
        n_specks = has[:, 3] * torch.randint(SPECKS[0], SPECKS[1] + 1, (B,), generator=gen)
    images = torch.empty(B, 3, SIZE, SIZE)
    for n, (_, shape, _) in enumerate(words):
        sdf = shape_sdf(shape, centre[n, :1], centre[n, 1:], scale[n : n + 1])
        alpha = (0.5 - sdf).clamp(0, 1)  # (1, H, W): a one-pixel anti-aliased edge
        if sigma[n] > 0:
            alpha = blur(alpha, sigma[n].item())
        images[n] = bg[:, None, None] + alpha * (colour[n] - bg)[:, None, None]
        if n_specks[n] > 0:
            images[n] = _add_specks(images[n], sdf[0], colour[n] - bg, int(n_specks[n]), gen)
    return images.clamp(0, 1) * 2 - 1


def _add_specks(image, sdf, direction, count, gen):
    """`count` 2×2 specks on the background, ≥ 3 px from the shape, of a colour that differs from
    the background orthogonally to the object's colour (so they never look like part of it)."""
    free = (sdf[:-1, :-1] > 3) & (sdf[1:, 1:] > 3) & (sdf[:-1, 1:] > 3) & (sdf[1:, :-1] > 3)
    spots = free.flatten().nonzero().flatten()
    if len(spots) == 0:
        return image
    image = image.clone()
    d = direction / direction.norm()
    for k in spots[torch.randint(len(spots), (count,), generator=gen)].tolist():
        y, x = divmod(k, SIZE - 1)
        u = torch.rand(3, generator=gen)
        u = u - (u @ d) * d  # orthogonal to the object's colour direction
        tint = SPECK_BRIGHTNESS * u / u.norm().clamp(min=1e-6)
        image[:, y : y + 2, x : x + 2] = image[:, y : y + 2, x : x + 2] + tint[:, None, None]
    return image


# ---------------------------------------------------------------------------------------------
# Frozen text encoder: a fixed seeded vector per word
# ---------------------------------------------------------------------------------------------
WORD_DIM = 32
VOCAB = [*COLORS, *SHAPES, *POSITIONS]
_WORD_VECTORS = torch.randn(len(VOCAB), WORD_DIM, generator=torch.Generator().manual_seed(0))


def encode(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(encoder_hidden_states (B, 3, WORD_DIM), pooled_projections (B, 3·WORD_DIM))."""
    ids = torch.tensor([[VOCAB.index(w) for w in words] for words in parse(prompts)])
    tokens = _WORD_VECTORS[ids]  # (B, 3, WORD_DIM)
    return tokens, tokens.flatten(1)


# ---------------------------------------------------------------------------------------------
# The base model
# ---------------------------------------------------------------------------------------------
MODEL_CONFIG = dict(
    sample_size=SIZE,
    patch_size=4,
    in_channels=3,
    out_channels=3,
    num_layers=4,
    num_attention_heads=4,
    attention_head_dim=32,
    joint_attention_dim=WORD_DIM,
    caption_projection_dim=128,
    pooled_projection_dim=3 * WORD_DIM,
    pos_embed_max_size=SIZE // 4,
)
SHIFT = 3.0  # SD3's schedule shift; training times are drawn from the same shifted law


def shifted(u: torch.Tensor, shift: float = SHIFT) -> torch.Tensor:
    """SD3's time shift t = s·u / (1 + (s - 1)·u), as in FlowMatchEulerDiscreteScheduler."""
    return shift * u / (1 + (shift - 1) * u)


def velocity(model, x: torch.Tensor, cond: tuple[torch.Tensor, torch.Tensor], t: torch.Tensor):
    """v(x_t, c, t) for an SD3 transformer; t in [0, 1] of shape (B,) (SD3 feeds 1000·t)."""
    tokens, pooled = cond
    return model(
        hidden_states=x, encoder_hidden_states=tokens, pooled_projections=pooled, timestep=1000 * t
    ).sample


# what a toy-world model must read and write: its pixels, patches and the toy text encoding
INTERFACE = ("in_channels", "out_channels", "sample_size", "patch_size", "joint_attention_dim",
             "pooled_projection_dim")  # fmt: skip


def not_a_toy_model(path: str) -> str | None:
    """Why the folder `path`, which holds a config.json, is not a toy-world model, or None when it
    is one: its config.json names an SD3Transformer2DModel with MODEL_CONFIG's INTERFACE. A
    component folder of a diffusers pipeline (its transformer/) holds a config.json too, and would
    otherwise be loaded as a toy model, failing on its weights or its first forward."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        return f"{path}/config.json cannot be read as a toy-world model's ({e})"
    found = config.get("_class_name") if isinstance(config, dict) else None
    if found != "SD3Transformer2DModel":
        differs = f"a {found}"
    else:
        wrong = [k for k in INTERFACE if config.get(k) != MODEL_CONFIG[k]]
        if not wrong:
            return None
        key = wrong[0]
        differs = (f"an SD3 transformer of {key} {config.get(key)} (the toy world's: "
                   f"{MODEL_CONFIG[key]})")  # fmt: skip
    return (f"{path} holds {differs} (config.json) and no model_index.json: neither a toy-world "
            "model nor a diffusers pipeline. For a diffusers model give the pipeline's folder, "
            "the one holding model_index.json, not a component's (transformer/)")  # fmt: skip


def load_base(path: str = MODEL_DIR, dtype: torch.dtype = torch.float32):
    from diffusers import SD3Transformer2DModel

    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"no toy model at {path}: run `python -m worlds.toyworld train` first"
        )
    return SD3Transformer2DModel.from_pretrained(path, torch_dtype=dtype).eval()


class ToyWorld:
    """What recast.py needs of a world; diffusersworld.DiffusersWorld has the same shape.

    Full fine-tuning: the trained policy θ, the old (sampling) policy θ_old and the frozen
    reference are three copies of the 2.3 M-parameter transformer.
    """

    reward_names = ("position", "color", "sharpness", "background")
    judge_names = ("shape", "iou")

    def __init__(self, device: torch.device, model_dir: str = MODEL_DIR):
        from diffusers import FlowMatchEulerDiscreteScheduler

        self.device = device
        self.trainable = load_base(model_dir).to(device).requires_grad_(True)
        self.old_model = copy.deepcopy(self.trainable).requires_grad_(False)
        self.ref_model = copy.deepcopy(self.trainable).requires_grad_(False)
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
        self.train_prompts, self.eval_prompts = TRAIN_PROMPTS, HELDOUT_PROMPTS
        self.latent_shape = (3, SIZE, SIZE)
        self.policy = self.trainable  # recast.py swaps in the DDP wrapper when distributed

    def sigmas(self, steps: int) -> torch.Tensor:
        """t_0 = 1 > … > t_T = 0: the scheduler's shifted schedule (DESIGN §1)."""
        self.scheduler.set_timesteps(steps)
        return self.scheduler.sigmas.float().to(self.device)

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(c.to(self.device) for c in encode(prompts))

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return x  # pixel space: the latents are the image

    def ideal(self, prompts: list[str]) -> torch.Tensor:
        return render(prompts).to(self.device)

    def v(self, which: str, x: torch.Tensor, cond, t: torch.Tensor) -> torch.Tensor:
        """Velocity of the trained ("policy"), old ("old") or reference ("ref") model."""
        model = {"policy": self.policy, "old": self.old_model, "ref": self.ref_model}[which]
        return velocity(model, x, cond, t)

    @torch.no_grad()
    def update_old(self, decay: float) -> None:
        """θ_old ← d·θ_old + (1 - d)·θ (DESIGN §6)."""
        for p_old, p in zip(self.old_model.parameters(), self.trainable.parameters(), strict=True):
            p_old.lerp_(p, 1 - decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            **{f"policy.{k}": v for k, v in self.trainable.state_dict().items()},
            **{f"old.{k}": v for k, v in self.old_model.state_dict().items()},
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for prefix, model in (("policy.", self.trainable), ("old.", self.old_model)):
            model.load_state_dict(
                {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            )


def train_base(steps: int, batch: int, lr: float, seed: int, out: str) -> None:
    """Rectified flow matching on freshly rendered batches: v_θ(x_t) → ε - x0 (DESIGN §1)."""
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import save_file
    from tqdm import trange

    # one thread: the same weights on any machine (a reduction's split depends on the thread count)
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = SD3Transformer2DModel(**MODEL_CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    bar = trange(steps, desc="base model", unit="step")
    for _ in bar:
        prompts = [PROMPTS[i] for i in torch.randint(len(PROMPTS), (batch,), generator=gen)]
        x0 = render(prompts, gen)
        noise = torch.randn(x0.shape, generator=gen)
        t = shifted(torch.rand(batch, generator=gen))
        x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        loss = F.mse_loss(velocity(model, x_t, encode(prompts), t), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        bar.set_postfix(loss=f"{loss.item():.4f}")
    # fp16 on disk keeps the checkpoint at ~4.6 MB; it is loaded back as fp32
    os.makedirs(out, exist_ok=True)
    model.save_config(out)
    state = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(dict(steps=steps, batch=batch, lr=lr, seed=seed, shift=SHIFT), f, indent=1)
    print(f"saved {out}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="retrain the shipped base model from scratch")
    tr.add_argument("--steps", type=int, default=3000, help="optimizer steps")
    tr.add_argument("--batch", type=int, default=64, help="images per step")
    tr.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine decay)")
    tr.add_argument("--seed", type=int, default=0, help="seed of weights, data and noise")
    tr.add_argument("--out", default=MODEL_DIR, help="folder for config + safetensors")
    args = ap.parse_args()
    if args.cmd == "train":
        bad = [
            (flag, why)
            for flag, ok, why in [
                ("--steps", args.steps >= 1, f"must be ≥ 1, got {args.steps}"),
                ("--batch", args.batch >= 1, f"must be ≥ 1, got {args.batch}"),
                ("--lr", 0 < args.lr < math.inf, f"must be > 0 and finite, got {args.lr}"),
                ("--seed", args.seed >= 0, f"must be ≥ 0, got {args.seed}"),
            ]
            if not ok
        ]
        if bad:
            ap.exit(2, f"worlds/toyworld.py train: error: {bad[0][0]}: {bad[0][1]}\n")
        train_base(args.steps, args.batch, args.lr, args.seed, args.out)
