"""The units test's verdict (studies/comparison.py: units_ship_lines, units_lines) on made-up
runs, condition by condition against its protocol in docs/results.md ("Protocol (the units
test)"): B per budget and unit system, no lost budget in any of the four cells, no held-out judge
nor the pairwise judge (against B itself) lost in a majority of a cell's budgets, a win over B in
both unit systems of one setting, the tie-break, and a verdict marked provisional until every seed
the protocol decides on is in. Every run is an archive record (no run folders)."""

import argparse
import json
import os
from types import SimpleNamespace

import pytest

from studies import comparison as cmp

CELLS = [(k, u) for k in (5, 6) for u in ("", "x")]  # (setting, unit system): "" native
LEVEL = {"uniform": 0.30, "sum": 0.33, "sumunit": 0.32,  # B is sum unless a test says otherwise
         "perreward": 0.29, "batch": 0.31, "unitjoint": 0.36}  # fmt: skip


def wobble(arm: str, seed: int) -> float:
    """A candidate's seed 1 a little higher, so that its paired SE is not 0."""
    return 0.001 * (seed == 1) * (arm in cmp.CANDIDATES)


def standard(k, u, arm, j, seed):
    """(final λ-weighted gap, judge → final score, pairwise distances or None) of one run."""
    return LEVEL[arm] + 0.01 * seed + wobble(arm, seed), {}, None


def first_line(k: int) -> dict:
    """The base model's eval (epoch 0)."""
    study = cmp.STUDIES[f"setting{k}"]
    return {"epoch": 0, "time": 0.0, **{f"eval/{n}": 0.0 for n in study["names"] + study["judges"]}}


def final_line(k: int, gap: float, judges: dict, distance) -> dict:
    study = cmp.STUDIES[f"setting{k}"]
    line = {"epoch": 20, "time": 0.0, "gap/weighted": gap, "W": [[0.025] * 10] * 4}
    line.update({f"gap/{n}": gap for n in study["names"]})
    line.update({f"eval/{n}": judges.get(n, 0.5) for n in study["names"] + study["judges"]})
    if distance != "absent":  # None: every image equally far from the ideal (the judge ties)
        line["judge/distance"] = [0.3] * 4 if distance is None else distance
    return line


def made_up(tmp_path, value=standard, seeds: int = 3, missing=(), protocol_seeds: int = 3,
            arms=(*cmp.BASELINES, *cmp.CANDIDATES), cells=CELLS):  # fmt: skip
    """An archive of every baseline's and candidate's runs (or `arms`') in the four cells (or
    `cells`; value(k, u, arm, budget index, seed) → the run's numbers), less `missing` ((budget,
    arm, seed)); the args of `report --study setting6 --seeds protocol_seeds`."""
    path = tmp_path / "runs.jsonl"
    with open(path, "w") as f:
        for j, lam in enumerate(cmp.BUDGETS):
            for k, u in cells:
                for a in arms:
                    for s in range(seeds):
                        if (lam, f"t{k}{u}-{a}", s) in missing:
                            continue
                        lines = [first_line(k), final_line(k, *value(k, u, a, j, s))]
                        name = os.path.basename(cmp.folder("", lam, f"t{k}{u}-{a}", s))
                        f.write(json.dumps({"run": name, "lines": lines}) + "\n")
    return argparse.Namespace(out=str(tmp_path / "sweep"), archive=str(path),
                              seeds=protocol_seeds, code=cmp.ROOT, study="setting6")  # fmt: skip


def ship(args) -> list[str]:
    return cmp.units_ship_lines(SimpleNamespace(args=args))


def qualifies(lines: list[str], arm: str) -> bool:
    line = next(x for x in lines if x.startswith(f"- {arm}: no budget lost"))
    return line.endswith(": qualifies")


def test_standard_runs_ship_unit_joint_and_only_it(tmp_path):
    """The baseline for the rest: unit-joint 0.03 above B (sum) everywhere qualifies; per-reward
    and batch lose to B everywhere; every run in: no "so far"."""
    lines = ship(made_up(tmp_path))
    assert [qualifies(lines, a) for a in cmp.CANDIDATES] == [False, False, True]
    assert lines[-1] == "- --normalize unit-joint becomes the default"


def test_b_is_the_best_baseline_by_mean_gap_per_budget_and_unit_system(tmp_path):
    """Natively, uniform is best in the first budget, sumunit in the second, and in the third sum
    has the best seed 0 but sumunit the best mean; in changed units sum is best everywhere."""

    def value(k, u, arm, j, seed):
        gap = LEVEL[arm] + 0.01 * seed + wobble(arm, seed)
        if not u and j == 0 and arm == "uniform":
            gap = 0.34 + 0.01 * seed
        if not u and j == 1 and arm == "sumunit":
            gap = 0.335 + 0.01 * seed
        if not u and j == 2 and arm in ("sum", "sumunit"):
            gap = {"sum": (0.40, 0.30, 0.30), "sumunit": (0.33, 0.34, 0.35)}[arm][seed]
        return gap, {}, None

    lines = ship(made_up(tmp_path, value))
    native = next(x for x in lines if x.startswith("- setting 5 native, unitjoint against B: "))
    budgets = native.split(": ", 1)[1].split("; ")
    assert [b.split(" ")[1] for b in budgets[:5]] == [
        "(uniform)", "(sumunit)", "(sumunit)", "(sum)", "(sum)"]  # fmt: skip
    changed = next(x for x in lines if x.startswith("- setting 5 changed units, unitjoint "))
    assert changed.count("(sum)") == 5
    assert qualifies(lines, "unitjoint") and lines[-1] == (
        "- --normalize unit-joint becomes the default")  # fmt: skip


@pytest.mark.parametrize("cell", CELLS)
def test_one_budget_lost_in_one_cell_keeps_a_candidate_out(tmp_path, cell):
    def value(k, u, arm, j, seed):
        gap = LEVEL[arm] + 0.01 * seed + wobble(arm, seed)
        if (k, u) == cell and j == 3 and arm == "unitjoint":
            gap = LEVEL["sum"] - 0.01 + 0.01 * seed + wobble(arm, seed)  # a loss to B (sum)
        return gap, {}, None

    lines = ship(made_up(tmp_path, value))
    assert not qualifies(lines, "unitjoint")
    assert lines[-1] == "- none qualifies: joint stays the default"


@pytest.mark.parametrize("lost,ships", [(2, True), (3, False)])
def test_a_held_out_judge_lost_in_a_majority_of_a_cells_budgets_keeps_it_out(tmp_path, lost, ships):
    """Setting 6 in changed units: texture (held out there) lost to B in `lost` budgets. Size,
    which setting 6 trains on, is no judge there: its eval score lost everywhere counts for
    nothing."""

    def value(k, u, arm, j, seed):
        judges = {}
        if (k, u) == (6, "x") and arm == "unitjoint":
            judges["size"] = 0.3  # a training reward's eval score, not a judge
            if j < lost:
                judges["texture"] = 0.45 - 0.001 * (seed == 1)
        return LEVEL[arm] + 0.01 * seed + wobble(arm, seed), judges, None

    lines = ship(made_up(tmp_path, value))
    cell = next(x for x in lines if x.startswith("- setting 6 changed units, unitjoint against"))
    assert cell.endswith("judges lost in most budgets: " + ("none" if ships else "texture"))
    assert qualifies(lines, "unitjoint") is ships


@pytest.mark.parametrize("lost,ships", [(2, True), (3, False)])
def test_the_pairwise_judge_compares_the_candidate_with_b_itself(tmp_path, lost, ships):
    """Pairwise distances (1 − SSIM to the ideal, smaller preferred): B (sum) 0.1, uniform 0.5,
    sumunit 0.3; the candidate at 0.2 in `lost` budgets of setting 5 natively, preferred to uniform
    and to sumunit there but not to B, so the pairwise judge loses to B; 0.1 (B's) elsewhere."""
    level = {"uniform": 0.5, "sum": 0.1, "sumunit": 0.3, "perreward": 0.1, "batch": 0.1}

    def value(k, u, arm, j, seed):
        if arm != "unitjoint":
            distance = [level[arm]] * 4
        elif (k, u) == (5, "") and j < lost:  # seed 1: one image of four closer than B's
            distance = [0.2, 0.2, 0.2, 0.05 if seed == 1 else 0.2]
        else:
            distance = [0.1] * 4
        return LEVEL[arm] + 0.01 * seed + wobble(arm, seed), {}, distance

    lines = ship(made_up(tmp_path, value))
    cell = next(x for x in lines if x.startswith("- setting 5 native, unitjoint against B: "))
    assert cell.endswith("judges lost in most budgets: " + ("none" if ships else "pairwise"))
    assert qualifies(lines, "unitjoint") is ships


@pytest.mark.parametrize("beaten,ships", [
    ({(5, ""), (5, "x")}, True), ({(6, ""), (6, "x")}, True), (set(CELLS), True),
    ({(5, ""), (6, "x")}, False), ({(5, "")}, False), (set(), False)])  # fmt: skip
def test_it_must_beat_b_in_both_unit_systems_of_one_setting(tmp_path, beaten, ships):
    """unit-joint 0.03 above B in the `beaten` cells, level with it (ties) in the others."""

    def value(k, u, arm, j, seed):
        gap = LEVEL[arm] + 0.01 * seed + wobble(arm, seed)
        if arm == "unitjoint":
            gap = LEVEL["sum"] + 0.03 * ((k, u) in beaten) + 0.01 * seed + wobble(arm, seed)
        return gap, {}, None

    lines = ship(made_up(tmp_path, value))
    assert qualifies(lines, "unitjoint") is ships
    assert lines[-1] == ("- --normalize unit-joint becomes the default" if ships else
                         "- none qualifies: joint stays the default")  # fmt: skip


@pytest.mark.parametrize("perreward,unitjoint,shipped", [
    (0.37, 0.36, "per-reward"), (0.36, 0.37, "unit-joint")])  # fmt: skip
def test_of_two_that_qualify_the_higher_mean_gap_over_the_four_cells_ships(
        tmp_path, perreward, unitjoint, shipped):  # fmt: skip
    """Both above B everywhere; in setting 6 natively the lower one's lead is larger, but the
    mean over the four cells decides."""
    level = {**LEVEL, "perreward": perreward, "unitjoint": unitjoint}
    low = "perreward" if perreward < unitjoint else "unitjoint"

    def value(k, u, arm, j, seed):
        gap = level[arm] + 0.01 * seed + wobble(arm, seed)
        if arm == low and (k, u) == (6, ""):
            gap += 0.02  # its best cell: 0.01 above the other there, 0.005 below on the mean
        return gap, {}, None

    lines = ship(made_up(tmp_path, value))
    assert qualifies(lines, "perreward") and qualifies(lines, "unitjoint")
    assert not qualifies(lines, "batch")
    assert lines[-1] == f"- --normalize {shipped} becomes the default"


def test_runs_without_the_pairwise_judges_distances_decide_nothing(tmp_path):
    """A cell whose runs lack the distances would count no pairwise loss; the verdict says it
    cannot decide rather than letting the judge pass unread."""

    def value(k, u, arm, j, seed):
        gap, judges, _ = standard(k, u, arm, j, seed)
        return gap, judges, "absent" if (k, u, j) == (6, "x", 3) else None

    lines = ship(made_up(tmp_path, value))
    assert lines[-1].endswith("(undecided: some budget's runs lack the pairwise judge's distances)")


def test_a_missing_run_makes_the_verdict_provisional(tmp_path):
    missing = {(cmp.BUDGETS[2], "t5x-sumunit", 2)}
    lines = ship(made_up(tmp_path, missing=missing))
    assert lines[-1].endswith("(so far: not every run is finished, this decides nothing)")


@pytest.mark.parametrize("seeds", [1, 2])
def test_the_verdict_is_provisional_with_fewer_seeds_than_the_protocol(tmp_path, seeds):
    """`run --study setting6 --seeds N` (the sittings' command, N = 1, 2, 3) ends with the report
    of args.seeds = N, and so does `report --seeds N`. The protocol decides on seeds 0–2: with
    every run of seeds 0 … N−1 in and N < 3, the verdict must be marked provisional (it was
    once printed unmarked, counted against --seeds)."""
    lines = ship(made_up(tmp_path, seeds=seeds, protocol_seeds=seeds))
    assert lines[-1].endswith("(so far: not every run is finished, this decides nothing)")


def test_how_far_each_rule_moved_is_changed_minus_native_paired_by_seed(tmp_path):
    """units_lines: per budget, changed − native paired within seed (its SE from the per-seed
    differences, not from the two arms' spreads), and the largest |difference| of one run."""
    native = {lam: [0.30, 0.40, 0.50] for lam in cmp.BUDGETS}
    moved = {lam: [0.32, 0.41, 0.52] for lam in cmp.BUDGETS}
    moved[cmp.BUDGETS[4]] = [0.30, 0.40, 0.44]  # one run 0.06 lower
    gap = {}
    for lam in cmp.BUDGETS:
        gap[lam, "t6-uniform"], gap[lam, "t6x-uniform"] = native[lam], moved[lam]
        gap[lam, "t6-unitjoint"], gap[lam, "t6x-unitjoint"] = native[lam], native[lam]
    arms = ["t6-uniform", "t6-unitjoint", "t6x-uniform", "t6x-unitjoint"]
    r = SimpleNamespace(args=SimpleNamespace(study="setting6"), budgets=cmp.BUDGETS, gap=gap,
                        arms=arms, out_dir=str(tmp_path))  # fmt: skip
    lines = cmp.units_lines(r)
    assert (tmp_path / "units.png").stat().st_size > 0 and lines[-1].startswith("- units.png")
    assert "(--reward-scale 0.1,0.1,10,1)" in lines[1]
    uniform = next(x for x in lines if x.startswith("- uniform: "))
    assert uniform == ("- uniform: " + "+0.0167 ± 0.0033 win; " * 4 + "-0.0200 ± 0.0200 tie; "
                       "largest |difference| of one run 0.0600")  # fmt: skip
    unitjoint = next(x for x in lines if x.startswith("- unitjoint: "))
    assert unitjoint == ("- unitjoint: " + "; ".join(["+0.0000 ± 0.0000 tie"] * 5)
                         + "; largest |difference| of one run 0.0000")  # fmt: skip
    assert not any(x.startswith("- sum: ") for x in lines)  # an arm not in the report: no line


def test_the_report_pairs_each_arm_with_uniform_in_its_own_units(tmp_path):
    """The protocol's rule is applied "for every arm against uniform in its own units": a
    changed-units arm against t6x-uniform, not against native t6-uniform. Here uniform drops 0.05
    in changed units and batch does not: against uniform in its own units batch wins in every
    budget (against t6-uniform, as every arm was once paired, it ties)."""
    level = {"uniform": 0.30, "sum": 0.33, "sumunit": 0.32, "joint": 0.33, "perreward": 0.31,
             "batch": 0.30, "unitjoint": 0.33}  # fmt: skip

    def value(k, u, arm, j, seed):
        gap = level[arm] - 0.05 * (arm == "uniform" and u == "x") + 0.01 * seed
        return gap + wobble(arm, seed), {}, None

    args = made_up(tmp_path, value, arms=list(cmp.UNIT_ARMS), cells=[(6, ""), (6, "x")])
    cmp.report(args)
    table = open(os.path.join(args.out, "setting6", "table.md")).read().splitlines()
    line = next(x for x in table if x.startswith("- t6x-batch: "))
    assert line.startswith("- t6x-batch: 5 win") and line.endswith("beats t6x-uniform")
    assert any(x.startswith("- t6x-batch − t6x-uniform, gap/color: 5 win") for x in table)
