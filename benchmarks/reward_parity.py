"""Model rewards scored beside their released code: the reference runs as released, in its own
virtual environment at the versions it pins; it builds a tiny random model of its released
architecture with its own classes, saves it in its released file layout, and scores a fixed set of
images and prompts with its own scoring code. rewards.py's loader then reads the same file and
scores the same inputs; the table is max |Δ| per reward, in float32.

    python -m benchmarks.reward_parity --setup   # the reference venvs, from benchmarks/parity_envs
    python -m benchmarks.reward_parity           # the table (docs/your_reward.md#parity)
    python -m benchmarks.reward_parity --rewards imagereward --keep WORK   # one, its files kept

The venvs live under --envs (default $RECAST_PARITY_ENVS, else ~/.cache/recast/parity_envs), one
per reference (pickscore, clipscore and aesthetic share one, `clip`), from the pinned requirement
file beside its script in benchmarks/parity_envs/ (<reward>.txt or clip.txt, <reward>_ref.py).
Without them this prints the --setup command and exits 2. The project's own requirements are not
touched: `hpsv2`, whose reward needs the hpsv2 package and torchvision, is scored by rewards.py
run in its reference's venv. Each reference's script states what it builds and runs.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
from plumbing import cli

HERE = Path(__file__).resolve().parent / "parity_envs"
DEFAULT_ENVS = Path(os.environ.get("RECAST_PARITY_ENVS", "~/.cache/recast/parity_envs"))


@dataclass(frozen=True)
class Reference:
    requirements: str  # pinned requirement file in benchmarks/parity_envs
    script: str  # run with the venv's python: builds, saves and scores
    tolerance: float  # max |Δ| allowed, float32 on the CPU
    env: dict  # rewards.py's variables, relative to the work folder
    text: bool = False  # scored on rendered words (OCR_CASES), not on colour fields
    venv: str = ""  # the venv's name under --envs, if not the reward's (references that share one)
    ours_there: bool = False  # rewards.py scores in that venv too (the reward needs its package)


REFERENCES = {
    "imagereward": Reference(
        "imagereward.txt", "imagereward_ref.py", 1e-4, {"RECAST_IMAGEREWARD": "."}
    ),
    "hpsv3": Reference(
        "hpsv3.txt",
        "hpsv3_ref.py",
        1e-4,
        {
            "RECAST_HPSV3": "HPSv3.safetensors",
            "RECAST_HPSV3_BASE": "base",
            "RECAST_HPSV3_PROMPT": "data_collator_qwen.py",
        },
    ),  # fmt: skip
    "ocr": Reference("ocr.txt", "ocr_ref.py", 1e-6, {}, text=True),
    "pickscore": Reference(
        "clip.txt",
        "pickscore_ref.py",
        1e-4,
        {"RECAST_PICKSCORE": "model", "RECAST_PICKSCORE_PROCESSOR": "processor"},
        venv="clip",
    ),
    "clipscore": Reference(
        "clip.txt", "clipscore_ref.py", 1e-4, {"RECAST_CLIPSCORE": "model"}, venv="clip"
    ),
    "aesthetic": Reference(
        "clip.txt",
        "aesthetic_ref.py",
        1e-4,
        {"RECAST_AESTHETIC": "model", "RECAST_AESTHETIC_HEAD": "head.pth"},
        venv="clip",
    ),
    "hpsv2": Reference(
        "hpsv2.txt",
        "hpsv2_ref.py",
        1e-4,
        {"RECAST_HPSV2": "HPS_v2.1_compressed.pt"},
        ours_there=True,
    ),
}
PROMPTS = [
    "a red cat on a sofa",
    "two boats at dawn",
    "a shop sign that says open",
    "x",
    "a tree on a hill by the sea at night",
    "a green clock",
]
SIZES = [(512, 512), (768, 1024), (333, 500), (1024, 576), (256, 256), (600, 400)]  # (H, W)
# (drawn, asked for, font px, what is done to it): clean words, then the kinds of damage early
# training images have, then a blank and words set far apart (EasyOCR's merging of boxes)
OCR_CASES = [
    ("OPEN", "OPEN", 40, ""),
    ("Hello you", "hello you", 36, ""),
    ("COFFEE SHOP", "coffee shop", 28, ""),
    ("recast", "recast", 48, "blur"),
    ("PARITY", "parity", 40, "noise"),
    ("low contrast", "low contrast", 32, "faint"),
    ("TILTED", "tilted", 40, "tilt"),
    ("small words", "small words", 14, ""),
    ("", "open", 40, ""),
    ("OPNE SHOP", "open shop", 32, ""),
    ("WELCME", "welcome", 40, ""),
    ("GOOD         DAY", "good day", 28, ""),
    ("SHADOW", "shadow", 36, "blur3"),
    ("tiny print", "tiny print", 10, ""),
    ("whisper", "whisper", 36, "fainter"),
    ("STATIC", "static", 36, "noise60"),
]


def venv(envs: Path, name: str) -> Path:
    """Reward `name`'s reference venv."""
    return envs.expanduser() / (REFERENCES[name].venv or name)


def python(envs: Path, name: str) -> Path:
    return venv(envs, name) / "bin" / "python"


def setup(envs: Path, names: list[str]) -> None:
    """A venv per reference, from its pinned file: torch and torchvision first (a package that
    builds against torch, fairscale, then builds without pip's isolation), then the rest, then
    the lines marked `# --no-deps` without their dependencies. References that share a venv
    (`Reference.venv`) make it once."""
    for where, name in {venv(envs, name): name for name in names}.items():
        subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
        pip = [str(where / "bin" / "python"), "-m", "pip", "install", "-q"]
        lines = (HERE / REFERENCES[name].requirements).read_text().splitlines()
        pins = [line.split("#")[0].strip() for line in lines]
        first = [p for p in pins if p.split("==")[0] in ("torch", "torchvision")]
        alone = [p for p, line in zip(pins, lines, strict=True) if line.endswith("# --no-deps")]
        rest = [p for p in pins if p and p not in first + alone]
        subprocess.run([*pip, "setuptools", "wheel", *first], check=True)
        subprocess.run([*pip, "--no-build-isolation", *first, *rest], check=True)
        if alone:
            subprocess.run([*pip, "--no-deps", *alone], check=True)
        print(f"{name}: {where}")


def images(work: Path) -> torch.Tensor:
    """The fixed images, written as 8-bit PNGs (what the references read): smooth random colour
    fields with noise, at SIZES (square and not); returned in [-1, 1], one (3, H, W) each."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    out = []
    (work / "images").mkdir(parents=True, exist_ok=True)
    for i, (h, w) in enumerate(SIZES):
        x = torch.rand(1, 3, h // 32, w // 32, generator=g) * 2 - 1
        x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", align_corners=False)
        x = (x[0] + 0.1 * torch.randn(3, h, w, generator=g)).clamp(-1, 1)
        rgb = ((x + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        Image.fromarray(rgb).save(work / "images" / f"{i:02d}.png")
        out.append(torch.from_numpy(rgb.astype(np.float32)).permute(2, 0, 1) / 127.5 - 1)
    return out


def words(work: Path) -> tuple[list[torch.Tensor], list[str]]:
    """OCR_CASES drawn black on white (320 x 96 px, Pillow's own font) and damaged as each says,
    written as 8-bit PNGs; returned in [-1, 1], with prompts quoting the text asked for."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    g = np.random.default_rng(0)
    out, prompts = [], []
    (work / "images").mkdir(parents=True, exist_ok=True)
    for i, (drawn, asked, px, damage) in enumerate(OCR_CASES):
        ink, paper = {"faint": (150, 200), "fainter": (185, 200)}.get(damage, (0, 255))
        im = Image.new("L", (320, 96), paper)
        ImageDraw.Draw(im).text((12, 48 - px // 2), drawn, ink, ImageFont.load_default(px))
        if damage.startswith("blur"):
            im = im.filter(ImageFilter.GaussianBlur({"blur": 1.5, "blur3": 3}[damage]))
        if damage == "tilt":
            im = im.rotate(10, Image.BICUBIC, fillcolor=paper)
        rgb = np.repeat(np.asarray(im, dtype=np.float32)[..., None], 3, axis=2)
        if damage.startswith("noise"):
            sigma = {"noise": 30, "noise60": 60}[damage]
            rgb = np.clip(rgb + g.normal(0, sigma, rgb.shape), 0, 255)
        rgb = rgb.round().astype(np.uint8)
        Image.fromarray(rgb).save(work / "images" / f"{i:02d}.png")
        out.append(torch.from_numpy(rgb.astype(np.float32)).permute(2, 0, 1) / 127.5 - 1)
        prompts.append(f'a sign that says "{asked}"')
    return out, prompts


def inputs(name: str, work: Path) -> tuple[list[torch.Tensor], list[str]]:
    """The work folder's inputs: images and prompts (prompts.json), and the tiny tokenizers'
    files (ImageReward's BERT vocabulary and text encoder's configuration; HPSv3's byte-level
    vocabulary, special tokens and chat template, modelzoo.tiny_vlm's; CLIP's byte vocabulary,
    modelzoo.clip_tokenizer's) or, for `ocr`, the weights folder the ocr reward reads."""
    from benchmarks import modelzoo
    from reward_models import ocr_reader

    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("images/*.png"):  # a kept folder's earlier run
        stale.unlink()
    pictures, prompts = words(work) if REFERENCES[name].text else (images(work), PROMPTS)
    (work / "prompts.json").write_text(json.dumps(prompts))
    if name == "ocr":
        (work / "weights.txt").write_text(ocr_reader.ocr_folder())
    spec = dict(vocab=modelzoo.byte_vocabulary(), special=list(modelzoo.VLM_SPECIAL_TOKENS),
                chat_template=modelzoo.VLM_CHAT_TEMPLATE)  # fmt: skip
    (work / "tokenizer_spec.json").write_text(json.dumps(spec))
    (work / "vocab.txt").write_text("\n".join(modelzoo.TINY_IMAGEREWARD_VOCAB) + "\n")
    (work / "clip_vocab.json").write_text(json.dumps(modelzoo.clip_vocabulary()))
    med = dict(
        modelzoo.TINY_IMAGEREWARD_MED,
        hidden_size=768,
        intermediate_size=1536,
        num_attention_heads=12,
    )  # fmt: skip  (ImageReward's head reads 768 wide)
    (work / "med_config.json").write_text(json.dumps(med, indent=2))
    return pictures, prompts


def read_png(path: Path) -> torch.Tensor:
    """An 8-bit PNG as (3, H, W) in [-1, 1], as `images` and `words` return theirs."""
    from PIL import Image

    rgb = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32)
    return torch.from_numpy(rgb).permute(2, 0, 1) / 127.5 - 1


def ours(name: str, work: Path, pictures: list[torch.Tensor], prompts: list[str]) -> list[float]:
    """rewards.py's scores of the work folder's inputs, its loader reading the reference's
    saved model; one image a call (the images differ in size)."""
    import rewards

    for variable, relative in REFERENCES[name].env.items():
        os.environ[variable] = str(work / relative)
    fn = rewards.get(name, torch.device("cpu"))
    pairs = zip(pictures, prompts, strict=True)
    return [rewards.score(name, fn, x[None], [p]).item() for x, p in pairs]


def ours_in_venv(name: str, envs: Path, work: Path) -> list[float]:
    """`ours` run by the reference's venv on the work folder's saved inputs (`--ours`): for a
    reward that needs a package the project does not pin (hpsv2, and the torchvision it needs)."""
    command = [str(python(envs, name)), "-m", "benchmarks.reward_parity", "--rewards", name]
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([*command, "--ours", str(work)], cwd=root, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"{name}: rewards.py in its venv failed:\n{run.stderr[-4000:]}")
    return json.loads((work / "ours.json").read_text())


def compare(name: str, envs: Path, work: Path) -> dict:
    """One reward's row: the reference run in its venv, then ours on the same files."""
    import rewards

    pictures, prompts = inputs(name, work)
    start = time.perf_counter()
    run = subprocess.run(
        [str(python(envs, name)), str(HERE / REFERENCES[name].script), str(work)],
        capture_output=True,
        text=True,
    )
    if run.returncode:
        raise RuntimeError(f"{name}'s reference failed:\n{run.stderr[-4000:]}")
    reference = json.loads((work / "reference.json").read_text())
    if "reads" in reference:  # a reader's text, scored with the reward's own formula
        pairs = zip(reference["reads"], prompts, strict=True)
        reference["scores"] = [rewards.text_match(read, rewards.quoted(p)) for read, p in pairs]
    if REFERENCES[name].ours_there:
        got = ours_in_venv(name, envs, work)
    else:
        got = ours(name, work, pictures, prompts)
    deltas = [abs(a - b) for a, b in zip(got, reference["scores"], strict=True)]
    return {
        "reward": name,
        "images": len(got),
        "max_delta": max(deltas),
        "tolerance": REFERENCES[name].tolerance,
        "spread": max(reference["scores"]) - min(reference["scores"]),  # the images' scores
        "seconds": time.perf_counter() - start,
        "ours": got,
        "reference": reference["scores"],
        "reads": reference.get("reads"),
    }


PROG = "reward_parity.py"


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", action="store_true", help="create the reference venvs")
    parser.add_argument("--envs", type=Path, default=DEFAULT_ENVS, help="where the venvs live")
    parser.add_argument("--rewards", default=",".join(REFERENCES), help="comma-separated")
    parser.add_argument("--keep", type=Path, help="work folder to keep (default: a temporary)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--ours", type=Path, help=argparse.SUPPRESS)  # a work folder (compare)
    args = parser.parse_args(argv)
    names = [n for n in args.rewards.split(",") if n]
    unknown = [n for n in names if n not in REFERENCES]
    if unknown or not names:
        cli.fail("--rewards", f"no reference for {unknown or repr(args.rewards)}; known: "
                 f"{', '.join(REFERENCES)}", PROG)  # fmt: skip
    if args.json and not args.json.resolve().parent.is_dir():
        cli.fail("--json", f"{args.json}'s folder does not exist: give a file in an existing "
                 "folder (it is written after every comparison has run)", PROG)  # fmt: skip
    if args.ours:  # rewards.py's scores of a work folder's saved inputs, run by compare()
        prompts = json.loads((args.ours / "prompts.json").read_text())
        pictures = [read_png(path) for path in sorted((args.ours / "images").glob("*.png"))]
        got = ours(names[0], args.ours, pictures, prompts)
        (args.ours / "ours.json").write_text(json.dumps(got))
        return 0
    if args.setup:
        setup(args.envs, names)
        return 0
    missing = [n for n in names if not python(args.envs, n).exists()]
    if missing:
        print(
            f"no reference environment for {', '.join(missing)} under {args.envs}; create them "
            f"with: python -m benchmarks.reward_parity --setup --envs {args.envs}",
            file=sys.stderr,
        )
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bar = tqdm(names, unit="reward", leave=False)  # stderr: a reference takes up to minutes
        for name in bar:
            bar.set_description(f"{name} beside its reference")
            rows.append(compare(name, args.envs, (args.keep or Path(tmp)) / name))
    print("| reward | images | max \\|Δ\\| | tolerance | score spread | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['reward']} | {r['images']} | {r['max_delta']:.2e} | {r['tolerance']:g} "
              f"| {r['spread']:.3f} | {r['seconds']:.0f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if all(r["max_delta"] <= r["tolerance"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
