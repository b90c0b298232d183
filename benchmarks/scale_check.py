"""SD3.5-Medium at its real size with random weights: the real loop's memory and time, and a FLOP
cost model beside them (issue #22). One command, one report file.

    python benchmarks/scale_check.py --out scale_check_out             # one CUDA GPU
    python benchmarks/scale_check.py --shrink 16 --out /tmp/scale      # CPU: widths ÷ 16, < 1 min
    python benchmarks/scale_check.py --cost-model                      # the FLOP model alone

What it does
------------
1. Builds, with random weights and directly on the device, every model a `--rewards paper1` run of
   SD3.5-Medium loads, at the sizes of benchmarks/configs/*.json (each value's source is written
   there): the MMDiT transformer, VAE, CLIP-L, CLIP-G and T5-XXL (bf16 on CUDA, as sd3world.py
   loads them; fp32 on CPU), and the reward backbones in fp32, as rewards.py loads them: a CLIP
   ViT-H/14 for PickScore, another for HPS v2.1, one CLIP ViT-L/14 shared by CLIPScore and the
   aesthetic score, and LAION's aesthetic MLP. Tokenizers are small generated ones with the real
   sequence lengths (77 CLIP tokens, 256 T5 tokens; prompts long enough to fill CLIP's 77).
   Everything is saved into a temporary folder in the layout the real loaders read
   (StableDiffusion3Pipeline.save_pretrained, CLIPModel + CLIPProcessor folders, a .safetensors
   head), so the run loads it through the real code. Nothing is downloaded.
   HPS v2.1 is the one stand-in: its loader needs the `hpsv2` package (its own open_clip), which is
   not installed here nor on the GPU machine. Its random ViT-H/14 is a transformers CLIPModel of
   open_clip ViT-H-14's shape behind open_clip's call signature, scored by rewards.hpsv2_scorer,
   the same code as the real reward (uint8 rounding, PIL preprocessing on the CPU, 77 tokens).
2. Runs the real loop, recast.main() in this process (no copy of it), with the one-GPU command of
   docs/sd35.md: 512 px, T = 10, --batch-size 16, --kl-coef 1e-4, 2 epochs, with 8 prompts × 8
   images instead of the command's 32 to fit the device time, scoring the command's fraction of
   them (SD3's default of 4 groups of 32: --gain-frac 0.125, one group of 8; bf16), so that every
   phase's share of the epoch is the command's,
   - once with --weighting recast, once with --weighting uniform (which scores no step
     prediction: DiffusionNFT's work only), so their ratio is ReCAST's cost. The second epoch is
     reported (the first carries warm-up);
   - then one epoch at 1024 px with --grad-checkpointing (and fewer prompts if the time budget,
     judged from the 512 px epochs and the cost model, would not hold 8).
   Instrumentation is the loop's own hook, recast.main(argv, observe=Probe): entered around each
   phase (phase times; on CUDA recast.py itself logs mem/<phase>, peak allocated GiB, reset per
   phase; on CPU the peak resident memory of the process per phase is taken instead, from
   /proc/self/status after /proc/self/clear_refs), around step scoring and gains + Sinkhorn
   within time/recast, around the fused loss's forward and each micro-batch's backward (CUDA
   events on CUDA, perf_counter on CPU), and around each epoch's save (wall time per epoch).
3. Measures the peak memory of recast_kernels.nft_loss (fused) against reference_nft_loss at
   the real micro-batch (--batch-size pairs of fp32 latents, forward + backward): on CUDA with
   max_memory_allocated; on CPU from torch.profiler's memory timeline (where nft_loss, outside
   the Triton interpreter, is reference_nft_loss itself).
4. The cost model: FLOPs of every component, counted by torch.utils.flop_counter on models built
   from the same configurations on the meta device (matmuls, convolutions, attention; element-
   wise work is not counted), summed per phase; modelled seconds at each precision's matmul
   throughput measured on this machine (bf16 for the transformer and text encoders under
   autocast, TF32 for the fp32 VAE's convolutions, fp32 for the reward models), and measured ÷
   modelled per phase. `--cost-model` prints it alone (no device, no models built), with
   ReCAST's modelled share for several --gain-frac / --gain-every (and, with paper2's rewards,
   --score-size), the trade-off table that sets each share beside the gains' noise the toy world
   measured (read from docs/scoring/: the scoring study's and studies/score_size.py's output),
   and --shard's communication
   on one node of 8 GPUs (NVLink) and on 4 nodes of 8 (InfiniBand between them: HSDP's mesh
   against a flat one).
Writes OUT/scale_check.md: the report in markdown, and every figure again in a ```json block at
its end, rewritten after every stage (a check stopped from outside leaves a partial report that
says so). Run folders and models live in a temporary folder, removed at the end. On the GPU the
check aims to end within --budget seconds (default DEFAULT_BUDGET_S) by giving the 1024 px run
fewer prompts; a 512 px run that runs out of memory is repeated with --grad-checkpointing.

--shrink F runs the same on the CPU, in seconds: every width ÷ F (attention heads ÷ 2 or 4 and head
widths ÷ the rest, so that the attention maps shrink too), and, to end within a minute on a 2-core
machine, every depth ÷ SHRINK_DEPTH; sequence lengths (77 and 256 tokens), vocabularies, the 224 px
reward input and the structure are kept; the runs use SHRUNK_RUN's sizes (32 and 64 px, T = 4,
2 prompts × 2) and keep their full-size names.
"""

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere
from benchmarks.modelzoo import (  # noqa: E402
    SHRINK_DEPTH,
    SHRINKS,
    OpenClipLike,
    aesthetic_head,
    clip_config,
    clip_text_config,
    clip_tokenizer,
    family_models,
    load_configs,
    n_params,
    prompts,
    reward_image_processor,
    sd35m_models,
    t5_config,
    t5_tokenizer,
)
from plumbing import cli  # noqa: E402 (after the path)

LAMBDA = "0.4,0.2,0.2,0.2"
# docs/sd35.md's one-GPU command (its --epochs 100 becomes 2; --eval-every 10 keeps eval to the
# base model and the last epoch; 8 of its DOCS_PROMPTS prompts, scoring its fraction of them);
# every other flag is recast.py's default (DEFAULTED, SD3's scoring defaults for DOCS_PROMPTS),
# and the cost model of a run reads the values the run itself wrote to its args.json
DOCS_PROMPTS = 32
FULL_RUN = dict(resolution=512, steps=10, prompts=8, group_size=8, batch_size=16, eval_prompts=4,
                eval_seeds=2, kl_coef=1e-4)  # fmt: skip
# --shrink: the same loop on sizes a 2-core CPU runs in seconds
SHRUNK_RUN = dict(resolution=32, steps=4, prompts=2, group_size=2, batch_size=4, eval_prompts=1,
                  eval_seeds=1, kl_coef=1e-4)  # fmt: skip
DEFAULTED = ("train_frac", "gain_frac", "gain_every", "score_precision")  # the cost model's
DEFAULT_BUDGET_S = 420  # the whole check on the GPU, building included; the 1024 px run adapts
# Peak dense matmul throughput (TFLOP/s) by precision, from the vendors' data sheets (SXM parts);
# the H200 has the H100's compute. Used only for the extrapolation, never for a measured figure.
SPEC_TFLOPS = {
    "H100/H200 SXM": {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100 SXM": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
ANCHOR = "DiffusionNFT's SD3.5 run as reported by a user: 1152 images per step in ≈ 173 s on 8×A100"
ANCHOR_RATE = 1152 / 173 / 8  # images per GPU-second
PHASES = ("rollout", "score", "recast", "update", "eval")


def fail(flag: str, message: str) -> NoReturn:
    cli.fail(flag, message, "scale_check.py")


def parse(argv=None) -> argparse.Namespace:
    ap = cli.Parser(prog="scale_check.py", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", help="folder for scale_check.md, or reward_timing.md with "
                    "--reward-timing (created; may exist; --cost-model needs none)")  # fmt: skip
    ap.add_argument("--shrink", type=int, default=0,
                    help=f"divide every width by this ({', '.join(map(str, SHRINKS))}) and run on "
                    "the CPU; leave out for the real sizes (needs a CUDA GPU)")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per epoch (default: 8, a quarter of the docs' command; "
                    "--shrink: 2)")  # fmt: skip
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole check (default {DEFAULT_BUDGET_S} on the GPU, 600 "
                    "with --shrink on the CPU): "
                    "the 1024 px run gets fewer prompts, or is skipped, to end within "
                    "it")  # fmt: skip
    ap.add_argument("--cost-model", action="store_true",
                    help="print the FLOP cost model of the full-size configurations and ReCAST's "
                    "modelled share of an epoch, then exit (no device, nothing built)")  # fmt: skip
    ap.add_argument("--reward-timing", action="store_true",
                    help="time one scored image of each paper2 reward and judge that is not a "
                    "CLIP (ocr, vqa, imagereward, hpsv3) at its real size with random weights, "
                    "at 512 and 1024 px, and write OUT/reward_timing.md (needs a CUDA "
                    "GPU)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.shrink and args.shrink not in SHRINKS:
        fail("--shrink", f"must be one of {', '.join(map(str, SHRINKS))} (every width is divided "
             f"by it; leave it out for the real sizes), got {args.shrink}")  # fmt: skip
    if args.prompts is not None and args.prompts < 1:  # 0 ran the command's own, said nothing
        fail("--prompts", f"must be ≥ 1 (leave it out for the command's own), got {args.prompts}")
    if args.budget is not None and not (0 < args.budget < math.inf):  # 0: the default, unsaid
        fail("--budget", f"must be > 0 seconds (leave it out for the default), got {args.budget}")
    if args.cost_model:  # the model of the full sizes alone: a flag for a run would go unread
        unread = [f for f, v in (("--out", args.out), ("--shrink", args.shrink),
                                 ("--prompts", args.prompts), ("--budget", args.budget),
                                 ("--reward-timing", args.reward_timing)) if v]  # fmt: skip
        if unread:
            fail("--cost-model", f"prints the cost model alone and reads no {', '.join(unread)}: "
                 "drop them, or run the check without --cost-model")  # fmt: skip
        return args
    if not args.out:
        fail("--out", "give the folder for the report, e.g. --out scale_check_out")
    problem = unwritable(args.out)
    if problem:
        fail("--out", problem)
    return args


def unwritable(path: str) -> str:
    """Why a report could not be written under folder `path` ('' when it can), without writing."""
    p = Path(path).absolute()
    if p.exists():
        if not p.is_dir():
            return f"{path} exists and is not a folder"
        return "" if os.access(p, os.W_OK | os.X_OK) else f"{path} is not writable"
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder, so {path} cannot be made"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be made: {parent} is not writable"
    return ""


# ---------------------------------------------------------------------------------------------
# Models: built with random weights on the device, saved where the real loaders read them
# ---------------------------------------------------------------------------------------------
def build_and_save(c: dict, root: Path, device, dtype) -> dict:
    """The SD3.5 pipeline folder and the reward-model folders under `root`; returns their paths
    and parameter counts."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from safetensors.torch import save_file
    from transformers import CLIPModel, CLIPProcessor, CLIPTextModelWithProjection, T5EncoderModel

    torch.manual_seed(0)
    counts, paths = {}, {}
    tok = clip_tokenizer(root / "clip_tokenizer")

    def made(name, model, cast=dtype):
        counts[name] = n_params(model)
        return model.to(device=device, dtype=cast).eval()

    with torch.device(device):
        transformer = made("transformer", SD3Transformer2DModel(**c["sd35m_transformer"]))
        vae = made("vae", AutoencoderKL(**c["sd35m_vae"]))
        clip_l = made("clip_l", CLIPTextModelWithProjection(clip_text_config(c["clip_l_text"])))
        clip_g = made("clip_g", CLIPTextModelWithProjection(clip_text_config(c["clip_g_text"])))
        t5 = made("t5xxl", T5EncoderModel(t5_config(c["t5xxl_encoder"])))
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**c["sd35m_scheduler"]),
        text_encoder=clip_l, tokenizer=tok, text_encoder_2=clip_g, tokenizer_2=tok,
        text_encoder_3=t5, tokenizer_3=t5_tokenizer(root / "t5_tokenizer"),
    )  # fmt: skip
    paths["pipe"] = root / "pipe"
    pipe.save_pretrained(paths["pipe"])
    del pipe, transformer, vae, clip_l, clip_g, t5
    free_device_memory()

    images = reward_image_processor(c["reward_image_size"])
    for name, key in (("clip_h", "clip_vit_h14"), ("hpsv2_clip", "clip_vit_h14"),
                      ("clip_l14", "clip_vit_l14")):  # fmt: skip
        with torch.device(device):
            model = made(name, CLIPModel(clip_config(c[key])), torch.float32)
        paths[name] = root / name
        model.save_pretrained(paths[name])
        CLIPProcessor(image_processor=images, tokenizer=tok).save_pretrained(paths[name])
        del model
        free_device_memory()
    head = aesthetic_head(c["aesthetic_head"], real=True)
    paths["aesthetic_head"] = root / "aesthetic_head.safetensors"
    save_file(head, paths["aesthetic_head"])
    counts["aesthetic_head"] = sum(v.numel() for v in head.values())
    return {"paths": {k: str(v) for k, v in paths.items()}, "params": counts}


def free_device_memory() -> None:
    """Drop what is no longer referenced from the GPU (on the CPU there is nothing to hand back)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip.constants.OPENAI_DATASET_MEAN
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)  # open_clip.constants.OPENAI_DATASET_STD


def openclip_preprocess(size: int):
    """A timing stand-in for hpsv2's image preprocessing (its open_clip fork's image_transform,
    resize_longest_max): the longest side resized to `size` (bicubic), padded with black to a
    centred square, to [0, 1], normalised with OpenAI's mean and std; resized as a PIL image,
    where hpsv2 resizes the tensor (the real reward uses hpsv2's own)."""
    import numpy as np
    import torch
    from PIL import Image

    mean = torch.tensor(OPENAI_MEAN)[:, None, None]
    std = torch.tensor(OPENAI_STD)[:, None, None]

    def preprocess(im):
        w, h = im.size
        scale = size / max(w, h)
        w, h = round(w * scale), round(h * scale)
        square = Image.new("RGB", (size, size))
        square.paste(
            im.convert("RGB").resize((w, h), Image.BICUBIC), ((size - w) // 2, (size - h) // 2)
        )
        x = torch.from_numpy(np.asarray(square).copy()).permute(2, 0, 1).float() / 255
        return (x - mean) / std

    return preprocess


def hpsv2_stand_in(folder: str, size: int):
    """A loader for reward 'hpsv2' (registered in rewards.LOADERS for the check): a random CLIP
    ViT-H/14 behind open_clip's model(image, text) → {"image_features", "text_features"}, scored
    by rewards.hpsv2_scorer (the real reward's own scoring code). Loaded once per device."""
    import torch
    from transformers import CLIPModel, CLIPTokenizer

    import rewards

    loaded = {}

    def load(device):
        if str(device) not in loaded:
            clip = CLIPModel.from_pretrained(folder, dtype=torch.float32)
            clip = clip.to(device).eval().requires_grad_(False)  # hpsv2: precision="fp32"
            tok = CLIPTokenizer.from_pretrained(folder)

            def tokenize(texts):  # open_clip's tokenizer: always the full 77-token context
                return tok(texts, padding="max_length", max_length=77, truncation=True,
                           return_tensors="pt").input_ids  # fmt: skip

            model = OpenClipLike(clip).eval()
            loaded[str(device)] = rewards.hpsv2_scorer(model, openclip_preprocess(size), tokenize,
                                                       device)  # fmt: skip
        return loaded[str(device)]

    return load


# ---------------------------------------------------------------------------------------------
# Cost model: FLOPs of each component, counted on meta-device models built from the configs
# ---------------------------------------------------------------------------------------------
def count_flops(fn) -> float:
    """The FLOPs torch's FlopCounterMode counts in fn()."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        fn()
    return float(fc.get_total_flops())


def component_flops(c: dict, resolutions) -> dict:
    """{component: FLOPs per image (per prompt for the text encoders)}; the transformer and VAE
    at each resolution. The transformer's backward has its weights frozen (only input gradients,
    as for the LoRA-wrapped base model; the adapters' own FLOPs, < 1 %, are left out)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    meta = torch.device("meta")
    out = {}
    with meta:
        m = sd35m_models(c)
    tr, vae, t5 = m["transformer"].requires_grad_(False), m["vae"], m["t5xxl_encoder"]
    texts = {k: m[k] for k in ("clip_l_text", "clip_g_text")}
    clips = {"clip_h": m["clip_vit_h14"], "clip_l14": m["clip_vit_l14"]}
    tr_cfg, vae_cfg = c["sd35m_transformer"], c["sd35m_vae"]
    down = 2 ** (len(vae_cfg["block_out_channels"]) - 1)
    ctx = 77 + c["t5_tokens"]
    with torch.no_grad():
        ids = torch.zeros(1, 77, dtype=torch.long, device=meta)
        for name, model in texts.items():
            out[name] = count_flops(lambda m=model: m(input_ids=ids, output_hidden_states=True))
        t5_ids = torch.zeros(1, c["t5_tokens"], dtype=torch.long, device=meta)
        out["t5xxl"] = count_flops(lambda: t5(input_ids=t5_ids))
        size = c["reward_image_size"]
        pixels = torch.zeros(1, 3, size, size, device=meta)
        for name, m in clips.items():
            out[f"{name}_image"] = count_flops(lambda m=m: m.visual_projection(
                m.vision_model(pixel_values=pixels).pooler_output))  # fmt: skip
            out[f"{name}_text"] = count_flops(lambda m=m: m.text_projection(
                m.text_model(input_ids=ids).pooler_output))  # fmt: skip
        w = c["aesthetic_head"]
        out["aesthetic_head"] = float(sum(2 * a * b for a, b in zip(w, w[1:], strict=False)))
    embeds = torch.zeros(1, ctx, tr_cfg["joint_attention_dim"], device=meta)
    pooled = torch.zeros(1, tr_cfg["pooled_projection_dim"], device=meta)
    t = torch.ones(1, device=meta)
    for res in resolutions:
        side = res // down
        x = torch.zeros(1, tr_cfg["in_channels"], side, side, device=meta, requires_grad=True)
        with FlopCounterMode(display=False) as fc:
            v = tr(hidden_states=x, encoder_hidden_states=embeds, pooled_projections=pooled,
                   timestep=t, return_dict=False)[0]  # fmt: skip
        out[f"transformer_fwd@{res}"] = float(fc.get_total_flops())
        out[f"transformer_bwd@{res}"] = count_flops(lambda v=v: v.sum().backward())
        z = torch.zeros(1, vae_cfg["latent_channels"], side, side, device=meta)
        with torch.no_grad():
            out[f"vae_decode@{res}"] = count_flops(lambda z=z: vae.decode(z, return_dict=False))
    return out


def reward_flops(cf: dict) -> dict:
    """FLOPs per image of each paper1 reward: two ViT-H/14 (image + 77-token text), CLIPScore's
    ViT-L/14 (image + text), the aesthetic score (ViT-L/14 image + MLP)."""
    h = cf["clip_h_image"] + cf["clip_h_text"]
    return {"pickscore": h, "hpsv2": h, "clipscore": cf["clip_l14_image"] + cf["clip_l14_text"],
            "aesthetic": cf["clip_l14_image"] + cf["aesthetic_head"]}  # fmt: skip


def model_reward_flops(spec: dict, resolution: int) -> float:
    """FLOPs per scored image of a reward configuration (modelzoo.reward_config) on an image of
    `resolution` px, counted on its meta-device models as rewards.py runs them: "ocr" the
    detector on the whole image (padded to 32 px) and the recogniser on boxes_per_image line
    boxes; "blip" ImageReward's ViT on 224 px and its text encoder on 35 tokens attending to it,
    and the head; "vlm" the vision tower on the patches its image processor makes and the
    language model on those merged tokens and text_tokens more (vqa: the answer's logits only;
    HPSv3: the reward head on one hidden state); "clip" image and 77-token text towers."""
    import torch

    from benchmarks import modelzoo

    kind, c = spec["kind"], spec["config"]
    with torch.device("meta"):
        m = modelzoo.reward_models(spec)
    head = sum(2 * i * o for i, o in zip(c.get("head", []), c.get("head", [])[1:], strict=False))
    meta = torch.device("meta")
    with torch.no_grad():
        if kind == "ocr":
            side = -(-resolution // 32) * 32
            x = torch.zeros(1, 3, side, side, device=meta)
            line = torch.zeros(c["boxes_per_image"], 1, c["line_height"], c["box_width"],
                               device=meta)  # fmt: skip
            return count_flops(lambda: m["detector"](x)) + count_flops(
                lambda: m["recogniser"](line)
            )
        if kind == "blip":
            v = c["vision_config"]
            pixels = torch.zeros(1, 3, v["image_size"], v["image_size"], device=meta)
            seen = m["vision"](pixel_values=pixels).last_hidden_state
            ids = torch.zeros(1, c["text_tokens"], dtype=torch.long, device=meta)
            return (
                count_flops(lambda: m["vision"](pixel_values=pixels))
                + count_flops(lambda: m["text"](input_ids=ids, encoder_hidden_states=seen))
                + head
            )
        if kind == "vlm":
            from benchmarks import memtrace

            with memtrace.GpuForm("cuda"):  # the inputs' values, as the planner keeps them
                inputs = modelzoo.vlm_inputs(c, 1, resolution, resolution, meta)
                if c.get("output", "logits") == "logits":
                    fn = lambda: m["model"](**inputs, use_cache=False, logits_to_keep=2)  # noqa: E731
                else:
                    fn = lambda: m["model"].model(**inputs, use_cache=False)  # noqa: E731
                return count_flops(fn) + head
        pixels = torch.zeros(1, 3, 224, 224, device=meta)
        ids = torch.zeros(1, 77, dtype=torch.long, device=meta)
        return count_flops(lambda: m["model"](input_ids=ids, pixel_values=pixels))


PAPER2 = ("pickscore", "ocr", "vqa", "aesthetic")  # --rewards paper2 (rewards.PRESETS)
PAPER2_JUDGES = ("imagereward", "hpsv3", "clipscore")


def paper2_flops(cf: dict, resolutions) -> dict:
    """{resolution: {reward or judge: FLOPs per scored image}} of paper2's rewards and judges:
    the CLIPs from component_flops (`cf`), the others from their configurations
    (model_reward_flops)."""
    from benchmarks import modelzoo

    clip = reward_flops(cf)
    out = {}
    for res in resolutions:
        out[res] = {"clipscore": clip["clipscore"]}
        for name in (*PAPER2, *PAPER2_JUDGES):
            if name in clip:
                out[res][name] = clip[name]
            elif name in modelzoo.REWARD_CONFIGS:
                path = modelzoo.CONFIGS / f"{modelzoo.REWARD_CONFIGS[name]}.json"
                out[res][name] = model_reward_flops(modelzoo.reward_config(path), res)
    return out


def by_precision(flops: dict, names) -> dict:
    """{"fp32", "bf16": FLOPs per image} of rewards `names`: a VLM's in bf16 (rewards.VLM on a
    GPU), the others in fp32."""
    from benchmarks import modelzoo

    vlm = {n for n, f in modelzoo.REWARD_CONFIGS.items() if f.startswith(("vqa_", "hpsv3_"))}
    return {"fp32": sum(flops[n] for n in names if n not in vlm),
            "bf16": sum(flops[n] for n in names if n in vlm)}  # fmt: skip


def phase_flops(cf: dict, r: dict, epoch: int = 2, amortised: bool = False) -> dict:
    """{phase: {precision: FLOPs}} of one epoch of run `r` (resolution, steps, prompts,
    group_size, train_frac, kl_coef, gain_frac, gain_every, score_precision, grad_checkpointing,
    eval_images, eval: whether this epoch evaluates; optionally reward_flops, the rewards' FLOPs
    per image by precision, and step_reward_flops, theirs at --score-size). `amortised` spreads
    step scoring over --gain-every epochs instead of charging the epochs that score."""
    res, T, P, G = r["resolution"], r["steps"], r["prompts"], r["group_size"]
    n, fwd, bwd = P * G, cf[f"transformer_fwd@{res}"], cf[f"transformer_bwd@{res}"]
    # the rewards' FLOPs per image by precision: paper1's CLIPs in fp32, or r["reward_flops"]
    # (paper2_reward_flops: its VLM's in bf16, as rewards.VLM loads it on a GPU)
    per = r.get("reward_flops") or {"fp32": sum(reward_flops(cf).values())}
    # --score-size: the step predictions' rewards at the reduced size (r["step_reward_flops"],
    # paper2_flops at that size; the decode stays full size, the resize is elementwise)
    step = r.get("step_reward_flops") or per
    vae, rew = cf[f"vae_decode@{res}"], sum(step.values())
    text = cf["text"] if "text" in cf else cf["clip_l_text"] + cf["clip_g_text"] + cf["t5xxl"]
    from plumbing import cli

    scored_groups = cli.scored_groups(r["gain_frac"], P)
    if amortised:
        share = 1 / r["gain_every"]
    else:
        share = 1.0 if (epoch - 1) % r["gain_every"] == 0 else 0.0
    scored = scored_groups * G * share * (r.get("weighting", "recast") in ("recast", "reversed"))
    pairs = max(1, round(r["train_frac"] * n * T))
    per_pair = fwd + bwd + fwd * (1 + bool(r["grad_checkpointing"]) + (r["kl_coef"] > 0))
    E = r["eval_images"] if r.get("eval", False) else 0

    def rewards_at(k: float, flops: dict = per) -> dict:  # k images through every reward
        return {p: k * v for p, v in flops.items() if v}  # by precision

    steps = scored * (T - 1)
    return {
        "rollout": {"bf16": n * T * fwd + P * text},
        "score": {"tf32": n * vae, **rewards_at(n)},
        "recast": (
            {"bf16": steps * (vae + rew)}
            if r.get("score_precision", "fp32") == "bf16"
            else {"tf32": steps * vae, **rewards_at(steps, step)}
        ),
        "update": {"bf16": pairs * per_pair + P * text},
        "eval": {
            "tf32": E * vae,
            **rewards_at(E),
            "bf16": E * (T * fwd + text) + E * per.get("bf16", 0.0),
        },  # fmt: skip
    }


def modelled_seconds(flops: dict, rates: dict) -> dict:
    """{phase: seconds} at `rates` (FLOP/s per precision; a missing precision falls back to
    fp32, as on the CPU where everything is fp32)."""
    return {
        ph: sum(v / rates.get(p, rates["fp32"]) for p, v in f.items()) for ph, f in flops.items()
    }


def total(flops: dict) -> dict:
    return {ph: sum(f.values()) for ph, f in flops.items()}


def measure_rates(device) -> dict:
    """Matmul throughput (FLOP/s) on this device: bf16, TF32 and fp32 on CUDA (best of 5 after a
    warm-up), fp32 on the CPU."""
    import torch

    def best(fn, flops, reps=5):
        fn()
        times = []
        for _ in range(reps):
            sync(device)
            tic = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - tic)
        return flops / min(times)

    if device.type != "cuda":
        cpu = torch.randn(512, 512)
        return {"fp32": best(lambda: cpu @ cpu, 2 * 512**3)}
    n = 8192
    half = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    full = half.float()
    rates = {"bf16": best(lambda h=half: h @ h, 2 * n**3)}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        rates["tf32"] = best(lambda f=full: f @ f, 2 * n**3)
        torch.backends.cuda.matmul.allow_tf32 = False
        rates["fp32"] = best(lambda f=full: f @ f, 2 * n**3, reps=3)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    del half, full
    free_device_memory()
    return rates


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Instrumentation of the real loop (recast.py's functions wrapped from outside)
# ---------------------------------------------------------------------------------------------
def peak_rss_reset() -> bool:
    """Reset the process's peak resident memory (Linux: /proc/self/clear_refs, 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_gib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 2**30
    except OSError:
        pass
    return None


class Clock:
    """Marks on the device's timeline: CUDA events on CUDA, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def mark(self):
        import torch

        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1000 if self.cuda else b - a


class Probe:
    """recast.main's hook (its `observe`): entered around each phase and step of the loop by
    name, it times them and keeps the peak RSS of each phase (CPU)."""

    PHASES = ("rollout", "score", "recast", "update", "eval")

    def __init__(self, device):
        self.device, self.clock = device, Clock(device)
        self.epoch = 1
        self.phase = "set-up"
        self.epoch_start, self.epoch_end, self.rss = {}, {}, {}
        self.nft = {}  # epoch → {"fwd": [(a, b)], "bwd": [(a, b)]}
        self.seconds = {"steps": {}, "weights": {}}  # epoch → seconds

    @contextlib.contextmanager
    def __call__(self, name: str):
        if name in self.PHASES:
            self.phase = name
            if name == "rollout":
                self.epoch_start[self.epoch] = time.perf_counter()
            cpu = self.device.type != "cuda"
            if cpu:
                peak_rss_reset()
            yield
            if cpu:
                self.rss.setdefault(self.epoch, {})[name] = peak_rss_gib()
        elif name in self.seconds:  # step scoring; gains and W
            sync(self.device)
            tic = time.perf_counter()
            yield
            sync(self.device)
            into = self.seconds[name]
            into[self.epoch] = into.get(self.epoch, 0.0) + time.perf_counter() - tic
        elif name in ("loss", "backward"):  # the fused loss's forward; a micro-batch's backward
            rec = self.nft.setdefault(self.epoch, {"fwd": [], "bwd": []})
            start = self.clock.mark()
            yield
            rec["fwd" if name == "loss" else "bwd"].append((start, self.clock.mark()))
        elif name == "save":
            yield
            self.epoch_end[self.epoch] = time.perf_counter()
            self.epoch += 1
        else:
            yield

    def summary(self) -> dict:
        """Per epoch: wall seconds, nft_loss forward/backward seconds, step-scoring and gains+W
        seconds, peak RSS per phase (CPU)."""
        sync(self.device)
        out = {}
        for e, end in self.epoch_end.items():
            rec = self.nft.get(e, {"fwd": [], "bwd": []})
            out[e] = {
                "wall_s": end - self.epoch_start.get(e, end),
                "nft_fwd_s": sum(self.clock.seconds(a, b) for a, b in rec["fwd"]),
                "backward_s": sum(self.clock.seconds(a, b) for a, b in rec["bwd"]),
                "nft_calls": len(rec["fwd"]),
                "step_scoring_s": self.seconds["steps"].get(e, 0.0),
                "gains_and_W_s": self.seconds["weights"].get(e, 0.0),
                "rss": self.rss.get(e, {}),
            }
        return out


def run_loop(name: str, argv: list[str], device) -> dict:
    """recast.main(argv) in this process under a Probe; what it measured, or why it failed."""
    import torch

    import recast

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    status, tic = "ok", time.perf_counter()
    probe = Probe(device)
    try:
        recast.main(argv, observe=probe)  # the probe is the loop's hook: nothing is patched
    except torch.OutOfMemoryError as e:
        status = f"out of memory in phase {probe.phase}: {str(e).splitlines()[0]}"
    except SystemExit as e:
        status = f"exited with code {e.code} in phase {probe.phase}"
    except Exception as e:  # noqa: BLE001 (reported, and the next run still made)
        status = f"{type(e).__name__} in phase {probe.phase}: {e}"
    for sig, handler in handlers.items():  # recast.py's own (finish the epoch) are its run's
        signal.signal(sig, handler)
    seconds = time.perf_counter() - tic
    free_device_memory()
    out = Path(argv[argv.index("--out") + 1])
    metrics, used = [], {}
    if (out / "metrics.jsonl").is_file():
        from plumbing.checkpoints import (
            read_metrics,  # a torn last line (a crash mid-append) skipped
        )

        metrics = read_metrics(str(out))
    if (out / "args.json").is_file():
        used = json.loads((out / "args.json").read_text())
    return {"name": name, "status": status, "seconds": seconds, "metrics": metrics,
            "args": used, "probe": probe.summary()}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Peak memory of the fused loss against the eager reference, at the real micro-batch
# ---------------------------------------------------------------------------------------------
def loss_memory(device, batch: int, latent: tuple, K: int, T: int) -> dict:
    """Peak bytes above the inputs of one forward + backward (v_theta's gradient included) of
    nft_loss and of reference_nft_loss, on `batch` fp32 rows of shape `latent` (the dtype
    recast.py passes: world.v returns fp32), with v_ref (κ > 0)."""
    import torch

    from recast_kernels.nft_loss import nft_loss, reference_nft_loss

    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(batch, *latent, generator=gen) for _ in range(5)]
    t = torch.rand(batch, generator=gen).clamp_min(0.05)
    t_index = torch.randint(0, T, (batch,), generator=gen)
    r = torch.rand(batch, K, generator=gen)
    W = torch.softmax(torch.randn(K, T, generator=gen), 0) / T
    v_theta, v_old, x0, eps, v_ref = (x.to(device) for x in rows)
    rest = [x.to(device) for x in (t, t_index, r, W)]

    def step(fn, v):
        fn(v, v_old, x0, eps, *rest, 0.1, 5.0, v_ref, 1e-4).backward()

    out = {}
    for name, fn in (("fused", nft_loss), ("reference", reference_nft_loss)):
        step(fn, v_theta.clone().requires_grad_(True))  # warm-up (compiles the kernels on CUDA)
        v = v_theta.clone().requires_grad_(True)
        if device.type == "cuda":
            free_device_memory()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step(fn, v)
            torch.cuda.synchronize(device)
            out[name] = torch.cuda.max_memory_allocated(device) - base
        else:
            out[name] = cpu_peak_bytes(lambda fn=fn, v=v: step(fn, v))
    out["fused_is_reference_here"] = device.type != "cuda"
    out["rows"], out["row_elements"] = batch, math.prod(latent)
    return out


def cpu_peak_bytes(fn) -> int | None:
    """Peak bytes allocated during fn() beyond what was live when it started, from torch.profiler's
    memory timeline (CPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        from torch.profiler._memory_profiler import MemoryProfileTimeline
    except ImportError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                     with_stack=True) as prof:  # fmt: skip
            fn()
        _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(
            torch.device("cpu"))  # fmt: skip
    totals = [sum(s) for s in sizes]
    return int(max(totals) - totals[0]) if totals else None


# ---------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------
def run_flags(paths: dict, files: dict, r: dict, device, out: Path) -> list[str]:
    """recast.py's command line for run settings `r`."""
    flags = [
        "--model", paths["pipe"], "--rewards", "paper1", "--lambda", LAMBDA,
        "--prompts-file", files["train"], "--eval-prompts-file", files["eval"],
        "--resolution", str(r["resolution"]), "--steps", str(r["steps"]),
        "--prompts", str(r["prompts"]), "--group-size", str(r["group_size"]),
        "--batch-size", str(r["batch_size"]), "--kl-coef", str(r["kl_coef"]),
        "--epochs", str(r["epochs"]), "--eval-every", "10", "--eval-seeds", str(r["eval_seeds"]),
        "--weighting", r["weighting"], "--device", device.type, "--out", str(out),
    ]  # fmt: skip
    if r["weighting"] == "recast":  # the docs' command's scored fraction, not this run's default
        flags += ["--gain-frac", str(r["gain_frac"]), "--score-precision", r["score_precision"]]
    if r["grad_checkpointing"]:
        flags.append("--grad-checkpointing")
    return flags


def measure(run: dict, r: dict, cf: dict, rates: dict) -> dict:
    """The figures of run `run`'s last epoch (its settings `r`), beside the cost model's."""
    epoch = r["epochs"]
    m = next((x for x in run["metrics"] if x.get("epoch") == epoch), None)
    probe = run["probe"].get(epoch)
    if m is None or probe is None or "time/update" not in m:
        return {"status": run["status"], "epoch": epoch, "complete": False}
    times = {ph: m[f"time/{ph}"] for ph in PHASES if f"time/{ph}" in m}
    mem = {ph: m[f"mem/{ph}"] for ph in PHASES if f"mem/{ph}" in m}
    mem_kind = "peak allocated GiB (max_memory_allocated, reset at each phase)"
    if not mem:
        mem = {ph: v for ph, v in probe["rss"].items() if v is not None}
        mem_kind = "peak resident GiB of the whole process (VmHWM, reset at each phase; CPU)"
    epoch_s = probe["wall_s"] - times.get("eval", 0.0)  # the epoch, without its eval
    n = r["prompts"] * r["group_size"]
    model = phase_flops(cf, {**r, "eval": "eval" in times}, epoch)
    modelled = modelled_seconds(model, rates)
    out = {
        "status": run["status"], "epoch": epoch, "complete": True, "time_s": times,
        "mem_gib": mem, "mem_kind": mem_kind, "epoch_wall_s": probe["wall_s"], "epoch_s": epoch_s,
        "sum_time_s": sum(times.values()), "images": n, "images_per_gpu_s": n / epoch_s,
        "recast_share": times["recast"] / epoch_s,
        "recast_step_scoring_s": probe["step_scoring_s"],
        "recast_gains_W_s": probe["gains_and_W_s"],
        "nft_loss": {"fwd_s": probe["nft_fwd_s"], "calls": probe["nft_calls"],
                     "share_of_update": probe["nft_fwd_s"] / times["update"]},
        "update_backward_s": probe["backward_s"],
        "modelled_tflop": {ph: v / 1e12 for ph, v in total(model).items()},
        "modelled_s": modelled,
        "measured_over_modelled": {ph: times[ph] / modelled[ph] for ph in times
                                   if modelled.get(ph, 0) > 0},
    }  # fmt: skip
    if mem and "mem/rollout" in m:  # on a GPU: measured ÷ the data sheet's peak (H100/H200)
        at_peak = modelled_seconds(model, peak_rates("H100/H200 SXM"))
        out["measured_over_peak"] = {ph: times[ph] / at_peak[ph] for ph in times
                                     if at_peak.get(ph, 0) > 0}  # fmt: skip
    return out


def epoch_flops(cf: dict, r: dict) -> float:
    return sum(total(phase_flops(cf, r, 1)).values())


def plan_1024_prompts(r512: dict, m512: dict, cf: dict, r1024: dict, left_s: float) -> int:
    """The most prompts (≤ r1024's) whose 1024 px run fits in `left_s`: the measured 512 px epoch
    and eval scaled by the cost model's FLOP ratios, plus a minute for loading and warm-up."""
    per_prompt_512 = m512["epoch_s"] / r512["prompts"]
    one = {"prompts": 1, "eval": False}
    per_prompt = per_prompt_512 * epoch_flops(cf, {**r1024, **one}) / epoch_flops(
        cf, {**r512, **one})  # fmt: skip
    evals = {"prompts": 0, "eval": True}
    eval_512 = epoch_flops(cf, {**r512, **evals})
    eval_s = 2 * m512["time_s"].get("eval", 0.0) * epoch_flops(cf, {**r1024, **evals}) / eval_512
    return max(0, min(r1024["prompts"], int((left_s - 60 - eval_s) // per_prompt)))


def recast_defaults() -> dict:
    """recast.py's defaults of the flags the docs' command leaves out (DEFAULTED), SD3's scoring
    defaults for the command's DOCS_PROMPTS included (sd3world.scoring_defaults)."""
    import recast
    from worlds import sd3world

    defaults = {k: getattr(recast.Args(), k) for k in DEFAULTED}
    return {**defaults, **sd3world.scoring_defaults(DOCS_PROMPTS)}


def run_settings(args) -> tuple[dict, dict, dict]:
    """Settings of the 512 px recast and uniform runs and of the 1024 px run."""
    base = {**recast_defaults(), **(SHRUNK_RUN if args.shrink else FULL_RUN)}
    base["prompts"] = args.prompts or base["prompts"]
    base.update(epochs=2, weighting="recast", grad_checkpointing=False,
                eval_images=base["eval_prompts"] * base["eval_seeds"])  # fmt: skip
    uniform = {**base, "weighting": "uniform"}
    r1024 = {**base, "resolution": 2 * base["resolution"], "epochs": 1, "grad_checkpointing": True}
    return base, uniform, r1024


def check(args, save) -> dict:
    """The whole check; `save(report)` is called after every stage, so that a check stopped from
    outside (a time limit) leaves the report of what it measured."""
    import torch

    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    device = torch.device("cpu" if args.shrink else "cuda")
    budget = args.budget or (DEFAULT_BUDGET_S if device.type == "cuda" else 600.0)
    c = load_configs(args.shrink)
    r512, uniform, r1024 = run_settings(args)
    cf = component_flops(c, (r512["resolution"], r1024["resolution"]))
    rates = measure_rates(device)
    channels = c["sd35m_transformer"]["in_channels"]
    report = {
        "device": device_name(device), "shrink": args.shrink, "software": software(),
        "budget_s": budget, "configs": c, "matmul_tflops": {k: v / 1e12 for k, v in rates.items()},
        "component_tflop": {k: v / 1e12 for k, v in cf.items()},
        "run_settings": {"512-recast": r512, "512-uniform": uniform, "1024-recast": r1024},
        "loss_memory": {
            str(res): loss_memory(device, r512["batch_size"], (channels, res // 8, res // 8),
                                  len(LAMBDA.split(",")), r512["steps"])
            for res in (r512["resolution"], r1024["resolution"])
        },
        "runs": {}, "notes": [], "finished": False,
    }  # fmt: skip

    def saved() -> None:
        rec, uni = report["runs"].get("512-recast", {}), report["runs"].get("512-uniform", {})
        if rec.get("complete") and uni.get("complete"):
            report["recast_over_uniform"] = rec["epoch_s"] / uni["epoch_s"]
            share = (rec["epoch_s"] - uni["epoch_s"]) / rec["epoch_s"]
            report["recast_minus_uniform_share"] = share
        report["cost_model"] = cost_model_tables(cf, r512, r1024, rates, report["runs"])
        report["seconds"] = time.perf_counter() - start
        save(report)

    with tempfile.TemporaryDirectory(prefix="scale_check_") as tmp:
        tmp = Path(tmp)
        tic = time.perf_counter()
        dtype = torch.float32 if args.shrink else torch.bfloat16
        built = build_and_save(c, tmp, device, dtype)
        report["build_and_save_s"] = time.perf_counter() - tic
        report["params"], paths = built["params"], built["paths"]
        saved()
        files = {"train": tmp / "prompts.txt", "eval": tmp / "eval.txt"}
        files["train"].write_text("\n".join(prompts(max(64, r512["prompts"]))) + "\n")
        files["eval"].write_text("\n".join(prompts(r512["eval_prompts"], 1000)) + "\n")
        files = {k: str(v) for k, v in files.items()}
        import rewards

        os.environ.update(
            RECAST_PICKSCORE=paths["clip_h"], RECAST_PICKSCORE_PROCESSOR=paths["clip_h"],
            RECAST_CLIPSCORE=paths["clip_l14"], RECAST_AESTHETIC=paths["clip_l14"],
            RECAST_AESTHETIC_HEAD=paths["aesthetic_head"],
        )  # fmt: skip
        real_hpsv2 = rewards.LOADERS["hpsv2"]
        rewards.LOADERS["hpsv2"] = hpsv2_stand_in(paths["hpsv2_clip"], c["reward_image_size"])

        made = []

        def one(name: str, r: dict) -> None:
            made.append(name)  # a folder of its own, also for a run repeated under its name
            flags = run_flags(paths, files, r, device, tmp / "runs" / f"{len(made)}-{name}")
            print(f"scale_check: {name}: python recast.py {' '.join(flags)}", flush=True)
            run = run_loop(name, flags, device)
            given = {k: v for k, v in run["args"].items() if k in r and v is not None}
            r = {**r, **given}  # the values the run used, defaults included
            report["runs"][name] = {"flags": flags, "settings": r, **measure(run, r, cf, rates),
                                    "run_seconds": run["seconds"],
                                    "metrics": run["metrics"]}  # fmt: skip
            saved()

        def skip(name: str, why: str) -> None:
            report["runs"][name] = {"complete": False, "status": f"skipped: {why}"}
            saved()

        try:
            one("512-recast", r512)
            if "out of memory" in report["runs"]["512-recast"]["status"]:  # then: checkpointing
                report["notes"].append("512 px without --grad-checkpointing: "
                                       + report["runs"]["512-recast"]["status"]
                                       + "; both 512 px runs were made with it")  # fmt: skip
                r512, uniform = ({**r, "grad_checkpointing": True} for r in (r512, uniform))
                report["run_settings"].update({"512-recast": r512, "512-uniform": uniform})
                one("512-recast", r512)
            left = budget - (time.perf_counter() - start)
            if left < 0.8 * report["runs"]["512-recast"]["run_seconds"]:
                skip("512-uniform", f"{left:.0f} s of the {budget:.0f} s budget left")
            else:
                one("512-uniform", uniform)
            left = budget - (time.perf_counter() - start)
            m512, n = report["runs"]["512-recast"], r1024["prompts"]
            if device.type == "cuda":  # no 512 px epoch to scale from: a quarter of the prompts
                n = (plan_1024_prompts(r512, m512, cf, r1024, left) if m512["complete"]
                     else max(1, n // 4))  # fmt: skip
            if n < 1:
                skip("1024-recast", f"{left:.0f} s of the {budget:.0f} s budget left, too little "
                     "for one prompt")  # fmt: skip
            else:
                if n < r1024["prompts"]:
                    report["notes"].append(f"1024 px: {n} prompts instead of {r1024['prompts']}, "
                                           "so that the check ends within its time "
                                           "budget")  # fmt: skip
                one("1024-recast", {**r1024, "prompts": n})
        finally:
            rewards.LOADERS["hpsv2"] = real_hpsv2
    report["finished"] = True
    saved()
    return report


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def software() -> dict:
    import diffusers
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    versions.update(diffusers=diffusers.__version__, transformers=transformers.__version__)
    if torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
    return versions


def peak_rates(hw: str) -> dict:
    return {k: v * 1e12 for k, v in SPEC_TFLOPS[hw].items()}


def cost_model_tables(cf: dict, r512: dict, r1024: dict, rates: dict, runs: dict) -> dict:
    """Per resolution, one epoch (step scoring amortised over --gain-every, no eval): modelled
    TFLOP and seconds per phase at this machine's measured matmul rates and at the data sheets'
    peaks; where that resolution's run was measured on a GPU, each hardware's *extrapolated*
    seconds: its data-sheet seconds × (measured ÷ data-sheet seconds here), phase by phase."""
    out = {}
    for key, r in (("512", r512), ("1024", r1024)):
        f = phase_flops(cf, {**r, "eval": False}, amortised=True)
        f.pop("eval")
        entry = {"tflop": {k: v / 1e12 for k, v in total(f).items()},
                 "s_at_measured_matmul": modelled_seconds(f, rates),
                 "s_at_peak": {hw: modelled_seconds(f, peak_rates(hw))
                               for hw in SPEC_TFLOPS}}  # fmt: skip
        slow = runs.get(f"{key}-recast", {}).get("measured_over_peak")
        if slow:
            entry["extrapolated_s"] = {
                hw: {ph: sec * slow[ph] for ph, sec in secs.items() if ph in slow}
                for hw, secs in entry["s_at_peak"].items()
            }
        out[key] = entry
    out["recast_share_by_setting"] = recast_shares(cf, r512)
    return out


SHARE_SETTINGS = (
    (1.0, 1, "fp32"),
    (0.5, 1, "fp32"),
    (0.25, 1, "fp32"),
    (0.125, 1, "fp32"),
    (1.0, 2, "fp32"),
    (1.0, 1, "bf16"),
    (0.5, 1, "bf16"),
    (0.25, 1, "bf16"),
    (0.125, 1, "bf16"),
)  # (--gain-frac, --gain-every, --score-precision)


def recast_shares(cf: dict, r: dict) -> list[dict]:
    """ReCAST's modelled share of an epoch (step scoring amortised, no eval) for each setting of
    SHARE_SETTINGS: of the FLOPs, and of the time at the H100/H200 data sheet's peak of each
    precision (the same efficiency in every phase). With --score-precision bf16 the step scoring
    runs at the transformer's bf16 rate."""
    rows = []
    for frac, every, precision in SHARE_SETTINGS:
        setting = {"gain_frac": frac, "gain_every": every, "score_precision": precision}
        f = phase_flops(cf, {**r, **setting, "eval": False}, amortised=True)
        fl, sec = total(f), modelled_seconds(f, peak_rates("H100/H200 SXM"))
        rows.append({**setting,
                     "flop_share": fl["recast"] / sum(fl.values()),
                     "time_share_at_peak": sec["recast"] / sum(sec.values()),
                     "epoch_s_at_peak": sum(sec.values())})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}g}" if isinstance(x, float) else str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(fmt(x) for x in row) + " |" for row in rows]


def run_section(name: str, run: dict) -> list[str]:
    L = [f"## {name}", ""]
    if "flags" in run:
        L += ["```", "python recast.py " + " ".join(run["flags"]), "```", ""]
    if not run.get("complete"):
        return L + [f"**Not measured**: {run['status']}", ""]
    first = " (the first: warm-up included)" if run["epoch"] == 1 else ""
    L += [f"Epoch {run['epoch']}{first}, status {run['status']}. Memory: {run['mem_kind']}.", ""]
    rows = [[ph, run["time_s"][ph], run["mem_gib"].get(ph), run["modelled_tflop"].get(ph),
             run["modelled_s"].get(ph), run["measured_over_modelled"].get(ph)]
            for ph in PHASES if ph in run["time_s"]]  # fmt: skip
    L += table(["phase", "seconds", "peak memory GiB", "modelled TFLOP", "modelled s",
                "measured ÷ modelled"], rows)  # fmt: skip
    nft = run["nft_loss"]
    L += [
        "",
        f"- seconds per epoch, without eval: **{run['epoch_s']:.2f}** (wall clock, checkpoint and "
        f"W.png included; with eval {run['epoch_wall_s']:.2f}; Σ time/* {run['sum_time_s']:.2f})",
        f"- images per GPU-second: **{run['images_per_gpu_s']:.3f}** ({run['images']} images)",
        f"- ReCAST's own share of the epoch (time/recast): **{run['recast_share']:.1%}** (step "
        f"predictions scored in {run['recast_step_scoring_s']:.2f} s, gains + W in "
        f"{run['recast_gains_W_s']:.3f} s)",
        f"- fused nft_loss forward: {nft['fwd_s']:.4f} s in {nft['calls']} calls, "
        f"**{nft['share_of_update']:.2%}** of time/update; the micro-batches' backward "
        f"(transformer and loss): {run['update_backward_s']:.4f} s",
        "",
    ]
    return L


def markdown(rep: dict) -> str:
    size = (
        f"every width ÷ {rep['shrink']}, depth ÷ {SHRINK_DEPTH}" if rep["shrink"] else "real size"
    )
    soft = ", ".join(f"{k} {v}" for k, v in rep["software"].items())
    shrink_flag = f" --shrink {rep['shrink']}" if rep["shrink"] else ""
    L = [
        f"# SD3.5-Medium scale check ({size}, random weights)",
        "",
        f"`python benchmarks/scale_check.py{shrink_flag}`"
        f" on **{rep['device']}** ({soft}): {rep['seconds']:.0f} s in all, of which "
        f"{rep['build_and_save_s']:.0f} s building and saving the models.",
        "",
        "Every figure is **measured** here in this run, except those marked *modelled* (the FLOP "
        "cost model) or *extrapolated* (the cost model scaled by what was measured here).",
        "",
        "Parameters (M): " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in rep["params"].items())
        + ". HPS v2.1 is a stand-in: a transformers CLIP of open_clip ViT-H-14's shape, scored by "
        "rewards.hpsv2_scorer (the hpsv2 package is not installed).",
        "",
        "Matmul throughput measured here, TFLOP/s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in rep["matmul_tflops"].items()),
        "",
    ]  # fmt: skip
    if not rep.get("finished"):
        L += ["**Partial report**: written while the check was still running (a check stopped "
              "from outside leaves this); the runs below are those finished by then.",
              ""]  # fmt: skip
    if rep["shrink"]:
        L += [f"The runs keep their full-size names; their resolutions here are ÷ {rep['shrink']} "
              "(see each command), and the runs' sizes are SHRUNK_RUN's, not the docs' "
              "command.", ""]  # fmt: skip
    L += [f"Note: {note}\n" for note in rep["notes"]]
    for name, run in rep["runs"].items():
        L += run_section(name, run)
    if "recast_over_uniform" in rep:
        L += ["## ReCAST against uniform weighting, same process", "",
              f"Epoch seconds, recast ÷ uniform: **{rep['recast_over_uniform']:.3f}**; ReCAST's "
              f"extra work is {rep['recast_minus_uniform_share']:.1%} of the recast epoch. Uniform "
              "ran with --gain-every 2, so its epoch 2 scored no step predictions: DiffusionNFT's "
              "work.", ""]  # fmt: skip
    L += ["## Fused nft_loss against the eager reference", "",
          "Peak memory above the inputs, forward + backward (gradient included), at the real "
          "micro-batch:", ""]  # fmt: skip
    rows = []
    for res, lm in rep["loss_memory"].items():
        mib = [None if lm[k] is None else lm[k] / 2**20 for k in ("fused", "reference")]
        rows.append([res, f"{lm['rows']} × {lm['row_elements']}", *mib])
    L += table(["px", "fp32 rows × elements", "fused MiB", "reference MiB"], rows)
    if any(lm["fused_is_reference_here"] for lm in rep["loss_memory"].values()):
        L += ["", "(On the CPU, outside the Triton interpreter, nft_loss is reference_nft_loss.)"]
    L += cost_model_section(rep)
    L += anchor_section(rep)
    L += ["", "## All figures", "", "```json", json.dumps(rep, indent=1, default=str), "```", ""]
    return "\n".join(L)


def cost_model_section(rep: dict) -> list[str]:
    cm = rep["cost_model"]
    L = ["", "## Cost model (*modelled*)", "",
         "FLOPs counted by torch.utils.flop_counter on meta-device models built from "
         "benchmarks/configs (matmuls, convolutions, attention; elementwise work not counted), "
         "per image (text encoders: per prompt; transformer backward: input gradients only, the "
         "base weights being frozen):", ""]  # fmt: skip
    L += table(["component", "TFLOP"], [[k, v] for k, v in rep["component_tflop"].items()])
    for key, settings in (("512", "512-recast"), ("1024", "1024-recast")):
        e, r = cm[key], rep["run_settings"][settings]
        hws = list(SPEC_TFLOPS)
        header = ["phase", "TFLOP", "s at matmul rates measured here"]
        header += [f"s at {hw} peak" for hw in hws]
        header += [f"{hw} s, *extrapolated*" for hw in hws] if "extrapolated_s" in e else []
        rows = []
        for ph in e["tflop"]:
            row = [ph, e["tflop"][ph], e["s_at_measured_matmul"][ph]]
            row += [e["s_at_peak"][hw][ph] for hw in hws]
            if "extrapolated_s" in e:
                row += [e["extrapolated_s"][hw].get(ph) for hw in hws]
            rows.append(row)
        ckpt = ", --grad-checkpointing" if r["grad_checkpointing"] else ""
        L += ["", f"One epoch at {r['resolution']} px, {r['prompts']} prompts × "
              f"{r['group_size']}, T = {r['steps']}{ckpt} (*modelled*, no eval; extrapolated "
              "columns only where measured on a GPU):", ""]  # fmt: skip
        L += table(header, rows)
    L += ["", "ReCAST's share of a 512 px epoch (*modelled*; time at each precision's data-sheet "
          "peak, the same efficiency in every phase):", ""]  # fmt: skip
    rows = [[x["gain_frac"], x["gain_every"], x["score_precision"], f"{x['flop_share']:.1%}",
             f"{x['time_share_at_peak']:.1%}"] for x in cm["recast_share_by_setting"]]  # fmt: skip
    L += table(["--gain-frac", "--gain-every", "--score-precision", "share of FLOPs",
                "share of time"], rows)  # fmt: skip
    return L


def anchor_section(rep: dict) -> list[str]:
    rec, uni = rep["runs"].get("512-recast", {}), rep["runs"].get("512-uniform", {})
    if not rec.get("complete"):
        return []
    line = (f"{ANCHOR}: ≈ {ANCHOR_RATE:.2f} images per GPU-second, each image scored once per "
            f"reward. Here, on {rep['device']}: **{rec['images_per_gpu_s']:.3f}** images per "
            f"GPU-second with ReCAST, where each image's {rec['settings']['steps'] - 1} step "
            "predictions are also decoded and scored by the 4 rewards")  # fmt: skip
    if uni.get("complete"):
        line += f"; {uni['images_per_gpu_s']:.3f} without that work (uniform, epoch 2)"
    return ["", "## Anchor", "", line + "."]


def print_cost_model() -> None:
    """--cost-model: the cost model of the full-size configurations for docs/sd35.md's one-GPU
    command, its 32 prompts and SD3's scoring defaults (no device, nothing built)."""
    from plumbing import cli

    c = load_configs()
    r512 = {**recast_defaults(), **FULL_RUN, "prompts": DOCS_PROMPTS, "grad_checkpointing": False,
            "eval_images": 0}  # fmt: skip
    r1024 = {**r512, "resolution": 1024, "grad_checkpointing": True}
    cf = component_flops(c, (512, 1024))
    print("parameters (meta-device models of benchmarks/configs):")
    for name, n in config_params(c).items():
        print(f"  {name:<24} {n / 1e9:7.3f} B")
    print("FLOPs per image (text encoders: per prompt):")
    for k, v in cf.items():
        print(f"  {k:<24} {v / 1e12:9.4f} TFLOP")
    peaks = peak_rates("H100/H200 SXM")
    for name, r in (("512 px", r512), ("1024 px, --grad-checkpointing", r1024)):
        f = phase_flops(cf, {**r, "eval": False}, amortised=True)
        fl, sec = total(f), modelled_seconds(f, peaks)
        print(f"one epoch at {name} ({r['prompts']} prompts × {r['group_size']}, T = "
              f"{r['steps']}, no eval), at the H100/H200 data-sheet peaks:")  # fmt: skip
        for ph in ("rollout", "score", "recast", "update"):
            print(f"  {ph:<8} {fl[ph] / 1e15:8.3f} PFLOP {sec[ph]:8.2f} s")
    print(f"ReCAST's modelled share of a 512 px epoch (one-GPU command, {r512['prompts']} "
          "prompts, no eval):")  # fmt: skip
    print("  --gain-frac  groups --gain-every --score-precision  FLOP share  time share at peak")
    for x in recast_shares(cf, r512):
        groups = cli.scored_groups(x["gain_frac"], r512["prompts"])
        print(f"  {x['gain_frac']:>11} {groups:>7} {x['gain_every']:>12} "
              f"{x['score_precision']:>17}  "
              f"{x['flop_share']:>10.1%}  {x['time_share_at_peak']:>18.1%}")  # fmt: skip
    print_paper2_costs(cf, r512, r1024)
    fams = {family: family_flops(c, cf, family, (512, 1024)) for family in FAMILY_NAMES}
    print_family_costs(c, fams, r512, r1024)
    print_shard_costs(c, fams, r512, r1024)


PAPER2_SETTINGS = (
    (0.125, 1, 0),
    (0.0625, 1, 0),
    (0.03125, 1, 0),
    (0.125, 2, 0),
    (0.125, 4, 0),
    (0.0625, 2, 0),
    (0.125, 1, 384),
    (0.125, 1, 256),
    (0.125, 1, 128),
)  # (--gain-frac, --gain-every, --score-size) of 32 prompts in bf16; the first: today's default
SCORE_SIZES = sorted({px for *_, px in PAPER2_SETTINGS if px})


def paper2_shares(cf: dict, r: dict, flops: dict, settings=PAPER2_SETTINGS) -> list[dict]:
    """ReCAST's modelled share of a paper2 epoch (step scoring amortised over --gain-every, no
    eval) for each (--gain-frac, --gain-every, --score-size) of `settings`: of the FLOPs and of
    the time at the H100/H200 data sheet's peaks, and the recast epoch over the uniform one
    (which scores no step). `flops`: paper2_flops at r's resolution and every --score-size (a
    size at or above the resolution changes nothing)."""
    rows, rates, res = [], peak_rates("H100/H200 SXM"), r["resolution"]
    base = {**r, "reward_flops": by_precision(flops[res], PAPER2), "eval": False}
    uniform = modelled_seconds(phase_flops(cf, {**base, "weighting": "uniform"}), rates)
    for frac, every, px in settings:
        step = by_precision(flops[min(px, res) if px else res], PAPER2)
        setting = {"gain_frac": frac, "gain_every": every, "score_size": px}
        f = phase_flops(cf, {**base, **setting, "score_precision": "bf16",
                             "step_reward_flops": step}, amortised=True)  # fmt: skip
        fl, sec = total(f), modelled_seconds(f, rates)
        rows.append({**setting, "flop_share": fl["recast"] / sum(fl.values()),
                     "time_share_at_peak": sec["recast"] / sum(sec.values()),
                     "epoch_s_at_peak": sum(sec.values()),
                     "over_uniform": sum(sec.values()) / sum(uniform.values())})  # fmt: skip
    return rows


def print_paper2_costs(cf: dict, r512: dict, r1024: dict) -> None:
    """paper2's rewards and judges per scored image, ReCAST's share of a paper2 epoch, and the
    trade-off table of its share against the gains' noise measured in the toy world."""
    from plumbing import cli

    flops = paper2_flops(cf, (512, 1024, *SCORE_SIZES))
    sizes = (512, 1024, *SCORE_SIZES)
    print("paper2's rewards and judges, GFLOP per scored image (at " + ", ".join(
        f"{px} px" for px in sizes) + "; the VLMs at the image token counts their image "
        "processors make):")  # fmt: skip
    for name in (*PAPER2, *PAPER2_JUDGES):
        print(f"  {name:<12}" + "".join(f" {flops[px][name] / 1e9:10.1f}" for px in sizes))
    for name, r in (("512 px", r512), ("1024 px, --grad-checkpointing", r1024)):
        rows = paper2_shares(cf, r, flops)
        print(
            f"ReCAST's modelled share of a paper2 epoch at {name} ({r['prompts']} prompts, no "
            "eval, bf16 step scoring; the first row is today's scoring default; --score-size 0: "
            "off), at the H100/H200 peaks:"
        )
        print("  --gain-frac  groups --gain-every --score-size  FLOP share  time share  epoch s"
              "  recast/uniform")  # fmt: skip
        for x in rows:
            groups = cli.scored_groups(x["gain_frac"], r["prompts"])
            print(f"  {x['gain_frac']:>11} {groups:>7} {x['gain_every']:>12} "
                  f"{x['score_size']:>12} {x['flop_share']:>10.1%} "
                  f"{x['time_share_at_peak']:>11.1%} {x['epoch_s_at_peak']:>8.1f} "
                  f"{x['over_uniform']:>15.3f}")  # fmt: skip
    print_tradeoff(cf, r512, flops)


# The trade-off: ReCAST's share (this cost model) beside the gains' noise, measured in the toy
# world by two studies whose output files are read here (their commands print them)
SCORING_TABLE = ROOT / "docs" / "scoring" / "table.md"
SCORING_COMMAND = "python studies/comparison.py report --study scoring"
SCORE_SIZE_TABLE = ROOT / "docs" / "scoring" / "score_size.md"
SCORE_SIZE_COMMAND = "python studies/score_size.py --seeds 5"
TOY_PROMPTS, TOY_PX = 16, 32  # the scoring study's prompt groups an epoch; the toy images' size
SCORING_ARMS = ("recast-frac1", "recast-frac0.5", "recast-frac0.25", "recast-frac0.125",
                "recast-every2")  # the scoring study's ReCAST arms (docs/results.md)  # fmt: skip
TRADEOFF = (
    (0.5, 1, 0),
    (0.25, 1, 0),
    (0.125, 1, 0),
    (0.0625, 1, 0),
    (0.5, 2, 0),
    (0.125, 1, 384),
    (0.125, 1, 256),
    (0.125, 1, 128),
)  # (--gain-frac, --gain-every, --score-size) of 32 prompts: each has a toy-world measurement


def read_scoring_study(path: Path = SCORING_TABLE) -> dict:
    """From the scoring study's report (SCORING_COMMAND's table.md): {"w_error": {arm: mean
    Σ|W − W_full| over the epochs}, "floor": full scoring's seed-to-seed mean, "vs_full": {arm:
    its final λ-weighted gap − full scoring's, paired, and the verdict}}; {} without the file."""
    import re

    if not path.is_file():
        return {}
    out = {"w_error": {"recast-frac1": 0.0}, "floor": None, "vs_full": {"recast-frac1": "(itself)"}}
    for line in path.read_text().splitlines():
        if m := re.fullmatch(r"- λ = [\d.,]+, (recast-[\w.]+): .*; mean ([\d.]+)", line):
            out["w_error"][m[1]] = float(m[2])
        elif m := re.fullmatch(r"- λ = [\d.,]+, the noise floor .*: mean ([\d.]+)", line):
            out["floor"] = float(m[1])
        elif m := re.fullmatch(r"- cheaper scoring against full scoring, λ = [\d.,]+: "
                               r"(recast-[\w.]+) − recast-frac1 = (.+)", line):  # fmt: skip
            out["vs_full"][m[1]] = m[2]
    return out


def read_score_size_study(path: Path = SCORE_SIZE_TABLE) -> dict:
    """From studies/score_size.py's output (SCORE_SIZE_COMMAND's score_size.md): {"move": {px:
    mean Σ|W_px − W_full|}, "largest": {px: the largest seed's}, "floor": the seed-to-seed mean,
    "smallest": the smallest seed pair's}; {} without the file."""
    import re

    if not path.is_file():
        return {}
    out = {"move": {}, "largest": {}, "floor": None, "smallest": None}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit():
            out["move"][int(cells[0])], out["largest"][int(cells[0])] = map(float, cells[2:4])
        elif m := re.match(r"noise floor, .*: mean ([\d.]+), smallest ([\d.]+)", line):
            out["floor"], out["smallest"] = float(m[1]), float(m[2])
    return out


def toy_arm(frac: float, every: int, prompts: int) -> str | None:
    """The scoring study's arm that scores as many groups an epoch as `frac` of `prompts` (the
    study's carry rule: W's error follows the number of groups scored; both worlds' groups are
    8 images), or None where it ran none."""
    from plumbing import cli

    toy = cli.scored_groups(frac, prompts) / TOY_PROMPTS
    arm = f"recast-frac{toy:g}" if every == 1 else f"recast-every{every}" if toy == 1 else None
    return arm if arm in SCORING_ARMS else None


def tradeoff_rows(cf: dict, r: dict, flops: dict, scoring: dict, sizes: dict) -> list[dict]:
    """Per setting of TRADEOFF: ReCAST's modelled share of r's paper2 epoch, the toy arm that
    measured it, its W error and outcome against full scoring (the scoring study), and, with
    --score-size, the toy size of the same fraction of the side and its W move (studies/
    score_size.py)."""
    rows = []
    for x in paper2_shares(cf, r, flops, TRADEOFF):
        arm = toy_arm(x["gain_frac"], x["gain_every"], r["prompts"])
        px = round(x["score_size"] * TOY_PX / r["resolution"]) if x["score_size"] else 0
        rows.append({**x, "arm": arm, "w_error": scoring.get("w_error", {}).get(arm),
                     "vs_full": scoring.get("vs_full", {}).get(arm), "toy_px": px,
                     "size_move": sizes.get("move", {}).get(px) if px else None})  # fmt: skip
    return rows


def three(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def print_tradeoff(cf: dict, r: dict, flops: dict) -> None:
    """The trade-off table: ReCAST's share of a paper2 512 px epoch beside the gains' noise the
    toy world measured for the same number of groups (and, with --score-size, the same fraction
    of the side), each column's source named."""
    from plumbing import cli

    scoring, sizes = read_scoring_study(), read_score_size_study()
    print(
        f"The trade-off, ReCAST's share of a paper2 epoch at {r['resolution']} px against the "
        "gains' noise measured in the toy world (W error: mean Σ|W − W_full| over a trained "
        "run's 20 epochs, same seed; the arm scoring as many groups of 8 an epoch, of its 16):"
    )
    print("  --gain-frac  groups --gain-every --score-size  time share  toy arm            "
          "W error  final gap − full scoring   toy px  W move")  # fmt: skip
    for x in tradeoff_rows(cf, r, flops, scoring, sizes):
        groups = cli.scored_groups(x["gain_frac"], r["prompts"])
        move = "" if not x["toy_px"] else three(x["size_move"])
        print(f"  {x['gain_frac']:>11} {groups:>7} {x['gain_every']:>12} {x['score_size']:>12} "
              f"{x['time_share_at_peak']:>11.1%}  {x['arm'] or '–':<18} {three(x['w_error']):>7}"
              f"  {x['vs_full'] or '–':<24} {x['toy_px'] or '':>6}  {move:>6}")  # fmt: skip
    print(f"  noise floors: full scoring's W, seed against seed, same epoch of a trained run: "
          f"{three(scoring.get('floor'))}; one base-model epoch's W (--profile), seed against "
          "seed: "
          f"mean {three(sizes.get('floor'))}, smallest {three(sizes.get('smallest'))}")  # fmt: skip
    print(f"  sources: time share: this cost model; W error, final gap and the first floor: "
          f"`{SCORING_COMMAND}` ({SCORING_TABLE.relative_to(ROOT)}"
          f"{'' if scoring else ': not found'}); W move (--score-size's, one base-model epoch, "
          f"mean of seeds, the toy images resized to toy px and back) and the second floor: "
          f"`{SCORE_SIZE_COMMAND}` ({SCORE_SIZE_TABLE.relative_to(ROOT)}"
          f"{'' if sizes else ': not found'})")  # fmt: skip
    print(
        "  what transfers: the number of groups scored (8 images each in both worlds) and the "
        "fraction of the side; what does not: the toy rewards are hand-written pixel measures, "
        "not CLIPs and a 7B VLM, and a --score-size row's W error is its arm's without the "
        "resize, the W move being measured apart (one base-model epoch, not a trained run)"
    )


# ---------------------------------------------------------------------------------------------
# One scored image per reward, measured (--reward-timing)
# ---------------------------------------------------------------------------------------------
OCR_PROMPT = 'a wooden sign that says "COSMIC VIBES", beside a toaster'  # prompts/ocr_eval.txt


def reward_timings(specs: dict, resolution: int, device, repeats: int = 5) -> dict:
    """{reward: {"s": median seconds of one scored image, "gflop": its modelled GFLOP}} of each
    reward configuration in `specs` (modelzoo.reward_config), built with random weights on
    `device` (a VLM in bf16 on CUDA, as rewards.VLM loads it) and scored on one random image of
    `resolution` px after a warm-up: "ocr" by rewards.ocr_scorer itself (the detector, the
    components and boxes its random output gives, the recogniser on each), "blip" by
    imagereward_model.imagereward_scorer, "vlm" by the planner's forward at the image token count
    its image processor makes (memory_plan.model_reward; rewards.VLM needs the model's own
    tokenizer, which is not here). Each model is freed before the next is built."""
    import statistics

    import torch

    import rewards
    from benchmarks import memory_plan
    from reward_models import ocr_reader

    out = {}
    with tempfile.TemporaryDirectory(prefix="reward_timing_") as tmp:
        for name, spec in specs.items():
            with torch.device(device):
                fn, held = memory_plan.model_reward(spec, Path(tmp), device, device.type == "cuda")
            if spec["kind"] == "ocr":
                fn = rewards.ocr_scorer(ocr_reader.TextReader(held[0], held[1], device))
            image = torch.rand(1, 3, resolution, resolution, device=device) * 2 - 1
            fn(image, [OCR_PROMPT])  # warm-up
            times = []
            for _ in range(repeats):
                sync(device)
                tic = time.perf_counter()
                fn(image, [OCR_PROMPT])
                sync(device)
                times.append(time.perf_counter() - tic)
            out[name] = {"s": statistics.median(times),
                         "gflop": model_reward_flops(spec, resolution) / 1e9}  # fmt: skip
            del fn, held, image
            free_device_memory()
    return out


def write_reward_timing(out: Path, device) -> None:
    """--reward-timing: reward_timings of paper2's model rewards and judges at 512 and 1024 px,
    printed and written to OUT/reward_timing.md (with the device and software)."""
    from benchmarks import modelzoo

    specs = {n: modelzoo.reward_config(modelzoo.CONFIGS / f"{f}.json")
             for n, f in modelzoo.REWARD_CONFIGS.items()}  # fmt: skip
    rows = {res: reward_timings(specs, res, device) for res in (512, 1024)}
    lines = [f"# One scored image per reward, random weights, on {device_name(device)}", "",
             f"`python benchmarks/scale_check.py --reward-timing --out {out}`; "
             + ", ".join(f"{k} {v}" for k, v in software().items()), "",
             "| reward | px | ms | GFLOP (modelled) | TFLOP/s |",
             "|---|---|---|---|---|"]  # fmt: skip
    for res, timed in rows.items():
        for name, x in timed.items():
            lines.append(f"| {name} | {res} | {1e3 * x['s']:.1f} | {x['gflop']:.1f} | "
                         f"{x['gflop'] / 1e3 / x['s']:.1f} |")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "reward_timing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Model families: each family's transformer, VAE and text encoders at their real sizes
# ---------------------------------------------------------------------------------------------
FAMILY_NAMES = ("SD3.5-Medium", "FLUX.1-dev", "FLUX.1-schnell", "FLUX.2-klein 4B", "Qwen-Image")


def family_flops(c: dict, cf: dict, family: str, resolutions) -> dict:
    """SD3.5's component FLOPs `cf` (the reward models are every family's) with the family's
    transformer (forward; backward with frozen weights), VAE decode and text encoders ("text",
    per prompt) in place of SD3.5's, counted on meta-device models."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    if family == "SD3.5-Medium":
        return cf

    meta = torch.device("meta")
    with meta:
        m = family_models(c, family)
    tr, vae = m["transformer"].requires_grad_(False), m["vae"]
    out = dict(cf)
    with torch.no_grad():
        out["text"] = sum(
            count_flops(
                lambda e=e, n=n: e(input_ids=torch.zeros(1, n, dtype=torch.long, device=meta))
            )
            for e, n in m["text"]
        )
    tokens = m["text"][-1][1] - (34 if family == "Qwen-Image" else 0)  # its template dropped
    cfg = tr.config
    for res in resolutions:
        side = res // 8  # every family's VAE downsamples 8x
        L = (side // 2) ** 2  # 2×2 patches, packed
        x = torch.zeros(1, L, cfg.in_channels, device=meta, requires_grad=True)
        kw = dict(hidden_states=x, timestep=torch.ones(1, device=meta), return_dict=False,
                  encoder_hidden_states=torch.zeros(1, tokens, cfg.joint_attention_dim,
                                                    device=meta))  # fmt: skip
        if family.startswith("FLUX.1"):
            guidance = torch.ones(1, device=meta) if cfg.guidance_embeds else None
            kw.update(pooled_projections=torch.zeros(1, cfg.pooled_projection_dim, device=meta),
                      img_ids=torch.zeros(L, 3, device=meta), guidance=guidance,
                      txt_ids=torch.zeros(tokens, 3, device=meta))  # fmt: skip
        elif family == "FLUX.2-klein 4B":
            kw.update(img_ids=torch.zeros(1, L, 4, dtype=torch.long, device=meta),
                      txt_ids=torch.zeros(1, tokens, 4, dtype=torch.long, device=meta))  # fmt: skip
        else:
            kw.update(img_shapes=[[(1, side // 2, side // 2)]])
        with FlopCounterMode(display=False) as fc:
            v = tr(**kw)[0]
        out[f"transformer_fwd@{res}"] = float(fc.get_total_flops())
        out[f"transformer_bwd@{res}"] = count_flops(lambda v=v: v.sum().backward())
        shape = {"FLUX.2-klein 4B": (1, 32, side, side), "Qwen-Image": (1, 16, 1, side, side)}
        z = torch.zeros(*shape.get(family, (1, 16, side, side)), device=meta)
        with torch.no_grad():
            out[f"vae_decode@{res}"] = count_flops(lambda z=z: vae.decode(z, return_dict=False))
    return out


def family_params(c: dict, family: str) -> dict:
    """Parameter counts (B) of a family's transformer and text encoders, on the meta device."""
    import torch

    with torch.device("meta"):
        if family == "SD3.5-Medium":
            m = sd35m_models(c)
            texts = [m[k] for k in ("clip_l_text", "clip_g_text", "t5xxl_encoder")]
            return {"transformer": n_params(m["transformer"]) / 1e9,
                    "text": sum(n_params(t) for t in texts) / 1e9}  # fmt: skip
        m = family_models(c, family)
    return {"transformer": n_params(m["transformer"]) / 1e9,
            "text": sum(n_params(e) for e, _ in m["text"]) / 1e9}  # fmt: skip


def print_family_costs(c: dict, fams: dict, r512: dict, r1024: dict) -> None:
    """Each family's modelled epoch of the one-GPU command (docs/models.md) at 512 and 1024 px,
    and ReCAST's share of it: with the scoring defaults, and with full fp32 scoring at 512 px."""
    peaks = peak_rates("H100/H200 SXM")
    full = {"gain_frac": 1.0, "gain_every": 1, "score_precision": "fp32"}
    print(f"model families: one epoch of the one-GPU command ({r512['prompts']} prompts × "
          f"{r512['group_size']}, T = {r512['steps']}, no eval; 1024 px with "
          "--grad-checkpointing), seconds at the H100/H200 data-sheet peaks, and ReCAST's share "
          "of them (defaults; full: --gain-frac 1 --score-precision fp32):")  # fmt: skip
    print(f"  {'family':<16} {'transformer':>11} {'text enc.':>9} {'fwd@512':>8} {'epoch@512':>9}"
          f" {'ReCAST':>7} {'full':>6} {'epoch@1024':>10} {'ReCAST':>7}")  # fmt: skip
    print(f"  {'':<16} {'B params':>11} {'B params':>9} {'TFLOP':>8} {'s':>9} {'share':>7} "
          f"{'share':>6} {'s':>10} {'share':>7}")  # fmt: skip
    for family in FAMILY_NAMES:
        f, p = fams[family], family_params(c, family)
        secs = [modelled_seconds(phase_flops(f, {**r, "eval": False}, amortised=True), peaks)
                for r in (r512, {**r512, **full}, r1024)]  # fmt: skip
        epoch = [sum(s.values()) for s in secs]
        share = [s["recast"] / e for s, e in zip(secs, epoch, strict=True)]
        print(f"  {family:<16} {p['transformer']:>11.2f} {p['text']:>9.2f} "
              f"{f['transformer_fwd@512'] / 1e12:>8.2f} {epoch[0]:>9.1f} {share[0]:>7.1%} "
              f"{share[1]:>6.1%} {epoch[2]:>10.1f} {share[2]:>7.1%}")  # fmt: skip


# --shard's communication, modelled: FSDP2 all-gathers every layer of the transformer (bf16) for
# each forward and again for its backward, and each text encoder per encode call; only the LoRA
# gradients (fp32) are reduce-scattered (the base weights are frozen)
NVLINK_BYTES_S = 450e9  # per direction per GPU, H100/H200 SXM (NVLink 4: 900 GB/s both ways)
# between nodes: 4 × 400 Gb/s InfiniBand NDR per node of 8 GPUs, per direction (200 GB/s a node),
# which a collective over every GPU of the node shares: 25 GB/s a GPU
NODE_NETWORK_BYTES_S = 4 * 400e9 / 8
NETWORK_BYTES_S = NODE_NETWORK_BYTES_S / 8
SHARD_RANKS = 8  # GPUs of a node
SHARD_NODES = 4  # the several-node case of the table
PARTS = {"SD3.5-Medium": "sd3world", "FLUX.1-dev": "fluxworld", "FLUX.1-schnell": "fluxworld",
         "FLUX.2-klein 4B": "flux2world", "Qwen-Image": "qwenimageworld"}  # fmt: skip


def part_of(family: str):
    """The family part (worlds/*world.py) of a family of FAMILY_NAMES."""
    import importlib

    return importlib.import_module(f"worlds.{PARTS[family]}")


def lora_params(c: dict, family: str, rank: int = 32) -> float:
    """Trainable parameters of one adapter (rank r on each Linear the family part targets)."""
    import torch

    from worlds import diffusersworld

    part = part_of(family)
    with torch.device("meta"):
        tr = sd35m_models(c) if family == "SD3.5-Medium" else family_models(c, family)
        tr = tr["transformer"]
    mods = dict(tr.named_modules())
    names = diffusersworld.lora_targets(tr, part.LORA_TARGETS)
    return float(sum(rank * (mods[n].in_features + mods[n].out_features) for n in names))


def shard_costs(c: dict, f: dict, r: dict, family: str, ranks: int = SHARD_RANKS,
                nodes: int = 1, hsdp: bool = True) -> dict:  # fmt: skip
    """One epoch of run `r` (the one-GPU command's work split over `ranks` GPUs) under --shard:
    per rank, the bytes all-gathered and reduce-scattered and their seconds on NVLink, beside the
    compute seconds of the cost model (data-sheet peaks); and what is not hidden behind compute.
    FSDP2 gathers layer i+1 while layer i computes (forward) and layer i-1 while i's backward
    runs, and reduce-scatters i's gradients during i-1's backward, so a forward's gathers hide
    behind its compute when they take less time: exposed = max(0, gather − compute) per forward.

    `nodes` > 1: `nodes` nodes of `ranks` GPUs running `nodes` times the prompts and --batch-size
    (each GPU's work as on one node). `hsdp` (recast.py's mesh on several nodes): each node shards
    and gathers on its NVLink as one node does, and the nodes all-reduce the LoRA gradients' node
    shards between them on the network (2 (nodes−1)/nodes of 1/ranks of them per GPU, at
    NETWORK_BYTES_S); flat (one mesh over every GPU): each GPU keeps 1/(nodes·ranks) and every
    gather crosses the network, whose share of a node's links bounds a ring over the nodes."""
    p = family_params(c, family)
    peaks = peak_rates("H100/H200 SXM")
    if nodes > 1:  # each GPU's work as on one node
        r = {**r, "prompts": r["prompts"] * nodes, "batch_size": r["batch_size"] * nodes}
    group = ranks if hsdp else ranks * nodes  # the GPUs that shard a model among them
    link = NVLINK_BYTES_S if group <= ranks else NETWORK_BYTES_S  # a gather's slowest link
    replicas = nodes if hsdp else 1
    ranks = ranks * nodes  # every GPU: the work splits over all of them
    res, T, P, G = r["resolution"], r["steps"], r["prompts"], r["group_size"]
    fwd, bwd = f[f"transformer_fwd@{res}"], f[f"transformer_bwd@{res}"]
    share = (group - 1) / group  # of every gathered byte, what comes from the other ranks
    tr_bytes, text_bytes = 2 * p["transformer"] * 1e9, 2 * p["text"] * 1e9
    lora_bytes = 4 * lora_params(c, family)
    images = P * G // ranks  # this rank's rollout, in sampler calls of --batch-size images
    calls = T * -(-images // r["batch_size"])
    per_call = min(images, r["batch_size"])
    pairs = max(1, round(r["train_frac"] * P * G * T))
    micro = -(-pairs // r["batch_size"])  # micro-batches; each rank takes batch / ranks pairs
    local = r["batch_size"] / ranks
    passes = 2 + (r["kl_coef"] > 0)  # policy, old, reference forwards; then the backward
    chunk = part_of(family).ENCODE_CHUNK  # prompts per text-encoder call
    encodes = -(-(P // ranks) // chunk) + -(-P // chunk)  # rollout's share, the update's all
    gathered = share * (tr_bytes * (calls + micro * (passes + 1)) + text_bytes * encodes)
    scattered = share * lora_bytes * micro / r.get("grad_accum", 1)
    # HSDP: the replicas all-reduce each GPU's reduce-scattered shard (ring: 2 (n−1)/n of it)
    network = 2 * (replicas - 1) / replicas * lora_bytes / group * micro / r.get("grad_accum", 1)
    gather_s = share * tr_bytes / link  # one whole transformer
    rate = peaks["bf16"]
    ckpt = fwd * bool(r["grad_checkpointing"])
    exposed = (calls * max(0.0, gather_s - per_call * fwd / rate)
               + micro * passes * max(0.0, gather_s - local * fwd / rate)
               + micro * max(0.0, gather_s - local * (bwd + ckpt) / rate))  # fmt: skip
    compute = sum(modelled_seconds(phase_flops(f, {**r, "eval": False}, amortised=True),
                                   peaks).values()) / ranks  # fmt: skip
    comm = (gathered + scattered) / link + network / NETWORK_BYTES_S
    return {"gathered_gb": gathered / 1e9, "scattered_gb": scattered / 1e9, "comm_s": comm,
            "network_gb": (network + (gathered + scattered) * (link == NETWORK_BYTES_S)) / 1e9,
            "compute_s": compute, "exposed_s": exposed,
            "exposed_share": exposed / (compute + exposed)}  # fmt: skip


def print_shard_costs(c: dict, fams: dict, r512: dict, r1024: dict) -> None:
    print(f"--shard on {SHARD_RANKS} GPUs, modelled: one epoch of the one-GPU command split "
          f"{SHARD_RANKS} ways (1024 px with --grad-checkpointing); per GPU, the transformer's "
          "layers all-gathered (bf16) for every forward and backward, the text encoders' per "
          "encode call, the LoRA gradients (fp32) reduce-scattered per optimizer step, at "
          f"{NVLINK_BYTES_S / 1e9:.0f} GB/s (NVLink, one direction); compute at the data-sheet "
          "peaks; exposed: the gathers that take longer than the forward they feed")  # fmt: skip
    print(f"  {'family':<16} {'px':>5} {'gathered':>9} {'scattered':>9} {'comm':>7} "
          f"{'compute':>8} {'exposed':>8} {'share of':>8}")  # fmt: skip
    print(f"  {'':<16} {'':>5} {'GB':>9} {'GB':>9} {'s':>7} {'s':>8} {'s':>8} "
          f"{'epoch':>8}")  # fmt: skip
    for family in FAMILY_NAMES:
        for r in (r512, r1024):
            x = shard_costs(c, fams[family], r, family)
            print(f"  {family:<16} {r['resolution']:>5} {x['gathered_gb']:>9.0f} "
                  f"{x['scattered_gb']:>9.2f} {x['comm_s']:>7.1f} {x['compute_s']:>8.1f} "
                  f"{x['exposed_s']:>8.1f} {x['exposed_share']:>8.1%}")  # fmt: skip
    print(f"--shard on {SHARD_NODES} nodes of {SHARD_RANKS} GPUs, modelled: each GPU's work as on "
          f"one node ({SHARD_NODES}× the prompts and --batch-size); between nodes "
          f"{NODE_NETWORK_BYTES_S / 1e9:.0f} GB/s a node (4 × 400 Gb/s InfiniBand, one direction), "
          f"{NETWORK_BYTES_S / 1e9:.0f} GB/s a GPU; HSDP (recast.py's mesh: shard within a node, "
          "replicate across nodes) against one flat mesh over every GPU; per GPU, seconds of an "
          "epoch")  # fmt: skip
    print(f"  {'family':<16} {'px':>5} {'1 node':>8} {'HSDP':>8} {'network':>8} {'flat':>8} "
          f"{'network':>8}")  # fmt: skip
    print(f"  {'':<16} {'':>5} {'exposed':>8} {'exposed':>8} {'GB':>8} {'exposed':>8} "
          f"{'GB':>8}")  # fmt: skip
    for family in FAMILY_NAMES:
        for r in (r512, r1024):
            one = shard_costs(c, fams[family], r, family)
            hsdp = shard_costs(c, fams[family], r, family, nodes=SHARD_NODES)
            flat = shard_costs(c, fams[family], r, family, nodes=SHARD_NODES, hsdp=False)
            print(f"  {family:<16} {r['resolution']:>5} {one['exposed_s']:>8.1f} "
                  f"{hsdp['exposed_s']:>8.1f} {hsdp['network_gb']:>8.2f} "
                  f"{flat['exposed_s']:>8.1f} {flat['network_gb']:>8.0f}")  # fmt: skip


def config_params(c: dict) -> dict:
    """Parameter counts of the configured models, built on the meta device."""
    import torch

    with torch.device("meta"):
        models = sd35m_models(c)
    return {k: n_params(m) for k, m in models.items()}


def main(argv=None) -> None:
    args = parse(argv)
    if args.cost_model:
        print_cost_model()
        return
    import torch

    if args.reward_timing:
        if not torch.cuda.is_available():
            fail("--reward-timing", "times the reward models at their real size on a CUDA GPU "
                 "and there is none here (its CPU path is tested on tiny configurations: "
                 "benchmarks/test_scale_check.py)")  # fmt: skip
        write_reward_timing(Path(args.out), torch.device("cuda"))
        return
    if not args.shrink and not torch.cuda.is_available():
        fail("--shrink", "the full-size check needs a CUDA GPU and there is none here; on the CPU "
             "run the scaled-down check instead, e.g. --shrink 16")  # fmt: skip
    path = Path(args.out) / "scale_check.md"

    def save(report: dict) -> None:
        os.makedirs(args.out, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(markdown(report))
        os.replace(tmp, path)

    report = check(args, save)
    print(markdown(report).split("\n## All figures")[0])
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
