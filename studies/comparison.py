"""When does timestep credit pay off? The pre-registered comparisons of docs/results.md (toy world).

Three studies share one machinery and one archive (arms are recast.py's defaults otherwise, the
same for every arm, except the alignment `--gain-shift`, which every ReCAST arm names: its default
became 1 after the shift study; five budgets λ, one for the scoring study; seeds 0 … --seeds-1,
seed s giving every arm the same prompts and noise in its first epoch; held-out eval every 2
epochs for the curves):

- `--study tau` (the first comparison): ReCAST at τ = 1, 0.5 and 0.25 (the dose: W concentrates as
  τ falls), uniform (W = λ/T), reversed (ReCAST's W at τ = 0.25 with its timesteps in reverse
  order: same marginals, credit in the wrong place) and sum (DiffusionNFT's single reward
  Σ λ_k s_k).
- `--study shift` (the alignment comparison): ReCAST at τ = 1 with `--gain-shift` 1 and 2 (W
  column i credited with gain g_i-S), paired against uniform and against ReCAST as shipped
  (shift 0); uniform's and recast-tau1's runs are the first study's, once `reproduce` has shown
  that this commit reproduces them.
- `--study credit1` … `credit8` (the credit test): ReCAST against its flat ablation (the same
  r, W = λ/T) and the placement control in settings 1-8, and per-reward uniform, gdpo and sum in
  7 and 8; each report ends with the protocol's verdicts pooled over the settings (credit_lines)
  and draws them in credit.png (recast − flat per cell, and against the predictor).
- `--study default`: the default run (setting 1, one budget, 10 seeds) and its five baselines.
- `--study scoring`: ReCAST (τ = 1, shift 1) scoring a fraction of the groups (`--gain-frac` 1, 0.5,
  0.25, 0.125) or every other epoch (`--gain-every 2`); per epoch, W's L1 distance from full
  scoring's W in the same seed, against the seed-to-seed noise floor (w_error.png).

    python studies/comparison.py run [--study shift] [--stop-after 150]  # resumable; 2 at once
    python studies/comparison.py report [--study shift]                  # tables and figures
    python studies/comparison.py archive              # finished runs → docs/comparison/
    python studies/comparison.py reproduce [--arms A,B]  # rerun archived runs, compare
    python studies/comparison.py credit-l1          # the credit test's predictor, base model

`run` goes seed by seed (all budgets and arms of seed 0, then seed 1, …), so a sitting that stops
early leaves whole seeds; finished runs (a folder's or the archive's, below) are skipped and an
interrupted one resumes. --stop-after MINUTES starts no new run after that many minutes (the running
ones finish). A run that fails starts no other: the finished runs are archived and `run` exits 1
naming its log. `report` uses every (budget, seed) whose runs of the study's arms are all finished
and writes into --out: table.md (per budget and arm: final λ-weighted gap closed, the paired
difference from uniform with its standard error and the verdict, per-reward gaps, judges, epochs and
seconds to 90% of uniform's final gap; the across-budget verdicts; the study's other pairs; the same
rule applied per budget to every training reward and every held-out judge; for the shift study the
pre-registered decision; for the settings studies the pairwise judge, the paper's three claims and
the reruns' reproduction; uniform's last eval-to-eval changes), curves.png, dose.png (gain over
uniform per arm), weights.png (mean final W per arm and budget), for setting2 w_settings.png
(ReCAST's W in both settings), and for settings 5 and 6 units.png (how far each rule moved when
only the rewards' units changed).

`archive` keeps what the report reads of every finished run (per epoch: the time; at each eval: the
held-out scores and gaps; the final W) in docs/comparison/runs.jsonl, a few kB per run, committed
with the code: `report` uses a run's folder when it exists and its archived record otherwise, so
the tables and figures can be rebuilt without the run folders (gigabytes of checkpoints), and
`run` on another machine starts only the runs the archive lacks.

`reproduce` reruns, with this checkout's recast.py, the archived runs named in REPRODUCE (one
uniform, one recast-tau1) and prints the largest difference of any eval/gap value from the archive;
it exits 1 when one exceeds REPRODUCE_TOL (the shift study's protocol: then both arms are rerun).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from plumbing import cli, eval_images, reward_profile  # noqa: E402
from plumbing.checkpoints import read_metrics  # noqa: E402
from studies.judge import prefer_by_distance, preference_rate, toy_distances  # noqa: E402
from studies.summarize import mean_std, spearman, spearman_bar  # noqa: E402
from worlds.toyworld import ToyWorld  # noqa: E402

BUDGETS = ["0.4,0.2,0.2,0.2", "0.2,0.4,0.2,0.2", "0.2,0.2,0.4,0.2", "0.2,0.2,0.2,0.4",
           "0.25,0.25,0.25,0.25"]  # fmt: skip
SHIPPED = ["--weighting", "recast", "--tau", "1", "--gain-shift", "1"]  # since the shift study
ARMS = {  # name → recast.py flags; the dose order: uniform (τ → ∞), τ = 1, 0.5, 0.25, reversed
    "uniform": ["--weighting", "uniform"],
    "recast-tau1": ["--weighting", "recast", "--tau", "1", "--gain-shift", "0"],
    "recast-tau0.5": ["--weighting", "recast", "--tau", "0.5", "--gain-shift", "0"],
    "recast-tau0.25": ["--weighting", "recast", "--tau", "0.25", "--gain-shift", "0"],
    "reversed-tau0.25": ["--weighting", "reversed", "--tau", "0.25", "--gain-shift", "0"],
    "sum": ["--weighting", "sum"],
    "recast-shift1": ["--weighting", "recast", "--tau", "1", "--gain-shift", "1"],
    "recast-shift2": ["--weighting", "recast", "--tau", "1", "--gain-shift", "2"],
    **{f"recast-frac{f}": [*SHIPPED, "--gain-frac", f] for f in ("1", "0.5", "0.25", "0.125")},
    "recast-every2": [*SHIPPED, "--gain-every", "2"],
}
NAMES = list(ToyWorld.reward_names)
JUDGES = list(ToyWorld.judge_names)
EVAL_EVERY = 2
# The two settings side by side (#32): setting 2 (--rewards toy2) with setting 1's rewards among its
# judges, setting 1 rerun as shipped with setting 2's rewards among its judges; every run keeps its
# final eval images for the pairwise judge (studies/judge.py).
TOY2 = ["size", "elongation", "outline", "texture"]  # rewards.PRESETS["toy2"]
TOY3 = ["color", "elongation", "background", "outline"]  # rewards.PRESETS["toy3"]
TOY4 = ["size", "texture", "elongation", "background"]  # rewards.PRESETS["toy4"]
JUDGES1, JUDGES2 = [*JUDGES, *TOY2], [*JUDGES, *NAMES]
SETTING1 = ["--judges", ",".join(JUDGES1)]
SETTING2 = ["--rewards", "toy2", "--judges", ",".join(JUDGES2)]
ARMS.update({
    "s1-uniform": [*SETTING1, "--weighting", "uniform"],
    "s1-recast": [*SETTING1, *SHIPPED],
    "s2-uniform": [*SETTING2, "--weighting", "uniform"],
    "s2-recast": [*SETTING2, *SHIPPED],
    "s2-sum": [*SETTING2, "--weighting", "sum"],
    # development of joint normalisation (#38): every arm run anew, in the pinned DISPATCH
    "d1-uniform": [*SETTING1, "--weighting", "uniform"],
    "d1-sum": [*SETTING1, "--weighting", "sum"],
    "d1-recast": [*SETTING1, *SHIPPED],
    "d1-joint": [*SETTING1, *SHIPPED, "--normalize", "joint"],
    "d2-uniform": [*SETTING2, "--weighting", "uniform"],
    "d2-sum": [*SETTING2, "--weighting", "sum"],
    "d2-recast": [*SETTING2, *SHIPPED],
    "d2-joint": [*SETTING2, *SHIPPED, "--normalize", "joint"],
})  # fmt: skip
# The test (#38): settings 3 and 4, fixed before any run in them (docs/toy_world.md); every reward
# a setting does not train on is its judge. The candidate arm runs only if the development's pick
# rule sends it to the test.
JUDGES3 = [*JUDGES, "position", "sharpness", "size", "texture"]
JUDGES4 = [*JUDGES, "position", "color", "sharpness", "outline"]
SETTING3 = ["--rewards", "toy3", "--judges", ",".join(JUDGES3)]
SETTING4 = ["--rewards", "toy4", "--judges", ",".join(JUDGES4)]
for _n, _flags in (("t3", SETTING3), ("t4", SETTING4)):
    ARMS.update({f"{_n}-uniform": [*_flags, "--weighting", "uniform"],
                 f"{_n}-sum": [*_flags, "--weighting", "sum"], f"{_n}-recast": [*_flags, *SHIPPED],
                 f"{_n}-joint": [*_flags, *SHIPPED, "--normalize", "joint"]})  # fmt: skip
# The units test (#57): settings 5 and 6, fixed before any run in them (docs/toy_world.md), each
# run in the rewards' native units (t5-, t6-) and in changed units (t5x-, t6x-: every reward's
# scores times a factor drawn once from {0.1, 1, 10} with seed 57, written in the protocol first).
TOY5 = ["position", "color", "elongation", "texture"]  # rewards.PRESETS["toy5"]
TOY6 = ["color", "size", "elongation", "outline"]  # rewards.PRESETS["toy6"]
UNITS = {5: "0.1,1,10,10", 6: "0.1,0.1,10,1"}  # --reward-scale of the changed units
JUDGES5 = [*JUDGES, "sharpness", "background", "size", "outline"]
JUDGES6 = [*JUDGES, "position", "sharpness", "background", "texture"]
UNIT_ARMS = {  # arm → its flags in both unit systems; uniform first (every arm is paired with it)
    "uniform": ["--weighting", "uniform"],
    "sum": ["--weighting", "sum"],  # DiffusionNFT's Σ λ_k s_k on raw scores
    "sumunit": ["--weighting", "sum", "--normalize", "unit-joint"],  # Σ λ_k s_k / σ_k
    "joint": [*SHIPPED, "--normalize", "joint"],  # ReCAST's default
    "perreward": [*SHIPPED, "--normalize", "per-reward"],
    "batch": [*SHIPPED, "--normalize", "batch"],
    "unitjoint": [*SHIPPED, "--normalize", "unit-joint"],
}
CANDIDATES = ["perreward", "batch", "unitjoint"]  # the unit-invariant rules the test may ship
BASELINES = ["uniform", "sum", "sumunit"]  # B: the best of these, per budget and unit system
for _k in (5, 6):
    _rewards = ["--rewards", f"toy{_k}", "--judges", ",".join(JUDGES5 if _k == 5 else JUDGES6)]
    for _a, _flags in UNIT_ARMS.items():
        ARMS[f"t{_k}-{_a}"] = [*_rewards, *_flags]
        ARMS[f"t{_k}x-{_a}"] = [*_rewards, *_flags, "--reward-scale", UNITS[_k]]
# The default run (#69): setting 1's default command, ReCAST at today's defaults (unit-joint
# since #69), and beside it every baseline, each differing from it in one flag and named by what
# it removes or by the rule users run; one budget, 10 seeds, the default's own judges. Every arm
# is paired with the default (its first).
DEFAULT_RUN = {
    "def-recast": [],  # python recast.py --lambda 0.4,0.2,0.2,0.2: the default
    "def-flat": ["--weighting", "flat"],  # the same r, W = λ/T: ReCAST without its timing
    "def-gdpo": ["--weighting", "gdpo"],  # Flow-Factory's default aggregation
    "def-uniform": ["--weighting", "uniform"],  # per-reward r, W = λ/T (GDPO unwhitened)
    "def-sum": ["--weighting", "sum"],  # DiffusionNFT's and flow_grpo's raw Σ λ_k s_k
    "def-joint": ["--normalize", "joint"],  # the previous default: λ weighs raw units
}
ARMS.update(DEFAULT_RUN)
# The credit test (#70): does W's timing pay on top of the unit-free signal? ReCAST (the default)
# against its flat ablation (--weighting flat: the same r, W = λ/T) and the placement control
# (--weighting reversed) in settings 1-6 (seen: in-sample) and 7-8 (fixed by the protocol's rule,
# docs/results.md, before any run in them: the test), where per-reward uniform and the rules users
# run (gdpo, sum) run beside them. Every arm is paired with flat (its first).
TOY7 = ["color", "position", "elongation", "background"]  # earliest profile centroid first
TOY8 = ["color", "texture", "background", "outline"]
JUDGES7 = [*JUDGES, "sharpness", "size", "outline", "texture"]
JUDGES8 = [*JUDGES, "position", "sharpness", "size", "elongation"]
CREDIT_SETTINGS = {1: (NAMES, JUDGES1), 2: (TOY2, JUDGES2), 3: (TOY3, JUDGES3),
                   4: (TOY4, JUDGES4), 5: (TOY5, JUDGES5), 6: (TOY6, JUDGES6),
                   7: (TOY7, JUDGES7), 8: (TOY8, JUDGES8)}  # fmt: skip
FRESH = (7, 8)  # the test settings; 1-6 in-sample
CREDIT_ARMS = {"flat": ["--weighting", "flat"], "recast": [],
               "reversed": ["--weighting", "reversed"], "uniform": ["--weighting", "uniform"],
               "gdpo": ["--weighting", "gdpo"], "sum": ["--weighting", "sum"]}  # fmt: skip
CREDIT_SEEDS = {k: 5 if k in FRESH else 3 for k in CREDIT_SETTINGS}


def credit_arms(k: int) -> list[str]:
    """Setting k's arms in the credit test: flat first, then recast and reversed; in the fresh
    settings per-reward uniform, gdpo and sum as well."""
    return [f"c{k}-{a}" for a in CREDIT_ARMS if k in FRESH or a in ("flat", "recast", "reversed")]


AS_WRITTEN = dict(DEFAULT_RUN)  # arms defined at today's defaults: run as written (flags_for)
for _k, (_names, _judges) in CREDIT_SETTINGS.items():
    for _arm in credit_arms(_k):
        AS_WRITTEN[_arm] = ["--rewards", ",".join(_names), "--judges", ",".join(_judges),
                            *CREDIT_ARMS[_arm.split("-", 1)[1]]]  # fmt: skip
ARMS.update(AS_WRITTEN)
# Every run's CPU kernels: one thread, and ATen, MKL and oneDNN held to their AVX2 code on every
# x86 machine, so that a run repeats to the bit on another machine with the same packages (their
# own choice by processor moved results at float rounding between sittings: docs/results.md).
DISPATCH = {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2",
            "ONEDNN_MAX_CPU_ISA": "AVX2"}  # fmt: skip


# A study's own report sections (after the generic tables and rule lines, and at the very end),
# each a function of the report's numbers (Report, below) returning its lines.
STUDIES = {  # study → its arms (uniform first: every arm is paired with it) and its other pairs
    "tau": {
        "arms": [
            "uniform",
            "recast-tau1",
            "recast-tau0.5",
            "recast-tau0.25",
            "reversed-tau0.25",
            "sum",
        ],  # fmt: skip
        "pairs": [  # (a, b, why)
            ("recast-tau0.25", "reversed-tau0.25", "placement control (pre-registered)"),
            (
                "recast-tau0.5",
                "recast-tau1",
                "τ = 0.5 against τ = 1 (exploratory, not in the protocol)",
            ),  # fmt: skip
        ],
    },
    "shift": {
        "arms": ["uniform", "recast-tau1", "recast-shift1", "recast-shift2"],
        "pairs": [
            ("recast-shift1", "recast-tau1", "shift 1 against shift 0 (pre-registered, decides)"),
            ("recast-shift2", "recast-tau1", "shift 2 against shift 0 (pre-registered, decides)"),
        ],
        "sections": [lambda r: decide(r.gap, r.budgets, r.judge_words, r.partial)],
    },
    "scoring": {  # how W and the outcome degrade when fewer step predictions are scored (#22)
        "arms": [
            "uniform",
            "recast-frac1",
            "recast-frac0.5",
            "recast-frac0.25",
            "recast-frac0.125",
            "recast-every2",
        ],  # fmt: skip
        "pairs": [
            (a, "recast-frac1", "cheaper scoring against full scoring")
            for a in ("recast-frac0.5", "recast-frac0.25", "recast-frac0.125", "recast-every2")
        ],  # fmt: skip
        "budgets": ["0.4,0.2,0.2,0.2"],
        "sections": [lambda r: w_error(r.res, r.seeds, r.budgets, r.study["pairs"], r.out_dir)],
    },
    "setting1": {  # setting 1 rerun as shipped, eval images kept; reproduces the archive's runs
        "arms": ["s1-uniform", "s1-recast"],
        "pairs": [],
        "judges": JUDGES1,
        "reproduces": {"s1-uniform": "uniform", "s1-recast": "recast-shift1"},
        "sections": [lambda r: claims_lines(r), lambda r: reproduction_lines(r)],
    },
    "setting2": {  # the pre-registered test in a setting nothing was tuned on (docs/results.md)
        "arms": ["s2-uniform", "s2-recast", "s2-sum"],
        "pairs": [],
        "names": TOY2,
        "judges": JUDGES2,
        "sections": [lambda r: claims_lines(r)],
        "closing": [lambda r: settings_w(r.args, r.fin, r.seeds, r.out_dir)],
    },
    # Development (#38, in-sample): ReCAST on joint normalisation against uniform, sum and
    # ReCAST as shipped, in both settings; the rule that picks the candidate is in results.md.
    "dev1": {
        "arms": ["d1-uniform", "d1-sum", "d1-recast", "d1-joint"],
        "pairs": [(a, "d1-sum", f"{a} against sum") for a in ("d1-recast", "d1-joint")],
        "judges": JUDGES1,
        "closing": [lambda r: pick_lines(r)],
    },
    "dev2": {
        "arms": ["d2-uniform", "d2-sum", "d2-recast", "d2-joint"],
        "pairs": [(a, "d2-sum", f"{a} against sum") for a in ("d2-recast", "d2-joint")],
        "names": TOY2,
        "judges": JUDGES2,
        "closing": [lambda r: pick_lines(r)],  # over both settings: run it after dev1's report
    },
    # the pre-registered test in settings 3 and 4 (docs/results.md); ReCAST as shipped against
    # uniform is the paper's claims' comparison, every arm against sum the users' rule's
    **{
        f"setting{k}": {
            "arms": [f"t{k}-uniform", f"t{k}-sum", f"t{k}-recast", f"t{k}-joint"],
            "pairs": [(f"t{k}-{a}", f"t{k}-sum", f"{a} against sum") for a in ("recast", "joint")],
            "names": list(TOY3 if k == 3 else TOY4),
            "judges": JUDGES3 if k == 3 else JUDGES4,
            "sections": [lambda r: claims_lines(r)],
            "closing": [
                lambda r: ship_lines(r),
                lambda r: prediction_lines(r),
                lambda r: side_by_side_lines(r),
            ],
        }
        for k in (3, 4)
    },
    # the units test (#57): every rule in both unit systems; the pairs say how far each moved
    **{
        f"setting{k}": {
            "arms": [f"t{k}{u}-{a}" for u in ("", "x") for a in UNIT_ARMS],
            "pairs": [
                (f"t{k}x-{a}", f"t{k}-{a}", f"{a}: changed units − native") for a in UNIT_ARMS
            ]
            + [  # added after the result, beside the shipping rule (docs/results.md): ReCAST
                # against the summed reward on the same scores, in each unit system
                (f"t{k}{u}-{a}", f"t{k}{u}-{b}", f"{a} − {b}, {w}")
                for u, w in (("", "native"), ("x", "changed units"))
                for a, b in (("joint", "sum"), ("unitjoint", "sumunit"))
            ],  # fmt: skip
            "names": list(TOY5 if k == 5 else TOY6),
            "judges": JUDGES5 if k == 5 else JUDGES6,
            "seeds": 3,
            "base": lambda a: a.split("-", 1)[0] + "-uniform",  # uniform in the arm's own units
            "sections": [lambda r: units_lines(r)],
            "closing": [lambda r: units_ship_lines(r), lambda r: default_change_lines(r)],
        }
        for k in (5, 6)
    },
    # the credit test (#70): one study a setting, each run seed by seed (7 and 8 first); each
    # report ends with the pre-registered verdicts pooled over every setting (credit_lines)
    **{
        f"credit{k}": {
            "arms": credit_arms(k),
            "pairs": [(f"c{k}-recast", f"c{k}-reversed", "placement control")]
            + [
                (f"c{k}-recast", f"c{k}-{b}", f"recast against {b}")
                for b in ("uniform", "gdpo", "sum")
                if k in FRESH
            ],  # fmt: skip
            "names": list(names),
            "judges": judges,
            "seeds": CREDIT_SEEDS[k],
            "closing": [lambda r: credit_closing(r)],
        }
        for k, (names, judges) in CREDIT_SETTINGS.items()
    },
    "default": {  # the default run and its baselines (#69), every arm against the default
        "arms": list(DEFAULT_RUN),
        "pairs": [],
        "budgets": ["0.4,0.2,0.2,0.2"],
        "seeds": 10,
    },
}
# The test's prediction (docs/results.md): W's L1 distance from λ/T on the base model, per budget
# in BUDGETS' order, as `python recast.py --profile [--rewards toyK] --lambda λ --prompts 64`
# prints it; settings 3 and 4 written in the protocol before any run, settings 1 and 2 measured
# from the protocol's commit before any test result was read ("Changes to this protocol").
PROFILE_L1 = {
    "dev1": (0.52, 0.53, 0.53, 0.63, 0.55),
    "dev2": (0.37, 0.29, 0.35, 0.30, 0.34),
    "setting3": (0.58, 0.47, 0.49, 0.48, 0.51),
    "setting4": (0.40, 0.37, 0.38, 0.46, 0.41),
}
SETTINGS = (("dev1", "d1-"), ("dev2", "d2-"), ("setting3", "t3-"), ("setting4", "t4-"))
REPRODUCE = [("0.4,0.2,0.2,0.2", "uniform", 0), ("0.4,0.2,0.2,0.2", "recast-tau1", 0)]
REPRODUCE_TOL = 1e-5  # the shift study's protocol (docs/results.md)


def folder(out: str, lam: str, arm: str, seed: int) -> str:
    return os.path.join(out, "runs", f"{lam.replace(',', '_')}-{arm}-s{seed}")


ARCHIVE = os.path.join(ROOT, "docs", "comparison", "runs.jsonl")


def done(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "summary.json"))


def plan(seeds: int, arms: list[str], budgets: list[str] = BUDGETS) -> list[tuple[str, str, int]]:
    """Every (budget, arm, seed), seed by seed: the order `run` starts them in."""
    return [(lam, arm, s) for s in range(seeds) for lam in budgets for arm in arms]


def compact(lines: list[dict]) -> list[dict]:
    """What the report and summarize.py read of a run's metrics.jsonl: per epoch its time (the
    sum of time/*, and each phase's) and W, at each eval the held-out scores and gaps, and the
    ideal rendering's scores (epoch 0). (Runs archived before the scoring study kept W at their
    last eval only; before the default run's study, neither the phases nor the ideal.)"""
    out = []
    for m in lines:
        c = {"epoch": m["epoch"], "time": sum(v for k, v in m.items() if k.startswith("time/"))}
        c.update({k: v for k, v in m.items()
                  if k.startswith(("eval/", "gap/", "W", "ideal/", "time/"))})  # fmt: skip
        out.append(c)
    return out


def record(path: str) -> list[dict]:
    """A finished run folder's compact lines; where it kept its final eval images, their
    pairwise-judge distances (1 − SSIM to the ideal rendering, studies/judge.py) ride on the
    last line as judge/distance, so preferences can be recomputed without the images; its
    environment.json (packages, CPU, kernel dispatch) rides there too, as env, and its
    args.json on the first line, as args (for summarize.py --archive)."""
    lines = compact(read_metrics(path))
    if os.path.isfile(os.path.join(path, "args.json")):
        with open(os.path.join(path, "args.json")) as f:
            lines[0]["args"] = json.load(f)
    if os.path.isdir(os.path.join(path, eval_images.FOLDER)):
        index, images = eval_images.load(path)
        distance = toy_distances(images, index["prompts"])
        lines[-1]["judge/distance"] = [round(d, 5) for d in distance.tolist()]
    if os.path.isfile(os.path.join(path, "environment.json")):
        with open(os.path.join(path, "environment.json")) as f:
            lines[-1]["env"] = json.load(f)
    return lines


def read_archive(path: str) -> dict[str, list[dict]]:
    """Run name → compact lines, from the archive (empty if there is none)."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return {r["run"]: r["lines"] for r in map(json.loads, f)}


def archive(args) -> None:
    """Add every finished run's compact record to the archive (a run already there is replaced
    by its folder's, which is the same run)."""
    records = read_archive(args.archive)
    done_here = finished(args, list(ARMS))  # every study's runs share one runs/ folder
    records.update({os.path.basename(folder(args.out, *k)): v for k, v in done_here.items()})
    os.makedirs(os.path.dirname(args.archive), exist_ok=True)
    with open(args.archive + ".tmp", "w") as f:
        for name in sorted(records):
            f.write(json.dumps({"run": name, "lines": records[name]}) + "\n")
    os.replace(args.archive + ".tmp", args.archive)
    print(f"{len(records)} runs in {args.archive}")


def flags_for(code: str, arm: str) -> list[str]:
    """ARMS[arm] for code/recast.py: every arm was defined while per-reward normalisation was
    ReCAST's default, so a recast or reversed arm that names none gets `--normalize per-reward`
    from a recast.py that has the flag (joint became the default by the test's shipping rule,
    docs/results.md); a recast.py from before the flag runs the arm as it was."""
    flags = ARMS[arm]
    if arm in AS_WRITTEN:  # defined at today's defaults: run as written
        return flags
    weighting = flags[flags.index("--weighting") + 1]
    if "--normalize" in flags or weighting not in ("recast", "reversed"):
        return flags
    with open(os.path.join(code, "recast.py"), encoding="utf-8") as f:
        knows = "\n    normalize:" in f.read()  # `normalize: str =`, later `normalize: Literal[`
    return [*flags, "--normalize", "per-reward"] if knows else flags


def run_one(code: str, path: str, lam: str, arm: str, seed: int, deadline: float, bar,
            failed: threading.Event | None = None) -> None:  # fmt: skip
    """One run of code/recast.py, resumed if a previous sitting left it unfinished; skipped when
    the sitting's time is up, or once a run of the sitting has failed (`failed`, which a failing
    run sets). `bar` counts the finished runs."""
    if time.monotonic() > deadline or (failed is not None and failed.is_set()):
        return
    cmd = [sys.executable, os.path.join(code, "recast.py"), "--lambda", lam, *flags_for(code, arm)]
    cmd += ["--seed", str(seed), "--eval-every", str(EVAL_EVERY), "--out", path]
    cmd += ["--resume"] if os.path.isfile(os.path.join(path, "args.json")) else []
    with open(path + ".log", "a") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=code,
                            env=dict(os.environ, **DISPATCH)).returncode  # fmt: skip
    if rc:
        if failed is not None:
            failed.set()
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {rc}); see {path}.log")
    bar.set_postfix_str(f"last: {os.path.basename(path)}", refresh=False)
    bar.update(1)


def run(args) -> None:
    arms, budgets = STUDIES[args.study]["arms"], STUDIES[args.study].get("budgets", BUDGETS)
    if getattr(args, "arms", ""):  # this sitting runs only these arms (setting 2's uniform check)
        wrong = [a for a in args.arms.split(",") if a not in arms]
        if wrong:
            print(f"comparison.py: error: --arms: {', '.join(wrong)} not in study {args.study} "
                  f"({', '.join(arms)})", file=sys.stderr)  # fmt: skip
            sys.exit(2)
        arms = args.arms.split(",")
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    everything = plan(args.seeds, arms, budgets)
    have = finished(args, arms)  # a folder's or the archive's
    keys = [key for key in everything if key not in have]
    total, left = len(everything), len(keys)
    print(f"study {args.study}: {total} runs, {left} to go; two at a time; recast.py of "
          f"{args.code}", flush=True)  # fmt: skip
    deadline = time.monotonic() + 60 * args.stop_after
    bar = tqdm(total=total, initial=total - left, unit="run", smoothing=0)
    failed, errors = threading.Event(), []  # a failed run: no new one starts, hours of a queue
    with ThreadPoolExecutor(2) as pool, bar:  # the bar's rate and ETA: this sitting's runs
        jobs = [pool.submit(run_one, args.code, folder(args.out, *key), *key, deadline, bar,
                            failed) for key in keys]  # fmt: skip
        for job in jobs:
            try:
                job.result()
            except RuntimeError as e:
                errors.append(str(e))
    archive(args)  # the runs that finished, the failed one's neighbour included
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        print(f"comparison.py: {errors[0]}{more}; no run started after it, and the finished "
              "ones are archived: fix it, then run again (finished runs are skipped)",
              file=sys.stderr)  # fmt: skip
        sys.exit(1)
    report(args)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def decided_on(args, study: str) -> int:
    """How many seeds a study's verdict needs: its protocol's (a study that names them), or the
    report's --seeds, whichever is more: a report on fewer seeds is marked provisional."""
    return max(args.seeds, STUDIES[study].get("seeds", 0))


def evals(lines: list[dict]) -> list[dict]:
    """The protocol's evals, every EVAL_EVERY epochs: a run stopped between them (SIGTERM, the
    sweep paused) evaluated at the epoch it stopped after too, and resumed from it; that extra
    eval (its numbers are the resumed run's at that epoch) is left out, so every run of a study
    has the same evals."""
    return [m for m in lines if is_eval(m)]


def is_eval(m: dict) -> bool:
    """A metrics line that is one of the protocol's evals (see evals)."""
    return "gap/weighted" in m and m["epoch"] % EVAL_EVERY == 0


def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean and standard error of the paired differences a_s - b_s."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return statistics.fmean(d), se


def verdict(diff: float, se: float) -> str:
    """The rule fixed in the protocol: win / loss beyond twice the paired standard error (no
    verdict from one seed)."""
    if se != se:  # NaN: fewer than two seeds
        return "n/a"
    return "win" if diff > 2 * se else "loss" if diff < -2 * se else "tie"


def to_reach(lines: list[dict], target: float) -> tuple[float, float]:
    """(epoch, seconds of the run's own time/*) of the first eval at or above target (or inf)."""
    seconds = 0.0
    for m in lines[1:]:
        seconds += m["time"]
        if is_eval(m) and m["gap/weighted"] >= target:
            return m["epoch"], seconds
    return float("inf"), float("inf")


def finished(args, arms: list[str]) -> dict[tuple, list[dict]]:
    """(budget, arm, seed) → compact lines of every finished run of `arms`: its folder, else the
    archive."""
    kept, res = read_archive(args.archive), {}
    for key in plan(args.seeds, arms):
        path = folder(args.out, *key)
        if done(path):
            res[key] = record(path)
        elif os.path.basename(path) in kept:
            res[key] = kept[os.path.basename(path)]
    return res


def metrics_of(study: dict) -> list[str]:
    """Every training reward's gap and every judge's final score: what the rule is applied to."""
    names, judges = study.get("names", NAMES), study.get("judges", JUDGES)
    return [f"gap/{n}" for n in names] + [f"eval/{n}" for n in judges]


def rule_lines(fin, seeds, budgets, a: str, b: str,
               metrics: list[str]) -> tuple[list[str], dict[str, list[str]]]:  # fmt: skip
    """The pre-registered rule applied per budget to every training reward's gap and every judge's
    final score, a − b paired within seeds: one line per metric, and metric → verdict per budget."""
    lines, words = [], {}
    for metric in metrics:
        ds = [paired([fin[lam, a, s][metric] for s in seeds[lam]],
                     [fin[lam, b, s][metric] for s in seeds[lam]]) for lam in budgets]  # fmt: skip
        words[metric] = [verdict(d, se) for d, se in ds]
        counts = ", ".join(f"{words[metric].count(w)} {w}" for w in ("win", "tie", "loss"))
        each = "; ".join(
            f"{d:+.3f} ± {se:.3f} {v}" for (d, se), v in zip(ds, words[metric], strict=True)
        )
        lines.append(f"- {a} − {b}, {metric}: {counts} ({each})")
    return lines, words


def w_error(res, seeds, budgets, pairs, out_dir: str) -> list[str]:
    """The scoring study: per epoch, Σ|W_a − W_full| between each cheaper-scoring arm a and full
    scoring in the same seed (mean over seeds), printed and drawn in w_error.png."""
    out = ["", "W's L1 distance from full scoring's W in the same seed (mean over seeds), by "
           "epoch:", ""]  # fmt: skip
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for lam in budgets:
        for a, b, _ in pairs:
            per_seed = []
            for s in seeds[lam]:
                Wa = {m["epoch"]: torch.tensor(m["W"]) for m in res[lam, a, s] if "W" in m}
                Wb = {m["epoch"]: torch.tensor(m["W"]) for m in res[lam, b, s] if "W" in m}
                per_seed.append([float((Wa[e] - Wb[e]).abs().sum()) for e in sorted(Wa)])
            curve = torch.tensor(per_seed).mean(0).tolist()
            ax.plot(range(1, len(curve) + 1), curve, marker="o", ms=2, label=a)
            shown = sorted({e for e in (1, 5, 10, 15) if e < len(curve)} | {len(curve)})
            each = ", ".join(f"epoch {e} {curve[e - 1]:.3f}" for e in shown)
            out.append(f"- λ = {lam}, {a}: {each}; mean {statistics.fmean(curve):.3f}")
        full = [{m["epoch"]: torch.tensor(m["W"]) for m in res[lam, pairs[0][1], s] if "W" in m}
                for s in seeds[lam]]  # fmt: skip
        floor = [float((x[e] - y[e]).abs().sum()) for i, x in enumerate(full) for y in full[i + 1 :]
                 for e in x]  # fmt: skip
        if floor:  # W's own spread: full scoring in two different seeds, the same epoch
            out.append(f"- λ = {lam}, the noise floor (full scoring, seed against seed, every "
                       f"epoch): mean {statistics.fmean(floor):.3f}")  # fmt: skip
            ax.axhline(statistics.fmean(floor), color="grey", ls=":", lw=1, label="seed vs seed")
    ax.set_xlabel("epoch")
    ax.set_ylabel("Σ|W − W(full scoring)|, same seed")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "w_error.png"), dpi=110)
    plt.close(fig)
    return out


def l1_from_uniform(W: list[list[float]], lam: str) -> float:
    """Σ_k,i |W_k,i - λ_k/T| of an archived W and a budget string (reward_profile's)."""
    budgets = torch.tensor([float(x) for x in lam.split(",")], dtype=torch.float64)
    return reward_profile.l1_from_uniform(torch.tensor(W, dtype=torch.float64), budgets)


def beats(words: list[str]) -> bool:
    """Across the budgets: wins in at least 3 and loses in none (both protocols)."""
    return words.count("win") >= 3 and "loss" not in words


def decide(gap, budgets, judge_words, partial: bool) -> list[str]:
    """The shift study's rule, fixed before its runs: a shift becomes the default if it beats
    recast-tau1 across the budgets and, for each judge, loses to uniform in no more budgets than
    recast-tau1 does; of two that qualify, the larger mean gain over recast-tau1 wins."""
    out, qualified = ["", "Decision (the shift study's pre-registered rule):", ""], {}
    base_losses = {j: judge_words["recast-tau1"][f"eval/{j}"].count("loss") for j in JUDGES}
    for arm in ("recast-shift1", "recast-shift2"):
        ds = [paired(gap[lam, arm], gap[lam, "recast-tau1"]) for lam in budgets]
        words, mean = [verdict(d, se) for d, se in ds], statistics.fmean(d for d, _ in ds)
        losses = {j: judge_words[arm][f"eval/{j}"].count("loss") for j in JUDGES}
        judged = all(losses[j] <= base_losses[j] for j in JUDGES)
        if beats(words) and judged:
            qualified[arm] = mean
        verb = "beats" if beats(words) else "does not beat"
        out.append(
            f"- {arm} vs recast-tau1: {words.count('win')} win, {words.count('tie')} tie, "
            f"{words.count('loss')} loss, mean {mean:+.3f} ({verb}); judges lost to uniform in "
            + ", ".join(f"{j} {losses[j]} (recast-tau1 {base_losses[j]})" for j in JUDGES)
            + f" budgets: {'qualifies' if arm in qualified else 'does not qualify'}"
        )
    best = max(qualified, key=qualified.get) if qualified else None
    shift = ARMS[best][-1] if best else "0"
    tail = " (so far: partial)" if partial else ""
    out.append(
        f"- default: --gain-shift {shift}"
        + (f" ({best})" if best else " (none qualifies: unchanged)")
        + tail
    )
    return out


def pairwise_lines(fin, seeds, budgets, a: str, b: str) -> tuple[list[str], list[str]]:
    """The pairwise judge (studies/judge.py) on the final eval images: per seed, the share of
    the eval pairs in which a's image is preferred (a tie counts half) minus ½, and the same rule
    per budget: (its line, its verdict per budget). Runs archived without their images' distances
    have neither."""
    per = {}
    for lam in budgets:
        pairs = [(fin[lam, a, s].get("judge/distance"), fin[lam, b, s].get("judge/distance"))
                 for s in seeds[lam]]  # fmt: skip
        if pairs and all(da and db for da, db in pairs):
            per[lam] = [preference_rate(prefer_by_distance(torch.tensor(da), torch.tensor(db)))
                        - 0.5 for da, db in pairs]  # fmt: skip
    if not per:
        return [], []
    ds = {lam: paired(v, [0.0] * len(v)) for lam, v in per.items()}
    words = [verdict(d, se) for d, se in ds.values()]
    counts = ", ".join(f"{words.count(w)} {w}" for w in ("win", "tie", "loss"))
    each = "; ".join(f"{d + 0.5:.3f} ({d:+.3f} ± {se:.3f}) {w}"
                     for (d, se), w in zip(ds.values(), words, strict=True))  # fmt: skip
    return [f"- {a} over {b}, pairwise judge (preference rate; − ½ ± SE): {counts} ({each})"], words


def claims_lines(r: "Report") -> list[str]:
    """The paper's three claims as the settings protocol tests them, ReCAST as shipped (the
    study's second arm) against uniform (its first), across the budgets: 1. the λ-weighted gap
    beats or matches; 2. every held-out judge beats; 3. the pairwise judge's preference beats ½.
    Beats: ≥ 3 wins and no loss; matches: no loss."""
    a, base, partial = next(x for x in r.arms if x.endswith("recast")), r.base, r.partial
    gap_ds, judge_words, pair_words = r.summary[a], r.judge_words[a], r.pair_words[a]

    def counted(words: list[str]) -> str:
        return "/".join(str(words.count(w)) for w in ("win", "tie", "loss"))

    def grade(words: list[str]) -> str:
        return "beats" if beats(words) else "matches" if "loss" not in words else "loses"

    gap_words = [verdict(d, se) for d, se in gap_ds]
    mean = statistics.fmean(d for d, _ in gap_ds)
    shown = {"beats": "shown (improves)", "matches": "shown (matches)", "loses": "not shown"}
    judges = {m.removeprefix("eval/"): w for m, w in judge_words.items() if m.startswith("eval/")}
    beaten = [j for j, w in judges.items() if beats(w)]
    out = ["", f"The paper's three claims, {a} against {base} (win/tie/loss over the budgets; "
           "beats: ≥ 3 wins and no loss, matches: no loss)" + (", so far" if partial else "")
           + ":", "",
           f"1. training rewards improve or match: λ-weighted gap {counted(gap_words)}, mean "
           f"{mean:+.3f}, {grade(gap_words)}: {shown[grade(gap_words)]}",
           "2. every held-out judge improves: "
           + ", ".join(f"{j} {counted(w)} {grade(w)}" for j, w in judges.items())
           + f": {len(beaten)} of {len(judges)} beat {base}: "
           + ("shown" if len(beaten) == len(judges) else "not shown")]  # fmt: skip
    if pair_words:
        verdict3 = "shown" if beats(pair_words) else "not shown"
        out.append(f"3. the independent judge prefers {a}: pairwise {counted(pair_words)}, "
                   f"{grade(pair_words)} ½: {verdict3}")  # fmt: skip
    else:
        out.append("3. the independent judge prefers it: no eval images' distances: not measured")
    return out


def reproduction_lines(r: "Report") -> list[str]:
    """Each rerun arm's eval/gap values at every eval against the archived run it repeats (same
    budget and seed; the values both have), the largest difference per arm against
    REPRODUCE_TOL."""
    args, res, seeds, study = r.args, r.res, r.seeds, r.study
    kept = read_archive(args.archive)
    out = ["", f"Reproduction of the archived runs (every eval/gap value both have, tolerance "
           f"{REPRODUCE_TOL:g}):", ""]  # fmt: skip
    for arm, archived in study["reproduces"].items():
        worst, over, n = 0.0, [], 0
        for lam in seeds:
            for s in seeds[lam]:
                old = kept.get(os.path.basename(folder("", lam, archived, s)))
                if old is None:
                    continue
                new = evals(res[lam, arm, s])
                diffs = [abs(x[k] - y[k]) for x, y in zip(new, evals(old), strict=True)
                         for k in y if k.startswith(("eval/", "gap/")) and k in x]  # fmt: skip
                n += 1
                worst = max(worst, max(diffs))
                if max(diffs) > REPRODUCE_TOL:
                    over.append(f"{lam} s{s} ({max(diffs):.1e})")
        beyond = f"beyond the tolerance: {', '.join(over)}" if over else "all within"
        out.append(f"- {arm} against {archived}: {n} runs, largest difference {worst:.1e}; "
                   + beyond)  # fmt: skip
    return out


@dataclass
class Report:
    """What a study's report has computed, for its own sections (STUDIES' sections, closing)."""

    args: argparse.Namespace
    study: dict
    arms: list[str]
    base: str  # the arm every other is paired with (uniform)
    out_dir: str
    res: dict  # (budget, arm, seed) → compact lines of every finished run used
    fin: dict  # (budget, arm, seed) → its last eval's line
    seeds: dict  # budget → the seeds every arm has finished
    budgets: list[str]
    gap: dict  # (budget, arm) → final λ-weighted gap per seed
    summary: dict  # arm → (paired difference from base, SE) per budget
    judge_words: dict  # arm → metric → verdict against base per budget
    pair_words: dict  # arm → the pairwise judge's verdict per budget
    partial: bool  # fewer seeds than the protocol decides on


def report(args) -> None:
    study = STUDIES[args.study]
    chosen = (
        getattr(args, "arms", "") or ""
    )  # a protocol may leave an arm out (the test's candidate)
    base_of = study.get("base", lambda a: study["arms"][0])  # each arm's paired baseline
    arms = [a for a in study["arms"] if not chosen or a in chosen.split(",")]
    arms = [a for a in study["arms"] if a in arms or a in map(base_of, arms)]  # with their bases
    out_dir = os.path.join(args.out, args.study)
    base, names, judges = arms[0], study.get("names", NAMES), study.get("judges", JUDGES)
    bases = list(dict.fromkeys(map(base_of, arms)))  # arms[0], or one per unit system
    os.makedirs(out_dir, exist_ok=True)
    res = finished(args, arms)
    seeds = {lam: [s for s in range(args.seeds) if all((lam, a, s) in res for a in arms)]
             for lam in study.get("budgets", BUDGETS)}  # fmt: skip
    if not any(seeds.values()):
        print(f"study {args.study}: nothing finished yet: no (budget, seed) with all arms done")
        return
    res = {(lam, a, s): res[lam, a, s] for lam in seeds for a in arms for s in seeds[lam]}
    fin = {k: evals(v)[-1] for k, v in res.items()}
    budgets = [lam for lam in seeds if seeds[lam]]
    gap = {(lam, a): [fin[lam, a, s]["gap/weighted"] for s in seeds[lam]]
           for lam in budgets for a in arms}  # fmt: skip
    said = " or ".join(bases)  # the baseline's name in the table's header
    rows = [f"| λ | arm | seeds | λ-weighted gap | vs {said} (paired) | verdict | "
            + " | ".join(names) + " | " + " | ".join(judges)
            + f" | epochs to 90% of {said} | seconds to 90% |",
            "|---" * (10 + len(names) + len(judges) - 2) + "|"]  # fmt: skip
    summary = {a: [] for a in arms}  # (diff, se) per budget
    for lam in budgets:
        ss = seeds[lam]
        for a in arms:
            b = base_of(a)
            diff, se = paired(gap[lam, a], gap[lam, b])
            if a != b:
                summary[a].append((diff, se))
            reach = [to_reach(res[lam, a, s], 0.9 * statistics.fmean(gap[lam, b])) for s in ss]
            cells = [lam, a, str(len(ss)), "{:+.3f} ± {:.3f}".format(*mean_std(gap[lam, a])),
                     "" if a == b else f"{diff:+.3f} ± {se:.3f}",
                     "" if a == b else verdict(diff, se)]  # fmt: skip
            cells += ["{:+.2f}".format(statistics.fmean(fin[lam, a, s][f"gap/{n}"] for s in ss))
                      for n in names]  # fmt: skip
            cells += ["{:.3f}".format(statistics.fmean(fin[lam, a, s][f"eval/{n}"] for s in ss))
                      for n in judges]  # fmt: skip
            cells += [f"{statistics.median(e for e, _ in reach):.0f}",
                      f"{statistics.median(t for _, t in reach):.0f}"]  # fmt: skip
            rows.append(f"| {' | '.join(cells)} |")
    out = os.path.relpath(args.out, ROOT)
    out = args.out if out.startswith("..") else out  # the folder as it was given, if outside
    lines = [f"# The comparison, study {args.study} (docs/results.md has the protocol)", "",
             f"Written by `python studies/comparison.py report --study {args.study} --out {out}`,"
             " from the runs' folders or their archived records.", ""]  # fmt: skip
    need = decided_on(args, args.study)
    partial = min(len(ss) for ss in seeds.values()) < need
    if partial:  # the protocol decides on every seed: a part of them decides nothing
        have = ", ".join(f"{lam}: {len(seeds[lam])}" for lam in seeds)
        note = (
            f"**Partial, not a result:** finished seeds per budget ({have}) of the "
            f"{need} the protocol decides on; every verdict below is provisional."
        )
        lines += [note, ""]
    lines += [*rows, ""]
    lines.append(f"Across the budgets (arm beats {said}: wins in ≥ 3 budgets and loses in none):")
    lines.append("")
    for a, ds in summary.items():
        if a in bases or not ds:
            continue
        words = [verdict(d, se) for d, se in ds]
        counts = ", ".join(f"{words.count(w)} {w}" for w in ("win", "tie", "loss", "n/a"))
        mean_diff = statistics.fmean(d for d, _ in ds)
        lines.append(f"- {a}: {counts}; mean paired difference {mean_diff:+.3f}; "
                     f"{'beats' if beats(words) else 'does not beat'} {base_of(a)}"
                     + (" (so far)" if partial else ""))  # fmt: skip
    pairs = [(a, b, why) for a, b, why in study["pairs"] if a in arms and b in arms]  # --arms
    if pairs:
        lines += ["", "Other paired comparisons, per budget (same rule; win: a above b):", ""]
    for a, b, why in pairs:
        for lam in budgets:
            d, se = paired(gap[lam, a], gap[lam, b])
            lines.append(f"- {why}, λ = {lam}: {a} − {b} = {d:+.3f} ± {se:.3f}, {verdict(d, se)}")
    lines += ["", "Per training reward (gap closed) and per held-out judge (final score), the same "
              "rule per budget (" + ", ".join(budgets) + "):", ""]  # fmt: skip
    judge_words, metrics = {}, metrics_of(study)
    pair_words = {}
    for a in (a for a in arms if a not in bases):
        more, judge_words[a] = rule_lines(fin, seeds, budgets, a, base_of(a), metrics)
        lines += more
        more, pair_words[a] = pairwise_lines(fin, seeds, budgets, a, base_of(a))
        lines += more
    for a, b, _ in pairs:
        lines += rule_lines(fin, seeds, budgets, a, b, metrics)[0]
        lines += pairwise_lines(fin, seeds, budgets, a, b)[0]
    r = Report(args, study, arms, base, out_dir, res, fin, seeds, budgets, gap, summary,
               judge_words, pair_words, partial)  # fmt: skip
    for section in study.get("sections", []):  # the study's own, declared in STUDIES
        lines += section(r)
    lines += ["", f"Does W's distance from uniform predict the gain? Per budget: the mean final "
              f"W's L1 distance from λ/T (0: uniform, 2: disjoint) and the paired gain over "
              f"{said}" + ("; Spearman ρ over the budgets:" if len(budgets) > 1 else ":"),
              ""]  # fmt: skip
    for a in (a for a in arms if a not in bases):
        far = [statistics.fmean(l1_from_uniform(fin[lam, a, s]["W"], lam) for s in seeds[lam])
               for lam in budgets]  # fmt: skip
        if not any(far):  # W = λ/T throughout (uniform, sum): nothing to relate
            continue
        gain = [statistics.fmean(gap[lam, a]) - statistics.fmean(gap[lam, base_of(a)])
                for lam in budgets]  # fmt: skip
        each = "; ".join(f"{d:.2f} → {g:+.3f}" for d, g in zip(far, gain, strict=True))
        rho = (
            f"; ρ {spearman(far, gain):+.2f} over {len(budgets)} budgets"
            if len(budgets) > 1
            else ""
        )
        lines.append(f"- {a}: {each}{rho}")  # one budget: no relation to rank
    for b in bases:
        lines += ["", f"Has {b}'s curve flattened? Its λ-weighted gap's change between its last "
                  "three evals (mean over seeds):", ""]  # fmt: skip
        for lam in budgets:
            late = [[m["gap/weighted"] for m in evals(res[lam, b, s])[-3:]] for s in seeds[lam]]
            steps = [statistics.fmean(g[i + 1] - g[i] for g in late)
                     for i in range(len(late[0]) - 1)]  # fmt: skip
            lines.append(f"- λ = {lam}: " + ", then ".join(f"{x:+.3f}" for x in steps))
    ses = [se for se in (s for _, s in summary.get(arms[1], [])) if se == se]
    if ses:
        lines.append(f"\nResolvable difference (2 × the median paired SE of {arms[1]} over the "
                     f"budgets): {2 * statistics.median(ses):.3f}")  # fmt: skip
    first = next(iter(res.values()))[0]
    lines.append(
        "\nBase model: " + ", ".join(f"{n} {first[f'eval/{n}']:+.3f}" for n in names + judges)
    )
    lines.append("Per-reward columns: gap closed (mean over seeds); judges: final score.")
    for section in study.get("closing", []):
        lines += section(r)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(res, fin, gap, seeds, arms, out_dir, names, base_of)
    print("\n".join(lines))
    print(f"\nwrote {out_dir}/table.md, curves.png, dose.png, weights.png")


def pick_lines(r: Report) -> list[str]:
    """The development's pick rule (docs/results.md, written before its runs), over settings 1
    and 2 (studies dev1, dev2): in each (setting, budget) cell B is the better of uniform and sum
    (the higher mean λ-weighted gap) and d = an arm's mean gap − B's. The candidate (`-joint`) goes
    to the test if (1) its worst d is above ReCAST as shipped's, (2) it loses to B (the rule) in
    no more cells, and (3) no judge nor the pairwise judge loses to B in a majority of a
    setting's budgets for it where it does not for ReCAST as shipped."""
    out = ["", "The development's pick rule (docs/results.md), both settings; per cell B = the "
           "better of uniform and sum by mean gap, d = arm − B:", ""]  # fmt: skip
    arms = {"recast": "ReCAST as shipped", "joint": "the candidate"}
    worst, losses, majority, complete = {a: [] for a in arms}, dict.fromkeys(arms, 0), {}, True
    for study, prefix in (("dev1", "d1-"), ("dev2", "d2-")):
        majority[study] = {}
        for a in arms:
            got = against_better(r.args, study, prefix, a)
            complete &= got["complete"]
            worst[a] += [d for _, _, d, _, _ in got["cells"]]
            losses[a] += sum(v == "loss" for *_, v in got["cells"])
            majority[study][a] = {j for j, n in got["judges"].items() if n >= 3}
            out += [f"- {study}, λ = {lam}: B = {B}; {a} {d:+.3f} ± {se:.3f} {v}"
                    for lam, B, d, se, v in got["cells"]]  # fmt: skip
    if not worst["joint"]:
        return [*out, "- nothing to decide yet"]
    for a, name in arms.items():
        out.append(f"- {name} ({a}): worst d {min(worst[a]):+.3f}, loses to B in {losses[a]} of "
                   f"{len(worst[a])} cells; judges losing to B in a majority of a setting's "
                   "budgets: " + ("; ".join(f"{st} {', '.join(sorted(m[a])) or 'none'}"
                                           for st, m in majority.items())))  # fmt: skip
    passes = [min(worst["joint"]) > min(worst["recast"]), losses["joint"] <= losses["recast"],
              all(m["joint"] <= m["recast"] for m in majority.values())]  # fmt: skip
    tail = "" if complete else " (so far: not every run is finished, this decides nothing)"
    verdict_ = "goes to the test" if all(passes) else "does not go to the test"
    out.append(
        f"- (1) worst d above: {passes[0]}; (2) no more losses: {passes[1]}; (3) no judge "
        f"newly lost in a majority: {passes[2]}: the candidate {verdict_}{tail}"
    )
    return out


def against_better(args, study: str, prefix: str, arm: str,
                   baselines: tuple[str, ...] = ("uniform", "sum")) -> dict:  # fmt: skip
    """Per budget of a study, `arm` against B, the best of `baselines` there (the higher mean
    λ-weighted gap over the seeds every arm has finished): {"cells": [(budget, B, d, SE,
    verdict)], "judges": {judge or "pairwise": budgets lost to B}, "complete": every seed done,
    "judged": budgets with the pairwise judge's verdict, "mean": the arm's mean final λ-weighted
    gap over its cells}."""
    arms = [*(prefix + b for b in baselines), prefix + arm]
    n_base, gaps_all = len(baselines), []
    res, out = finished(args, arms), {"cells": [], "judges": {}, "complete": True, "judged": 0}
    for lam in BUDGETS:
        seeds = [s for s in range(args.seeds) if all((lam, a, s) in res for a in arms)]
        out["complete"] &= len(seeds) >= decided_on(args, study)
        if len(seeds) < 2:
            continue
        fin = {(a, s): evals(res[lam, a, s])[-1] for a in arms for s in seeds}
        gaps = lambda a, ss=seeds, fin=fin: [fin[a, s]["gap/weighted"] for s in ss]  # noqa: E731
        B = max(arms[:n_base], key=lambda a: statistics.fmean(gaps(a)))
        d, se = paired(gaps(prefix + arm), gaps(B))
        gaps_all += gaps(prefix + arm)
        out["cells"].append((lam, B, d, se, verdict(d, se)))
        for j in STUDIES[study]["judges"]:
            dj, sej = paired([fin[prefix + arm, s][f"eval/{j}"] for s in seeds],
                             [fin[B, s][f"eval/{j}"] for s in seeds])  # fmt: skip
            out["judges"][j] = out["judges"].get(j, 0) + (verdict(dj, sej) == "loss")
        fins = {(lam, x, s): fin[x, s] for x in (prefix + arm, B) for s in seeds}
        _, words = pairwise_lines(fins, {lam: seeds}, [lam], prefix + arm, B)
        out["judges"]["pairwise"] = out["judges"].get("pairwise", 0) + words.count("loss")
        out["judged"] += bool(words)  # budgets the pairwise judge could read (distances archived)
    out["mean"] = statistics.fmean(gaps_all) if gaps_all else float("nan")
    return out


def units_lines(r: Report) -> list[str]:
    """The units test: how far each rule moved when only the rewards' units changed, the same
    seeds and budgets: per arm, the final λ-weighted gap in changed units − native, paired within
    seed, per budget (mean ± SE, the rule's verdict), and the largest |difference| of any run."""
    k = r.args.study.removeprefix("setting")
    scale = UNITS[int(k)]
    out = ["", f"How far each rule moved when only the units changed (--reward-scale {scale}), "
           "final λ-weighted gap, changed − native, paired by seed:", ""]  # fmt: skip
    shift = {}  # arm → (mean, SE) per budget
    for a in UNIT_ARMS:
        native, moved = f"t{k}-{a}", f"t{k}x-{a}"
        if native not in r.arms or moved not in r.arms:
            continue
        ds = [paired(r.gap[lam, moved], r.gap[lam, native]) for lam in r.budgets]
        pairs = [zip(r.gap[lam, moved], r.gap[lam, native], strict=True) for lam in r.budgets]
        largest = max(abs(x - y) for each in pairs for x, y in each)
        words = [verdict(d, se) for d, se in ds]
        out.append(
            f"- {a}: "
            + "; ".join(
                f"{d:+.4f} ± {se:.4f} {v}" for (d, se), v in zip(ds, words, strict=True)
            )  # fmt: skip
            + f"; largest |difference| of one run {largest:.4f}"
        )
        shift[a] = ds
    if shift:
        plot_units(shift, r.budgets, f"setting {k}, --reward-scale {scale}", r.out_dir)
        out += ["", "- units.png: each rule's move per budget (mean ± 2 SE), 0 for a rule "
                "the units do not reach"]  # fmt: skip
    return out


def plot_units(moved: dict, budgets: list[str], title: str, out_dir: str) -> None:
    """units.png: per arm, the final λ-weighted gap in changed units − native, paired by seed,
    one point per budget (mean ± 2 SE), arms side by side."""
    fig, ax = plt.subplots(figsize=(1.1 * len(moved) + 2.4, 3.4))
    for i, ds in enumerate(moved.values()):
        for j, (d, se) in enumerate(ds):
            x = i + (j - (len(ds) - 1) / 2) * 0.12
            ax.errorbar(x, d, yerr=2 * se, fmt="o", ms=4, color=f"C{j}", capsize=2,
                        label=budgets[j] if i == 0 else None)  # fmt: skip
    ax.axhline(0, color="0.6", lw=0.8)
    ax.set_xticks(range(len(moved)), list(moved))
    ax.set(title=title, ylabel="gap, changed − native units")
    ax.legend(title="λ", fontsize=7, title_fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "units.png"), dpi=110)
    plt.close(fig)


def units_ship_lines(r: Report) -> list[str]:
    """The units test's shipping rule (docs/results.md, written before its runs): a candidate
    (per-reward, batch, unit-joint) qualifies if, in each of settings 5 and 6 and each unit system,
    it loses to B (the best of uniform, sum and the unit-free sum, per budget) in no budget and no
    judge nor the pairwise judge loses to B in a majority (≥ 3) of the budgets, and in at least one
    setting it beats B (≥ 3 wins, no loss) in both unit systems. Of several, the one with the
    higher mean final λ-weighted gap over every cell ships; of none, joint stays."""
    out = ["", "The units test's shipping rule (docs/results.md), settings 5 and 6 in both unit "
           "systems; per budget B = the best of uniform, sum and sumunit by mean gap:",
           ""]  # fmt: skip
    complete, judged, qualified = True, True, {}
    for arm in CANDIDATES:
        ok, beat_in, means = True, {}, []
        for k in (5, 6):
            for u in ("", "x"):
                a = against_better(r.args, f"setting{k}", f"t{k}{u}-", arm, tuple(BASELINES))
                complete &= a["complete"]
                judged &= a["judged"] == len(a["cells"])  # a judge it cannot read decides nothing
                words = [v for *_, v in a["cells"]]
                lost = sorted(j for j, n in a["judges"].items() if n >= 3)
                ok &= bool(words) and "loss" not in words and not lost
                beat_in.setdefault(k, []).append(beats(words))
                means.append(a["mean"])
                cells = "; ".join(f"{lam} ({B.split('-', 1)[1]}) {d:+.3f} ± {se:.3f} {v}"
                                  for lam, B, d, se, v in a["cells"])  # fmt: skip
                units = "changed units" if u else "native"
                out.append(f"- setting {k} {units}, {arm} against B: {cells}; judges lost in "
                           f"most budgets: {', '.join(lost) or 'none'}")  # fmt: skip
        beat = any(all(b) and len(b) == 2 for b in beat_in.values())
        mean = statistics.fmean(means)
        out.append(f"- {arm}: no budget lost and no judge lost in most budgets anywhere: {ok}; "
                   f"beats B in both unit systems of a setting: {beat}; mean gap {mean:+.3f}: "
                   f"{'qualifies' if ok and beat else 'does not qualify'}")  # fmt: skip
        if ok and beat:
            qualified[arm] = mean
    best = max(qualified, key=qualified.get) if qualified else None
    tail = "" if complete else " (so far: not every run is finished, this decides nothing)"
    if complete and not judged:
        tail = " (undecided: some budget's runs lack the pairwise judge's distances)"
    ships = f"--normalize {UNIT_ARMS[best][-1]} becomes the default" if best else (
        "none qualifies: joint stays the default")  # fmt: skip
    out.append(f"- {ships}{tail}")
    return out


def default_change_lines(r: Report) -> list[str]:
    """What made unit-joint the default (#69): in each unit system of the setting, unit-joint
    against joint, paired by seed per budget (against_better with joint alone as B): wins, ties
    and losses over the budgets and the mean difference."""
    k = r.args.study.removeprefix("setting")
    out = ["", "unit-joint against joint, the default before it (added after the units test; "
           "it made unit-joint the default: DESIGN §3), final λ-weighted gap paired by seed:",
           ""]  # fmt: skip
    for u, units in (("", "native units"), ("x", "changed units")):
        a = against_better(r.args, r.args.study, f"t{k}{u}-", "unitjoint", ("joint",))
        words = [v for *_, v in a["cells"]]
        counts = " / ".join(str(words.count(w)) for w in ("win", "tie", "loss"))
        mean = statistics.fmean(d for _, _, d, _, _ in a["cells"]) if a["cells"] else math.nan
        out.append(f"- setting {k}, {units}: wins / ties / losses {counts}, mean difference "
                   f"{mean:+.3f}")  # fmt: skip
    return out


# The credit test's predictor (docs/results.md, written before any run in settings 7 and 8): per
# setting, the base model's W's L1 distance from λ/T per budget in BUDGETS' order, as `python
# recast.py --profile --rewards R --lambda λ --prompts 64` prints it at the protocol's commit
# (`credit-l1 --code` the worktree of 668353f, before the first run of the test).
CREDIT_L1: dict[int, tuple[float, ...]] = {
    1: (0.523, 0.529, 0.53, 0.626, 0.553),  # position, color, sharpness, background
    2: (0.372, 0.293, 0.347, 0.302, 0.337),  # size, elongation, outline, texture
    3: (0.585, 0.467, 0.494, 0.476, 0.512),  # color, elongation, background, outline
    4: (0.402, 0.368, 0.382, 0.461, 0.414),  # size, texture, elongation, background
    5: (0.508, 0.519, 0.499, 0.482, 0.523),  # position, color, elongation, texture
    6: (0.614, 0.54, 0.486, 0.509, 0.553),  # color, size, elongation, outline
    7: (0.577, 0.564, 0.551, 0.583, 0.576),  # color, position, elongation, background
    8: (0.577, 0.498, 0.513, 0.502, 0.536),  # color, texture, background, outline
}
CREDIT_RHO = 0.5  # the predictor holds where ρ over settings 7 and 8's 10 cells is ≥ this


def credit_l1(args) -> None:
    """The credit test's predictor, measured on the base model before any run of the test: per
    setting, one `recast.py --profile --prompts 64` (seed 0) of its rewards, and from its gains
    the W that --profile prints at each budget (the gains do not depend on λ: the same rollout
    and scores) and that W's L1 distance from λ/T; printed as CREDIT_L1's entries."""
    from recast import recast_weights  # not at the top: the report needs no model code

    found = {}
    for k, (names, _) in CREDIT_SETTINGS.items():
        out = os.path.join(args.out, "profiles", f"setting{k}")
        if not os.path.isfile(os.path.join(out, "profile.json")):
            cmd = [
                sys.executable,
                os.path.join(args.code, "recast.py"),
                "--profile",
                "--rewards",
                ",".join(names),
                "--lambda",
                BUDGETS[0],
                "--prompts",
                "64",
                "--out",
                out,
            ]
            subprocess.run(cmd, cwd=args.code, env=dict(os.environ, **DISPATCH), check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
        with open(os.path.join(out, "profile.json")) as f:
            p = json.load(f)
        gains = torch.tensor(p["gains"], dtype=torch.float64)
        found[k] = []
        for lam in BUDGETS:
            budgets = torch.tensor([float(x) for x in lam.split(",")], dtype=torch.float64)
            W = recast_weights(gains, budgets, p["tau"], p["floor"], p["gain_shift"])
            found[k].append(round(l1_from_uniform(W.tolist(), lam), 3))
        assert abs(found[k][0] - p["l1_from_uniform"]) < 2e-3, (found[k][0], p["l1_from_uniform"])
        print(f"    {k}: {tuple(found[k])},  # {', '.join(names)}", flush=True)


def bootstrap(cells: list[list[float]], reps: int = 10_000) -> tuple[float, float, float]:
    """The mean of every cell's per-seed values pooled (a cell: one (setting, budget)), and its
    95 % percentile interval over `reps` resamples of the seeds with replacement within each cell
    (a fixed generator, so the report repeats)."""
    gen = torch.Generator().manual_seed(70)
    total = sum(len(c) for c in cells)
    stats = torch.zeros(reps, dtype=torch.float64)
    for c in cells:
        values = torch.tensor(c, dtype=torch.float64)
        stats += values[torch.randint(len(c), (reps, len(c)), generator=gen)].sum(1)
    stats /= total
    lo, hi = torch.quantile(stats, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return statistics.fmean(x for c in cells for x in c), lo, hi


def credit_word(lo: float, hi: float, pays: str = "W pays", costs: str = "W costs") -> str:
    """The protocol's reading of an interval: above 0 pays, below 0 costs, else unresolved."""
    return pays if lo > 0 else costs if hi < 0 else "no difference resolved"


def credit_runs(args) -> dict[int, dict]:
    """Setting → (budget, arm, seed) → compact lines of its finished credit runs, read once."""
    return {k: finished(argparse.Namespace(**{**vars(args), "seeds": CREDIT_SEEDS[k]}),
                        credit_arms(k)) for k in CREDIT_SETTINGS}  # fmt: skip


def credit_cells(runs: dict, a: str, b: str, metric: str, settings) -> tuple[list, list, bool]:
    """Per (setting, budget) of `settings` where both arms ran (`runs`: credit_runs): the per-seed
    differences a − b of `metric` at the final eval ("pairwise": a's preference rate over b's
    images − ½), the cells' names, and whether every run of the protocol is finished."""
    cells, names, complete = [], [], True
    for k in settings:
        need = CREDIT_SEEDS[k]
        arms = [f"c{k}-{a}", f"c{k}-{b}"]
        if metric.startswith("eval/") and metric[5:] not in CREDIT_SETTINGS[k][1]:
            continue  # not a judge of this setting
        res = runs[k]
        for lam in BUDGETS:
            seeds = [s for s in range(need) if all((lam, x, s) in res for x in arms)]
            complete &= len(seeds) == need
            if not seeds:
                continue
            fin = {(x, s): evals(res[lam, x, s])[-1] for x in arms for s in seeds}
            if metric == "pairwise":
                dist = [tuple(fin[x, s].get("judge/distance") for x in arms) for s in seeds]
                if not all(x and y for x, y in dist):
                    continue
                diffs = [preference_rate(prefer_by_distance(torch.tensor(x), torch.tensor(y)))
                         - 0.5 for x, y in dist]  # fmt: skip
            else:
                diffs = [fin[arms[0], s][metric] - fin[arms[1], s][metric] for s in seeds]
            cells.append(diffs)
            names.append((k, lam))
    return cells, names, complete


def credit_closing(r: Report) -> list[str]:
    """A credit study's report ends with credit_lines and credit_figure, the archive read once."""
    runs = credit_runs(r.args)
    return credit_lines(r, runs) + credit_figure(r, runs)


def credit_lines(r: Report, runs: dict | None = None) -> list[str]:
    """The credit test's pre-registered verdicts (docs/results.md): recast − flat, the λ-weighted
    gap at the final eval, paired by seed and pooled over the (budget, seed) cells of settings 7
    and 8, with its 95 % bootstrap interval (seeds resampled within each cell): W pays if the
    interval lies above 0, costs if below; the same for settings 1-6 (in-sample); every held-out
    judge (recast − flat, and recast − per-reward uniform in 7 and 8) and the pairwise judge by
    the same rule; the placement control and the rules users run; the predictor's ρ."""
    runs = credit_runs(r.args) if runs is None else runs
    out = ["", "The credit test (docs/results.md), pooled over the (budget, seed) cells; 95 % "
           "bootstrap intervals, seeds resampled within each cell:", ""]  # fmt: skip
    complete = True

    def line(label: str, a: str, b: str, metric: str, settings, pays="W pays", costs="W costs"):
        nonlocal complete
        cells, _, done = credit_cells(runs, a, b, metric, settings)
        complete &= done
        if not cells:
            return f"- {label}: no finished cell"
        mean, lo, hi = bootstrap(cells)
        n = sum(map(len, cells))
        return (f"- {label}: {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] over {len(cells)} cells, {n} "
                f"pairs: {credit_word(lo, hi, pays, costs)}")  # fmt: skip

    fresh, seen = FRESH, [k for k in CREDIT_SETTINGS if k not in FRESH]
    out.append(line("primary, settings 7 and 8: recast − flat, λ-weighted gap", "recast", "flat",
                    "gap/weighted", fresh))  # fmt: skip
    out.append(line("in-sample, settings 1-6: recast − flat, λ-weighted gap", "recast", "flat",
                    "gap/weighted", seen))  # fmt: skip
    for k in CREDIT_SETTINGS:
        out.append(line(f"setting {k}: recast − flat", "recast", "flat", "gap/weighted", [k]))
    judges = list(dict.fromkeys(j for k in fresh for j in CREDIT_SETTINGS[k][1]))
    for b in ("flat", "uniform"):
        for j in judges:
            out.append(line(f"settings 7 and 8, judge {j}: recast − {b}", "recast", b,
                            f"eval/{j}", fresh, "recast higher", "recast lower"))  # fmt: skip
    out.append(line("settings 7 and 8, the pairwise judge: recast's images over flat's, "
                    "preference rate − ½", "recast", "flat", "pairwise", fresh,
                    "prefers recast", "prefers flat"))  # fmt: skip
    out.append(line("settings 1-6, the pairwise judge: recast over flat, − ½", "recast", "flat",
                    "pairwise", seen, "prefers recast", "prefers flat"))  # fmt: skip
    out.append(line("placement control, settings 7 and 8: recast − reversed", "recast",
                    "reversed", "gap/weighted", fresh, "placement matters",
                    "reversed better"))  # fmt: skip
    out.append(line("placement control, settings 1-6: recast − reversed", "recast", "reversed",
                    "gap/weighted", seen, "placement matters", "reversed better"))  # fmt: skip
    for b in ("gdpo", "sum", "uniform"):
        out.append(line(f"the rules users run, settings 7 and 8: recast − {b}", "recast", b,
                        "gap/weighted", fresh, "recast higher", "recast lower"))  # fmt: skip
    out += credit_prediction_lines(runs)
    if not complete:
        out.append("- so far: not every run of the protocol is finished; this decides nothing")
    return out


def credit_figure(r: Report, runs: dict | None = None) -> list[str]:
    """credit.png, the credit test in one picture: left, recast − flat (λ-weighted gap) in every
    (setting, budget) cell with both arms finished, each seed a dot and the cell's mean a bar, with
    the pooled mean and its 95 % bootstrap interval as a band over settings 7 and 8 (the primary
    endpoint) and over settings 1-6 (in-sample); right, each cell's mean against the predictor
    written in the protocol (CREDIT_L1), settings 7 and 8 filled."""
    runs = credit_runs(r.args) if runs is None else runs
    cells, names, _ = credit_cells(runs, "recast", "flat", "gap/weighted", CREDIT_SETTINGS)
    if not cells:
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [2.4, 1]})
    order = list(dict.fromkeys(k for k, _ in names))
    x = [i + 0.8 * order.index(k) for i, (k, _) in enumerate(names)]  # a gap between settings
    for group, colour in ((FRESH, "tab:red"), ([k for k in CREDIT_SETTINGS if k not in FRESH],
                                               "tab:blue")):  # fmt: skip
        at = [i for i, (k, _) in enumerate(names) if k in group]
        if not at:
            continue
        mean, lo, hi = bootstrap([cells[i] for i in at])
        left, right = x[at[0]] - 0.4, x[at[-1]] + 0.4
        ax.fill_between([left, right], lo, hi, color=colour, alpha=0.15, lw=0)
        ax.plot([left, right], [mean, mean], color=colour, lw=1,
                label=("settings 7 and 8" if group == FRESH else "settings 1-6, in-sample")
                + f": {mean:+.4f} [{lo:+.4f}, {hi:+.4f}]")  # fmt: skip
        for i in at:
            ax.scatter([x[i]] * len(cells[i]), cells[i], s=6, color=colour, alpha=0.6)
            ax.plot([x[i] - 0.3, x[i] + 0.3], [statistics.fmean(cells[i])] * 2, color="k", lw=1)
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xticks([statistics.fmean(x[i] for i, (k, _) in enumerate(names) if k == s)
                   for s in order], [f"setting {s}" for s in order], fontsize=8)  # fmt: skip
    ax.set_ylabel("recast − flat, λ-weighted gap closed")
    ax.set_title("each dot a seed, each bar a budget's mean; bands: pooled mean, 95 % interval",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="lower left")
    for i, (k, lam) in enumerate(names):
        if k in CREDIT_L1:
            fresh = k in FRESH
            bx.scatter(CREDIT_L1[k][BUDGETS.index(lam)], statistics.fmean(cells[i]), s=18,
                       color="tab:red" if fresh else "none",
                       edgecolors="tab:red" if fresh else "tab:blue")  # fmt: skip
    bx.axhline(0, color="grey", lw=0.6)
    bx.set_xlabel("predictor: base model's W, L1 from λ/T")
    bx.set_ylabel("recast − flat, a cell's mean")
    bx.set_title("filled: settings 7 and 8 (the test); open: 1-6", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(r.out_dir, "credit.png"), dpi=110)
    plt.close(fig)
    return ["", f"credit.png: recast − flat in each of the {len(cells)} cells with both arms "
            "finished, the pooled intervals, and each cell against the predictor."]  # fmt: skip


def credit_prediction_lines(runs: dict) -> list[str]:
    """The predictor written in the protocol (CREDIT_L1, the base model's W distance from λ/T):
    Spearman ρ with the mean recast − flat per (setting, budget), over settings 7 and 8's cells
    (decides: holds at ρ ≥ CREDIT_RHO, the sign written: positive) and over every cell."""
    if not CREDIT_L1:
        return ["- predictor: not measured (CREDIT_L1 is empty)"]
    out = []
    for label, settings in (("settings 7 and 8", FRESH), ("every setting", CREDIT_SETTINGS)):
        cells, names, _ = credit_cells(runs, "recast", "flat", "gap/weighted",
                                       [k for k in settings if k in CREDIT_L1])  # fmt: skip
        x = [CREDIT_L1[k][BUDGETS.index(lam)] for k, lam in names]
        y = [statistics.fmean(c) for c in cells]
        if len(x) < 3:
            out.append(f"- predictor over {label}: fewer than 3 cells")
            continue
        rho = spearman(x, y)
        said = ""
        if settings == FRESH:
            said = ": holds" if rho >= CREDIT_RHO else ": does not hold"
        out.append(f"- predictor (base model's W distance from λ/T) against recast − flat, over "
                   f"{label}: Spearman ρ {rho:+.2f} over {len(x)} cells{said}")  # fmt: skip
    return out


def ship_lines(r: Report) -> list[str]:
    """The test's shipping rule (docs/results.md, written before its runs): the candidate
    (`-joint`) becomes the default only if, in both settings 3 and 4, it loses in no budget to
    B, the better of uniform and sum, it beats B (≥ 3 wins, no loss) in at least one, and no judge
    nor the pairwise judge loses to B in a majority of a setting's budgets."""
    out = ["", "The test's shipping rule (docs/results.md), settings 3 and 4; per budget B = the "
           "better of uniform and sum by mean gap:", ""]  # fmt: skip
    ok, beat, complete = True, False, True
    for study, prefix in (("setting3", "t3-"), ("setting4", "t4-")):
        for arm in ("recast", "joint"):
            a = against_better(r.args, study, prefix, arm)
            complete &= a["complete"]
            words = [v for *_, v in a["cells"]]
            lost = sorted(j for j, n in a["judges"].items() if n >= 3)
            out.append(f"- {study}, {prefix}{arm} against B: "
                       + "; ".join(f"{lam} ({B.removeprefix(prefix)}) {d:+.3f} ± {se:.3f} {v}"
                                   for lam, B, d, se, v in a["cells"])
                       + f"; judges lost in most budgets: {', '.join(lost) or 'none'}")  # fmt: skip
            if arm == "joint":
                ok &= bool(words) and "loss" not in words and not lost
                beat |= beats(words)
    tail = "" if complete else " (so far: not every run is finished, this decides nothing)"
    ships = ok and beat
    out.append(f"- the candidate {'becomes' if ships else 'does not become'} the default{tail}")
    return out


def prediction_lines(r: Report) -> list[str]:
    """The test's prediction from `--profile` (docs/results.md): across the (setting, budget) cells
    of settings 1–4, does the base model's W distance from λ/T (PROFILE_L1) order ReCAST as
    shipped's gain over uniform, and over sum (the mean paired difference of the λ-weighted gap)?
    It holds for a comparison when Spearman ρ passes the one-sided 5% permutation threshold."""
    out = ["", "The --profile prediction (docs/results.md): per (setting, budget) cell, the base "
           "model's W distance from λ/T and ReCAST as shipped's mean paired gain:", ""]  # fmt: skip
    far, gain, complete, who = [], {"uniform": [], "sum": []}, True, []
    for study, prefix in SETTINGS:
        got = {b: versus(r.args, study, prefix + "recast", prefix + b) for b in gain}
        complete &= all(v["complete"] for v in got.values())
        for lam, dist in zip(BUDGETS, PROFILE_L1[study], strict=True):
            if not all(lam in v["gap"] for v in got.values()):
                continue
            far.append(dist)
            who.append(study)
            for b, v in got.items():
                gain[b].append(v["gap"][lam][0])
            out.append(f"- {study}, λ = {lam}: distance {dist:.2f}; over uniform "
                       f"{gain['uniform'][-1]:+.3f}, over sum {gain['sum'][-1]:+.3f}")  # fmt: skip
    if len(far) < 3:
        return [*out, "- nothing to decide yet"]
    bar, tail = spearman_bar(far), "" if complete else " (so far: this decides nothing)"
    for b, gs in gain.items():
        rho, (slope, at0) = spearman(far, gs), statistics.linear_regression(far, gs)
        out.append(f"- the distance orders the gain over {b}: ρ {rho:+.2f} over {len(far)} cells "
                   f"against the one-sided 5% permutation threshold {bar:.2f}: "
                   f"{'held' if rho > bar else 'did not hold'}{tail}; least-squares line: gain ≈ "
                   f"{slope:+.3f} × distance {at0:+.3f} (reward_profile.PREDICTION "
                   f"{b!r}: ({slope:.4f}, {at0:.4f}, {rho:.2f}))")  # fmt: skip
    test = [j for j, study in enumerate(who) if study in ("setting3", "setting4")]
    if len(test) >= 3:  # the test sets alone: the 20-cell verdict leans on development cells
        far_t = [far[j] for j in test]
        bar_t = spearman_bar(far_t)
        for b, gs in gain.items():
            rho = spearman(far_t, [gs[j] for j in test])
            out.append(f"- over the {len(test)} test cells alone (settings 3 and 4), the gain over "
                       f"{b}: ρ {rho:+.2f} against the threshold {bar_t:.2f} for {len(test)} "
                       f"cells: {'held' if rho > bar_t else 'did not hold'} (not the protocol's "
                       "test: said beside it)")  # fmt: skip
    plot_prediction(far, gain, who, r.out_dir)
    out.append("- prediction.png: the cells and the lines")
    return out


def plot_prediction(far: list[float], gain: dict, who: list[str], out_dir: str) -> None:
    """prediction.png: each (setting, budget) cell's gain against its base-model W distance, one
    panel per comparison, with the least-squares line."""
    fig, axes = plt.subplots(1, len(gain), figsize=(4.2 * len(gain), 3.2), sharey=True)
    for ax, (b, gs) in zip(axes, gain.items(), strict=True):
        for study, _ in SETTINGS:
            at = [i for i, w in enumerate(who) if w == study]
            name = "setting " + study[-1]
            ax.scatter([far[i] for i in at], [gs[i] for i in at], s=22, label=name)
        slope, at0 = statistics.linear_regression(far, gs)
        xs = [min(far), max(far)]
        ax.plot(xs, [slope * x + at0 for x in xs], "k--", lw=1)
        ax.axhline(0, color="0.7", lw=0.8)
        ax.set(title=f"ReCAST − {b} (ρ {spearman(far, gs):+.2f})",
               xlabel="base model's W distance from λ/T")  # fmt: skip
    axes[0].set_ylabel("mean paired gain, λ-weighted gap")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "prediction.png"), dpi=110)
    plt.close(fig)


def versus(args, study: str, a: str, b: str) -> dict:
    """a against b in each budget of a study, on the seeds both have finished, by the rule:
    {"gap": {budget: (d, SE, verdict)}, "judges": {judge: [verdict]}, "pairwise": [verdict],
    "complete": every seed done}."""
    res, out = finished(args, [a, b]), {"gap": {}, "judges": {}, "pairwise": [], "complete": True}
    for lam in BUDGETS:
        seeds = [s for s in range(args.seeds) if (lam, a, s) in res and (lam, b, s) in res]
        out["complete"] &= len(seeds) >= decided_on(args, study)
        if len(seeds) < 2:
            continue
        fin = {(lam, x, s): evals(res[lam, x, s])[-1] for x in (a, b) for s in seeds}
        for j in ["weighted", *STUDIES[study]["judges"]]:
            key = "gap/weighted" if j == "weighted" else f"eval/{j}"
            d, se = paired(
                [fin[lam, a, s][key] for s in seeds], [fin[lam, b, s][key] for s in seeds]
            )
            if j == "weighted":
                out["gap"][lam] = (d, se, verdict(d, se))
            else:
                out["judges"].setdefault(j, []).append(verdict(d, se))
        out["pairwise"] += pairwise_lines(fin, {lam: seeds}, [lam], a, b)[1]
    return out


def side_by_side_lines(r: Report) -> list[str]:
    """The four settings side by side (settings 1 and 2 from the development's runs, 3 and 4 from
    the test): each comparison's λ-weighted gap over the budgets (win/tie/loss, mean paired
    difference) with the judges it loses in a majority of budgets, and the paper's three claims,
    ReCAST as shipped against uniform, graded as claims_lines grades them."""
    rows = {"ReCAST − uniform": ("recast", "uniform"), "ReCAST − sum": ("recast", "sum"),
            "joint − uniform": ("joint", "uniform"), "joint − sum": ("joint", "sum"),
            "sum − uniform": ("sum", "uniform")}  # fmt: skip
    head = ["setting 1 (dev)", "setting 2 (dev)", "setting 3 (test)", "setting 4 (test)"]
    out = ["", "The four settings side by side (gap: win/tie/loss over the budgets, mean paired "
           "difference; then the judges lost in ≥ 3 budgets):", "",
           "| | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]  # fmt: skip
    count = lambda w: "/".join(str(w.count(x)) for x in ("win", "tie", "loss"))  # noqa: E731
    grade = lambda w: "beats" if beats(w) else "matches" if "loss" not in w else "loses"  # noqa: E731
    got = {(row, st): versus(r.args, st, p + a, p + b) for row, (a, b) in rows.items()
           for st, p in SETTINGS}  # fmt: skip
    complete = all(v["complete"] for v in got.values())
    for row in rows:
        cells = []
        for st, _ in SETTINGS:
            v = got[row, st]
            if not v["gap"]:
                cells.append("not run")
                continue
            words = [w for *_, w in v["gap"].values()]
            lost = [j for j, w in v["judges"].items() if w.count("loss") >= 3]
            lost += ["pairwise"] * (v["pairwise"].count("loss") >= 3)
            mean = statistics.fmean(d for d, *_ in v["gap"].values())
            cells.append(f"{count(words)}, {mean:+.3f}; "
                         f"loses {', '.join(lost) or 'no judge'}")  # fmt: skip
        out.append(f"| {row} | " + " | ".join(cells) + " |")
    claims = {"1. training rewards improve or match": [], "2. every held-out judge improves": [],
              "3. the pairwise judge prefers ReCAST": []}  # fmt: skip
    for st, _ in SETTINGS:
        v = got["ReCAST − uniform", st]
        words = [w for *_, w in v["gap"].values()]
        beaten = sum(beats(w) for w in v["judges"].values())
        claims["1. training rewards improve or match"].append(
            f"{grade(words)}: {'shown' if grade(words) != 'loses' else 'not shown'}" if words
            else "not run")  # fmt: skip
        claims["2. every held-out judge improves"].append(
            f"{beaten} of {len(v['judges'])} beat: "
            + ("shown" if v["judges"] and beaten == len(v["judges"]) else "not shown")
        )
        claims["3. the pairwise judge prefers ReCAST"].append(
            f"{count(v['pairwise'])}, {grade(v['pairwise'])}: "
            f"{'shown' if beats(v['pairwise']) else 'not shown'}" if v["pairwise"]
            else "not measured")  # fmt: skip
    out += [f"| {c} | " + " | ".join(cells) + " |" for c, cells in claims.items()]
    return out + ([] if complete else ["", "(so far: not every run is finished)"])


def draw_w(ax, Ws: list, names: list[str]) -> None:
    """One panel of weights.png / w_settings.png: the mean of these final W, times T (uniform
    weighting is λ_k·T per row), reward names on the rows when given."""
    W = torch.tensor(Ws).mean(0)
    ax.imshow((W * W.shape[1]).numpy(), cmap="magma", vmin=0, vmax=1.5, aspect="auto")
    ax.set_xticks([])
    ax.set_yticks(range(W.shape[0]), names, fontsize=6)


def settings_w(args, fin, seeds, out_dir: str) -> list[str]:
    """ReCAST's mean final W in setting 1 (the s1-recast reruns) above setting 2's, per budget,
    over the seeds both settings have finished: w_settings.png, and each W's L1 distance from
    uniform. Nothing when setting 1 has no finished run yet."""
    s1 = finished(args, ["s1-recast"])
    both = {lam: [s for s in ss if (lam, "s1-recast", s) in s1] for lam, ss in seeds.items()}
    both = {lam: ss for lam, ss in both.items() if ss}
    if not both:
        return []
    rows = [("s1-recast", NAMES, lambda lam, s: evals(s1[lam, "s1-recast", s])[-1]["W"]),
            ("s2-recast", TOY2, lambda lam, s: fin[lam, "s2-recast", s]["W"])]  # fmt: skip
    fig, axes = plt.subplots(2, len(both), figsize=(2.4 * len(both), 3.2), squeeze=False)
    out = ["", "ReCAST's mean final W in both settings (w_settings.png); per budget, the final "
           "W's L1 distance from uniform (mean over seeds), setting 1 → setting 2:",
           ""]  # fmt: skip
    far = {}
    for i, (arm, names, W_of) in enumerate(rows):
        for j, (lam, ss) in enumerate(both.items()):
            far[arm, lam] = statistics.fmean(l1_from_uniform(W_of(lam, s), lam) for s in ss)
            ax = axes[i][j]
            draw_w(ax, [W_of(lam, s) for s in ss], names if j == 0 else [])
            ax.set_title(f"{'setting 1' if i == 0 else 'setting 2'}, λ = {lam}", fontsize=7)
    for lam, ss in both.items():
        n = f"{len(ss)} seed" + "s" * (len(ss) > 1)
        out.append(f"- λ = {lam} ({n}): {far['s1-recast', lam]:.2f} → "
                   f"{far['s2-recast', lam]:.2f}")  # fmt: skip
    fig.suptitle("ReCAST's mean final W·T, setting 1 (top) and setting 2 (bottom); timestep 0 = "
                 "noise at the left", fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "w_settings.png"), dpi=110)
    plt.close(fig)
    return out


def plot(res, fin, gap, seeds, arms: list[str], out_dir: str, names: list[str],
         base_of) -> None:  # fmt: skip
    budgets = list(dict.fromkeys(lam for lam, _ in gap))
    fig, axes = plt.subplots(1, len(budgets), figsize=(3.2 * len(budgets), 3), sharey=True,
                             squeeze=False)  # fmt: skip
    for ax, lam in zip(axes[0], budgets, strict=True):
        for a in arms:
            curves = torch.tensor([[0.0] + [m["gap/weighted"] for m in evals(res[lam, a, s])]
                                   for s in seeds[lam]])  # fmt: skip
            epochs = [0] + [m["epoch"] for m in evals(res[lam, a, seeds[lam][0]])]
            ax.plot(epochs, curves.mean(0).tolist(), label=a, lw=1.2)
        ax.set_title(f"λ = {lam}  ({len(seeds[lam])} seeds)", fontsize=9)
        ax.set_xlabel("epoch")
    axes[0][0].set_ylabel("λ-weighted gap closed (mean)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "curves.png"), dpi=110)
    plt.close(fig)

    bases = set(map(base_of, arms))
    dosed = [a for a in arms if a not in bases and not a.endswith("sum")]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    for j, lam in enumerate(budgets):
        ds = [paired(gap[lam, a], gap[lam, base_of(a)]) for a in dosed]
        x = [i + 0.08 * (j - 2) for i in range(len(dosed))]
        ax.errorbar(x, [d for d, _ in ds], yerr=[2 * se if se == se else 0 for _, se in ds],
                    fmt="o", ms=3, capsize=2, label=f"λ = {lam}")  # fmt: skip
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xticks(range(len(dosed)), dosed, fontsize=8, rotation=15)
    ax.set_ylabel(f"gap closed − {' or '.join(sorted(bases))}'s (± 2 SE)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "dose.png"), dpi=110)
    plt.close(fig)

    shown = [a for a in arms if not a.endswith("sum")]
    size = (2.4 * len(budgets), 1.5 * len(shown))
    fig, axes = plt.subplots(len(shown), len(budgets), figsize=size, squeeze=False)
    for i, a in enumerate(shown):
        for j, lam in enumerate(budgets):
            ax = axes[i][j]
            draw_w(ax, [fin[lam, a, s]["W"] for s in seeds[lam]], names if j == 0 else [])
            if i == 0:
                ax.set_title(f"λ = {lam}", fontsize=7)
            if j == 0:
                ax.set_ylabel(a, fontsize=7)
    fig.suptitle("mean final W·T (timestep 0 = noise at the left; rows sum to λ·T)", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "weights.png"), dpi=110)
    plt.close(fig)


def reproduce(args) -> None:
    """Rerun the REPRODUCE runs with --code's recast.py into OUT/reproduce/ and compare every
    eval/gap value at every eval with the archive's; exit 1 beyond REPRODUCE_TOL."""
    kept = read_archive(args.archive)
    keys = [(BUDGETS[0], a, 0) for a in args.arms.split(",")] if args.arms else REPRODUCE
    paths = [os.path.join(args.out, "reproduce", os.path.basename(folder("", *k))) for k in keys]
    os.makedirs(os.path.dirname(paths[0]), exist_ok=True)
    print(f"rerunning {len(paths)} archived runs with recast.py of {args.code}", flush=True)
    with tqdm(total=len(paths), unit="run") as bar, ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_one, args.code, path, *key, math.inf, bar)
                for path, key in zip(paths, keys, strict=True) if not done(path)]  # fmt: skip
        for job in jobs:
            job.result()
    worst = 0.0
    for path in paths:
        new, old = evals(compact(read_metrics(path))), evals(kept[os.path.basename(path)])
        if len(new) != len(old):
            raise SystemExit(f"{path}: {len(new)} evals, the archive has {len(old)}")
        diffs = [
            abs(a[k] - b[k])
            for a, b in zip(new, old, strict=True)
            for k in b
            if k.startswith(("eval/", "gap/"))
        ]
        W = max(
            abs(x - y)
            for r, q in zip(new[-1]["W"], old[-1]["W"], strict=True)
            for x, y in zip(r, q, strict=True)
        )
        print(f"{os.path.basename(path)}: {len(diffs)} eval/gap values, largest difference from "
              f"the archive {max(diffs):.1e} (final W: {W:.1e})")  # fmt: skip
        worst = max(worst, max(diffs))
    ok = worst <= REPRODUCE_TOL
    print(f"{'reproduced' if ok else 'NOT reproduced'}: largest difference {worst:.1e} "
          f"{'≤' if ok else '>'} {REPRODUCE_TOL:g}")  # fmt: skip
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("cmd", choices=["run", "report", "archive", "reproduce", "credit-l1"])
    ap.add_argument("--study", choices=list(STUDIES), default="tau",
                    help="which comparison: tau (the first), shift (the alignment), scoring "
                         "(fewer step predictions scored), setting1 and setting2 (the settings "
                         "comparison), dev1 and dev2 (joint normalisation's development), "
                         "setting3 and setting4 (the test), setting5 and setting6 (the units "
                         "test), default (the default run and its baselines, 10 seeds); "
                         "docs/results.md has each protocol")  # fmt: skip
    ap.add_argument("--out", default=os.path.join(ROOT, "sweeps", "comparison"))
    ap.add_argument("--archive", default=ARCHIVE, help="the finished runs' records (see above)")
    ap.add_argument("--code", default=ROOT,
                    help="the checkout whose recast.py `run` runs: a sweep keeps one commit from "
                         "its first run to its last (docs/results.md names it)")  # fmt: skip
    ap.add_argument("--seeds", type=int, default=0,
                    help="seeds 0 … N-1 (default: the study's protocol's, 5; 3 for settings 5 "
                         "and 6)")  # fmt: skip
    ap.add_argument("--arms", default="",
                    help="run, report: only these arms of the study; reproduce: rerun these arms' "
                         "archived runs at the first budget, seed 0, instead of REPRODUCE "
                         "(comma-separated)")  # fmt: skip
    ap.add_argument("--stop-after", type=float, default=150.0,
                    help="minutes after which no new run starts (running ones finish)")  # fmt: skip
    args = ap.parse_args()
    args.seeds = args.seeds or STUDIES[args.study].get("seeds", 5)
    for name in ("out", "archive", "code"):  # recast.py runs in --code: a relative --out would
        setattr(args, name, os.path.abspath(getattr(args, name)))  # land there, unseen here
    if args.seeds < 0 or args.stop_after < 0:
        flag = "--seeds" if args.seeds < 0 else "--stop-after"
        cli.fail(flag, "give a count of 0 or more (--seeds 0: the protocol's; --stop-after 0: "
                 "start no run, only report)", "comparison.py")  # fmt: skip
    if not os.path.isfile(os.path.join(args.code, "recast.py")):
        cli.fail("--code", f"{args.code} holds no recast.py: give a checkout of the project, "
                 "such as the protocol's worktree (git worktree add DIR COMMIT)",
                 "comparison.py")  # fmt: skip
    {"run": run, "report": report, "archive": archive, "reproduce": reproduce,
     "credit-l1": credit_l1}[args.cmd](args)  # fmt: skip
