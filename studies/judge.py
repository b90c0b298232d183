"""An independent pairwise judge: which of two runs' images of the same prompt and noise is better?

The paper's third kind of evidence is an independent LLM-as-a-Judge that prefers ReCAST's images.
This compares two runs image by image on their saved final eval (OUT/eval_images/: the held-out
prompts × eval seeds with the same fixed noise in every run) and prints A's preference rate over B,
its ties, and a 95 % bootstrap interval over prompts.

    python studies/judge.py RUN_A RUN_B                                   # toy world
    python studies/judge.py RUN_A RUN_B --judge vlm --judge-model PATH    # real models

`--judge toy` (the default) prefers the image closer to the prompt's ideal rendering, by one
whole-image measure: the structural similarity (SSIM; Wang et al. 2004: a Gaussian window, σ 1.5
and 11 px, centred on every pixel, per channel, on [0, 1] pixels) to the ideal rendering, so
distance = 1 − SSIM. SSIM compares local means (colour and place), contrasts (specks, mottling,
edges) and structure (shape, outline) everywhere at once, which none of the rewards or judges
does: each of those measures one property of the object's mask or colour. It is not one of them
and nothing trains on it. Two images whose distances differ by less than TIE (half a percent of
SSIM's range, invisible side by side at 32 px) are a tie.

`--judge vlm --judge-model PATH` asks a local vision-language model (studies/vlm_judge.py), both
orders of each pair; the orders disagreeing is a tie (docs/judge.md).

The preference rate counts a tie as half a win: 0.5 is no preference.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import cli, eval_images  # noqa: E402
from worlds import toyworld as tw  # noqa: E402

TIE = 0.005  # |d_A − d_B| below this (in SSIM) is a tie
BOOTSTRAP = 2000  # resamples of the prompts for the interval
WINDOW_SIGMA, WINDOW_RADIUS = 1.5, 5  # SSIM's Gaussian window (11 px)


def ssim(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean SSIM (B,) of images x, y (B, C, H, W) in [-1, 1], per channel, with a window centred
    on every pixel (the image reflected at its edges, so a corner counts as much as the middle;
    Wang et al. 2004's constants for a range of 1)."""
    x, y = (x.float() + 1) / 2, (y.float() + 1) / 2
    r = WINDOW_RADIUS
    g = torch.exp(-((torch.arange(-r, r + 1, dtype=torch.float32) / WINDOW_SIGMA) ** 2) / 2)
    g = g / g.sum()
    C = x.shape[1]
    kx, ky = g.view(1, 1, 1, -1).repeat(C, 1, 1, 1), g.view(1, 1, -1, 1).repeat(C, 1, 1, 1)

    def blur(z: torch.Tensor) -> torch.Tensor:  # every pixel a window's centre: edges reflected
        z = F.pad(z, (r, r, r, r), mode="reflect")
        return F.conv2d(F.conv2d(z, kx, groups=C), ky, groups=C)

    mx, my = blur(x), blur(y)
    vx, vy, cov = blur(x * x) - mx**2, blur(y * y) - my**2, blur(x * y) - mx * my
    c1, c2 = 0.01**2, 0.03**2
    s = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return s.mean((1, 2, 3))


def toy_distances(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """1 − SSIM (N,) of each image to its prompt's ideal rendering (toy-world prompts only)."""
    return 1 - ssim(images, tw.render(prompts))


def prefer_by_distance(d_a: torch.Tensor, d_b: torch.Tensor, tie: float = TIE) -> torch.Tensor:
    """+1 where A's image is closer to the ideal by at least `tie`, −1 where B's is, else 0."""
    return ((d_b - d_a > tie).to(torch.int8) - (d_a - d_b > tie).to(torch.int8)).to(torch.int8)


def preference_rate(votes: torch.Tensor) -> float:
    """A's preference rate over B: (wins + ties / 2) / pairs."""
    return ((votes.float() + 1) / 2).mean().item()


def bootstrap_interval(votes: torch.Tensor, prompts: list[str], resamples: int = BOOTSTRAP,
                       seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """95 % percentile interval of the preference rate, resampling the prompts (each with all its
    eval seeds) with replacement."""
    names = list(dict.fromkeys(prompts))
    per = torch.zeros(len(names))
    count = torch.zeros(len(names))
    where = torch.tensor([names.index(p) for p in prompts])
    per.index_add_(0, where, (votes.float() + 1) / 2)
    count.index_add_(0, where, torch.ones(len(prompts)))
    pick = torch.randint(len(names), (resamples, len(names)),
                         generator=torch.Generator().manual_seed(seed))  # fmt: skip
    rates = per[pick].sum(1) / count[pick].sum(1)
    lo, hi = torch.quantile(rates, torch.tensor([0.025, 0.975])).tolist()
    return lo, hi


class BadInput(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(message)
        self.flag = flag


def load_pair(run_a: str, run_b: str) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Both runs' eval images, checked to be of the same prompts and noise."""
    loaded = []
    for flag, run in (("RUN_A", run_a), ("RUN_B", run_b)):
        try:
            loaded.append(eval_images.load(run))
        except FileNotFoundError as e:
            raise BadInput(flag, str(e)) from e
    (ia, a), (ib, b) = loaded
    if ia["prompts"] != ib["prompts"] or ia["noise_sha256"] != ib["noise_sha256"]:
        what = "prompts" if ia["prompts"] != ib["prompts"] else "eval noise"
        raise BadInput("RUN_B", f"{run_a} and {run_b} were evaluated on different {what}: "
                       "compare runs of one world with the same --eval-seeds")  # fmt: skip
    if a.shape != b.shape:
        raise BadInput("RUN_B", f"images of {tuple(a.shape[1:])} and {tuple(b.shape[1:])}")
    return ia["prompts"], a, b


def judge_votes(args, prompts: list[str], a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """+1 / 0 / −1 per pair from the chosen judge."""
    if args.judge == "toy":
        try:
            tw.parse(prompts)
        except ValueError as e:
            raise BadInput("--judge", f"the toy judge needs toy-world prompts ({e}); for a real "
                           "model use --judge vlm --judge-model PATH") from e  # fmt: skip
        return prefer_by_distance(toy_distances(a, prompts), toy_distances(b, prompts))
    from studies import vlm_judge

    try:
        vlm_judge.check_prompts(prompts)
    except ValueError as e:
        raise BadInput("RUN_A", f"{e}; these runs' held-out prompts cannot be judged by a VLM "
                       "as written") from e  # fmt: skip
    try:
        judge = vlm_judge.VLMJudge(args.judge_model, torch.device(args.device))
    except (OSError, ValueError) as e:
        raise BadInput("--judge-model", str(e)) from e
    return judge.prefer(a, b, prompts)


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="judge.py", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("run_a", metavar="RUN_A", help="a run folder with eval_images/")
    ap.add_argument("run_b", metavar="RUN_B", help="another, evaluated on the same prompts, noise")
    ap.add_argument(
        "--judge",
        choices=["toy", "vlm"],
        default="toy",
        help="toy (default): SSIM to the ideal rendering; vlm: a local vision-language model",
    )
    ap.add_argument("--judge-model", default="", help="--judge vlm: the model's local folder")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="--judge vlm: where the model runs (default: cuda if available, else "
                    "cpu); --judge toy runs on the CPU")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        if args.judge == "vlm" and not args.judge_model:
            raise BadInput(
                "--judge-model",
                "--judge vlm needs --judge-model PATH, a local folder "
                "of an image-text-to-text model such as Qwen2.5-VL-7B-Instruct",
            )
        prompts, a, b = load_pair(args.run_a, args.run_b)
        votes = judge_votes(args, prompts, a, b)
    except BadInput as e:
        ap.exit(2, f"judge.py: error: {e.flag}: {e}\n")
    n, held = len(votes), len(dict.fromkeys(prompts))
    lo, hi = bootstrap_interval(votes, prompts)
    print(f"judge: {args.judge}; {n} pairs ({held} prompts × {n // held} seeds)")
    print(f"A = {args.run_a}\nB = {args.run_b}")
    share = {w: (votes == v).float().mean().item() for w, v in (("A", 1), ("tie", 0), ("B", -1))}
    print(f"A preferred {share['A']:.1%}, ties {share['tie']:.1%}, B preferred {share['B']:.1%}")
    print(f"A's preference rate over B (a tie counts half): {preference_rate(votes):.3f} "
          f"[95 % bootstrap over prompts: {lo:.3f}, {hi:.3f}]")  # fmt: skip


if __name__ == "__main__":
    main()
