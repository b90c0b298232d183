"""Command line of recast.py: flags from a dataclass, and every check that runs before anything
is loaded or written. Bad input exits with code 2 and one line that names the flag and the fix."""

import argparse
import ast
import difflib
import inspect
import json
import math
import os
import re
import sys
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Literal, NoReturn, get_args, get_origin

if TYPE_CHECKING:  # torch is imported where it is used: --help must not wait for it
    import torch

# The --weighting choices with W = λ/T: no gains, so no step prediction is scored
NO_GAINS = ("flat", "uniform", "sum", "gdpo")
# The --weighting choices that train one reward (one row of r, W = 1/T)
ONE_REWARD = ("sum", "gdpo")


def fail(flag: str, message: str, prog: str = "recast.py") -> NoReturn:
    """Exit 2 with one line naming the flag and the fix (every script of the project)."""
    print(f"{prog}: error: {flag}: {message}", file=sys.stderr)
    sys.exit(2)


def flag_of(name: str) -> str:
    return "--lambda" if name == "lam" else "--" + name.replace("_", "-")


def field_docs(cls) -> dict[str, str]:
    """The docstring under each dataclass field: the help text of its flag."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    return {
        a.target.id: b.value.value.strip()
        for a, b in zip(body, body[1:], strict=False)
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr)
    }


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's help, wrapped as argparse wraps it, with each flag's default on a line of its
    own."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        body, _, default = text.partition(DEFAULT)
        lines = super()._split_lines(body, width)
        return lines + super()._split_lines("default: " + default, width) if default else lines


DEFAULT = "\ndefault: "  # where a flag's help says its default


def help_text(doc: str, default) -> str:
    """A flag's help: its docstring, then its default, the docstring's own `default:` line where
    it has one (a default that depends on other flags, said in words)."""
    body, said, own = re.sub(r"\n\s*default: ", DEFAULT, doc, count=1).partition(DEFAULT)
    return f"{body}{DEFAULT}{own if said else repr(default)}"


class Parser(argparse.ArgumentParser):
    """argparse whose errors are `fail`'s one line (prefixed with the parser's prog), not the
    whole usage block. A flag is taken by its whole name only: an abbreviation (--norm for
    --normalize) is refused, naming the flags it could mean, since `given` reads the command line
    by whole names: a default filled in for a flag not given (fill_defaults) replaced its value."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})

    def error(self, message: str) -> NoReturn:
        extra = message.removeprefix("unrecognized arguments: ").split()
        if message.startswith("unrecognized arguments: ") and extra[0].startswith("--"):
            flag = extra[0].split("=")[0]
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            near = [o for o in known if o.startswith(flag)] or difflib.get_close_matches(
                flag, known, 3, 0.8)  # fmt: skip
            fail(flag, f"no such flag{': did you mean ' + ' or '.join(near) + '?' if near else ''} "
                 "(flags are given by their whole name; see --help)", self.prog)  # fmt: skip
        flag, _, detail = message.partition(": ")
        if flag.startswith("argument "):
            fail(flag.removeprefix("argument ").split("/")[0], detail, self.prog)
        fail("usage", f"{message} (see --help)", self.prog)


def parse(cls, argv: list[str] | None, description: str, before: dict | None = None):
    """An argparse parser with one flag per field of the dataclass `cls` (a Literal field takes
    one of its values); returns a `cls`. On --resume the run's args.json fills the flags not
    given, and `before` those the run predates (a flag's value before it existed)."""
    docs = field_docs(cls)
    ap = Parser(
        prog="recast.py",
        description=description,
        formatter_class=HelpFormatter,
    )
    for f in fields(cls):
        kw = dict(dest=f.name, default=f.default, help=help_text(docs[f.name], f.default))
        if f.type is bool:
            ap.add_argument(flag_of(f.name), action="store_true", **kw)
        elif get_origin(f.type) is Literal:
            ap.add_argument(flag_of(f.name), type=str, choices=get_args(f.type), **kw)
        else:
            ap.add_argument(flag_of(f.name), type=f.type, **kw)
    args = ap.parse_args(argv)
    saved = os.path.join(args.out, "args.json")
    if args.resume and args.out and os.path.isfile(saved):  # a resumed run keeps its flags
        # unless given again (no --out: check says so, whatever args.json the working folder has)
        kept = {**(before or {}), **saved_flags(args.out)}  # a newer flag: its old value
        for f in fields(cls):  # a value no launch writes (another tool's file): argparse would
            wrong = f.name in kept and not_a(f.type, kept[f.name])  # pass it on unchecked
            if wrong:
                fail("--resume", f"{saved} gives {flag_of(f.name)} {kept[f.name]!r}, not {wrong}: "
                     "restore it from a copy, or use a new --out")  # fmt: skip
        ap.set_defaults(**{k: v for k, v in kept.items() if k in vars(args)})
        args = ap.parse_args(argv)
    return cls(**vars(args))


def not_a(kind, value) -> str | None:
    """What a flag of type `kind` takes, where `value` (from args.json) is not one; else None."""
    if get_origin(kind) is Literal:
        return None if value in get_args(kind) else f"one of {', '.join(get_args(kind))}"
    takes = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}.get(kind, (object,))
    if isinstance(value, takes) and (kind is bool or not isinstance(value, bool)):
        return None
    return {bool: "true or false", int: "a whole number", float: "a number"}.get(kind, "a string")


def saved_flags(out: str, flag: str = "--resume",
                fix: str = "restore it from a copy, or use a new --out") -> dict:  # fmt: skip
    """The flags in OUT/args.json; exit 2 naming `flag`, the file and `fix` where it is not a
    run's (not JSON, torn, or not an object of flags)."""
    path = os.path.join(out, "args.json")
    try:
        with open(path, "rb") as f:
            flags = json.loads(f.read().decode())
        why = None if isinstance(flags, dict) else f"JSON, but a {type(flags).__name__}"
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        why = f"{type(e).__name__}: {e}"
    if why:
        fail(flag, f"{path} is not a run's flags ({why}): {fix}")
    return flags


def count(text: str) -> int:
    """argparse's type of a flag that counts (--threads, --prompts): a whole number ≥ 1, or
    Parser's one line, not a traceback where the count is first used."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number ≥ 1, got {text!r}")
    return int(text)


def parse_lambda(text: str, names: list[str]) -> "torch.Tensor":
    """--lambda → budgets (K,) float64 normalised to sum 1 (with a note when they did not)."""
    import torch  # not at the top: recast.py --help must not wait for it

    example = "--lambda " + ",".join(["0.25"] * len(names))
    if not text.strip():
        fail("--lambda", f"give one budget per reward ({', '.join(names)}), e.g. {example}")
    lam = torch.tensor(numbers("--lambda", text, names, "budgets", example), dtype=torch.float64)
    if not torch.isfinite(lam).all() or (lam < 0).any():
        fail("--lambda", f"budgets must be finite and ≥ 0, got {text!r}")
    if lam.sum() == 0:
        fail("--lambda", "all budgets are 0: give at least one reward a positive budget")
    if abs(lam.sum().item() - 1) > 1e-9:
        normalised = ", ".join(f"{x:.4g}" for x in (lam / lam.sum()).tolist())
        print(f"note: --lambda {text} sums to {lam.sum().item():g}; normalised to {normalised}")
    return lam / lam.sum()


def numbers(flag: str, text: str, names: list[str], what: str, example: str) -> list[float]:
    """A comma-separated list of one number per reward (`what`: their name in a message)."""
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        fail(flag, f"{text!r} is not a comma-separated list of numbers, e.g. {example}")
    if len(values) != len(names):
        fail(flag, f"{len(values)} {what} for {len(names)} rewards ({', '.join(names)})")
    return values


def parse_scale(text: str, names: list[str]) -> list[float]:
    """--reward-scale → one positive, finite factor per reward (empty: 1 each)."""
    if not text.strip():
        return [1.0] * len(names)
    example = "--reward-scale " + ",".join(["1"] * len(names))
    scale = numbers("--reward-scale", text, names, "factors", example)
    if not all(math.isfinite(f) and f > 0 for f in scale):
        fail("--reward-scale", f"factors must be finite and > 0, got {text!r}")
    return scale


def given(argv: list[str] | None, names: list[str]) -> list[str]:
    """The flags of `names` that appear on the command line `argv` (default: sys.argv)."""
    argv = sys.argv[1:] if argv is None else argv
    flags = [flag_of(n) for n in names]
    return [f for f in flags if any(a == f or a.startswith(f + "=") for a in argv)]


def fill_defaults(args, argv: list[str] | None, values: dict) -> dict:
    """Set `values` on `args` for the flags not on the command line `argv`, on a new run only (a
    resumed run keeps its args.json); returns what it set."""
    chosen = {} if args.resume else {k: v for k, v in values.items() if not given(argv, [k])}
    for k, v in chosen.items():
        setattr(args, k, v)
    return chosen


def scored_groups(gain_frac: float, prompts: int) -> int:
    """Prompt groups whose step predictions are scored an epoch, all ranks together: --gain-frac
    of --prompts, at least one. It depends on these two flags only, never on the number of ranks,
    so W does not either (docs/models.md#sharded-runs---shard)."""
    return max(1, round(gain_frac * prompts))


def scored_share(gain_frac: float, prompts: int, world_size: int, rank: int) -> list[int]:
    """The scored groups that `rank` holds, as indices among its own prompts // world_size groups
    (rank r holds the epoch's groups r·B … r·B + B - 1, B = prompts // world_size). The m =
    scored_groups groups are the epoch's groups ⌊i·prompts/m⌋, i < m: the same groups on any number
    of ranks, spread evenly over them. When m does not divide over the ranks they score unequal
    shares, one group apart (with fewer groups than ranks, some score none); recast.score_steps
    gathers them in order, and an epoch's scoring takes as long as the largest, ⌈m / ranks⌉."""
    m, per_rank = scored_groups(gain_frac, prompts), prompts // world_size
    first = rank * per_rank
    picked = (i * prompts // m for i in range(m))
    return [g - first for g in picked if first <= g < first + per_rank]


# What a new run leaves in its folder before its args.json: its lock, the args.json it was
# writing, torchrun's token (rundir.check_shared_folder). A folder holding no more holds no run.
NO_RUN_YET = re.compile(r"\.lock|args\.json\.tmp|\.shared-[0-9a-f]{8}(\.tmp)?")


def holds_no_run(out: str) -> bool:
    """Whether the folder `out` may take a new run: empty (made beforehand, as a job script's
    mkdir -p does), or holding only what a start stopped before its args.json leaves (a full
    disk or a kill while it was written). Said there, `--resume` has nothing to continue."""
    return os.path.isdir(out) and all(NO_RUN_YET.fullmatch(n) for n in os.listdir(out))


def check(args, world_size: int, resumable: set[str], before: dict | None = None) -> None:
    """Ranges, divisibility, and the run folder: everything checkable before loading a model.
    A resumed run may change the flags `resumable` only (`before`: as in parse)."""
    for name in ["prompts", "steps", "batch_size", "grad_accum", "eval_seeds", "eval_every",
                 "ckpt_every"]:  # fmt: skip
        if getattr(args, name) < 1:
            fail(flag_of(name), f"must be ≥ 1, got {getattr(args, name)}")
    if args.gain_every < 1:
        fail("--gain-every", f"must be ≥ 1, got {args.gain_every}")
    if not 0 <= args.gain_shift < args.steps:
        fail("--gain-shift", f"must be in [0, --steps) = [0, {args.steps}), got {args.gain_shift}")
    if args.score_size < 0:
        fail("--score-size", f"must be ≥ 0 (0: off; PX: step predictions scored at ≤ PX px), "
             f"got {args.score_size}")  # fmt: skip
    if args.score_size and args.weighting in NO_GAINS:
        fail("--score-size", f"means nothing with --weighting {args.weighting} (no step "
             "prediction is scored); drop it or use --weighting recast")  # fmt: skip
    if args.gain_shift and args.weighting in NO_GAINS:
        fail("--gain-shift", f"means nothing with --weighting {args.weighting} (no gains in W); "
             "drop it or use --weighting recast")  # fmt: skip
    if args.epochs < 0:
        fail("--epochs", f"must be ≥ 0, got {args.epochs}")
    if args.group_size < 2:
        fail("--group-size", "needs ≥ 2 images per prompt to compare them within a group")
    if args.steps < 2:
        fail("--steps", "needs ≥ 2 sampler steps")
    for name in ["alpha", "tau", "beta", "lr", "adv_clip_max", "grad_clip"]:
        if not 0 < getattr(args, name) < math.inf:
            fail(flag_of(name), f"must be > 0 and finite, got {getattr(args, name)}")
    for name in ["floor", "gain_frac", "train_frac"]:
        if not 0 < getattr(args, name) <= 1:
            fail(flag_of(name), f"must be in (0, 1], got {getattr(args, name)}")
    for name in ["gain_ema", "decay_cap"]:
        if not 0 <= getattr(args, name) < 1:
            fail(flag_of(name), f"must be in [0, 1), got {getattr(args, name)}")
    for name in ["decay_rate", "kl_coef"]:
        if not 0 <= getattr(args, name) < math.inf:
            fail(flag_of(name), f"must be ≥ 0 and finite, got {getattr(args, name)}")
    if args.profile:  # it compares the groups that score_steps scores: at least 2
        scored = scored_groups(args.gain_frac, args.prompts)
        if scored < 2:
            fail("--prompts", f"--profile compares prompt groups and would score {scored}: give "
                 "--prompts 2 or more (and --gain-frac 1)")  # fmt: skip
    if args.prompts % world_size or args.batch_size % world_size:
        fail("--prompts", f"--prompts and --batch-size must be multiples of {world_size} processes")
    saved = os.path.join(args.out, "args.json")
    if args.out and os.path.exists(args.out) and not args.resume and not holds_no_run(args.out):
        if not os.path.isfile(saved):
            fail("--out", f"{args.out} exists and is not a run (no args.json): pick another --out")
        fail("--out", f"{args.out} exists: add --resume to continue that run, or pick another "
             "--out")  # fmt: skip
    if args.resume:
        if not args.out:
            fail("--resume", "needs --out, the run folder to continue")
        if not os.path.isfile(saved):
            new = not os.path.exists(args.out) or holds_no_run(args.out)
            fix = "drop --resume to start one" if new else "pick another --out"
            fail("--resume", f"{args.out} is not a run (no args.json); {fix}")
        run = saved_flags(args.out)
        default = {f.name: f.default for f in fields(args)}  # a flag newer than the run: its
        default = {**default, **(before or {})}  # value before it existed
        differ = [k for k, v in asdict(args).items()
                  if k not in resumable and run.get(k, default[k]) != v]  # fmt: skip
        if differ:
            changes = ", ".join(
                f"{flag_of(k)} {run.get(k, default[k])!r} → {getattr(args, k)!r}" for k in differ
            )
            fail(
                "--resume",
                f"these differ from the run's args.json: {changes}; drop them or use a new --out",
            )
