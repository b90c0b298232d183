"""Rewards and held-out judges.

A reward is a function `(images, prompts) -> scores`: images (B, 3, H, W) in [-1, 1], prompts a list
of B strings, scores (B,) float, higher is better. `REWARDS` maps names to rewards; `JUDGES` maps
names to held-out judges that training never sees. To plug in your own reward, add a function of
that signature to `REWARDS` (or register it with `@reward("name")`).

The toy rewards, in the order `recast.py` uses them, each measuring one attribute of the toy world
(toyworld.py) and each decided at a different point of denoising:
- `position`:   minus the distance (pixels) of the object's centroid from the requested place;
- `color`:      minus the RGB distance of the object's core colour from the requested colour;
- `sharpness`:  minus the mean "in-betweenness" 4a(1-a) of the object's soft mask a inside a band
                around its boundary: a blurred edge has many half-object pixels, a crisp one few.
                Noise near the edge makes pixels in-between too, so noise can only lower it (a plain
                gradient-magnitude sharpness is gamed by noisy halos);
- `background`: minus the mean absolute deviation from the plain background colour, away (> 3 px)
                from the object.
Judges: `shape` (1 if the drawn mask matches the requested shape better than the other two shapes
of the same area and centroid) and `iou` (overlap of the drawn mask with the ideal rendering's).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

import toyworld as tw

RewardFn = Callable[[torch.Tensor, list[str]], torch.Tensor]
REWARDS: dict[str, RewardFn] = {}  # ready-to-call rewards
JUDGES: dict[str, RewardFn] = {}  # held-out judges: scored at eval, never trained on
LOADERS: dict[str, Callable[[torch.device], RewardFn]] = {}  # model-based rewards, loaded on use


def get(name: str, device: torch.device) -> RewardFn:
    """The reward or judge called `name`, loading its model first if it has one."""
    if name in REWARDS:
        return REWARDS[name]
    if name in JUDGES:
        return JUDGES[name]
    if name in LOADERS:
        return LOADERS[name](device)
    raise KeyError(f"unknown reward {name!r}; known: {', '.join([*REWARDS, *JUDGES, *LOADERS])}")


def reward(name: str, registry: dict[str, RewardFn] = REWARDS):
    def register(fn: RewardFn) -> RewardFn:
        registry[name] = fn
        return fn

    return register


class RewardError(RuntimeError):
    """A reward returned NaN/inf: the message names the reward and the prompt."""


def score(name: str, fn: RewardFn, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """fn(images, prompts) as float32 (B,), or a RewardError naming the reward and the prompt."""
    s = fn(images, prompts).float().reshape(-1)
    if s.shape[0] != len(prompts):
        raise RewardError(f"reward {name!r} returned {s.shape[0]} scores for {len(prompts)} images")
    bad = (~torch.isfinite(s)).nonzero().flatten()
    if len(bad):
        raise RewardError(
            f"reward {name!r} returned {s[bad[0]].item()} for prompt {prompts[bad[0]]!r} "
            f"({len(bad)} of {len(s)} images non-finite)"
        )
    return s


# ---------------------------------------------------------------------------------------------
# What every toy reward looks at: the object's soft mask
# ---------------------------------------------------------------------------------------------
def _rgb(images: torch.Tensor) -> torch.Tensor:
    return (images.float().clamp(-1, 1) + 1) / 2  # (B, 3, H, W) in [0, 1]


def object_colour(rgb: torch.Tensor) -> torch.Tensor:
    """Core colour (B, 3): pixels weighted by (distance from background)^4 — the object's
    interior dominates, anti-aliased edge pixels and faint noise hardly count."""
    bg = torch.tensor(tw.BACKGROUND, device=rgb.device)[:, None, None]
    dist = (rgb - bg).norm(dim=1)  # (B, H, W)
    w = (dist / (dist.amax((1, 2), keepdim=True) + 1e-6)) ** 4
    return (w[:, None] * rgb).sum((2, 3)) / (w.sum((1, 2))[:, None] + 1e-6)


def soft_mask(rgb: torch.Tensor) -> torch.Tensor:
    """a ∈ [0, 1] (B, H, W): where each pixel lies between background (0) and object colour (1)."""
    bg = torch.tensor(tw.BACKGROUND, device=rgb.device)
    direction = object_colour(rgb) - bg  # (B, 3)
    proj = torch.einsum("bchw,bc->bhw", rgb - bg[:, None, None], direction)
    return (proj / (direction.pow(2).sum(1)[:, None, None] + 1e-6)).clamp(0, 1)


def _targets(prompts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    words = tw.parse(prompts)
    centres = torch.tensor([tw.POSITIONS[p] for _, _, p in words], device=device)  # (B, 2) x, y
    colours = torch.tensor([tw.COLORS[c] for c, _, _ in words], device=device)  # (B, 3)
    return centres, colours


def centroid(a: torch.Tensor) -> torch.Tensor:
    """Mask-weighted centre (B, 2) as (x, y) in pixels."""
    H, W = a.shape[-2:]
    ys = torch.arange(H, device=a.device, dtype=a.dtype) + 0.5
    xs = torch.arange(W, device=a.device, dtype=a.dtype) + 0.5
    mass = a.sum((1, 2)) + 1e-6
    return torch.stack([(a.sum(1) * xs).sum(1) / mass, (a.sum(2) * ys).sum(1) / mass], 1)


def _blur(a: torch.Tensor, sigma: float) -> torch.Tensor:
    r = int(3 * sigma)
    k = torch.exp(-((torch.arange(-r, r + 1, device=a.device, dtype=a.dtype) / sigma) ** 2) / 2)
    k = k / k.sum()
    x = F.conv2d(F.pad(a[:, None], (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1))[:, 0]


# ---------------------------------------------------------------------------------------------
# The four toy rewards
# ---------------------------------------------------------------------------------------------
@reward("position")
def position(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    centres, _ = _targets(prompts, images.device)
    return -(centroid(soft_mask(_rgb(images))) - centres).norm(dim=1)


@reward("color")
def color(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    _, colours = _targets(prompts, images.device)
    return -(object_colour(_rgb(images)) - colours).norm(dim=1)


@reward("sharpness")
def sharpness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    a = soft_mask(_rgb(images))
    s = _blur((a > 0.5).to(a.dtype), 1.5)
    band = 4 * s * (1 - s)  # ≈ 1 within ~2 px of the hard mask's boundary, 0 far from it
    between = 4 * a * (1 - a)  # 1 for a half-object pixel, 0 for object or background
    # one pixel of "pure in-between" in the numerator: an image with no boundary scores ≈ -1
    return -((band * between).sum((1, 2)) + 1) / (band.sum((1, 2)) + 1)


@reward("background")
def background(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    rgb = _rgb(images)
    near = F.max_pool2d(soft_mask(rgb)[:, None], 7, stride=1, padding=3)[:, 0]  # dilate by 3 px
    far = 1 - near
    dev = (rgb - torch.tensor(tw.BACKGROUND, device=rgb.device)[:, None, None]).abs().mean(1)
    return -(far * dev).sum((1, 2)) / (far.sum((1, 2)) + 1e-6)


# ---------------------------------------------------------------------------------------------
# Held-out judges (never trained on)
# ---------------------------------------------------------------------------------------------
def hard_mask(images: torch.Tensor) -> torch.Tensor:
    return (soft_mask(_rgb(images)) > 0.5).float()  # (B, H, W)


def _iou(m1: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
    inter = (m1 * m2).sum((1, 2))
    return inter / ((m1 + m2 - m1 * m2).sum((1, 2)) + 1e-6)


@reward("shape", JUDGES)
def shape(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    mask = hard_mask(images).cpu()
    c = centroid(mask)
    scale = (mask.sum((1, 2)) / tw.AREA).clamp(min=1e-3).sqrt()
    fits = torch.stack(  # IoU with each candidate shape of the same area at the same centroid
        [_iou(mask, (tw.shape_sdf(s, c[:, 0], c[:, 1], scale) < 0).float()) for s in tw.SHAPES], 1
    )
    wanted = torch.tensor([tw.SHAPES.index(s) for _, s, _ in tw.parse(prompts)])
    drawn = fits.argmax(1).where(fits.amax(1) > 0, -1)  # an empty mask is no shape at all
    return (drawn == wanted).float().to(images.device)


@reward("iou", JUDGES)
def iou(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    ideal = hard_mask(tw.render(prompts).to(images.device))
    return _iou(hard_mask(images), ideal)
