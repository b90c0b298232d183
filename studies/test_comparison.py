"""Tests of studies/comparison.py on made-up runs: the pre-registered win/tie/loss rule, the
"beats uniform" count across budgets, and that the archive rebuilds the same report without the
run folders."""

import argparse
import json
import os
import shutil

import pytest

from studies import comparison as cmp

# Per arm, the final λ-weighted gap's offset from uniform's in seeds 0 and 1 (every budget).
OFFSETS = {
    "uniform": (0.0, 0.0),
    "recast-tau1": (0.05, 0.06),  # mean +0.055, paired SE 0.005: a win
    "recast-tau0.5": (0.03, -0.02),  # mean +0.005, SE 0.025: a tie
    "recast-tau0.25": (0.01, 0.011),  # mean +0.0105, SE 0.0005: a (small) win
    "reversed-tau0.25": (-0.10, -0.12),  # a loss
    "sum": (0.0, 0.0),  # identical to uniform: SE 0, difference 0, a tie
    "recast-shift1": (0.08, 0.10),  # over recast-tau1: +0.03, +0.04, SE 0.005: a win
    "recast-shift2": (0.10, 0.12),  # over recast-tau1: +0.05, +0.06: a larger win
}
IOU = {"recast-shift2": (-0.05, -0.06)}  # final iou's offset from every other arm's: a judge loss


def write_run(path: str, lines: list[dict]) -> None:
    """A finished run folder: its metrics.jsonl lines and a summary.json."""
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)
    with open(os.path.join(path, "summary.json"), "w") as f:
        f.write("{}")


def fake_run(path: str, lam_index: int, arm: str, seed: int) -> None:
    """metrics.jsonl with an eval every 2 epochs up to epoch 4, and summary.json (finished)."""
    os.makedirs(path)
    final = 0.30 + 0.01 * lam_index + 0.02 * seed + OFFSETS[arm][seed]
    names = cmp.NAMES + cmp.JUDGES
    lines = [{"epoch": 0, **{f"eval/{n}": -1.0 for n in names}}]
    for epoch in range(1, 5):
        m = {"epoch": epoch, "time/rollout": 1.0, "time/update": 2.0, "W": [[0.025] * 10] * 4}
        if epoch % 2 == 0:
            m.update({f"eval/{n}": -1.0 + epoch / 10 for n in names})
            m["eval/iou"] += IOU.get(arm, (0.0, 0.0))[seed] * epoch / 4
            m.update({f"gap/{n}": epoch / 40 for n in names})
            m["gap/weighted"] = final * epoch / 4
        lines.append(m)
    write_run(path, lines)


@pytest.fixture
def sweep(tmp_path):
    out = tmp_path / "sweep"
    for j, lam in enumerate(cmp.BUDGETS):
        for arm in OFFSETS:  # the tau and shift studies' arms
            for seed in (0, 1):
                fake_run(cmp.folder(str(out), lam, arm, seed), j, arm, seed)
    return argparse.Namespace(
        out=str(out), archive=str(tmp_path / "runs.jsonl"), seeds=2, code=cmp.ROOT, study="tau"
    )


def test_verdict_is_the_pre_registered_rule():
    assert cmp.verdict(0.041, 0.02) == "win" and cmp.verdict(-0.041, 0.02) == "loss"
    assert cmp.verdict(0.039, 0.02) == "tie" and cmp.verdict(-0.039, 0.02) == "tie"
    assert cmp.verdict(0.1, float("nan")) == "n/a"  # one seed: no verdict
    assert cmp.paired([0.35, 0.37], [0.30, 0.31]) == pytest.approx((0.055, 0.005))


def test_report_counts_budgets_and_the_archive_rebuilds_it(sweep, capsys):
    cmp.report(sweep)
    table = open(os.path.join(sweep.out, "tau", "table.md")).read()
    assert "- recast-tau1: 5 win, 0 tie, 0 loss, 0 n/a; mean paired difference +0.055; beats" in (
        table
    )
    assert "- recast-tau0.5: 0 win, 5 tie, 0 loss, 0 n/a" in table
    assert "- recast-tau0.25: 5 win, 0 tie, 0 loss, 0 n/a" in table
    lost = "- reversed-tau0.25: 0 win, 0 tie, 5 loss, 0 n/a; mean paired difference -0.110; does"
    assert lost in table
    assert "- sum: 0 win, 5 tie, 0 loss" in table
    assert "Partial" not in table and "so far" not in table  # every seed of the protocol is done
    # epochs to 90 % of uniform's final gap: uniform reaches it at its last eval, reversed never
    row = next(r for r in table.splitlines() if r.startswith("| 0.4,0.2,0.2,0.2 | reversed"))
    assert row.endswith("| inf | inf |"), row
    row = next(r for r in table.splitlines() if r.startswith("| 0.4,0.2,0.2,0.2 | uniform"))
    assert row.endswith("| 4 | 12 |"), row  # 4 epochs of 3 s
    # the placement control, paired within seeds: recast-tau0.25 − reversed: +0.110 and +0.131
    placed = "- placement control (pre-registered), λ = 0.2,0.2,0.2,0.4: recast-tau0.25 − "
    assert placed + "reversed-tau0.25 = +0.121 ± 0.010, win" in table
    explore = "λ = 0.4,0.2,0.2,0.2: recast-tau0.5 − recast-tau1 = -0.050 ± 0.030, tie"
    assert explore in table
    # uniform's gap rises linearly: from epoch 2 to 4 it gains half its final value
    assert "- λ = 0.4,0.2,0.2,0.2: +0.155" in table  # seeds 0, 1: (0.30 − 0.15, 0.32 − 0.16)
    for figure in ("curves.png", "dose.png", "weights.png"):
        assert os.path.getsize(os.path.join(sweep.out, "tau", figure)) > 0

    cmp.archive(sweep)
    shutil.rmtree(os.path.join(sweep.out, "runs"))
    os.remove(os.path.join(sweep.out, "tau", "table.md"))
    cmp.report(sweep)
    assert open(os.path.join(sweep.out, "tau", "table.md")).read() == table


def test_an_unfinished_seed_is_left_out(sweep):
    os.remove(os.path.join(cmp.folder(sweep.out, cmp.BUDGETS[0], "sum", 1), "summary.json"))
    cmp.report(sweep)
    table = open(os.path.join(sweep.out, "tau", "table.md")).read()
    rows = [r for r in table.splitlines() if r.startswith(f"| {cmp.BUDGETS[0]} |")]
    assert rows and all(r.split(" | ")[2] == "1" for r in rows)  # seed 0 only in that budget
    assert "- recast-tau1: 4 win, 0 tie, 0 loss, 1 n/a" in table and "(so far)" in table
    assert "**Partial, not a result:** finished seeds per budget (0.4,0.2,0.2,0.2: 1, " in table


def test_run_skips_finished_and_archived_runs_and_stops_at_the_deadline(sweep, monkeypatch):
    import types

    started = []
    fake = lambda cmd, **kw: started.append(cmd) or types.SimpleNamespace(returncode=0)  # noqa: E731
    monkeypatch.setattr(cmp.subprocess, "run", fake)
    unfinished = cmp.folder(sweep.out, cmp.BUDGETS[0], "sum", 1)
    os.remove(os.path.join(unfinished, "summary.json"))
    sweep.stop_after = 0.0  # the sitting is over before it starts: nothing new is started
    cmp.run(sweep)
    assert started == []
    assert len(cmp.read_archive(sweep.archive)) == 79  # every finished run of both studies
    sweep.stop_after, sweep.code = 60.0, "/pinned/checkout"  # --code: the commit a sweep keeps
    cmp.run(sweep)
    assert len(started) == 1 and started[0][1] == "/pinned/checkout/recast.py"
    assert started[0][started[0].index("--out") + 1] == unfinished
    assert started[0][started[0].index("--weighting") + 1] == "sum"
    # Another machine: the run folders are gone, the archive is not. Only the unfinished run,
    # which the archive does not hold, is started again.
    shutil.rmtree(os.path.join(sweep.out, "runs"))
    cmp.run(sweep)
    assert len(started) == 2 and started[1][started[1].index("--out") + 1] == unfinished


def test_a_failed_run_starts_no_other_and_the_finished_are_archived(sweep, monkeypatch, capsys):
    """A run that fails (exit 1) stops the queue: no run starts after it (the queue ran on for
    hours, then ended in a traceback without archiving), those finished are archived, exit 1
    naming its log."""
    import types

    started = []
    fake = lambda cmd, **kw: started.append(cmd) or types.SimpleNamespace(returncode=1)  # noqa: E731
    monkeypatch.setattr(cmp.subprocess, "run", fake)
    for arm in ("sum", "uniform", "recast-tau1"):
        os.remove(os.path.join(cmp.folder(sweep.out, cmp.BUDGETS[0], arm, 1), "summary.json"))
    sweep.stop_after = 60.0
    with pytest.raises(SystemExit) as e:
        cmp.run(sweep)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "failed (exit 1); see " in err and "are archived" in err
    assert 1 <= len(started) <= 2  # the two workers' first runs at most; the third never starts
    assert len(cmp.read_archive(sweep.archive)) == 77


def test_an_eval_at_the_epoch_a_stopped_run_ended_is_not_one_of_the_protocols():
    """A run stopped after epoch 3 (the sweep paused) evaluated there too and resumed: its record
    held 11 evals, the others 10, and the report's curves ended in a ValueError. Only the evals
    every EVAL_EVERY epochs count, in the curves and in the epochs to 90 %."""
    lines = [{"epoch": 0, "time": 0.0}] + [
        {"epoch": e, "time": 1.0, **({"gap/weighted": e / 10} if e % 2 == 0 or e == 3 else {})}
        for e in range(1, 7)]  # fmt: skip
    assert [m["epoch"] for m in cmp.evals(lines)] == [2, 4, 6]
    assert cmp.to_reach(lines, 0.3) == (4, 4.0)  # not epoch 3's extra eval


def test_shift_study_prints_judge_lines_and_applies_the_decision_rule(sweep):
    sweep.study = "shift"
    cmp.report(sweep)
    table = open(os.path.join(sweep.out, "shift", "table.md")).read()
    assert "- recast-shift1: 5 win, 0 tie, 0 loss, 0 n/a; mean paired difference +0.090; beats" in (
        table
    )
    # the rule per budget on each training reward and judge, against uniform and recast-tau1
    assert (
        "- recast-shift2 − uniform, eval/iou: 0 win, 0 tie, 5 loss (-0.055 ± 0.005 loss;" in table
    )
    assert "- recast-shift1 − recast-tau1, eval/iou: 0 win, 5 tie, 0 loss" in table
    assert "- recast-shift1 − uniform, gap/position: 0 win, 5 tie, 0 loss" in table
    # shift 2 beats recast-tau1 by more, but loses iou in 5 budgets where recast-tau1 loses none
    assert "- recast-shift1 vs recast-tau1: 5 win, 0 tie, 0 loss, mean +0.035 (beats)" in table
    assert "iou 5 (recast-tau1 0) budgets: does not qualify" in table
    assert "- default: --gain-shift 1 (recast-shift1)" in table
    assert "recast-tau0.5" not in table  # the other study's arms stay out


def test_shift_study_without_a_qualifier_keeps_the_default(sweep):
    sweep.study = "shift"
    for lam in cmp.BUDGETS:  # shift 1 now equals recast-tau1: ties everywhere
        for seed in (0, 1):
            path = cmp.folder(sweep.out, lam, "recast-shift1", seed)
            shutil.rmtree(path)
            shutil.copytree(cmp.folder(sweep.out, lam, "recast-tau1", seed), path)
    cmp.report(sweep)
    table = open(os.path.join(sweep.out, "shift", "table.md")).read()
    assert "- default: --gain-shift 0 (none qualifies: unchanged)" in table


def test_scoring_study_reports_w_error_per_epoch(sweep):
    """The scoring study: one budget; W's L1 distance from full scoring's, epoch by epoch."""
    sweep.study = "scoring"
    for arm, bump in (("recast-frac1", 0.0), ("recast-frac0.5", 0.01), ("recast-frac0.25", 0.02),
                      ("recast-frac0.125", 0.04), ("recast-every2", 0.0)):  # fmt: skip
        for seed in (0, 1):
            path = cmp.folder(sweep.out, cmp.BUDGETS[0], arm, seed)
            fake_run(path, 0, "recast-tau1", seed)
            lines = cmp.read_metrics(path)
            for m in lines[1:]:  # W moves off λ/T by bump·epoch in two cells
                m["W"] = [row[:] for row in m["W"]]
                m["W"][0][0] += bump * m["epoch"]
                m["W"][1][0] -= bump * m["epoch"]
            with open(os.path.join(path, "metrics.jsonl"), "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in lines)
    cmp.report(sweep)
    table = open(os.path.join(sweep.out, "scoring", "table.md")).read()
    assert "Partial" not in table  # one budget is the whole study
    assert "- λ = 0.4,0.2,0.2,0.2, recast-frac0.125: epoch 1 0.080, " in table  # 2 · 0.04 · 1
    assert "- λ = 0.4,0.2,0.2,0.2, recast-every2: epoch 1 0.000, " in table
    assert "the noise floor (full scoring, seed against seed, every epoch): mean 0.000" in table
    assert os.path.getsize(os.path.join(sweep.out, "scoring", "w_error.png")) > 0


def fake_setting_run(path: str, arm: str, seed: int, images=None, bump: float = 0.0) -> None:
    """A finished run of a settings study (#32): setting 1's or 2's rewards and judges, an eval
    every 2 epochs up to 4, and its final eval images when given."""
    from plumbing import eval_images
    from worlds import toyworld as tw

    study = cmp.STUDIES["setting2" if arm.startswith("s2") else "setting1"]
    names = study.get("names", cmp.NAMES) + study["judges"]
    os.makedirs(path)
    final = 0.30 + 0.02 * seed + bump
    lines = [{"epoch": 0, **{f"eval/{n}": -1.0 for n in names}}]
    for epoch in range(1, 5):
        m = {"epoch": epoch, "time/update": 2.0, "W": [[0.025] * 10] * 4}
        if epoch % 2 == 0:
            m.update({f"eval/{n}": -1.0 + epoch / 10 for n in names})
            m.update({f"gap/{n}": epoch / 40 for n in names})
            m["gap/weighted"] = final * epoch / 4
        lines.append(m)
    write_run(path, lines)
    if images is not None:
        prompts = tw.HELDOUT_PROMPTS[:4]
        index = {"epoch": 4, "prompts": prompts, "noise_sha256": "same"}
        eval_images.save(path, images(prompts), 0, index, rank=0)


def test_setting2_prints_the_pairwise_judge_and_setting1_its_reproduction(tmp_path):
    """Setting 2: ReCAST's eval images are the ideal renderings, uniform's blurred ones: the
    pairwise judge prefers ReCAST's in every pair of every seed (a win in every budget) and
    sum's not at all; the distances ride in the archive. Setting 1: the reruns against the
    archived runs they repeat, one of them off by 1e-4."""
    from worlds import toyworld as tw

    ideal = tw.render
    blurred = lambda p: tw.blur(tw.render(p).flatten(0, 1), 1.5).view(len(p), 3, 32, 32)  # noqa: E731
    out = tmp_path / "sweep"
    for lam in cmp.BUDGETS:
        for seed in (0, 1):
            for arm, images, bump in (("s2-uniform", blurred, 0.0), ("s2-recast", ideal, 0.01),
                                      ("s2-sum", blurred, 0.0), ("s1-uniform", None, 0.0),
                                      ("s1-recast", None, 0.0), ("uniform", None, 0.0),
                                      ("recast-shift1", None, 0.0)):  # fmt: skip
                fake_setting_run(cmp.folder(str(out), lam, arm, seed), arm, seed, images, bump)
    args = argparse.Namespace(out=str(out), archive=str(tmp_path / "runs.jsonl"), seeds=2,
                              code=cmp.ROOT, study="setting2")  # fmt: skip
    cmp.report(args)
    table = open(os.path.join(str(out), "setting2", "table.md")).read()
    assert "| λ | arm | seeds | λ-weighted gap | vs s2-uniform (paired) | verdict | size |" in table
    assert (
        "- s2-recast: 5 win, 0 tie, 0 loss, 0 n/a; mean paired difference +0.010; beats s2-"
        in table
    )
    assert "- s2-recast − s2-uniform, eval/position: 0 win, 5 tie, 0 loss" in table  # a judge
    assert "- s2-recast − s2-uniform, gap/outline: 0 win, 5 tie, 0 loss" in table
    assert "- s2-recast over s2-uniform, pairwise judge (preference rate; − ½ ± SE): 5 win, " in (
        table
    )
    assert "1.000 (+0.500 ± 0.000) win" in table
    assert (
        "1. training rewards improve or match: λ-weighted gap 5/0/0, mean +0.010, beats: shown"
        in (table)
    )
    assert "2. every held-out judge improves: shape 0/5/0 matches, iou 0/5/0 matches," in table
    assert ": 0 of 6 beat s2-uniform: not shown" in table
    assert "3. the independent judge prefers s2-recast: pairwise 5/0/0, beats ½: shown" in table
    # the made-up W is 0.025 everywhere: uniform for equal λ, 0.30 from λ/T for 0.4,0.2,0.2,0.2
    assert "- λ = 0.25,0.25,0.25,0.25 (2 seeds): 0.00 → 0.00" in table
    assert "- λ = 0.4,0.2,0.2,0.2 (2 seeds): 0.30 → 0.30" in table
    assert os.path.getsize(os.path.join(str(out), "setting2", "w_settings.png")) > 0
    assert "- s2-sum over s2-uniform, pairwise judge (preference rate; − ½ ± SE): 0 win, 5 tie" in (
        table
    )
    cmp.archive(args)
    kept = cmp.read_archive(args.archive)
    name = os.path.basename(cmp.folder("", cmp.BUDGETS[0], "s2-recast", 0))
    assert len(kept[name][-1]["judge/distance"]) == 4  # 8-bit PNGs of the ideal: about 0
    assert max(kept[name][-1]["judge/distance"]) < 1e-3
    shutil.rmtree(os.path.join(str(out), "runs"))  # the archive alone rebuilds the same table
    os.remove(os.path.join(str(out), "setting2", "table.md"))
    cmp.report(args)
    assert open(os.path.join(str(out), "setting2", "table.md")).read() == table

    # setting 1: the reruns repeat the archived runs; one value of one run is off by 1e-4
    path = cmp.folder("", cmp.BUDGETS[1], "recast-shift1", 1)
    lines = kept[os.path.basename(path)]
    lines[-1]["eval/iou"] += 1e-4
    with open(args.archive, "w") as f:
        f.writelines(json.dumps({"run": k, "lines": v}) + "\n" for k, v in kept.items())
    args.study = "setting1"
    cmp.report(args)
    table = open(os.path.join(str(out), "setting1", "table.md")).read()
    assert "- s1-uniform against uniform: 10 runs, largest difference 0.0e+00; all within" in table
    assert (
        "- s1-recast against recast-shift1: 10 runs, largest difference 1.0e-04; beyond the "
        in (table)
    )
    assert "0.2,0.4,0.2,0.2 s1 (1.0e-04)" in table
    assert "λ-weighted gap 0/5/0, mean +0.000, matches: shown (matches)" in table
    assert "3. the independent judge prefers it: no eval images' distances: not measured" in table


def dev_run(path: str, arm: str, seed: int, gap: float, judge: float) -> None:
    """A finished made-up run of a development arm: its final gap and every judge's score."""
    studies = {"d1": "dev1", "d2": "dev2", "t3": "setting3", "t4": "setting4", "t5": "setting5",
               "t6": "setting6"}  # fmt: skip
    study = cmp.STUDIES[studies.get(arm[:2], f"credit{arm[1]}")]  # c7-recast: credit7
    names, judges = study.get("names", cmp.NAMES), study["judges"]
    os.makedirs(path)
    last = {"epoch": 2, "gap/weighted": gap, **{f"gap/{n}": gap for n in names},
            **{f"eval/{j}": judge for j in judges}, "W": [[0.025] * 10] * 4}  # fmt: skip
    lines = [{"epoch": 0, **{f"eval/{n}": 0.0 for n in names + judges}}, last]
    write_run(path, lines)


def archived(path: str, distance: list[float]) -> dict:
    """A made-up run folder as the archive keeps it, with its eval images' pairwise-judge
    distances (which a folder's record computes from the images it kept); the folder goes."""
    lines = cmp.record(path)
    lines[-1]["judge/distance"] = distance
    shutil.rmtree(path)
    return {"run": os.path.basename(path), "lines": lines}


@pytest.mark.parametrize("joint_gain,goes", [(0.03, True), (-0.03, False)])
def test_the_development_pick_rule(tmp_path, capsys, joint_gain, goes):
    """Setting 1: ReCAST beats uniform and sum; setting 2: sum beats uniform and ReCAST loses to it
    (as in the archive). A candidate 0.03 above sum everywhere goes to the test; one 0.03 below
    loses more cells than ReCAST as shipped and does not."""
    out = tmp_path / "sweep"
    gaps = {
        "d1-uniform": 0.30,
        "d1-sum": 0.30,
        "d1-recast": 0.34,
        "d1-joint": 0.30 + joint_gain,
        "d2-uniform": 0.30,
        "d2-sum": 0.34,
        "d2-recast": 0.31,
        "d2-joint": 0.34 + joint_gain,
    }
    for lam in cmp.BUDGETS:
        for arm, gap in gaps.items():
            for seed in range(3):
                dev_run(cmp.folder(str(out), lam, arm, seed), arm, seed, gap + 0.01 * seed
                        + 0.001 * (seed == 1) * (arm.endswith("-joint") or arm.endswith("recast")),
                        judge=0.5)  # fmt: skip
    args = argparse.Namespace(out=str(out), archive=str(tmp_path / "none.jsonl"), seeds=3,
                              code=cmp.ROOT, study="dev2")  # fmt: skip
    cmp.report(args)
    table = open(os.path.join(out, "dev2", "table.md")).read()
    assert "- dev2, λ = 0.4,0.2,0.2,0.2: B = d2-sum; joint" in table
    assert "- dev1, λ = 0.4,0.2,0.2,0.2: B = d1-uniform; recast" in table  # a tie: the first
    said = "the candidate goes to the test" if goes else "the candidate does not go to the test"
    assert said in table and "so far" not in table
    assert "ReCAST as shipped (recast): worst d -0.030, loses to B in 5 of 10 cells" in table


@pytest.mark.parametrize("joint_gain,ships", [(0.03, True), (0.0, False)])
def test_the_tests_shipping_rule(tmp_path, joint_gain, ships):
    """Settings 3 and 4: a candidate 0.03 above the better of uniform and sum in every budget of
    both beats it and becomes the default; one that only ties it nowhere beats it and does not."""
    out = tmp_path / "sweep"
    gaps = {"uniform": 0.30, "sum": 0.33, "recast": 0.31, "joint": 0.33 + joint_gain}
    for lam in cmp.BUDGETS:
        for prefix in ("t3-", "t4-"):
            for arm, gap in gaps.items():
                for seed in range(3):
                    wobble = 0.001 * (seed == 1) * (arm in ("joint", "recast"))
                    dev_run(cmp.folder(str(out), lam, prefix + arm, seed), prefix + arm, seed,
                            gap + 0.01 * seed + wobble, judge=0.5)  # fmt: skip
    args = argparse.Namespace(out=str(out), archive=str(tmp_path / "none.jsonl"), seeds=3,
                              code=cmp.ROOT, study="setting4")  # fmt: skip
    cmp.report(args)
    table = open(os.path.join(out, "setting4", "table.md")).read()
    assert "- setting3, t3-joint against B: 0.4,0.2,0.2,0.2 (sum)" in table
    said = "becomes the default" if ships else "does not become the default"
    assert f"- the candidate {said}" in table.splitlines()  # complete: no "so far"
    w_lines = [x for x in table.splitlines() if x.startswith("- t4-") and " → " in x]
    assert [x.split(":")[0] for x in w_lines] == ["- t4-sum", "- t4-recast", "- t4-joint"]


@pytest.mark.parametrize("unit_gain,ships", [(0.03, True), (0.0, False)])
def test_the_units_tests_shipping_rule_and_how_far_each_rule_moved(tmp_path, unit_gain, ships):
    """Settings 5 and 6, both unit systems: the raw sum drops 0.05 in changed units, so B is sum
    natively and the unit-free sum in changed units. unit-joint 0.03 above both everywhere
    qualifies and ships; level with them it beats B nowhere and joint stays. Per-reward and batch
    lose to B and never qualify. The movement lines give each rule's changed − native."""
    out, records = tmp_path / "sweep", []
    gaps = {"uniform": 0.30, "sum": 0.33, "sumunit": 0.32, "joint": 0.33, "perreward": 0.29,
            "batch": 0.31, "unitjoint": 0.33 + unit_gain}  # fmt: skip
    for lam in cmp.BUDGETS:
        for prefix in ("t5-", "t5x-", "t6-", "t6x-"):
            for arm, gap in gaps.items():
                moved = -0.05 * (arm == "sum" and "x" in prefix)
                if arm == "unitjoint" and "x" in prefix:
                    gap = gaps["sumunit"] + unit_gain  # B in changed units is sumunit's 0.32
                for seed in range(3):
                    wobble = 0.001 * (seed == 1) * (arm in cmp.CANDIDATES)
                    path = cmp.folder(str(out), lam, prefix + arm, seed)
                    dev_run(path, prefix + arm, seed, gap + moved + 0.01 * seed + wobble, 0.5)
                    records.append(archived(path, distance=[0.3] * 4))  # the judge: a tie
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    args = argparse.Namespace(out=str(out), archive=str(tmp_path / "runs.jsonl"), seeds=3,
                              code=cmp.ROOT, study="setting6")  # fmt: skip
    cmp.report(args)
    table = open(os.path.join(out, "setting6", "table.md")).read().splitlines()
    assert "- setting 5 native, unitjoint against B: 0.4,0.2,0.2,0.2 (sum)" in "\n".join(table)
    assert "- setting 6 changed units, unitjoint against B: 0.4,0.2,0.2,0.2 (sumunit)" in (
        "\n".join(table))  # fmt: skip
    said = ("--normalize unit-joint becomes the default" if ships else
            "none qualifies: joint stays the default")  # fmt: skip
    assert f"- {said}" in table  # complete: no "so far"
    assert any(x.startswith("- perreward: ") and x.endswith("does not qualify") for x in table)
    moved = next(x for x in table if x.startswith("- sum: -0.0500 ± 0.0000 loss"))
    assert moved.endswith("largest |difference| of one run 0.0500")
    assert next(x for x in table if x.startswith("- joint: +0.0000 ± 0.0000 tie"))


@pytest.mark.parametrize("slope,held", [(0.1, "held"), (-0.1, "did not hold")])
def test_the_profile_prediction_over_the_four_settings(tmp_path, slope, held):
    """ReCAST's gain over uniform (and over sum, 0.01 above uniform) follows the base model's W
    distance in all 20 cells of settings 1–4: ρ 1, the prediction held; against it: ρ −1, not."""
    out = tmp_path / "sweep"
    for study, prefix in cmp.SETTINGS:
        for lam, dist in zip(cmp.BUDGETS, cmp.PROFILE_L1[study], strict=True):
            for arm, gap in (("uniform", 0.30), ("sum", 0.31), ("recast", 0.30 + slope * dist)):
                for seed in range(3):
                    wobble = 0.001 * (seed == 1) * (arm == "recast")
                    dev_run(cmp.folder(str(out), lam, prefix + arm, seed), prefix + arm, seed,
                            gap + 0.01 * seed + wobble, judge=0.5)  # fmt: skip
    args = argparse.Namespace(
        out=str(out),
        archive=str(tmp_path / "none.jsonl"),
        seeds=3,
        code=cmp.ROOT,
        study="setting4",
        arms="t4-uniform,t4-sum,t4-recast",
    )
    cmp.report(args)
    table = open(os.path.join(out, "setting4", "table.md")).read()
    d = cmp.PROFILE_L1["setting3"][0]
    assert (
        f"- setting3, λ = 0.4,0.2,0.2,0.2: distance {d:.2f}; over uniform {slope * d:+.3f}" in table
    )
    rho = "+1.00" if slope > 0 else "-1.00"
    for b, at0 in (("uniform", "+0.000"), ("sum", "-0.010")):
        line = (f"- the distance orders the gain over {b}: ρ {rho} over 20 cells against the "
                f"one-sided 5% permutation threshold 0.38: {held}; least-squares line: gain ≈ "
                f"{slope:+.3f} × distance {at0}")  # fmt: skip
        assert any(x.startswith(line) for x in table.splitlines()), line
    assert os.path.getsize(os.path.join(out, "setting4", "prediction.png")) > 0
    # the four settings side by side: ReCAST against uniform wins (or loses) in every budget of
    # every setting, the judges tie, the candidate was not run, no eval images were kept
    lines = table.splitlines()
    row = next(x for x in lines if x.startswith("| ReCAST − uniform | "))
    word = "5/0/0" if slope > 0 else "0/0/5"
    assert row.count(f"| {word}, ") == 4 and row.count("; loses no judge") == 4, row
    assert "| joint − sum | not run | not run | not run | not run |" in lines
    claim = "beats: shown" if slope > 0 else "loses: not shown"
    assert f"| 1. training rewards improve or match | {claim} | {claim} |" in table
    assert "| 2. every held-out judge improves | 0 of 6 beat: not shown | 0 of 6 beat" in table
    assert "| 3. the pairwise judge prefers ReCAST | not measured | not measured |" in table


def test_arms_keep_the_normalisation_they_were_defined_under(tmp_path):
    """Every arm was defined while per-reward was ReCAST's default: from a recast.py with the
    flag, a recast or reversed arm naming none runs --normalize per-reward; joint, uniform and
    sum arms run as written, and a recast.py from before the flag gets the arm unchanged."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for arm in ("t3-recast", "d2-recast", "recast-shift1", "reversed-tau0.25"):
        assert cmp.flags_for(here, arm) == [*cmp.ARMS[arm], "--normalize", "per-reward"], arm
    for arm in ("t3-joint", "t3-uniform", "t3-sum", "sum"):
        assert cmp.flags_for(here, arm) == cmp.ARMS[arm], arm
    (tmp_path / "recast.py").write_text("class Args:\n    gain_shift: int = 1\n")
    assert cmp.flags_for(str(tmp_path), "t3-recast") == cmp.ARMS["t3-recast"]


@pytest.mark.parametrize("w_gain,word", [(0.02, "W pays"), (0.0, "no difference resolved"),
                                         (-0.02, "W costs")])  # fmt: skip
def test_the_credit_tests_verdicts_pooled_over_settings_7_and_8(tmp_path, w_gain, word):
    """Settings 7 and 8 (5 seeds), 1 and 2 (3; the other in-sample settings not run): recast
    `w_gain` above flat in every cell, ± 0.005 by seed. The pooled interval reads as written;
    reversed 0.05 below recast is the placement control; the judges and the pairwise judge pool
    too; the predictor's ρ follows a made-up CREDIT_L1; settings 3-6 unrun: "so far"; credit.png
    draws the 20 cells that ran."""
    out, records = tmp_path / "sweep", []
    for k in (1, 2, 7, 8):
        for j, lam in enumerate(cmp.BUDGETS):
            for arm in cmp.credit_arms(k):
                base = {"recast": w_gain, "reversed": w_gain - 0.05}.get(arm.split("-")[1], 0.0)
                for seed in range(cmp.CREDIT_SEEDS[k]):
                    wobble = 0.005 * (-1) ** seed * ("recast" in arm)
                    path = cmp.folder(str(out), lam, arm, seed)
                    dev_run(path, arm, seed, 0.3 + base + wobble + 0.001 * j, judge=0.5 + base)
                    near = 0.2 - base  # recast's images nearer the ideal when it gains
                    records.append(archived(path, distance=[near if "recast" in arm else 0.2] * 4))
    with open(tmp_path / "runs.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    args = argparse.Namespace(out=str(out), archive=str(tmp_path / "runs.jsonl"), seeds=5,
                              code=cmp.ROOT, study="credit8")  # fmt: skip
    made_up = {7: (0.1, 0.2, 0.3, 0.4, 0.5), 8: (0.6, 0.7, 0.8, 0.9, 1.0)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cmp, "CREDIT_L1", made_up)
        lines = cmp.credit_lines(cmp.Report(args, cmp.STUDIES["credit8"], [], "", "", {}, {}, {},
                                            [], {}, {}, {}, {}, False))  # fmt: skip
        drawn = cmp.credit_figure(cmp.Report(args, cmp.STUDIES["credit8"], [], "", str(tmp_path),
                                             {}, {}, {}, [], {}, {}, {}, {}, False))  # fmt: skip
    assert "each of the 20 cells" in drawn[-1] and (tmp_path / "credit.png").stat().st_size > 0
    said = "\n".join(lines)
    primary = next(x for x in lines if x.startswith("- primary"))
    assert f"{w_gain + 0.001:+.4f}" in primary and primary.endswith(word), primary  # wobble
    assert "over 10 cells, 50 pairs" in primary
    assert "in-sample, settings 1-6" in said and "over 10 cells, 30 pairs" in said
    assert "- setting 3: recast − flat: no finished cell" in said
    control = next(x for x in lines if x.startswith("- placement control, settings 7 and 8"))
    assert control.endswith("placement matters") and "+0.0510" in control  # recast wobbles
    judge = next(x for x in lines if x.startswith("- settings 7 and 8, judge shape: recast − flat"))
    pair = next(x for x in lines if "pairwise judge: recast's images" in x)
    if word == "no difference resolved":
        assert judge.endswith("no difference resolved") and pair.endswith("no difference resolved")
    else:
        assert judge.endswith("recast higher" if w_gain > 0 else "recast lower")
        assert pair.endswith("prefers recast" if w_gain > 0 else "prefers flat")
    rho = next(x for x in lines if "over settings 7 and 8: Spearman" in x)
    assert "over 10 cells" in rho  # the gains rise by 0.001 a budget in both arms: d is flat
    assert said.endswith("this decides nothing")


def test_the_bootstrap_interval_covers_a_known_mean_and_shrinks_with_more_seeds():
    """bootstrap: the pooled mean is the mean of every pair, its interval lies around it, and
    ten times the seeds narrow it (about √10)."""
    gen = __import__("random").Random(0)
    few = [[0.01 + gen.gauss(0, 0.02) for _ in range(5)] for _ in range(10)]
    many = [[0.01 + gen.gauss(0, 0.02) for _ in range(50)] for _ in range(10)]
    mean, lo, hi = cmp.bootstrap(few)
    assert lo < mean < hi and mean == pytest.approx(sum(map(sum, few)) / 50)
    _, lo2, hi2 = cmp.bootstrap(many)
    assert lo2 < 0.01 < hi2 and (hi2 - lo2) < (hi - lo) / 2
    assert cmp.credit_word(0.001, 0.02) == "W pays" and cmp.credit_word(-0.02, -0.001) == "W costs"
    assert cmp.credit_word(-0.01, 0.01) == "no difference resolved"


@pytest.mark.parametrize("flags, flag", [(["--stop-after", "-1"], "--stop-after"),
                                         (["--seeds", "-2"], "--seeds"),
                                         (["--code", "nowhere"], "--code")])  # fmt: skip
def test_bad_flags_exit_2_naming_the_flag_and_write_nothing(tmp_path, flags, flag):
    """A negative count, or a --code with no recast.py (it ended in a traceback from subprocess),
    exits 2 naming the flag before anything is written or any run starts."""
    import subprocess
    import sys

    out = tmp_path / "out"
    script = os.path.join(cmp.ROOT, "studies", "comparison.py")
    cmd = [sys.executable, script, "run", "--study", "credit7", "--out", str(out), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"comparison.py: error: {flag}: ") and not out.exists()
