"""The `ocr` reward's two readers side by side (docs/your_reward.md#two-readers): EasyOCR's
(reward_models/ocr_reader.py) and PaddleOCR's as rapidocr runs it (reward_models/paddle_reader.py),
on words rendered here, clean and damaged as early training images are.

    python -m benchmarks.ocr_readers                # the table in docs/your_reward.md
    python -m benchmarks.ocr_readers --words 4      # a quick look

The words are the quoted texts of prompts/ocr_eval.txt, drawn by --seed. Each is drawn black on
white (448 x 112 px) in one of FONTS at one of SIZES, in turn, and damaged as each kind in KINDS
says; all damage comes from one generator seeded by --seed. Per kind, a reader's score is the
reward's `text_match` of what it reads against the TRUE text (`ideal`: what a perfect reader would
score), and its ranking is how often the right text scores above a wrong one drawn alike (ties
count half): what a group-relative training signal needs. Both readers run on the CPU, one image
at a time; seconds an image is the median of each reader's reads.
"""

import argparse
import os
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

import rewards
from plumbing import cli
from reward_models import ocr_reader, paddle_reader

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = (28, 36, 44)  # font px, in turn
SMALL = 9  # px: the `small` kind
# (kind, what the better image shows, what the worse one shows, what is done to both)
KINDS = {
    "clean": ("true", "other word", ""),
    "swap": ("true", "two letters swapped", ""),
    "missing": ("true", "a letter missing", ""),
    "blur": ("true", "misspelt", "Gaussian blur, sigma 3 px"),
    "faint": ("true", "misspelt", "ink 185 on paper 200"),
    "small": ("true", "misspelt", f"{SMALL} px font"),
    "noise": ("true", "misspelt", "Gaussian noise, sigma 80"),
    "mixed": ("true", "misspelt", "blur 1.5 px, ink 150 on 200, noise 30"),
}


def fonts() -> list:
    """Pillow's own font and three of the DejaVu faces matplotlib ships (a loader of size)."""
    import matplotlib
    from PIL import ImageFont

    ttf = os.path.join(matplotlib.get_data_path(), "fonts", "ttf")
    faces = [os.path.join(ttf, f) for f in ("DejaVuSans.ttf", "DejaVuSerif-Bold.ttf",
                                           "DejaVuSansMono.ttf")]  # fmt: skip
    return [ImageFont.load_default, *[lambda px, f=f: ImageFont.truetype(f, px) for f in faces]]


FONTS = ("Pillow's default", "DejaVu Sans", "DejaVu Serif Bold", "DejaVu Sans Mono")


def words(n: int, seed: int) -> list[str]:
    """n quoted texts of prompts/ocr_eval.txt, drawn without replacement."""
    with open(os.path.join(HERE, "prompts", "ocr_eval.txt")) as f:
        texts = sorted({rewards.quoted(line) for line in f if line.strip()})
    return [texts[i] for i in np.random.default_rng(seed).permutation(len(texts))[:n]]


def swap(text: str, rng: np.random.Generator) -> str:
    """Two neighbouring letters that differ, swapped."""
    spots = [
        i for i in range(len(text) - 1) if text[i] != text[i + 1] and " " not in text[i : i + 2]
    ]
    i = int(rng.choice(spots))
    return text[:i] + text[i + 1] + text[i] + text[i + 2 :]


def missing(text: str, rng: np.random.Generator) -> str:
    """One letter left out."""
    i = int(rng.choice([i for i, c in enumerate(text) if c != " "]))
    return text[:i] + text[i + 1 :]


def draw(text: str, font, px: int, kind: str, rng: np.random.Generator) -> torch.Tensor:
    """`text` black on white, damaged as `kind` says: an image (3, 112, 448) uint8."""
    from PIL import Image, ImageDraw, ImageFilter

    ink, paper = {"faint": (185, 200), "mixed": (150, 200)}.get(kind, (0, 255))
    px = SMALL if kind == "small" else px
    im = Image.new("L", (448, 112), paper)
    face = font(px)
    while ImageDraw.Draw(im).textlength(text, font=face) > 424:  # fit the width
        px -= 2
        face = font(px)
    ImageDraw.Draw(im).text((12, 56 - px // 2), text, ink, face)
    if kind in ("blur", "mixed"):
        im = im.filter(ImageFilter.GaussianBlur(3 if kind == "blur" else 1.5))
    grey = np.asarray(im, dtype=np.float32)
    if kind in ("noise", "mixed"):
        grey = grey + rng.normal(0, 80 if kind == "noise" else 30, grey.shape)
    grey = torch.from_numpy(np.clip(grey, 0, 255).round().astype(np.uint8))
    return grey.expand(3, -1, -1).contiguous()


def cases(n: int, seed: int) -> list[tuple[str, str, str, torch.Tensor, torch.Tensor]]:
    """(kind, true text, wrong text, better image, worse image) for n words and every kind."""
    rng = np.random.default_rng(seed)
    texts, loaders, out = words(n, seed), fonts(), []
    for w, text in enumerate(texts):
        font, px = loaders[w % len(loaders)], SIZES[w % len(SIZES)]
        for kind in KINDS:
            if kind == "clean":
                wrong = texts[(w + 1) % len(texts)]
            else:  # the visual kinds: a swap or a missing letter, by a coin
                garble = {"swap": swap, "missing": missing}.get(
                    kind, (swap, missing)[rng.integers(2)]
                )
                wrong = garble(text, rng)
            shown = "" if kind in ("clean", "swap", "missing") else kind
            out.append((kind, text, wrong, draw(text, font, px, shown, rng),
                        draw(wrong, font, px, shown, rng)))  # fmt: skip
    return out


def timed_reads(
    reader, images: list[torch.Tensor], desc: str = ""
) -> tuple[list[str], list[float]]:
    """What `reader` reads in each image and the seconds each read took; a bar on stderr (a
    read takes seconds on the CPU: the default table is minutes of them)."""
    reads, seconds = [], []
    for im in tqdm(images, desc=desc, unit="image", leave=False):
        tic = time.perf_counter()
        reads.append(reader.read(im))
        seconds.append(time.perf_counter() - tic)
    return reads, seconds


def table(rows: list, scored: dict) -> list[str]:
    """The markdown table: per kind, ideal and each reader's mean score (better image for clean
    and the visual kinds, the garbled one for swap and missing), and each reader's ranking."""
    names = list(scored)
    head = [
        "kind",
        "pairs",
        "ideal",
        *[f"{n} score" for n in names],
        *[f"{n} ranks" for n in names],
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    totals = {n: ([], []) for n in names}
    ideal_all = []
    for kind in KINDS:
        idx = [i for i, r in enumerate(rows) if r[0] == kind]
        garbled = kind in ("swap", "missing")
        ideal = [rewards.text_match(rows[i][2], rows[i][1]) if garbled else 1.0 for i in idx]
        ideal_all += ideal
        cells = [kind, str(len(idx)), f"{statistics.mean(ideal):.3f}"]
        ranks = []
        for n in names:
            better, worse = scored[n]
            s = [worse[i] if garbled else better[i] for i in idx]
            r = [
                1.0 if better[i] > worse[i] else 0.5 if better[i] == worse[i] else 0.0 for i in idx
            ]
            totals[n][0].extend(s)
            totals[n][1].extend(r)
            cells.append(f"{statistics.mean(s):.3f}")
            ranks.append(f"{statistics.mean(r):.3f}")
        lines.append("| " + " | ".join(cells + ranks) + " |")
    cells = ["all", str(len(rows)), f"{statistics.mean(ideal_all):.3f}"]
    cells += [f"{statistics.mean(totals[n][0]):.3f}" for n in names]
    cells += [f"{statistics.mean(totals[n][1]):.3f}" for n in names]
    lines.append("| " + " | ".join(f"**{c}**" for c in cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = cli.Parser(prog="ocr_readers.py", description=__doc__,
                   formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    p.add_argument("--words", type=int, default=10, help="texts of prompts/ocr_eval.txt (1-64)")
    p.add_argument("--seed", type=int, default=0, help="draws the texts and the damage")
    p.add_argument("--show", action="store_true", help="print every read")
    args = p.parse_args(argv)
    if not 1 <= args.words <= 64:
        cli.fail("--words", f"{args.words} is not in 1-64 (prompts/ocr_eval.txt quotes 64 texts)",
                 p.prog)  # fmt: skip
    rows = cases(args.words, args.seed)
    cpu = torch.device("cpu")
    readers = {"EasyOCR": ocr_reader.load_reader(cpu), "PaddleOCR": paddle_reader.load_reader(cpu)}
    scored, medians = {}, {}
    for name, reader in readers.items():
        better, t1 = timed_reads(reader, [r[3] for r in rows], f"{name}, true texts")
        worse, t2 = timed_reads(reader, [r[4] for r in rows], f"{name}, wrong texts")
        medians[name] = statistics.median(t1 + t2)
        truth = [r[1] for r in rows]
        scored[name] = tuple(
            [rewards.text_match(read, t) for read, t in zip(reads, truth, strict=True)]
            for reads in (better, worse)
        )
        if args.show:
            for r, b, w in zip(rows, better, worse, strict=True):
                print(f"{name:9} {r[0]:8} {r[1]!r:18} read {b!r:20} | {r[2]!r:18} read {w!r}")
    print(f"{args.words} texts of prompts/ocr_eval.txt, seed {args.seed}, fonts "
          f"{', '.join(FONTS)} at {', '.join(map(str, SIZES))} px in turn; "
          f"{torch.get_num_threads()} CPU threads")  # fmt: skip
    print("\n".join(table(rows, scored)))
    print("| seconds an image (median) | " + " | ".join(
        f"{n}: {medians[n]:.2f}" for n in readers) + " |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
