"""Tests of studies/summarize.py on made-up runs: the worst seed per row and the counts of
runs in which each reward and judge ends above the base model; runs that are not the seeds of
one configuration (other rewards, judges or method flags) exit 2 naming what differs; its
spearman, with anatomy.py's settled_step that reads it."""

import json
import os

import pytest

from studies import summarize

NAMES = ["position", "background", "iou"]


def fake_run(path, seed: int, final: dict[str, float]) -> str:
    """A finished run: args.json, and metrics.jsonl with the base model and one eval."""
    os.makedirs(path)
    with open(os.path.join(path, "args.json"), "w") as f:
        json.dump({"seed": seed, "rewards": "position,background"}, f)
    base = {"epoch": 0, **{f"eval/{n}": 0.0 for n in NAMES}, **{f"ideal/{n}": 1.0 for n in NAMES}}
    last = {"epoch": 1, "W": [[0.25, 0.25], [0.25, 0.25]], "time/update": 1.0}
    last.update({f"eval/{n}": v for n, v in final.items()})
    last.update({f"gap/{n}": v for n, v in final.items()})
    last["gap/weighted"] = (final["position"] + final["background"]) / 2
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in (base, last))
    return str(path)


def test_worst_seed_and_improvement_counts(tmp_path, capsys):
    runs = [
        fake_run(tmp_path / "a", 0, {"position": 0.5, "background": 0.10, "iou": 0.2}),
        fake_run(tmp_path / "b", 1, {"position": 0.4, "background": 0.05, "iou": 0.3}),
        fake_run(tmp_path / "c", 7, {"position": 0.6, "background": -0.01, "iou": 0.1}),
    ]
    summarize.main(runs)
    out = capsys.readouterr().out
    assert "| position | +0.000 | +0.500 ± 0.100 | +0.500 ± 0.100 | +0.400 (seed 1) |" in out
    assert "| background | +0.000 |" in out and "| -0.010 (seed 7) |" in out
    assert "| **λ-weighted** | | | **+0.273 ± 0.042** | +0.225 (seed 1) | |" in out
    assert "  position improves in 3 of 3 runs\n" in out
    assert "  background improves in 2 of 3 runs (not in seed 7)" in out
    assert "  iou improves in 3 of 3 runs\n" in out
    assert "| seed | position | background | iou | λ-weighted |" in out  # every run, by seed
    rows = [line for line in out.splitlines() if line.startswith(("| 0 |", "| 1 |", "| 7 |"))]
    assert rows == ["| 0 | +0.500 | +0.100 | +0.200 | +0.300 |",
                    "| 1 | +0.400 | +0.050 | +0.300 | +0.225 |",
                    "| 7 | +0.600 | -0.010 | +0.100 | +0.295 |"]  # fmt: skip


def test_a_folder_that_is_not_a_run_or_not_yet_evaluated_exits_2_naming_it(tmp_path, capsys):
    good = fake_run(tmp_path / "a", 0, {"position": 0.5, "background": 0.1, "iou": 0.2})
    (tmp_path / "empty").mkdir()
    base_only = fake_run(tmp_path / "b", 1, {"position": 0.5, "background": 0.1, "iou": 0.2})
    with open(os.path.join(base_only, "metrics.jsonl")) as f:
        first = f.readline()
    with open(os.path.join(base_only, "metrics.jsonl"), "w") as f:
        f.write(first)  # --epochs 0, or a run before its first eval
    for runs, said in (([good, str(tmp_path / "empty")], "is not a run folder (no args.json)"),
                       ([str(tmp_path / "nope")], "is not a run folder (no args.json)"),
                       ([good, base_only], "has no eval after training yet"),
                       ([], "give one or more run folders")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            summarize.main(runs)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("summarize.py: error: RUN: ") and said in err
        assert err.count("\n") == 1


def test_runs_of_other_rewards_or_judges_exit_2_naming_the_run(tmp_path, capsys):
    """Runs trained or judged on other rewards than the first ended in a KeyError traceback (its
    rows looked up under the first run's names), or a shape error in W's check."""
    final = {"position": 0.5, "background": 0.1, "iou": 0.2}
    good = fake_run(tmp_path / "a", 0, final)
    judged = fake_run(tmp_path / "b", 1, final)  # judged on color, not iou
    text = (tmp_path / "b" / "metrics.jsonl").read_text()
    (tmp_path / "b" / "metrics.jsonl").write_text(text.replace("/iou", "/color"))
    trained = fake_run(tmp_path / "c", 2, final)  # three rewards trained on: three rows of W
    lines = [json.loads(x) for x in (tmp_path / "c" / "metrics.jsonl").read_text().splitlines()]
    lines[1]["W"] = [[0.1, 0.1], [0.1, 0.1], [0.3, 0.3]]
    (tmp_path / "c" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    cases = {
        judged: "on position, background, color (2 trained on, W's rows)",
        trained: "on position, background, iou (3 trained on, W's rows)",
    }
    for run, said in cases.items():
        with pytest.raises(SystemExit) as e:
            summarize.main([good, run])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith(f"summarize.py: error: RUN: {run} is evaluated {said}, {good} on ")


def test_runs_of_another_method_exit_2_naming_the_flags(tmp_path, capsys):
    """Runs of other --lambda, --steps, --weighting, --normalize… were averaged together as if
    they were seeds of one configuration. Every flag but --seed, those --resume may change
    (--out, --epochs…) and the memory-only ones must match the first run's, --lambda as its
    normalised budgets; a flag an older run predates takes its value before it existed
    (harness.BEFORE), as on --resume."""
    final = {"position": 0.5, "background": 0.1, "iou": 0.2}
    flags = {"rewards": "position,background", "lam": "0.4,0.6", "steps": 10,
             "weighting": "recast", "normalize": "joint", "epochs": 20}  # fmt: skip

    def run(name: str, seed: int, **changed) -> str:
        path = fake_run(tmp_path / name, seed, final)
        args = {**flags, "seed": seed, "out": path, **changed}
        (tmp_path / name / "args.json").write_text(json.dumps(args))
        return path

    first = run("a", 0)
    same = [run("b", 1, epochs=40, device="cuda"), run("c", 2, eval_every=5)]
    summarize.main([first, *same])  # seeds, out, and flags --resume may change: one configuration
    memory = [run("m", 12, grad_checkpointing=True), run("n", 13, shard=True, lam="2,3")]
    summarize.main([first, *memory])  # memory-only flags, and λ 2,3 = 0.4,0.6: one configuration
    assert "3 runs, final epoch 1;" in capsys.readouterr().out
    older = run("d", 3, normalize="per-reward")
    args = json.loads((tmp_path / "d" / "args.json").read_text())
    args.pop("normalize")  # a run before --normalize existed: per-reward, harness.BEFORE
    (tmp_path / "d" / "args.json").write_text(json.dumps(args))
    summarize.main([run("e", 4, normalize="per-reward"), older])
    bf16 = run("i", 8, precision="auto", resolved_precision="bf16")
    summarize.main([bf16, run("j", 9, precision="auto")])  # older than resolved_precision: auto
    summarize.main([bf16, run("k", 10, precision="bf16")])  # ... or its explicit --precision
    capsys.readouterr()
    cases = {
        run("f", 5, lam="0.5,0.5", steps=8): "--lambda '0.4,0.6' → '0.5,0.5', --steps 10 → 8",
        run("g", 6, weighting="uniform"): "--weighting 'recast' → 'uniform'",
        older: "--normalize 'joint' → 'per-reward'",
        run("h", 7, gain_shift=1): "--gain-shift 0 → 1",  # absent in the first: BEFORE's 0
    }
    for other, said in cases.items():
        with pytest.raises(SystemExit) as e:
            summarize.main([first, same[0], other])
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith(
            f"summarize.py: error: RUN: {other} is another configuration than "
            f"{first}: {said} ({first}'s → its): summarize the seeds of one "
        )
    with pytest.raises(SystemExit):  # an older run's explicit --precision, against bf16
        summarize.main([bf16, run("l", 11, precision="fp32")])
    assert ": --precision (resolved) 'bf16' → 'fp32' (" in capsys.readouterr().err


def test_runs_whose_last_evals_are_at_other_epochs_get_a_note(tmp_path, capsys):
    """A run still training (or resumed with more --epochs) ends at another epoch than the rest:
    each run's last eval is summarized, and a note says at which epochs."""
    final = {"position": 0.5, "background": 0.1, "iou": 0.2}
    a, b = fake_run(tmp_path / "a", 0, final), fake_run(tmp_path / "b", 1, final)
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    lines[1]["epoch"] = 3
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    summarize.main([a, b])
    out = capsys.readouterr().out
    assert out.startswith("note: the runs' last evals are at epochs 1, 3 (in the order given)")
    assert "\n2 runs, final epochs 1–3;" in out


def test_runs_of_a_reward_preset_name_its_rewards_and_two_runs_of_one_seed_count_apart(
    tmp_path, capsys
):
    """--rewards toy2 (a preset, as setting 2's runs are trained) ended in zip()'s ValueError
    after the tables: W's four rows were named by the one word "toy2". And the counts named runs
    by seed: of two runs of seed 0, one below the base model, none was said not to improve. A
    time/ phase that one run logged and another did not was a KeyError."""
    names = ["size", "elongation", "outline", "texture"]
    final = {**dict.fromkeys(names, 0.1), "shape": 0.2, "iou": 0.3}

    def run(name: str, seed: int, shape: float) -> str:
        path = tmp_path / name
        os.makedirs(path)
        (path / "args.json").write_text(json.dumps({"seed": seed, "rewards": "toy2"}))
        base = {"epoch": 0, **{f"eval/{n}": 0.0 for n in final}}
        base.update({f"ideal/{n}": 1.0 for n in final})
        last = {"epoch": 1, "W": [[0.1, 0.15], [0.15, 0.1], [0.125, 0.125], [0.125, 0.125]]}
        last.update({f"eval/{n}": v for n, v in {**final, "shape": shape}.items()})
        last.update({f"gap/{n}": v for n, v in {**final, "shape": shape}.items()})
        last.update({"gap/weighted": 0.1, "time/update": 1.0})
        last.update({"time/eval": 3.0} if seed else {})  # a phase only one run logged
        (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in (base, last)))
        return str(path)

    summarize.main([run("a", 0, 0.2), run("b", 0, -0.1)])
    out = capsys.readouterr().out
    summarize.main([run("c", 1, 0.2), str(tmp_path / "a")])  # was a KeyError: 'eval' in run a
    assert "mean ± std over runs): update 62.5 ± 53.0 %, eval 37.5 ± 53.0 %\n" in (
        capsys.readouterr().out
    )
    assert (
        "weight centroid (timestep, mean ± std over epochs): size 0.60 ± 0.00, elongation "
        "0.40 ± 0.00, outline 0.50 ± 0.00, texture 0.50 ± 0.00" in out
    )
    assert "  size before elongation: 0 of 2 epochs\n" in out
    assert "  shape improves in 1 of 2 runs (not in seed 0)\n" in out
    assert "  iou improves in 2 of 2 runs\n" in out
    summarize.main([str(tmp_path / "a")])  # one run of one epoch: W's std over epochs is 0
    assert ": size 0.60 ± 0.00, elongation 0.40 ± 0.00," in capsys.readouterr().out


def test_spearman_shares_tied_ranks_and_anatomy_settles_at_the_first_step_that_stays():
    """summarize.spearman (anatomy.py's and diagnostic.py's ρ): tied values share their mean
    rank, so [1, 2, 2, 3] against [1, 2, 3, 4] is 3/√10, not 1; a constant side is nan.
    anatomy.settled_step: the first step from which every later step's ranking has ρ ≥ 0.8
    with the final one; a constant step (nan) does not count, and step 0 is never read."""
    import math

    import torch

    from studies import anatomy

    assert summarize.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / math.sqrt(10))
    assert summarize.spearman([3, 1, 2], [30, 10, 20]) == pytest.approx(1)
    assert summarize.spearman([3, 1, 2], [-3, -1, -2]) == pytest.approx(-1)
    assert math.isnan(summarize.spearman([1, 1, 1], [1, 2, 3]))
    final = torch.tensor([1.0, 2.0, 3.0, 4.0])
    steps = torch.stack([torch.zeros(4), final.flip(0), final, final * 2, final])  # T = 4
    assert anatomy.settled_step(steps) == 2  # step 1 reversed; 2, 3 agree with the final
    steps[3] = 5.0  # constant at step 3: nan, so nothing before the final is settled
    assert anatomy.settled_step(steps) == 4
    steps[3], steps[1] = final, final  # all agree: settled from step 1; step 0 (zeros) unread
    assert anatomy.settled_step(steps) == 1


def test_against_pairs_two_configurations_by_seed(tmp_path, capsys):
    """--against: per reward, judge and the λ-weighted gap, first − second paired by seed (given
    in any order), its mean ± std and the seeds where the first is higher, and each seed's
    differences to 4 decimals; runs of other seeds or
    judges exit 2 naming --against."""
    first = [
        fake_run(tmp_path / "a1", 1, {"position": 0.5, "background": 0.1, "iou": 0.2}),
        fake_run(tmp_path / "a0", 0, {"position": 0.4, "background": 0.3, "iou": 0.2}),
    ]
    second = [
        fake_run(tmp_path / "b0", 0, {"position": 0.3, "background": 0.1, "iou": 0.3}),
        fake_run(tmp_path / "b1", 1, {"position": 0.1, "background": 0.2, "iou": 0.2}),
    ]
    summarize.main([*first, "--against", *second])
    out = capsys.readouterr().out
    assert "(2 seeds)" in out
    assert (
        "| position | +0.250 ± 0.212 | 2 of 2 | +0.100 (0) |" in out
    )  # seed 0: +0.1, seed 1: +0.4
    assert "| background | +0.050 ± 0.212 | 1 of 2 | -0.100 (1) |" in out  # +0.2, -0.1
    assert "| iou | -0.050 ± 0.071 | 0 of 2 | -0.100 (0) |" in out  # -0.1, 0
    assert "| **λ-weighted** | +0.150 ± 0.000 | 2 of 2 | +0.150 (0) |" in out  # +0.15, +0.15
    assert "| 0 | +0.1000 | +0.2000 | -0.1000 | +0.1500 |" in out  # each seed, unrounded
    assert "| 1 | +0.4000 | -0.1000 | +0.0000 | +0.1500 |" in out
    other_seed = fake_run(tmp_path / "b7", 7, {"position": 0.1, "background": 0.2, "iou": 0.2})
    for runs in ([*first, "--against", second[0], other_seed], [*first, "--against", second[0]]):
        with pytest.raises(SystemExit) as e:
            summarize.main(runs)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("summarize.py: error: --against: ")
        assert "pair the same rewards, judges and seeds" in err


def test_archived_runs_summarize_as_their_folders(tmp_path, capsys, monkeypatch):
    """--archive: runs read from comparison.py's archive (its record of a folder: args, evals,
    ideal, W, times) print the folders' tables, alone and paired with --against; a run archived
    without its args exits 2 naming it."""
    from studies import comparison

    finals = [{"position": 0.5, "background": 0.1, "iou": 0.2},
              {"position": 0.4, "background": 0.05, "iou": 0.3}]  # fmt: skip
    runs = [fake_run(tmp_path / f"r{s}", s, f) for s, f in enumerate(finals)]
    other = [fake_run(tmp_path / f"o{s}", s, {**f, "position": 0.1}) for s, f in enumerate(finals)]
    summarize.main(runs)
    summarize.main([*runs, "--against", *other])
    want = capsys.readouterr().out
    monkeypatch.setattr(summarize, "ARCHIVE", {os.path.basename(r): comparison.record(r)
                                               for r in runs + other})  # fmt: skip
    monkeypatch.chdir(tmp_path / "..")  # the names are no folders here
    names = [os.path.basename(r) for r in runs]
    summarize.main(names)
    summarize.main([*names, "--against", *(os.path.basename(r) for r in other)])
    got = capsys.readouterr().out
    assert got.replace("r0", "X").replace("r1", "X").replace("o0", "X") == want.replace(
        runs[0], "X").replace(runs[1], "X").replace(other[0], "X")  # fmt: skip
    del summarize.ARCHIVE["r0"][0]["args"]
    with pytest.raises(SystemExit) as e:
        summarize.main(names)
    assert e.value.code == 2 and "r0" in capsys.readouterr().err
