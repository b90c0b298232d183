"""Will it fit? The peak GPU memory of each phase of a recast.py run, planned on a CPU.

    python benchmarks/memory_plan.py                           # docs/sd35.md's one-GPU command
    python benchmarks/memory_plan.py --model flux1-dev --guidance 3.5   # docs/models.md's
    python benchmarks/memory_plan.py --model qwen-image --grad-checkpointing --resolution 1024
    python benchmarks/memory_plan.py --resolution 1024 --grad-checkpointing --gpu-memory 141
    python benchmarks/memory_plan.py --world-size 8 --prompts 64 --batch-size 64   # per GPU
    python benchmarks/memory_plan.py --model flux1-dev --guidance 3.5 --world-size 8 --shard
    python benchmarks/memory_plan.py --model ./sd3.5-medium    # a pipeline folder's configurations
    python benchmarks/memory_plan.py --model TINY_FOLDER --check-cpu   # plan against CPU allocator
    python benchmarks/memory_plan.py --rewards paper2 --lambda 0.4,0.2,0.2,0.2 \\
        --judges paper2-judges                                 # two 7B VLMs: docs/sd35.md's paper2

Every model of the run is built at its real size on the meta device (nothing is downloaded or
allocated): the transformer with its two LoRA adapters (diffusersworld.DiffusersWorld itself with
the family's part, handed the pipeline), the VAE, the text encoders, and each reward and
--judges model (a judge runs at eval). They come from the configurations in benchmarks/configs
(the CLIP rewards; ocr, vqa,
imagereward and hpsv3, modelzoo.REWARD_CONFIGS, the VLMs at the image token counts their image
processors make; a reward a user registered, from `--reward-config NAME=FILE`; without `--model`,
SD3.5-Medium; `--model` NAME of CONFIG_MODELS, another family at its real size with generated
tokenizers) or from a pipeline folder's configurations, and the training flags default to
docs/sd35.md's one-GPU command; any recast.py flag may be given, and recast.py's own
checks reject what it would reject (exit 2, naming the flag). `--world-size N` plans one GPU of a
`torchrun --nproc_per_node=N` run (as recast.py reads them, --prompts counts all ranks, and
--batch-size all ranks' pairs in the update but each rank's images in the rollout and eval);
with `--shard` too, one rank of `recast.py --shard` (FSDP2, emulated on the meta models: Shards);
above 8, nodes of 8 GPUs (GPUS_PER_NODE; --world-size a multiple of 8), each sharding the models
among its own (HSDP).

Each phase of one epoch runs recast.py's own phase functions on those meta models (PlannedRun, a
harness.Run with the planner's hooks), under a tracer that counts every tensor's bytes as a CUDA
GPU would hold them (benchmarks/memtrace.py: flash attention as on the GPU, bf16 autocast where
diffusersworld/recast use it, the values of token ids and masks where a pipeline reads them, AdamW
in its foreach form, which recast.py's AdamW takes on CUDA; fused AdamW does not run on meta
tensors). Each loop of the method runs every batch; the transformer runs on the batches that set
the phase's peak (PlannedRun.progress), the others get its output's tensor without its forward:
- rollout: recast.rollout, the old policy over this rank's groups, the last batch (and the last
  full one, where the last is partial) through the transformer, the earlier ones' x0, x̂0 held;
- score: world.decode of this rank's images and every reward (recast.score_all), fp32;
- recast: recast.score_steps as the rank that scores the most groups, in --score-precision;
  recast.optimality;
- update: recast.nft_update, every micro-batch, those of its first optimizer step through the
  policy (with grad, through LoRA), the old and the reference: recast_kernels.nft_loss, backward,
  gradient clipping and the AdamW step, with the optimizer's state already made (a later step's);
- eval: harness.evaluate of this rank's held-out images in chunks of --batch-size, the last
  chunk (and the last full one) through the transformer, the images kept and concatenated;
- save: harness.save_epoch's checkpoint (under --shard, its gather of the largest trained tensor).
Before them, loading (load_phase, counted from the models' sizes, not traced): the GPU's peak
while the models are loaded (every model whole without --shard; under --shard the rank's shards,
one broadcast tensor, the VAE and reward models), and the host memory of rank 0's node (without
--shard every rank reads the pipeline whole; under --shard rank 0 alone reads one model at a
time), printed under the verdict. The verdict names the phase whose peak is the largest.
Tensors the loop keeps from one phase into the next (x0, x̂0, scores, the base model's eval images)
are carried, as recast.main keeps them. Per phase it prints the peak allocated GiB, split into
parameters (and buffers), gradients, optimizer state, data carried from earlier phases,
activations (made by the phase's forwards) and temporaries (backward and the optimizer step).

The trace counts each convolution's cuDNN workspace while it runs (memtrace.conv_workspace, as one
H200 measured it: benchmarks/decode_memory.py). The verdict adds what the trace does not count:
the CUDA context (CONTEXT_GIB), cuBLAS workspaces (WORKSPACE_GIB) and the caching allocator's
fragmentation (FRAGMENTATION of the peak);
where the run does not fit, it plans again with --grad-checkpointing and smaller --batch-size
(with --grad-accum keeping the pairs per optimizer step) and names the flags that fit.
`--check-cpu` runs the same calls for real on the CPU (random weights) and puts each phase's
planned peak beside the CPU allocator's (torch.profiler's memory events); `--json PATH` writes the
plan, keyed by the phase names of recast.py's mem/<phase> and scale_check.py's report.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere

import torch  # noqa: E402 (after the path)
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import harness  # noqa: E402
import recast  # noqa: E402
import rewards  # noqa: E402
from benchmarks import memtrace, modelzoo  # noqa: E402
from plumbing import cli, distributed  # noqa: E402
from recast_kernels.nft_loss import nft_loss, reference_nft_loss  # noqa: E402
from reward_models import imagereward_model  # noqa: E402
from worlds import diffusersworld, families  # noqa: E402

PHASES = ("rollout", "score", "recast", "update", "eval")
# docs/sd35.md's one-GPU command: the training flags when none is given
DOCS_COMMAND = ["--rewards", "paper1", "--lambda", "0.4,0.2,0.2,0.2", "--resolution", "512",
                "--steps", "10", "--prompts", "32", "--group-size", "8", "--batch-size", "16",
                "--kl-coef", "1e-4", "--eval-seeds", "2"]  # fmt: skip
# --model names that mean a family at its real size, from benchmarks/configs (modelzoo)
# (modelzoo's name of it, its pipeline class)
CONFIG_MODELS = {"sd35m": ("SD3.5-Medium", "StableDiffusion3Pipeline"),
                 "flux1-dev": ("FLUX.1-dev", "FluxPipeline"),
                 "flux1-schnell": ("FLUX.1-schnell", "FluxPipeline"),
                 "flux2-klein-4b": ("FLUX.2-klein 4B", "Flux2KleinPipeline"),
                 "qwen-image": ("Qwen-Image", "QwenImagePipeline")}  # fmt: skip
EVAL_PROMPTS = 32  # held-out prompts when no --eval-prompts-file is given
STAND_IN_PROMPTS = ROOT / "prompts" / "ocr_train.txt"  # for recast.py's checks (parse)
# What the trace does not count (docs/sd35.md says where each figure comes from)
CONTEXT_GIB = 1.0  # CUDA context and kernels: 0.5-1 GiB on recent drivers; the upper end
WORKSPACE_GIB = 0.5  # cuBLAS (tens of MiB per stream); cuDNN's convolution workspaces are traced
# (memtrace.conv_workspace: a copy of each convolution's input and output, as one H200 measured)
FRAGMENTATION = 0.10  # reserved - allocated of the caching allocator, as a share of the peak
GIB = 2**30


def fail(flag: str, message: str) -> NoReturn:
    cli.fail(flag, message, "memory_plan.py")


# ---------------------------------------------------------------------------------------------
# Flags: the planner's own, then recast.py's (parsed and checked by recast.py's own code)
# ---------------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, recast.Args]:
    """(the planner's flags, recast.Args): recast.py's flags on top of DOCS_COMMAND."""
    ap = cli.Parser(prog="memory_plan.py", description=__doc__, add_help=False,
                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--help", "-h", action="store_true")
    ap.add_argument("--gpu-memory", type=float, default=79.6,
                    help="GiB of one GPU as CUDA reports it (default 79.6: an H100 80GB's "
                    "81,559 MiB; an H200: 140.4)")  # fmt: skip
    ap.add_argument(
        "--world-size",
        type=int,
        default=1,
        help="GPUs of the torchrun command (--nproc_per_node; default 1); the plan is per GPU",
    )
    ap.add_argument(
        "--shrink",
        type=int,
        default=0,
        help="divide every width of SD3.5-Medium's configurations (sd35m, no other --model) by "
        "this: 2, 4, 8 or 16 (modelzoo.SHRINKS); default 0, the real sizes",
    )
    ap.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS,
                    help="held-out prompts, when neither --eval-prompts-file nor --prompts-file "
                    "is given (a --prompts-file alone: its last 10 %%, as recast.py holds out; "
                    f"default {EVAL_PROMPTS})")  # fmt: skip
    ap.add_argument(
        "--no-suggest",
        action="store_true",
        help="do not plan other flags when the run does not fit",
    )
    ap.add_argument(
        "--check-cpu",
        action="store_true",
        help="also run the same calls on the CPU and compare with its allocator",
    )
    ap.add_argument("--json", default="", help="write the plan to this file")
    ap.add_argument("--reward-config", action="append", default=[], metavar="NAME=FILE",
                    help="plan reward or judge NAME with the model of FILE, a configuration "
                    "file as benchmarks/configs holds them (\"kind\": clip, ocr, blip or vlm, "
                    "and \"config\"; e.g. benchmarks/configs/vqa_qwen25vl7b.json); "
                    "repeatable")  # fmt: skip
    argv = sys.argv[1:] if argv is None else list(argv)
    own, rest = ap.parse_known_args(argv)
    if own.help:
        ap.print_help()
        print("\nand every flag of recast.py (python recast.py --help)")
        sys.exit(0)
    if not (0 < own.gpu_memory < math.inf):
        fail("--gpu-memory", f"must be a positive number of GiB, got {own.gpu_memory}")
    if own.eval_prompts < 1:
        fail("--eval-prompts", f"must be ≥ 1, got {own.eval_prompts}")
    if own.world_size < 1:
        fail("--world-size", f"must be ≥ 1, got {own.world_size}")
    if own.shrink and own.shrink not in modelzoo.SHRINKS:
        fail("--shrink", f"must be one of {', '.join(map(str, modelzoo.SHRINKS))}")
    if own.check_cpu and not own.shrink and model_flag(rest) == "sd35m":
        fail("--check-cpu", "runs the same calls for real on this CPU: give --shrink 4 (or 8, 16) "
             "or a small --model folder")  # fmt: skip
    folder = os.path.dirname(os.path.abspath(own.json)) if own.json else ""
    if own.json and (os.path.isdir(own.json) or not os.access(folder, os.W_OK)):
        fail("--json", f"{own.json} cannot be written: give a file in a writable folder")
    # --model as recast.py's parser reads it (--model=NAME, an abbreviation, the last given)
    model = model_flag(rest)
    if model in CONFIG_MODELS:
        rest = [*rest, "--model", model]
    elif not os.path.isfile(os.path.join(model, "model_index.json")):
        fail("--model", f"{model!r} is neither a pipeline folder (with model_index.json) nor a "
             f"configuration of benchmarks/configs ({', '.join(CONFIG_MODELS)})")  # fmt: skip
    if own.shrink and model != "sd35m":
        fail("--shrink", f"shrinks SD3.5-Medium's configurations (sd35m), not {model}")
    full = [*DOCS_COMMAND, *rest]
    args = cli.parse(recast.Args, full, recast.__doc__, harness.BEFORE)
    harness.scoring_defaults(args, full)  # the diffusers scoring defaults, as recast.py sets them
    cli.check(args, own.world_size, harness.RESUMABLE, harness.BEFORE)
    known = [*rewards.REWARDS, *rewards.LOADERS]
    names = harness.expand_names("--rewards", args.rewards, known)
    cli.parse_lambda(args.lam, names)
    judges = harness.expand_names("--judges", args.judges, [*known, *rewards.JUDGES], True)
    if args.profile:
        fail("--profile", "plans a training run; --profile trains nothing")
    if args.shard and own.world_size < 2:
        fail("--shard", "plans one rank of a sharded torchrun run: give --world-size N (N ≥ 2), "
             "or drop --shard")  # fmt: skip
    if args.shard and own.check_cpu and own.world_size > GPUS_PER_NODE:
        # its gloo processes, without torchrun's nodes, shard on one flat mesh of every rank
        fail("--check-cpu", f"with --shard runs --world-size gloo processes as one node: give "
             f"--world-size {GPUS_PER_NODE} or fewer, got {own.world_size}")  # fmt: skip
    if args.shard and own.world_size > GPUS_PER_NODE and own.world_size % GPUS_PER_NODE:
        # torchrun starts as many ranks on each node: nodes of 8 make a multiple of 8
        fail("--world-size", f"above {GPUS_PER_NODE} GPUs --shard is planned on nodes of "
             f"{GPUS_PER_NODE}, each sharding the models among its own: give a multiple of "
             f"{GPUS_PER_NODE}, got {own.world_size}")  # fmt: skip
    harness.check_rewards(args, names, judges)
    given = args.prompts_file  # none: the plan writes its own (prompt_files); until then a
    args.prompts_file = given or str(STAND_IN_PROMPTS)  # shipped file stands in, so that the
    try:  # checks after it run (os.devnull, not a file, stopped them: a missing
        diffusersworld.check(args)  # --eval-prompts-file ended in a traceback)
    except diffusersworld.BadInput as e:
        fail(e.flag, str(e))
    if given or args.eval_prompts_file:  # what a reward reads from each prompt (ocr's quoted
        harness.check_prompts(args, names, judges)  # text), in the files given
    args.prompts_file = given
    try:  # the family's flags (FLUX.1-dev's --guidance, the resolution's step), as at load
        family, configs = family_configs(model)
        family.check(configs, args)
    except diffusersworld.BadInput as e:
        fail(e.flag, str(e))
    # harness.check_held_out's rule, on the held-out prompts the plan evaluates
    given = bool(args.eval_prompts_file or args.prompts_file)  # else the planner's --eval-prompts
    held = held_out(args, own.eval_prompts)
    unequal = args.shard and held * args.eval_seeds % own.world_size
    if held < own.world_size or unequal:
        fail("--eval-prompts-file" if given else "--eval-prompts", f"{held} held-out prompts × "
             f"--eval-seeds {args.eval_seeds} on {own.world_size} processes: recast.py needs one "
             "prompt a process at least, and under --shard a multiple of the processes (equal "
             "shares)")  # fmt: skip
    own.specs = reward_specs(own.reward_config)
    for flag, group in (("--rewards", names), ("--judges", judges)):
        # a reward registered in rewards.LOADERS by a user: its model is not known here
        unknown = [n for n in group if n not in BACKBONES and n not in own.specs]
        if unknown:
            example = modelzoo.CONFIGS / "vqa_qwen25vl7b.json"
            fail(flag, f"no model configuration for {', '.join(unknown)}: the planner knows "
                 f"{', '.join([*BACKBONES, *own.specs])}; give it one with --reward-config "
                 f"{unknown[0]}=FILE.json, a file as benchmarks/configs holds them (\"kind\": "
                 f"{', '.join(modelzoo.REWARD_KINDS)}; \"config\": the model's sizes; e.g. "
                 f"{example.relative_to(ROOT)})")  # fmt: skip
    own.names, own.judges = names, judges
    return own, args


def model_flag(rest: list[str]) -> str:
    """The --model of recast.py's flags `rest`, read as recast.py's parser reads it (the last one
    given, or --model=NAME; an abbreviation it refuses); "sd35m" where none is given."""
    ap = cli.Parser(prog="memory_plan.py", add_help=False)
    ap.add_argument("--model", default="sd35m")
    return ap.parse_known_args(rest)[0].model


def reward_specs(given: list[str]) -> dict:
    """{reward: its configuration} of modelzoo.REWARD_CONFIGS, then of --reward-config NAME=FILE
    (which may replace one: a 3B vqa model); a bad one exits 2 naming --reward-config."""
    specs = {n: modelzoo.reward_config(modelzoo.CONFIGS / f"{f}.json")
             for n, f in modelzoo.REWARD_CONFIGS.items()}  # fmt: skip
    for item in given:
        name, _, path = item.partition("=")
        if not name or not path:
            fail("--reward-config", f"takes NAME=FILE (a reward's name, its configuration "
                 f"file), got {item!r}")  # fmt: skip
        try:
            specs[name] = modelzoo.reward_config(path)
        except ValueError as e:
            fail("--reward-config", f"{e}; see benchmarks/configs/vqa_qwen25vl7b.json")
    return specs


# ---------------------------------------------------------------------------------------------
# Models: the pipeline and the reward models, built on the current device from configurations
# ---------------------------------------------------------------------------------------------
def family_configs(model: str) -> tuple:
    """(the family part, {"pipeline", "transformer", "vae", "scheduler": configuration}) of
    --model: a name of CONFIG_MODELS, or a pipeline folder."""
    if model in CONFIG_MODELS:
        family, part = CONFIG_MODELS[model]
        return families.PARTS[part], modelzoo.family_configs(modelzoo.load_configs(), family)
    return families.family_of(model), diffusersworld.read_configs(model)


def pipeline(model: str, c: dict, tokenizers: Path):
    """The diffusers pipeline of --model (fp32, random weights, on the current device): a family
    of benchmarks/configs at its real size, or a folder's component configurations and
    tokenizers (every component built from its configuration, no weight read)."""
    import importlib

    import diffusers
    import transformers

    if model == "sd35m":
        return modelzoo.sd35m_pipeline(c, modelzoo.sd35m_models(c), tokenizers)
    if model in CONFIG_MODELS:
        return modelzoo.family_pipeline(c, CONFIG_MODELS[model][0], tokenizers)
    index, parts = diffusers.DiffusionPipeline.load_config(model), {}
    for name, value in index.items():
        if name.startswith("_") or not isinstance(value, list):
            parts[name] = value if not name.startswith("_") else None  # e.g. is_distilled
            continue
        if value == [None, None]:  # left out (SD3 without T5)
            parts[name] = None
            continue
        cls = getattr(importlib.import_module(value[0]), value[1])
        folder = os.path.join(model, name)
        if name.startswith(("tokenizer", "scheduler")):
            parts[name] = cls.from_pretrained(folder)
        elif value[0] == "diffusers":
            parts[name] = cls.from_config(cls.load_config(folder))
        else:
            parts[name] = cls(transformers.AutoConfig.from_pretrained(folder))
    parts = {k: v for k, v in parts.items() if not k.startswith("_")}
    return getattr(diffusers, index["_class_name"])(**parts)


# reward → (its CLIP's variable, its processor's variable, its configuration in benchmarks/configs)
BACKBONES = {
    "pickscore": ("RECAST_PICKSCORE", "RECAST_PICKSCORE_PROCESSOR", "clip_vit_h14"),
    "clipscore": ("RECAST_CLIPSCORE", "RECAST_CLIPSCORE", "clip_vit_l14"),
    "aesthetic": ("RECAST_AESTHETIC", "RECAST_AESTHETIC", "clip_vit_l14"),
    "hpsv2": (None, None, "clip_vit_h14"),  # an open_clip ViT-H-14 of its own
}


def reward_models(names: list[str], c: dict, tokenizers: Path, device, specs: dict | None = None,
                  gpu_form: bool = True, replay=None) -> tuple[dict, list]:  # fmt: skip
    """({name: reward function}, [their models and tensors]) on the current device, frozen as
    rewards.py loads them: each CLIP (fp32) from the configuration of the folder its RECAST_*
    variable names, else from benchmarks/configs; rewards on the same CLIP share it, as
    rewards._clip does; the reward functions are rewards.py's own scorers. A name of `specs`
    (reward_specs: ocr, vqa, imagereward, hpsv3, --reward-config) is built from its configuration
    (model_reward), a vision-language model in bf16 on a GPU (`gpu_form`) as rewards.VLM loads
    it."""
    from transformers import AutoProcessor, CLIPConfig, CLIPModel, CLIPProcessor

    tok = modelzoo.clip_tokenizer(tokenizers / "reward_clip")
    images = modelzoo.reward_image_processor(c["reward_image_size"])
    models, fns, heads = {}, {}, []
    for name in names:
        if name in (specs or {}):
            fns[name], held = model_reward(specs[name], tokenizers, device, gpu_form, replay)
            heads.append(held)
            continue
        model_var, processor_var, key = BACKBONES[name]
        folder = os.environ.get(model_var or "", "")
        proc_folder = os.environ.get(processor_var or "", "")
        source = (folder, proc_folder) if os.path.isdir(folder) else (key, "")
        source = (*source, name) if name == "hpsv2" else source
        if source not in models:
            config = CLIPConfig.from_pretrained(folder) if source[0] == folder else None
            clip = CLIPModel(config or modelzoo.clip_config(c[key]))
            processor = (AutoProcessor.from_pretrained(proc_folder) if os.path.isdir(proc_folder)
                         else CLIPProcessor(image_processor=images, tokenizer=tok))  # fmt: skip
            # the prompts fill CLIP's 77 tokens, so the real mask is all ones and transformers
            # skips it; without it, meta tensors need not be read to find that out
            processor.tokenizer.model_input_names = ["input_ids"]
            models[source] = (clip.float().eval().requires_grad_(False), processor)
        clip, processor = models[source]
        if name == "pickscore":
            fns[name] = rewards.pickscore_scorer(clip, processor)
        elif name == "clipscore":
            fns[name] = rewards.clipscore_scorer(clip, processor)
        elif name == "aesthetic":
            head = aesthetic_head(c, device)
            heads += head
            fns[name] = rewards.aesthetic_scorer(clip, processor, head)
        else:
            fns[name] = hpsv2_device_work(clip, tok, c["reward_image_size"])
    return fns, [m for m, _ in models.values()] + [t for held in heads for t in held]


class Replay:
    """A reward model's forward on inputs of one shape, traced once on meta and replayed after:
    a 7B vision-language model's trace takes seconds an image on this CPU (Qwen2.5-VL's vision
    tower attends window by window), and a run scores hundreds. The first call of a key (the
    inputs' shape and the form's autocast) runs and records how far the tracker's total rose
    above where it started; a later call allocates and frees that many bytes, then returns
    zeros of the output's shape. The forwards hold nothing once they return, so the peak is the
    traced one. Off the meta trace (tracker None: the CPU check) every call runs."""

    def __init__(self, form: memtrace.GpuForm):
        self.form, self.tracker, self.seen = form, None, {}

    def __call__(self, key: tuple, fn, *args) -> torch.Tensor:
        t = self.tracker
        if t is None:
            return fn(*args)
        key = (*key, self.form.autocast)
        if key in self.seen:
            rise, shape = self.seen[key]
            temporary = torch.empty(rise, dtype=torch.uint8, device="meta")
            del temporary
            return torch.zeros(shape, device="meta")
        start, saved = sum(t.live.values()), (t.peak, t.peak_split)
        t.peak = start
        out = fn(*args)
        self.seen[key] = (t.peak - start, out.shape)
        if saved[0] >= t.peak:
            t.peak, t.peak_split = saved
        return out


def model_reward(spec: dict, tokenizers: Path, device, gpu_form: bool, replay=None) -> tuple:
    """(the reward function, [its models and head tensors]) of a reward configuration
    (modelzoo.reward_config), its models frozen on the current device. Its GPU work, as rewards.py
    does it: "ocr" (rewards.ocr_scorer: the detector on each image at its own size, padded to 32
    px, then the recogniser's convolutions on boxes_per_image line boxes line_height px high and
    box_width wide; the boxes are found from the detector's values, which meta tensors do not
    have, on the host), "blip" (imagereward_model.imagereward_scorer itself, with a generated BERT
    tokenizer: the token ids' values do not matter, only the 35 of them), "vlm" (a
    Qwen2-VL-family model on rewards.CHUNK images a forward at the token count the image
    processor makes of them, modelzoo.vlm_inputs: "output" "logits" asks for the answer's logits
    only, as rewards.vqa_scorer; "hidden", the last hidden states and the reward head, as
    hpsv3_model.hpsv3_scorer), "clip" (rewards.clipscore_scorer)."""
    kind, cfg = spec["kind"], spec["config"]
    replay = replay or (lambda key, fn, *args: fn(*args))
    models = modelzoo.reward_models(spec)
    for m in models.values():
        m.eval().requires_grad_(False)
    if kind == "vlm" and gpu_form:  # rewards.VLM: bf16 on a GPU
        models["model"].to(torch.bfloat16)
    widths = cfg.get("head", [])
    head = [(torch.zeros(o, i, device=device), torch.zeros(o, device=device))
            for i, o in zip(widths, widths[1:], strict=False)]  # fmt: skip
    held = [*models.values(), *(t for pair in head for t in pair)]
    if kind == "blip":
        from transformers import BertTokenizer

        folder = tokenizers / "bert"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "vocab.txt").write_text("\n".join(modelzoo.TINY_IMAGEREWARD_VOCAB) + "\n")
        tokenizer = BertTokenizer(str(folder / "vocab.txt"))
        pixels = lambda im, side: im.new_empty(len(im), 3, side, side)  # noqa: E731 (PIL's, on the host)
        return imagereward_model.imagereward_scorer(
            models["vision"], models["text"], tokenizer, head, pixels
        ), held
    if kind == "clip":
        from transformers import CLIPProcessor

        processor = CLIPProcessor(image_processor=modelzoo.reward_image_processor(
            cfg["vision_config"]["image_size"]), tokenizer=modelzoo.clip_tokenizer(
            tokenizers / "reward_clip"))  # fmt: skip
        processor.tokenizer.model_input_names = ["input_ids"]
        return rewards.clipscore_scorer(models["model"], processor), held

    def read(im: torch.Tensor) -> torch.Tensor:  # ocr_reader.TextReader.read of one image
        x = F.pad(im.float(), (0, -im.shape[-1] % 32, 0, -im.shape[-2] % 32))  # .boxes
        models["detector"](x[None]).float()
        line = torch.zeros(1, 1, cfg["line_height"], cfg["box_width"], device=im.device)
        for _ in range(cfg["boxes_per_image"]):  # the recogniser's convolutions; its LSTMs
            models["recogniser"].FeatureExtraction.ConvNet(line)  # hold < 1 MiB, and on meta
        return torch.zeros((), device=im.device)  # they run step by step (5 s an image)

    @torch.no_grad()
    def ocr(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        rgb = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        for im in rgb:
            replay(("ocr", *im.shape), read, im)
        return torch.zeros(len(prompts), device=images.device)

    def forward(n: int, height: int, width: int, device) -> torch.Tensor:
        inputs = modelzoo.vlm_inputs(cfg, n, height, width, device)
        if cfg.get("output", "logits") == "logits":  # the answer's logits (rewards.vqa_scorer)
            logits = models["model"](**inputs, use_cache=False, logits_to_keep=2).logits
            return logits[:, :-1].float().log_softmax(-1)[:, 0, 0].exp()
        hidden = models["model"].model(**inputs, use_cache=False).last_hidden_state
        hidden = hidden[:, -3].float()  # at <|Reward|>, near the end of HPSv3's question
        for i, (w, b) in enumerate(head):  # hpsv3_model.hpsv3_scorer's head: μ
            hidden = F.linear(hidden, w, b)
            hidden = hidden if i == len(head) - 1 else F.relu(hidden)
        return hidden[:, 0]

    @torch.no_grad()
    def vlm(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out, (height, width) = [], images.shape[-2:]
        for s in range(0, len(prompts), rewards.CHUNK):
            n = len(prompts[s : s + rewards.CHUNK])
            out.append(replay(("vlm", id(spec), n, height, width), forward, n, height, width,
                              images.device))  # fmt: skip
        return torch.cat(out)

    return (ocr if kind == "ocr" else vlm), held


def aesthetic_head(c: dict, device) -> list:
    """LAION's head: the file RECAST_AESTHETIC_HEAD names, or empty weights of its widths."""
    path = os.environ.get("RECAST_AESTHETIC_HEAD", "")
    if os.path.isfile(path):
        return [(w.to(device), b.to(device)) for w, b in rewards.aesthetic_head(path)]
    w = c["aesthetic_head"]
    return [(torch.zeros(o, i, device=device), torch.zeros(o, device=device))
            for i, o in zip(w, w[1:], strict=False)]  # fmt: skip


def hpsv2_device_work(clip, tok, size: int) -> rewards.RewardFn:
    """HPS v2.1's work on the GPU: rewards.hpsv2_scorer preprocesses each image with PIL on the CPU
    (which meta tensors cannot do) and sends rewards.CHUNK preprocessed images and 77 tokens per
    forward to open_clip's ViT-H-14 (here a CLIPModel of its shape, modelzoo.OpenClipLike)."""
    model = modelzoo.OpenClipLike(clip).eval()

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(prompts), rewards.CHUNK):
            chunk = prompts[s : s + rewards.CHUNK]
            pixels = torch.zeros(len(chunk), 3, size, size, device=images.device)
            tokens = tok(chunk, padding="max_length", max_length=77, truncation=True,
                         return_tensors="pt").input_ids.to(images.device)  # fmt: skip
            feats = model(pixels, tokens)
            out.append((feats["image_features"] * feats["text_features"]).sum(-1))
        return torch.cat(out)

    return score


class Autocasting:
    """The world with its v and encode under GpuForm's autocast: SD3World runs them under
    torch.autocast on CUDA, which takes no meta tensors. While `live` is False (a batch that does
    not set its phase's peak: PlannedRun.progress) v makes the velocity it would return, fp32 of
    x's shape (zeros, requiring grad for the policy's), without running the transformer."""

    def __init__(self, world, form: memtrace.GpuForm):
        self.world, self.form, self.live = world, form, True

    def __getattr__(self, name: str):
        return getattr(self.world, name)

    def v(self, which: str, x: torch.Tensor, cond, t: torch.Tensor) -> torch.Tensor:
        if not self.live:
            grad = which == "policy" and torch.is_grad_enabled()
            return torch.zeros(x.shape, device=x.device, requires_grad=grad)
        with self.form.autocasting():
            return self.world.v(which, x, cond, t)

    def encode(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        with self.form.autocasting():
            return self.world.encode(prompts)


# ---------------------------------------------------------------------------------------------
# --shard: FSDP2's memory on one rank, on the meta models
# ---------------------------------------------------------------------------------------------
def shard_share(p: torch.Tensor, ranks: int) -> float:
    """The share of p's elements one rank keeps: FSDP2 splits dim 0 into `ranks` chunks of
    ceil(d0 / ranks) rows (the last padded)."""
    if p.dim() == 0 or p.numel() == 0:
        return 1.0
    return -(-p.shape[0] // ranks) / p.shape[0]


class Shards:
    """What `recast.py --shard` holds on one rank of `ranks`, emulated on the meta models that
    the trace runs whole (FSDP2 itself needs a process group and real devices): the modules that
    plumbing.distributed.shard_models shards (world.shardable(), split into
    plumbing.distributed.layers and each model's root) count 1/ranks of each parameter
    (shard_share); each group's parameters are gathered whole, in the compute dtype, from its
    forward's start to its end (the root's around all of its layers'), and again for its
    backward, where the group computed next is gathered ahead (FSDP2's backward prefetch); on a
    GPU the next layer's forward gathers before the current one is freed (its all-gather stream
    runs ahead), `prefetch`."""

    def __init__(self, modules, ranks: int, tracker, dtype, prefetch: bool, gloo: bool):
        from plumbing.distributed import layers

        self.ranks, self.tracker, self.dtype, self.prefetch = ranks, tracker, dtype, prefetch
        self.gloo = gloo
        self.params, self.live, self.kept, self.sizes = set(), {}, None, {}
        for module in modules:
            groups = layers(module)
            inner = {id(p) for g in groups for p in g.parameters()}
            root = [p for p in module.parameters() if id(p) not in inner]
            self.params |= {id(p) for p in module.parameters()}
            self._hook(module, self._bytes(root), groups=groups)
            for i, g in enumerate(groups):
                ahead = groups[i - 1] if i > 0 else None  # backward runs the layers in reverse
                self._hook(g, self._bytes(list(g.parameters())), ahead=ahead)

    def share(self, p: torch.Tensor) -> float:
        return shard_share(p, self.ranks) if id(p) in self.params else 1.0

    def _bytes(self, params) -> int:
        """The group's parameters gathered whole (dim 0 padded to ranks × the shard's rows)."""
        whole = lambda p: p.numel() * (self.ranks * shard_share(p, self.ranks) if p.dim() else 1)  # noqa: E731
        return sum(round(whole(p)) * (self.dtype or p.dtype).itemsize for p in params)

    def gather(self, group) -> None:
        """FSDP2's all-gather of a group: this rank's shard copied in and the flat output (on gloo,
        the collective also allocates an output of its own, measured, gone when it returns), then
        the parameters copied out into their unsharded tensors, which stay; the rest goes."""
        if id(group) in self.live:
            return
        n = self.sizes[id(group)]
        empty = lambda k: torch.empty(k, dtype=torch.uint8, device="meta")  # noqa: E731
        with self.tracker.making("parameters"):
            local, flat = empty(-(-n // self.ranks)), empty(n)  # copy-in, output
            if self.gloo:
                empty(n)  # gone once the collective returns
            self.live[id(group)] = empty(n)  # copy-out
        del local, flat

    def free(self, group) -> None:
        self.live.pop(id(group), None)

    def _hook(self, m, nbytes: int, groups=(), ahead=None) -> None:
        self.sizes[id(m)] = nbytes

        def before(*_):
            self.gather(m)

        def after(*_):
            if self.prefetch and not groups:  # a layer: kept until the next one has run
                kept, self.kept = self.kept, m
                self.free(kept) if kept is not None else None
                return
            self.free(m)
            if groups and self.kept is not None:  # the root's end: the last layer goes too
                self.free(self.kept)
                self.kept = None

        def before_backward(*_):
            self.gather(m)
            if ahead is not None:
                self.gather(ahead)

        m.register_forward_pre_hook(before)
        m.register_forward_hook(after)
        m.register_full_backward_pre_hook(before_backward)
        m.register_full_backward_hook(lambda *_: self.free(m))


# ---------------------------------------------------------------------------------------------
# One epoch, phase by phase, through the project's calls
# ---------------------------------------------------------------------------------------------
class Marks:
    """Phase boundaries and what the phase makes: the tracker's on meta, no-ops elsewhere."""

    def __init__(self, tracker: memtrace.StorageTracker | None = None):
        self.tracker, self.peaks = tracker, {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = self.tracker
        if t is None:
            with torch.profiler.record_function(f"phase:{name}"):
                yield
            return
        t.carry()
        t.reset_peak()
        yield
        self.peaks[name] = {"peak": t.peak, **t.peak_split}

    def making(self, kind: str) -> contextlib.AbstractContextManager:
        return self.tracker.making(kind) if self.tracker else contextlib.nullcontext()


def gathered(x: torch.Tensor, world_size: int, dim: int = -1) -> torch.Tensor:
    """distributed.gather's memory on one rank of `world_size`: the parts (zeros: the CPU check
    reads them), then their cat. Under the sharded CPU check's process group, the gather itself."""
    if torch.distributed.is_initialized():
        return distributed.gather(x, dim)
    if world_size == 1:
        return x
    parts = [x, *(torch.zeros_like(x) for _ in range(world_size - 1))]
    return torch.cat(parts, dim)


@dataclasses.dataclass
class PlannedRun(harness.Run):
    """harness.Run with the planner's hooks, so that recast.py's own phase functions run on the
    meta models: `progress` (each loop of the method over its batches) lets the transformer run on
    the batches that set the phase's peak only, the others getting velocities of the right shape,
    made but not computed (Autocasting.live), their outputs kept as data; `autocast` is the GPU
    form's (torch.autocast takes no meta tensors); `observe` counts backward and the optimizer
    step as temporaries."""

    marks: Marks | None = None
    form: memtrace.GpuForm | None = None
    live: str = "last"  # the next loop's live batches: "last" or "first step"

    def autocast(self, enabled: bool) -> contextlib.AbstractContextManager:
        return self.form.autocasting() if enabled else contextlib.nullcontext()

    def progress(self, starts: range, desc: str) -> Iterator[int]:
        """The last batch, and the last full one when the last is partial (the most data held
        when they run); "first step": the micro-batches of the first optimizer step (full, and
        their gradients accumulate as in any step)."""
        k = len(starts)
        if self.live == "first step":
            live = set(range(min(k, self.args.grad_accum)))
        else:
            partial = (starts.stop - starts.start) % starts.step != 0
            live = {k - 1} | ({k - 2} if partial and k > 1 else set())
        for j, s in enumerate(starts):
            self.world.live = j in live
            with contextlib.nullcontext() if j in live else self.marks.making("data"):
                yield s
        self.world.live = True


def loop_of(run: dict, marks: Marks) -> PlannedRun:
    """The PlannedRun of make_run's parts: rank 0 of --world-size."""
    args, names = run["args"], list(run["reward_fns"])

    def observe(name: str) -> contextlib.AbstractContextManager:  # backward, the optimizer step
        temporaries = name in ("backward", "step")
        return marks.making("temporaries") if temporaries else contextlib.nullcontext()

    return PlannedRun(args, names, cli.parse_lambda(args.lam, names), 0, run["ws"], run["world"],
                      run["reward_fns"], run["scorers"], run["sigmas"], run["params"], run["opt"],
                      observe=observe, nft_loss=run["nft_loss"], marks=marks,
                      form=run["form"])  # fmt: skip


def epoch(run, marks: Marks, bar) -> None:
    """One epoch on rank 0 through recast.py's own phase functions (recast.main's order), with
    what recast.main carries from phase to phase; the collectives (gather) as their memory on one
    rank of --world-size (`gathered`)."""
    loop = loop_of(run, marks)
    args, world, ws, G = loop.args, loop.world, loop.world_size, loop.args.group_size
    T, device = len(loop.sigmas) - 1, world.device
    E = len(world.eval_prompts) * args.eval_seeds
    E_local = math.ceil(E / ws)  # the largest share of the held-out images (Run.share: rank 0
    # holds ⌊E / ws⌋, the last ranks ⌈E / ws⌉), planned on rank 0 as the most a rank holds
    with marks.making("data"):  # EvalSet keeps the base model's eval images on rank 0
        base_images = torch.zeros(E_local, 3, args.resolution, args.resolution, device=device)

    with marks.phase("rollout"):  # this rank's groups, --batch-size a sampler call
        loop.live = "last"
        prompts, my_prompts, x0, preds = recast.rollout(loop, 1)
    bar.update()
    with marks.phase("score"):
        per_image = [p for p in my_prompts for _ in range(G)]
        final = recast.score_all(loop.reward_fns, world.decode(x0), per_image)  # (K, n)
    bar.update()
    with marks.phase("recast"):
        step_scores = None
        if args.weighting in ("recast", "reversed"):  # as the rank that scores the most groups
            shares = [len(cli.scored_share(args.gain_frac, args.prompts, ws, r)) for r in range(ws)]
            loop.rank = shares.index(max(shares))
            step_scores = recast.score_steps(loop, preds, final, per_image)
            loop.rank = 0
            if not torch.distributed.is_initialized():  # else score_steps gathered them
                step_scores = gathered(step_scores, ws)
        final, x0 = gathered(final, ws), gathered(x0, ws, 0)
        r = recast.optimality(loop, final)  # (K, N)
        K = len(loop.names)  # W: K·T numbers, from the gains' values (not on meta tensors)
        W = torch.full((K, T), 1 / (K * T), device=device)
    bar.update()
    with marks.phase("update"):  # every micro-batch; those of the first optimizer step run
        loop.live = "first step"
        recast.nft_update(loop, 1, prompts, x0, r, W, 0)
    bar.update()
    with marks.phase("eval"):  # harness.evaluate of rank 0's held-out images, in chunks
        loop.live = "last"
        eval_prompts = [world.eval_prompts[i % len(world.eval_prompts)] for i in range(E_local)]
        with marks.making("data"):  # on the device, so that the CPU check counts what the plan
            noise = torch.randn(E_local, *world.latent_shape, device=device)  # does: a run keeps
        # it on the host and moves a chunk at a time (the plan's over by the other chunks' noise)
        scores, images = harness.evaluate(recast.sample, world, loop.scorers, eval_prompts,
                                          noise, loop.sigmas, args.batch_size,  # EvalSet's chunks
                                          progress=loop.progress)  # fmt: skip
        del scores, images, noise
    bar.update()
    with marks.phase("save"):  # harness.save_epoch, the epoch's data still held
        saved(run, marks)
    del base_images, x0, preds, final, step_scores, r, W


def saved(run, marks: Marks) -> None:
    """harness.save_epoch's GPU memory. Under --shard each sharded tensor of the adapters and of
    AdamW's state is gathered whole, one at a time, and copied to the host (world.state_dict;
    distributed.optimizer_state, with cpu_offload): counted as the largest trained tensor, fp32,
    twice (the all-gather's output and its unpadded copy). Unsharded the checkpoint's copies are
    made on the host: nothing more on the GPU. The host holds the whole state on rank 0 (twice
    while it is serialised), not planned here."""
    if not run["args"].shard or run["world"].device.type != "meta":  # the CPU check: not run
        return
    largest = max(p.numel() for p in run["params"])
    with marks.making("temporaries"):
        whole = [torch.empty(largest, device="meta") for _ in range(2)]
    del whole


def make_run(own, args, device: str, c: dict, tmp: Path, cpu_form: bool) -> dict:
    """The world (diffusersworld.DiffusersWorld with the family's part, on an already-built
    pipeline), the reward models, the AdamW of harness.setup with its state made, on `device`
    ("meta", or "cpu" for the allocator check) in the GPU's precisions (bf16 transformer and text
    encoders) when planning for a GPU. With --shard on the CPU (the allocator check, under a gloo
    process group) the models are sharded for real, by recast.py's own shard_models."""
    cuda_form = not cpu_form
    torch.manual_seed(0)
    with torch.device(device):
        pipe = pipeline(args.model, c, tmp / "tokenizers")
        encoders = [getattr(pipe, n, None) for n in ("text_encoder", "text_encoder_2",
                                                      "text_encoder_3")]  # fmt: skip
        if cuda_form:  # as from_pretrained(torch_dtype=bf16) loads them; the world makes the
            for m in (pipe.transformer, *encoders):  # VAE fp32
                if m is not None:
                    m.to(torch.bfloat16)
        replay = Replay(memtrace.GpuForm("cuda" if cuda_form else "cpu"))
        scorers, reward_held = reward_models([*own.names, *own.judges], c, tmp / "tokenizers",
                                             device, own.specs, cuda_form, replay)  # fmt: skip
        reward_fns = {n: scorers[n] for n in own.names}  # the judges score at eval only
        judge_bytes = 0  # what the judges alone hold (a judge may share a reward's CLIP)
        if own.judges and device == "meta":
            trained = reward_models(own.names, c, tmp / "tokenizers", device, own.specs,
                                    cuda_form)[1]  # fmt: skip
            judge_bytes = held_bytes(reward_held) - held_bytes(trained)
        family = families.PARTS[type(pipe).__name__]
        world = diffusersworld.DiffusersWorld(args, torch.device(device), family, pipe=pipe)
    form = replay.form
    if args.grad_checkpointing:  # the recomputation in backward takes the same form
        world.transformer.enable_gradient_checkpointing(form.checkpoint_function())
    if args.shard and device == "cpu":  # under the check's process group
        from plumbing.distributed import shard_models

        shard_models(world.shardable(), torch.device("cpu"))
    params = [p for p in world.trainable.parameters() if p.requires_grad]
    # harness.setup's AdamW takes its foreach form on CUDA; on meta it would take the for-loop one
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, foreach=True)
    for p in params:  # a later step: the state exists (exp_avg, exp_avg_sq, step)
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"args": args, "world": Autocasting(world, form), "form": form, "ws": own.world_size,
            "reward_fns": reward_fns, "scorers": scorers, "params": params, "opt": optimizer,
            "nft_loss": nft_loss if cuda_form else reference_nft_loss,
            "sigmas": world.sigmas(args.steps), "replay": replay, "judge_bytes": judge_bytes,
            "held": [world.transformer, pipe.vae,
            *encoders, *reward_held], "shardable": world.shardable()}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The plan, and its check against the CPU allocator
# ---------------------------------------------------------------------------------------------
def prompt_files(args, tmp: Path, n_eval: int) -> None:
    """Generated prompts (long enough to fill CLIP's 77 tokens) where no file was given: n_eval
    held-out ones where neither file was (a --prompts-file alone: recast.py holds out its last
    10 %, diffusersworld.split_prompts, and so does the plan's world)."""
    if not args.prompts_file:
        if not args.eval_prompts_file:
            path = tmp / "eval.txt"
            path.write_text("\n".join(modelzoo.prompts(n_eval, 1000)) + "\n")
            args.eval_prompts_file = str(path)
        path = tmp / "prompts.txt"
        path.write_text("\n".join(modelzoo.prompts(max(64, args.prompts))) + "\n")
        args.prompts_file = str(path)


def held_out(args, n_eval: int) -> int:
    """The held-out prompts of the run: --eval-prompts-file's, else the last 10 % of
    --prompts-file (diffusersworld.split_prompts), else n_eval (the planner's --eval-prompts)."""
    if not args.prompts_file and not args.eval_prompts_file:
        return n_eval
    return len(diffusersworld.split_prompts(args.prompts_file, args.eval_prompts_file)[1])


# a node's ranks (at most --world-size): the host memory of loading is a node's, and above it
# --shard shards within each node and replicates across nodes (HSDP, distributed.shard_mesh)
GPUS_PER_NODE = 8


def _bytes(module: torch.nn.Module, share=None) -> float:
    """A model's parameters and buffers, whole or (`share`) this rank's shards of them."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() * (share(t) if share else 1) for t in tensors)


def held_bytes(held: list) -> int:
    """The bytes of reward_models' models and tensors."""
    return sum(_bytes(h) if isinstance(h, torch.nn.Module) else h.numel() * h.element_size()
               for h in held)  # fmt: skip


def load_phase(run: dict, own) -> dict:
    """Loading (harness.setup, DiffusersWorld), counted from the models' sizes (not traced): its
    GPU peak on one rank as a phase {"peak", "parameters", the other kinds 0}, and the host memory
    it takes, "host_rank0", "host_rank" (any other rank) and "host_node" (rank 0's node: up to
    GPUS_PER_NODE ranks), bytes. Without --shard every rank reads the pipeline whole onto its host
    (from_pretrained), moves it to its GPU, then reads each reward model and moves it: on the GPU
    every model whole. Under --shard the transformer and text encoders are built on meta and
    sharded; each in turn is read whole by rank 0 alone and broadcast tensor by tensor (each rank
    receives one tensor whole at a time on its GPU and keeps its shard); then the VAE (read with the
    pipeline, on the host until then) and the reward models go to the GPU."""
    world, ranks = run["world"], own.world_size
    shardable = run["shardable"]
    models = [m for m in run["held"] if isinstance(m, torch.nn.Module)]
    tensors = [t for t in run["held"] if isinstance(t, torch.Tensor)]
    vae = world.pipe.vae
    rewards = [m for m in models if m is not vae and all(m is not s for s in shardable)]
    reward_bytes = [_bytes(m) for m in rewards] + [t.numel() * t.element_size() for t in tensors]
    largest_reward = max(reward_bytes, default=0)
    if run["args"].shard:
        share = lambda t: shard_share(t, min(ranks, GPUS_PER_NODE))  # noqa: E731
        shards = sum(_bytes(m, share) for m in shardable)
        one = max(t.numel() * t.element_size() for m in shardable for t in m.parameters())
        gpu = max(shards + one, shards + _bytes(vae) + sum(reward_bytes))
        rank0 = _bytes(vae) + max(_bytes(m) for m in shardable)
        other = max(_bytes(vae), largest_reward)
    else:
        gpu = sum(_bytes(m) for m in models) + sum(reward_bytes[len(rewards) :])
        rank0 = other = max(sum(_bytes(m) for m in shardable) + _bytes(vae), largest_reward)
    local = min(ranks, GPUS_PER_NODE)
    return {"peak": gpu, "parameters": gpu,
            **{k: 0 for k in memtrace.KINDS if k != "parameters"},
            "host_rank0": rank0, "host_rank": other,
            "host_node": rank0 + (local - 1) * other}  # fmt: skip


def plan(own, args, c: dict, tmp: Path, cpu_form: bool = False, desc: str = "plan") -> dict:
    """{phase: {"peak": bytes, kind: bytes at the peak}} of one epoch on rank 0, traced on meta
    in a CUDA GPU's form (or, `cpu_form`, in the CPU's: fp32, its attention, exact sizes), after
    loading's (load_phase, counted, not traced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = make_run(own, args, "meta", c, tmp, cpu_form)
    load = {**load_phase(run, own), "judges": run["judge_bytes"]}
    tracker = memtrace.StorageTracker(
        "meta", 1 if cpu_form else memtrace.CUDA_ROUND, conv_workspace=not cpu_form
    )  # cuDNN's: the GPU's form
    share = None
    if args.shard:  # FSDP2 on a node's ranks (all of --world-size up to 8), emulated (Shards)
        dtype = None if cpu_form else torch.bfloat16  # its MixedPrecisionPolicy's param_dtype
        shards = Shards(run["shardable"], min(own.world_size, GPUS_PER_NODE), tracker, dtype,
                        prefetch=not cpu_form, gloo=cpu_form)  # fmt: skip
        share = shards.share
    for held in run["held"]:
        if isinstance(held, torch.nn.Module):
            tracker.add_module(held, share)
        elif held is not None:
            tracker.add(held, "parameters")
    tracker.add_optimizer(run["opt"], share)
    hooks = tracker.watch_grads(run["params"], share)
    run["replay"].tracker = tracker  # a reward's forward traced once a shape (Replay)
    marks = Marks(tracker)
    with tqdm(total=len(PHASES), desc=desc, leave=False) as bar, warnings.catch_warnings():
        # Shards' full backward hooks fire on a layer's outputs when none of its inputs needs a
        # gradient (the first layer's latents), as they should here; torch warns that they do
        warnings.filterwarnings("ignore", "Full backward hook is firing", UserWarning)
        with tracker, run["form"]:
            epoch(run, marks, bar)
    for h in hooks:
        h.remove()
    return {"load": load, **marks.peaks}


def _sharded_worker(rank: int, own, args, c: dict, tmp: Path, out) -> None:
    """One gloo rank of the sharded allocator check: the same calls under torch.profiler. Each
    rank builds its pipeline's generated tokenizers in a folder of its own (`tmp`/rank<r>): in one
    shared folder a rank read a tokenizer file while the other rank was writing it."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=own.world_size)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run = make_run(own, args, "cpu", c, tmp / f"rank{rank}", cpu_form=True)
            with run["form"]:
                epoch(run, Marks(), tqdm(disable=True))
    if rank == 0:
        out.put(allocator_peaks(prof))
    dist.barrier()
    dist.destroy_process_group()


def check_cpu(own, args, c: dict, tmp: Path) -> dict:
    """{phase: {"planned": bytes, "allocator": bytes}}: the plan in the CPU's form, and the same
    calls run on the CPU (random weights) under torch.profiler, whose memory events carry the CPU
    allocator's running total of allocated bytes; per phase, its largest value."""
    from torch.profiler import ProfilerActivity, profile

    planned = plan(own, args, c, tmp, cpu_form=True, desc="plan, CPU form")
    if args.shard:  # rank 0 of own.world_size gloo processes, sharded for real
        import torch.multiprocessing as tmp_mp

        queue = tmp_mp.get_context("spawn").SimpleQueue()
        tmp_mp.spawn(_sharded_worker, (own, args, c, tmp, queue), nprocs=own.world_size)
        measured = queue.get()
        return {ph: {"planned": planned[ph]["peak"], "allocator": measured[ph]} for ph in PHASES}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run = make_run(own, args, "cpu", c, tmp, cpu_form=True)
            with tqdm(total=len(PHASES), desc="on the CPU", leave=False) as bar, run["form"]:
                epoch(run, Marks(), bar)
    measured = allocator_peaks(prof)
    return {ph: {"planned": planned[ph]["peak"], "allocator": measured[ph]} for ph in PHASES}


def allocator_peaks(prof) -> dict:
    """{phase: the CPU allocator's largest total of allocated bytes within "phase:<name>"}."""
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children)
    totals = sorted((n.start_time_ns, n.extra_fields.total_allocated) for n in nodes
                    if n.name == "[memory]" and n.extra_fields.device.type == "cpu")  # fmt: skip
    peaks = {}
    for n in nodes:
        if n.name.startswith("phase:"):
            before = [b for t, b in totals if t < n.start_time_ns]
            inside = [b for t, b in totals if n.start_time_ns <= t <= n.end_time_ns]
            peaks[n.name[6:]] = max(before[-1:] + inside)
    return peaks


# ---------------------------------------------------------------------------------------------
# Verdict, other flags, report
# ---------------------------------------------------------------------------------------------
def verdict(peaks: dict, gpu_gib: float) -> dict:
    """Fits when the largest phase peak, plus the caching allocator's fragmentation, the CUDA
    context and the workspaces, is within the GPU's memory."""
    peak = max(p["peak"] for p in peaks.values()) / GIB
    need = peak * (1 + FRAGMENTATION) + CONTEXT_GIB + WORKSPACE_GIB
    worst = max(peaks, key=lambda ph: peaks[ph]["peak"])
    return {"peak_gib": peak, "phase": worst, "needed_gib": need, "gpu_gib": gpu_gib,
            "margin_gib": gpu_gib - need, "fits": need <= gpu_gib}  # fmt: skip


def alternatives(args, world_size: int = 1, eval_images: int = 0) -> list[dict]:
    """Flags that lower the peak, in the order tried: --grad-checkpointing, then (under torchrun,
    on whole nodes of GPUS_PER_NODE above it, and where the `eval_images` held-out images split
    equally, as --shard needs: harness.check_held_out) --shard with it, then --batch-size halved
    (down to 1 pair per GPU) with --grad-accum doubled, so an optimizer step keeps its pairs."""
    out, batch, accum = [], args.batch_size, args.grad_accum
    if not args.grad_checkpointing:
        out.append({"grad_checkpointing": True})
    nodes = world_size <= GPUS_PER_NODE or world_size % GPUS_PER_NODE == 0  # as parse takes it
    equal = eval_images % world_size == 0
    shard = {"shard": True} if (world_size > 1 and nodes and equal) or args.shard else {}
    if shard and not args.shard:
        out.append({"grad_checkpointing": True, **shard})
    while batch % 2 == 0 and len(out) < 4 + bool(shard):
        batch, accum = batch // 2, accum * 2
        out.append({"grad_checkpointing": True, **shard, "batch_size": batch, "grad_accum": accum})
    return out


def flags_of(change: dict) -> str:
    return " ".join(cli.flag_of(k) if v is True else f"{cli.flag_of(k)} {v}"
                    for k, v in change.items())  # fmt: skip


def suggest(own, args, c: dict, tmp: Path) -> list[dict]:
    """Plans of alternatives(args), until one fits (those with a batch a world size cannot split
    are skipped)."""
    tried = []
    held = held_out(args, own.eval_prompts) * args.eval_seeds
    for change in alternatives(args, own.world_size, held):
        if change.get("batch_size", own.world_size) % own.world_size:
            continue
        changed = recast.Args(**{**vars(args), **change})
        peaks = plan(own, changed, c, tmp, desc=flags_of(change))
        tried.append({"flags": flags_of(change), "peaks": peaks,
                      "verdict": verdict(peaks, own.gpu_memory)})  # fmt: skip
        if tried[-1]["verdict"]["fits"]:
            break
    return tried


def shown_if_changed(settings: dict, *names: str) -> str:
    """` --flag value` of each of `names` whose value is not recast.py's default (it changes the
    plan: --weighting uniform scores no step prediction, --train-frac trains fewer pairs)."""
    default = recast.Args()
    return "".join(f" {cli.flag_of(n)} {settings[n]:g}" if isinstance(settings[n], float)
                   else f" {cli.flag_of(n)} {settings[n]}" for n in names
                   if settings.get(n, getattr(default, n)) != getattr(default, n))  # fmt: skip


def lines(report: dict) -> list[str]:
    a, v = report["settings"], report["verdict"]
    unit, div = ("GiB", GIB) if v["peak_gib"] >= 1 else ("MiB", 2**20)
    guidance = f" --guidance {a['guidance']:g}" if a["guidance"] else ""
    judges = f" --judges {','.join(report['judges'])}" if report.get("judges") else ""
    run = (f"--model {a['model']}{report['shrunk']} --resolution {a['resolution']} --steps "
           f"{a['steps']} --prompts {a['prompts']} --group-size {a['group_size']} --batch-size "
           f"{a['batch_size']} --grad-accum {a['grad_accum']} --lora-rank {a['lora_rank']}"
           f"{' --grad-checkpointing' if a['grad_checkpointing'] else ''}"
           f"{' --shard' if a.get('shard') else ''} --rewards "
           f"{','.join(report['rewards'])}{judges}{guidance} --kl-coef {a['kl_coef']:g} "
           f"--gain-frac {a['gain_frac']:.4g} --score-precision {a['score_precision']}"
           f"{' --score-size ' + str(a['score_size']) if a.get('score_size') else ''}"
           f"{shown_if_changed(a, 'weighting', 'train_frac')}")  # fmt: skip
    L = [f"planned (traced on CPU) GPU memory of one rank of {report['world_size']}: {run}",
         f"AdamW foreach; {report['eval_images']} held-out images on this rank; "
         f"planned in {report['seconds'] / 60:.1f} min on this CPU", "",
         f"phase      peak {unit}   params    grads    optim     data    activ"
         "    temps"]  # fmt: skip
    for ph, p in report["peaks"].items():
        L.append(f"{ph:<9} {p['peak'] / div:8.2f} " + "".join(f"{p[k] / div:9.2f}" for k in
                                                               memtrace.KINDS))  # fmt: skip
    L += ["", f"largest: {v['peak_gib']:.2f} GiB ({v['phase']}); with {FRAGMENTATION:.0%} for the "
          f"allocator's fragmentation, {CONTEXT_GIB} GiB CUDA context and {WORKSPACE_GIB} GiB "
          f"cuBLAS workspaces: {v['needed_gib']:.2f} GiB of {v['gpu_gib']:g}",
          f"verdict: {'FITS' if v['fits'] else 'DOES NOT FIT'} in {v['gpu_gib']:g} GiB, margin "
          f"{v['margin_gib']:+.2f} GiB"]  # fmt: skip
    if "load" in report["peaks"]:
        x, local = report["peaks"]["load"], min(report["world_size"], GPUS_PER_NODE)
        L.append(f"host memory while loading: {x['host_node'] / GIB:.2f} GiB on rank 0's node of "
                 f"{local} ranks (rank 0 {x['host_rank0'] / GIB:.2f}, each other rank "
                 f"{x['host_rank'] / GIB:.2f})")  # fmt: skip
    judges = report["peaks"].get("load", {}).get("judges", 0) / GIB
    if not v["fits"] and judges:  # the judges' weights are held in every phase, from loading on
        peak = v["peak_gib"] - judges
        need = peak * (1 + FRAGMENTATION) + CONTEXT_GIB + WORKSPACE_GIB
        L.append(f"  without --judges (their models hold {judges:.2f} GiB in every phase): peak "
                 f"at most {peak:.2f} GiB, needs at most {need:.2f} GiB: "
                 f"{'fits' if need <= v['gpu_gib'] else 'does not fit'}")  # fmt: skip
    for alt in report.get("alternatives", []):
        w = alt["verdict"]
        fits = "fits" if w["fits"] else "does not fit"
        L.append(f"  with {alt['flags']}: peak {w['peak_gib']:.2f} GiB ({w['phase']}), needs "
                 f"{w['needed_gib']:.2f} GiB: {fits}")  # fmt: skip
    if "cpu_check" in report:
        L += ["", "planned (CPU form) against the CPU allocator, MiB:",
              "phase       planned  allocator  planned/allocator - 1"]  # fmt: skip
        for ph, x in report["cpu_check"].items():
            L.append(f"{ph:<9} {x['planned'] / 2**20:9.2f} {x['allocator'] / 2**20:10.2f} "
                     f"{x['planned'] / x['allocator'] - 1:+10.2%}")  # fmt: skip
    return L


def main(argv: list[str] | None = None) -> None:
    own, args = parse(argv)  # bad input exits 2 before anything is built or written
    import diffusers
    import transformers

    transformers.logging.set_verbosity_error()  # CLIP's 77-token cut of the long prompts
    diffusers.logging.set_verbosity_error()
    c = modelzoo.load_configs(own.shrink)
    tic = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="memory_plan_") as tmp:
        prompt_files(args, Path(tmp), own.eval_prompts)
        peaks = plan(own, args, c, Path(tmp))
        report = {"settings": {k: v for k, v in vars(args).items()}, "rewards": own.names,
                  "judges": own.judges,
                  "world_size": own.world_size,
                  "shrunk": f" --shrink {own.shrink}" if own.shrink else "", "peaks": peaks,
                  "verdict": verdict(peaks, own.gpu_memory),
                  "eval_images": math.ceil(held_out(args, own.eval_prompts) * args.eval_seeds
                                           / own.world_size)}  # fmt: skip
        if not report["verdict"]["fits"] and not own.no_suggest:
            report["alternatives"] = suggest(own, args, c, Path(tmp))
        if own.check_cpu:
            report["cpu_check"] = check_cpu(own, args, c, Path(tmp))
    report["seconds"] = time.perf_counter() - tic
    print("\n".join(lines(report)))
    if own.json:
        Path(own.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"wrote {own.json}")


if __name__ == "__main__":
    main()
