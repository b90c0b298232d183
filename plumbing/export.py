"""`python recast.py --export RUN --to DIR`: a finished run's trained policy as a LoRA that
diffusers loads with `pipe.load_lora_weights(DIR)`, for every family recast.py trains
(docs/models.md).

The run's last checkpoint holds two adapters under peft's names, "default" (the trained policy θ)
and "old" (the sampling policy θ_old, an EMA of θ). The export keeps "default" only, under the
names diffusers reads (`transformer.<layer>.lora_A.weight`, `…lora_B.weight`), with its LoRA
configuration (rank, alpha, adapted layers) as the file's metadata, so the loaded adapter scales
as in training (alpha / rank). The file is written by the run's own pipeline class
(`save_lora_weights`), so it is the format that class's `load_lora_weights` reads:
`DIR/pytorch_lora_weights.safetensors`. Beside it, `DIR/recast_export.json` says where it comes
from and how the run sampled: CFG-free Euler, --steps, --resolution, --guidance (docs/models.md).

Bad input exits 2 naming the flag: a RUN that is not a diffusers run, not finished, or corrupt (no
checkpoint of its last epoch that verifies); a --to folder that holds anything, without
--overwrite (which replaces the two files above and leaves the folder's other files alone).
"""

import json
import os
import tempfile

from plumbing import cli
from plumbing.checkpoints import load_latest, resume_command, write_json_atomic

WEIGHTS = "pytorch_lora_weights.safetensors"  # diffusers' name for a LoRA folder's weights
INFO = "recast_export.json"


def parse(argv: list[str]):
    """--export RUN --to DIR [--overwrite]."""
    ap = cli.Parser(
        prog="recast.py",
        description="Export a finished run's trained policy (the 'default' LoRA adapter of its "
        "last checkpoint) as a folder that diffusers' pipe.load_lora_weights(DIR) reads.",
    )
    ap.add_argument("--export", required=True, metavar="RUN", help="the run folder (--out)")
    ap.add_argument("--to", required=True, metavar="DIR", help="the folder to write")
    ap.add_argument("--overwrite", action="store_true",
                    help="write into a --to folder that holds files (replacing "
                    f"{WEIGHTS} and {INFO})")  # fmt: skip
    return ap.parse_args(argv)


def policy_adapter(tensors: dict) -> dict:
    """The "default" adapter's tensors under diffusers' LoRA names: peft's
    `<layer>.lora_A.default.weight` → `<layer>.lora_A.weight` (the pipeline class prefixes
    `transformer.`)."""
    return {k.replace(".default.", "."): v for k, v in tensors.items() if ".default." in k}


def lora_config(layers: dict, args: dict) -> dict:
    """The adapter's LoRA configuration (the keyword arguments of peft's LoraConfig that diffusers
    reads from the file's metadata): its rank and alpha (recast.py's --lora-rank and
    --lora-alpha), the layers it adapts, by full name, and no per-layer rank or alpha (diffusers
    0.37 reads `rank_pattern` from the metadata without a default: a file without it fails to
    load there)."""
    ranks = {v.shape[0] for k, v in layers.items() if ".lora_A." in k}
    if ranks != {args["lora_rank"]}:
        raise ValueError(f"its adapters have rank {sorted(ranks)}, its args.json "
                         f"--lora-rank {args['lora_rank']}")  # fmt: skip
    targets = sorted({k.split(".lora_")[0] for k in layers})
    return {"r": args["lora_rank"], "lora_alpha": args["lora_alpha"], "target_modules": targets,
            "rank_pattern": {}, "alpha_pattern": {}}  # fmt: skip


def finished_checkpoint(run: str) -> tuple[dict, dict]:
    """(args.json, the tensors of the last epoch's checkpoint) of a finished diffusers run; exit 2
    naming --export and the run folder otherwise."""
    path = os.path.join(run, "args.json")
    if not os.path.isfile(path):
        cli.fail("--export", f"{run} is not a run folder (no args.json)")
    args = cli.saved_flags(run, "--export", "restore it from a copy")
    if not isinstance(args.get("model"), str):
        cli.fail("--export", f"{path} is not a run's flags (no --model): restore it from a copy")
    if _is_toy(args["model"]):
        cli.fail("--export", f"{run} trained the toy world, whose policy is a whole transformer "
                 "(its checkpoint), not a LoRA of a diffusers pipeline")  # fmt: skip
    notes: list[str] = []
    ckpt = load_latest(run, notes.append)
    unusable = f" ({'; '.join(notes)})" if notes else ""
    if ckpt is None:
        cli.fail("--export", f"{run} has no usable checkpoint{unusable}: it is corrupt or has not "
                 "saved one yet")  # fmt: skip
    tensors, _, state = ckpt
    if notes:  # its newest checkpoint does not verify: the run is damaged
        cli.fail("--export", f"{run} is corrupt: its newest checkpoint is unusable{unusable}")
    summary = os.path.join(run, "summary.json")
    done = os.path.isfile(summary) and state["epoch"] == args["epochs"]
    if done:
        with open(summary) as f:
            done = json.load(f).get("epochs") == args["epochs"]
    if not done:
        cli.fail("--export", f"{run} is not finished: its last checkpoint is epoch "
                 f"{state['epoch']} of --epochs {args['epochs']}; finish it first: "
                 f"{resume_command(run)}")  # fmt: skip
    return args, tensors


def _is_toy(model: str) -> bool:
    """--model of the toy world: "toy", or a folder holding a bare transformer (recast.py's
    is_toy_model)."""
    if model == "toy":
        return True
    has = lambda name: os.path.isfile(os.path.join(model, name))  # noqa: E731
    return has("config.json") and not has("model_index.json")


def pipeline_class(model: str):
    """The diffusers pipeline class that the run's --model names (its model_index.json); exit 2
    naming --export when it cannot be read."""
    import diffusers

    why = "the pipeline's model_index.json names the LoRA format to write"
    parts = model.split("/")
    hub_id = len(parts) == 2 and all(parts) and not model.startswith((".", "~", "/"))
    if not os.path.isdir(model) and not hub_id:
        cli.fail("--export", f"the run's --model {model!r} is not here ({why}): run the export "
                 "where the run was trained, or where the model is at the same path")  # fmt: skip
    try:
        name = diffusers.DiffusionPipeline.load_config(model)["_class_name"]
    except Exception as e:  # a folder without it, a hub id offline and not in the cache
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        cli.fail("--export", f"could not read the run's --model {model!r} ({why}): {cause}")
    cls = getattr(diffusers, name, None)
    if cls is None or not hasattr(cls, "save_lora_weights"):
        cli.fail("--export", f"{model} holds a {name}, which has no LoRA loader in diffusers")
    return cls


def main(argv: list[str]) -> None:
    """recast.py --export RUN --to DIR [--overwrite]."""
    opts = parse(argv)
    run, to = opts.export.rstrip("/") or opts.export, opts.to
    if os.path.exists(to) and not os.path.isdir(to):
        cli.fail("--to", f"{to} is a file: give a folder")
    if os.path.isdir(to) and os.listdir(to) and not opts.overwrite:
        cli.fail("--to", f"{to} exists and is not empty: give a new folder, or add --overwrite "
                 f"to replace its {WEIGHTS} and {INFO}")  # fmt: skip
    args, tensors = finished_checkpoint(run)
    cls = pipeline_class(args["model"])
    layers = policy_adapter(tensors)
    try:
        config = lora_config(layers, args)
    except ValueError as e:
        cli.fail("--export", f"{run} is corrupt: {e}")
    os.makedirs(to, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=to, prefix=".export-") as tmp:  # whole, or not at all
        cls.save_lora_weights(tmp, transformer_lora_layers=layers,
                              transformer_lora_adapter_metadata=config)  # fmt: skip
        os.replace(os.path.join(tmp, WEIGHTS), os.path.join(to, WEIGHTS))
    info = {
        "run": os.path.abspath(run), "epoch": args["epochs"], "model": args["model"],
        "pipeline": cls.__name__, "adapter": "default (the trained policy)",
        "lora_rank": args["lora_rank"], "lora_alpha": args["lora_alpha"],
        "layers": len(config["target_modules"]),
        "sampling": {"steps": args["steps"], "resolution": args["resolution"],
                     "guidance": args.get("guidance", 0.0), "cfg": "none (CFG-free Euler)"},
    }  # fmt: skip
    write_json_atomic(os.path.join(to, INFO), info)
    print(f"wrote {os.path.join(to, WEIGHTS)} ({cls.__name__}: {len(layers)} tensors, the "
          f"'default' adapter of {run} after epoch {args['epochs']}); load it with "
          f"pipe.load_lora_weights({to!r})")  # fmt: skip
