"""Prompt sets the project generates itself, for `recast.py --model … --prompts-file`:

    python -m studies.prompts                  # writes prompts/ (the files shipped in the repo)
    python -m studies.prompts --out DIR --seed 1

- **geneval** (`geneval_train.txt`, `geneval_eval.txt`): compositional prompts in GenEval's six
  categories, on COCO's 80 object classes, GenEval's ten colours, counts of two to four and four
  relative positions, in templates of this file's own: single object, two objects, counting,
  colours, position, colour attribution (`geneval_*.jsonl` says each prompt's category and
  slots). The split is by *scene*, not by string: "a cat left of a dog" and "a dog right of a
  cat" are one scene, as are "a red cup and a blue bowl" and "a blue bowl and a red cup", and a
  scene is in one split only, so no held-out prompt is a rewording of a training one.
- **ocr** (`ocr_train.txt`, `ocr_eval.txt`): short words and phrases in double quotes on a
  surface in a scene (a sign, a mug, a cake…, beside a COCO object), what reward `ocr` reads
  (rewards.quoted). The split is by *text*: no held-out text is ever asked for in training.
  Every prompt also describes a scene, so the preset `paper2` (pickscore, ocr, vqa, aesthetic)
  trains on it whole (docs/prompts.md).

Everything is drawn from one `random.Random(--seed)` in a fixed order: the same seed writes the
same bytes (the tests regenerate the shipped files). Nothing is downloaded; the public sets
(Pick-a-Pic, DrawBench, flow_grpo's GenEval and OCR sets) are fetched by the commands of
docs/prompts.md.
"""

import argparse
import itertools
import json
import os
import random

from plumbing import cli

# COCO's 80 object classes (the detection categories GenEval's object detector knows)
COCO = [
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "mouse", "remote",
    "keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book",
    "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
]  # fmt: skip
COLOURS = ["red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black",
           "white"]  # fmt: skip
COUNTS = {2: "two", 3: "three", 4: "four"}
# a relation and its mirror: "A left of B" is the scene "B right of A"
RELATIONS = {"to the left of": "to the right of", "above": "below"}
PLURAL = {"person": "people", "mouse": "computer mice", "knife": "knives", "sheep": "sheep",
          "skis": "pairs of skis", "scissors": "pairs of scissors", "broccoli": "heads of broccoli",
          "bus": "buses", "couch": "couches", "bench": "benches", "sandwich": "sandwiches",
          "wine glass": "wine glasses", "toothbrush": "toothbrushes", "tv": "tvs"}  # fmt: skip
# phrasings of this file's own (GenEval words every prompt "a photo of …")
FRAMES = ["a photo of {}", "a picture of {}", "an image showing {}", "a realistic photo of {}"]
CATEGORIES = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]

# the OCR set's texts: single words, and adjective-noun phrases, of this file's own choosing
WORDS = [
    "OPEN", "CLOSED", "SALE", "EXIT", "STOP", "HELLO", "WELCOME", "COFFEE", "BAKERY", "PIZZA",
    "BOOKS", "MUSIC", "GARDEN", "HOTEL", "TAXI", "POLICE", "LIBRARY", "MARKET", "CINEMA",
    "DANGER", "QUIET", "PUSH", "PULL", "THANKS", "SMILE", "DREAM", "RELAX", "ENJOY", "BELIEVE",
    "TODAY", "SUMMER", "WINTER", "OCEAN", "FOREST", "ROCKET", "PLANET", "ROBOT", "DRAGON",
    "CASTLE", "CIRCUS", "PICNIC", "HARBOR", "BRIDGE", "STATION", "MUSEUM", "STUDIO", "KITCHEN",
    "BISTRO", "DINER", "NOODLES", "TACOS", "DONUTS", "JUICE", "SOUP", "CANDY", "FLOWERS",
    "PLANTS", "TOYS", "GAMES", "TICKETS",
]  # fmt: skip
ADJECTIVES = ["FRESH", "HOT", "FREE", "BEST", "HAPPY", "GOOD", "BIG", "NEW", "OLD", "WILD",
              "SWEET", "LOCAL", "GOLDEN", "SILENT", "LUCKY", "TINY", "MAGIC", "COSMIC", "PURE",
              "DAILY"]  # fmt: skip
NOUNS = ["COFFEE", "BREAD", "BOOKS", "PIZZA", "MUSIC", "TEA", "FLOWERS", "GAMES", "NEWS",
         "DAYS", "IDEAS", "VIBES", "FRIENDS", "DREAMS", "MARKET", "GARDEN", "ROAD", "CAFE",
         "SHOP", "BAKERY", "DELI", "RADIO", "CINEMA", "HOTEL", "STUDIO"]  # fmt: skip
SURFACES = [
    "a wooden sign", "a neon sign", "a chalkboard", "a shop banner", "a street sign",
    "a coffee mug", "a t-shirt", "a book cover", "a birthday cake", "a poster on a brick wall",
    "a cardboard box", "a storefront window", "a paper bag", "a billboard", "a license plate",
    "a greeting card", "a road sign", "a flag", "a mural", "a doormat",
]  # fmt: skip
SAYS = ['{} that says "{}"', '{} with the words "{}"', '{} reading "{}"', '{} printed with "{}"']
PLACES = ["next to {}", "beside {}", "behind {}", "in front of {}"]


SINGULAR = {"skis": "pair of skis", "scissors": "pair of scissors"}  # COCO names that are plural


def article(noun: str, colour: str = "") -> str:
    """One `noun` (of `colour`): "an apple", "a red cup", "a pair of blue scissors"."""
    if noun in SINGULAR:
        return article(SINGULAR[noun].replace(" of ", f" of {colour} " if colour else " of "))
    words = f"{colour} {noun}" if colour else noun
    return ("an " if words[0] in "aeiou" else "a ") + words


def plural(noun: str) -> str:
    return PLURAL.get(noun, noun + "s")


def geneval_scenes(rng: random.Random) -> dict[str, list[tuple]]:
    """Every scene of each category, in a seeded order: a scene is what a prompt asks for, in a
    canonical form (unordered pairs as sorted tuples; a position by its left or upper object)."""
    pairs = list(itertools.combinations(COCO, 2))
    scenes = {
        "single_object": [(o,) for o in COCO],
        "two_object": pairs,
        "counting": [(o, n) for o in COCO for n in COUNTS],
        "colors": [(c, o) for o in COCO for c in COLOURS],
        "position": [(a, r, b) for a, b in itertools.permutations(COCO, 2) for r in RELATIONS],
        "color_attr": [((c1, a), (c2, b)) for a, b in pairs for c1 in COLOURS for c2 in COLOURS],
    }
    for found in scenes.values():
        rng.shuffle(found)
    return scenes


def geneval_prompt(category: str, scene: tuple, rng: random.Random) -> str:
    """One wording of a scene: its frame, and for pairs the order (and a position's direction)
    drawn from `rng`."""
    frame = rng.choice(FRAMES)
    if category == "single_object":
        return frame.format(article(scene[0]))
    if category == "two_object":
        a, b = rng.sample(scene, 2)
        return frame.format(f"{article(a)} and {article(b)}")
    if category == "counting":
        o, n = scene
        return frame.format(f"{COUNTS[n]} {plural(o)}")
    if category == "colors":
        c, o = scene
        return frame.format(article(o, c))
    if category == "position":
        a, r, b = scene
        if rng.random() < 0.5:  # the same scene, said from the other object
            a, r, b = b, RELATIONS[r], a
        return frame.format(f"{article(a)} {r} {article(b)}")
    (c1, a), (c2, b) = rng.sample(scene, 2)
    return frame.format(f"{article(a, c1)} and {article(b, c2)}")


def geneval(rng: random.Random, train_per: int, eval_per: int) -> dict[str, list[dict]]:
    """{"train": [...], "eval": [...]} of {"category", "scene", "prompt"}: per category the first
    `eval_per` scenes held out, the next `train_per` (or as many as there are) for training."""
    out = {"train": [], "eval": []}
    for category, scenes in geneval_scenes(rng).items():
        for split, chosen in (("eval", scenes[:eval_per]),
                              ("train", scenes[eval_per : eval_per + train_per])):  # fmt: skip
            for scene in chosen:
                prompt = geneval_prompt(category, scene, rng)
                out[split].append({"category": category, "scene": scene, "prompt": prompt})
    return out


def ocr_texts(rng: random.Random) -> list[str]:
    """The OCR set's texts, in a seeded order: the single words, and the adjective-noun phrases."""
    texts = [*WORDS, *(f"{a} {n}" for a in ADJECTIVES for n in NOUNS)]
    texts = list(dict.fromkeys(texts))
    rng.shuffle(texts)
    return texts


def ocr_prompt(text: str, rng: random.Random) -> str:
    """`text` in quotes on a surface, in a scene beside a COCO object (sometimes coloured)."""
    surface = rng.choice(SURFACES)
    thing = rng.choice(COCO)
    thing = article(thing, rng.choice(COLOURS) if rng.random() < 0.5 else "")
    return f"{rng.choice(SAYS).format(surface, text)}, {rng.choice(PLACES).format(thing)}"


def ocr(rng: random.Random, eval_texts: int, per_text: int) -> dict[str, list[dict]]:
    """{"train": [...], "eval": [...]} of {"text", "prompt"}: the first `eval_texts` texts held
    out (one prompt each), every other text in `per_text` training prompts (other scenes)."""
    texts = ocr_texts(rng)
    out = {"eval": [{"text": t, "prompt": ocr_prompt(t, rng)} for t in texts[:eval_texts]]}
    out["train"] = [{"text": t, "prompt": ocr_prompt(t, rng)} for t in texts[eval_texts:]
                    for _ in range(per_text)]  # fmt: skip
    return out


def generate(seed: int = 0, train_per: int = 300, eval_per: int = 16, ocr_eval: int = 64,
             ocr_per_text: int = 2) -> dict[str, dict[str, list[dict]]]:  # fmt: skip
    """{"geneval": {"train", "eval"}, "ocr": {"train", "eval"}}, all from random.Random(seed)."""
    rng = random.Random(seed)
    sets = {"geneval": geneval(rng, train_per, eval_per), "ocr": ocr(rng, ocr_eval, ocr_per_text)}
    for splits in sets.values():  # a prompt worded twice in one split is kept once
        for split, rows in splits.items():
            seen: set[str] = set()
            splits[split] = [r for r in rows if not (r["prompt"] in seen or seen.add(r["prompt"]))]
    return sets


def write(sets: dict, out: str) -> list[str]:
    """NAME_SPLIT.txt (one prompt a line, for --prompts-file / --eval-prompts-file) and
    NAME_SPLIT.jsonl (each prompt with its category and scene, or its text) into `out`."""
    os.makedirs(out, exist_ok=True)
    written = []
    for name, splits in sets.items():
        for split, rows in splits.items():
            base = os.path.join(out, f"{name}_{split}")
            with open(base + ".txt", "w", encoding="utf-8", newline="\n") as f:
                f.write("".join(r["prompt"] + "\n" for r in rows))
            with open(base + ".jsonl", "w", encoding="utf-8", newline="\n") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rows))
            written += [base + ".txt", base + ".jsonl"]
    return written


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="python -m studies.prompts", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", default="prompts", help="folder to write (default: prompts)")
    ap.add_argument("--seed", type=int, default=0, help="the one seed of every draw (default: 0)")
    sizes = {"train_per": (300, "geneval: training scenes per category, at most"),
             "eval_per": (16, "geneval: held-out scenes per category"),
             "ocr_eval": (64, "ocr: held-out texts, one prompt each"),
             "ocr_per_text": (2, "ocr: training prompts per other text")}  # fmt: skip
    for name, (default, what) in sizes.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                        help=f"{what} (default: {default})")  # fmt: skip
    a = ap.parse_args(argv)
    for flag in ("train_per", "eval_per", "ocr_eval", "ocr_per_text"):
        if getattr(a, flag) < 1:
            cli.fail(f"--{flag.replace('_', '-')}", f"must be ≥ 1, got {getattr(a, flag)}", ap.prog)
    # what is held out comes first, training takes the rest: each must leave some to train on
    scenes, texts = len(COCO), len(ocr_texts(random.Random(0)))  # single_object: the fewest
    if a.eval_per >= scenes:
        cli.fail("--eval-per", f"must be below {scenes}, the scenes of single_object (the "
                 f"smallest category), so every category keeps some to train on; got "
                 f"{a.eval_per}", ap.prog)  # fmt: skip
    if a.ocr_eval >= texts:
        cli.fail("--ocr-eval", f"must be below {texts}, the OCR set's texts, so some are left to "
                 f"train on; got {a.ocr_eval}", ap.prog)  # fmt: skip
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        cli.fail("--out", f"{a.out} is a file, not a folder for the prompt sets: pick another",
                 ap.prog)  # fmt: skip
    sets = generate(a.seed, a.train_per, a.eval_per, a.ocr_eval, a.ocr_per_text)
    for path in write(sets, a.out):
        if path.endswith(".txt"):
            with open(path, encoding="utf-8") as f:
                print(f"{path}: {sum(1 for _ in f)} prompts")


if __name__ == "__main__":
    main()
