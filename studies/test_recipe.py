"""studies/recipe.py's sweep: a bad --only or --seeds exits 2 before the sweep's folder is made,
and its runs show on a bar on stderr (stdout's table unchanged); a count below one (--threads 0)
in recipe.py, anatomy.py and diagnostic.py exits 2, as do diagnostic.py's --group-size 1 and
--steps 1; its --steps 2 and 3 print a note (that diagnostic.json is replaced whole or not at
all is plumbing/test_faults.py's); a relative --out of the sweep (and of collapse.py's run) is
where recast.py writes its runs."""

import json
import os

import pytest

from studies import recipe
from test_recast import refused


def test_an_unknown_recipe_or_a_malformed_seed_list_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "sweep"
    for only, seeds, flag in (("nosuch", "0", "--only"), ("", "0,x", "--seeds"),
                              ("", "0,,1", "--seeds"), ("", "-1", "--seeds"),
                              ("", "0,1,0", "--seeds")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            recipe.sweep(recipe.argparse.Namespace(only=only, seeds=seeds, out=str(out)))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"recipe.py: error: {flag}: ")
        assert err.count("\n") == 1 and not out.exists()
    (tmp_path / "file").write_text("kept")  # was os.makedirs's FileExistsError traceback
    with pytest.raises(SystemExit) as e:
        recipe.sweep(recipe.argparse.Namespace(only="", seeds="0", out=str(tmp_path / "file")))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"recipe.py: error: --out: {tmp_path}/file is a ")
    assert recipe.sweep_plan("", "0,3") == (list(recipe.RECIPES), [0, 3])
    assert recipe.sweep_plan("", "0, 3") == (list(recipe.RECIPES), [0, 3])  # as it always took


@pytest.mark.parametrize("script", ["recipe", "anatomy", "diagnostic"])
def test_a_count_below_one_exits_2_naming_the_flag(script, tmp_path, capsys):
    """--threads 0 (and diagnostic's --prompts, --steps, --eval-seeds): one line, exit 2, before
    torch.set_num_threads's traceback or anything written."""
    import importlib

    main = importlib.import_module(f"studies.{script}").main
    out = ["--out", str(tmp_path / "out")] if script != "recipe" else []
    cases = [["--threads", "0"], ["--threads", "-2"], ["--threads", "x"]]
    if script == "diagnostic":
        cases += [["--prompts", "0"], ["--steps", "0"], ["--eval-seeds", "0"]]
    prog = "recipe.py signal" if script == "recipe" else f"{script}.py"
    for argv in cases:
        refused(capsys, main, ["signal", *argv] if script == "recipe" else [*argv, *out],
                f"{prog}: error: {argv[0]}: takes a whole number ≥ 1, got ")  # fmt: skip
        assert not (tmp_path / "out").exists()


def test_diagnostic_without_a_group_to_compare_exits_2_naming_the_flag(tmp_path, capsys):
    """--group-size 1 ran the whole diagnostic (minutes) on every gain 0 and every r 1/2, 0 and
    below failed in the rollout; --steps 1 took each Spearman ρ over one timestep (recast.py
    needs 2); --eval-prompts below 0 and --delta 0 are checked alike."""
    from studies import diagnostic

    cases = {
        "--group-size 1": "--group-size: needs ≥ 2 images per prompt",
        "--group-size 0": "--group-size: needs ≥ 2 images per prompt",
        "--steps 1": "--steps: needs ≥ 2 sampler steps (ρ over timesteps), got 1",
        "--eval-prompts -1": "--eval-prompts: must be ≥ 0 (0: all), got -1",
        "--delta 0": "--delta: must be > 0 and finite, got 0.0",
        "--delta nan": "--delta: must be > 0 and finite, got nan",
    }
    for argv, said in cases.items():
        refused(capsys, diagnostic.main, [*argv.split(), "--out", str(tmp_path / "out")],
                f"diagnostic.py: error: {said}")  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_diagnostic_with_too_few_steps_for_every_shift_says_so(monkeypatch, capsys):
    """--steps 2 and 3 are valid, but ρ with the gains one or two steps earlier pairs fewer than
    2 timesteps (nan in the table): a note says so before the diagnostic runs."""
    from studies import diagnostic

    monkeypatch.setattr(diagnostic, "diagnostic", lambda args: None)  # the flags only
    for steps in (2, 3):
        diagnostic.main(["--steps", str(steps)])
        said = f"ρ (b) and (b2) are over T - 1 = {steps - 1} and T - 2 = {steps - 2} timesteps"
        out = capsys.readouterr().out
        assert out.startswith(f"note: --steps {steps}: {said}, nan below 2; --steps 4 or more")
        assert out.count("\n") == 1
    diagnostic.main(["--steps", "4"])
    assert capsys.readouterr().out == ""


def test_sweep_shows_a_bar_of_runs_on_stderr_counting_finished_ones(tmp_path, monkeypatch, capsys):
    """Hours of runs had no output until the table; now a bar of runs on stderr, a finished run
    (summary.json) counted from the start, and the table on stdout as it was."""
    names = list(recipe.RECIPES)[:2]

    def fake_run(out, recipe_, seed):
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch": 0, "gap/weighted": 0.5, "gap/shape": 0.25,
                                "time/rollout": 60.0}) + "\n")  # fmt: skip
        open(os.path.join(out, "summary.json"), "w").close()
        return out

    out = tmp_path / "sweep"
    fake_run(str(out / names[0]), None, 0)  # finished in an earlier sitting
    monkeypatch.setattr(recipe, "run_one", fake_run)
    recipe.sweep(recipe.argparse.Namespace(only=",".join(names), seeds="0", out=str(out)))
    stdout, err = capsys.readouterr()
    assert "1/2 [" in err and "2/2 [" in err  # the bar starts at the finished run
    lines = stdout.splitlines()
    assert lines[0].startswith("--weighting uniform") and lines[1].startswith("| recipe |")
    assert [x.split(" | ")[:2] for x in lines[3:]] == [[f"| {n}", "0.500"] for n in names]


def fake_recast(tmp_path, calls: list):
    """subprocess.run as recast.py would run: its --out read in its cwd; a finished run (metrics,
    summary.json) written there, refused outside tmp_path (the repository is left alone)."""

    def run(cmd, cwd, **kwargs):
        where = os.path.join(cwd, cmd[cmd.index("--out") + 1])
        assert where.startswith(str(tmp_path)), f"recast.py would write to {where}"
        calls.append(where)
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "metrics.jsonl"), "w") as f:
            f.write(json.dumps({"epoch": 2, "gap/weighted": 0.5, "time/rollout": 60.0}) + "\n")
        open(os.path.join(where, "summary.json"), "w").close()
        return recipe.subprocess.CompletedProcess(cmd, 0)

    return run


def test_a_relative_out_is_where_the_runs_are_written_and_read(tmp_path, monkeypatch, capsys):
    """recast.py runs in the repository's root: a relative --out given from another folder was
    written there by it, while the sweep looked for its runs (finished? to resume?) and read
    their metrics here, failing after hours; collapse.py did the same in --code. Both now pass
    the folder as an absolute path, and a second sitting skips the finished runs."""
    from studies import collapse

    calls = []
    monkeypatch.setattr(recipe.subprocess, "run", fake_recast(tmp_path, calls))
    monkeypatch.chdir(tmp_path)
    only = list(recipe.RECIPES)[0]
    for _ in range(2):
        recipe.sweep(recipe.argparse.Namespace(only=only, seeds="0", out="sweep"))
        assert f"| {only} | 0.500 |" in capsys.readouterr().out
    assert calls == [str(tmp_path / "sweep" / only)]  # once: the second sitting skips it
    calls.clear()
    monkeypatch.setattr(collapse.subprocess, "run", fake_recast(tmp_path, calls))
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "recast.py").touch()
    for _ in range(2):
        collapse.main(["run", "--code", "code", "--out", "runs"])
    assert sorted(calls) == sorted(str(tmp_path / "runs" / n) for n in collapse.RUNS)
    said = capsys.readouterr().out.splitlines()  # each run says where its progress is logged
    logs = [f"started: {n} (its progress: {tmp_path}/runs/{n}.log)" for n in collapse.RUNS]
    assert sorted(said) == sorted([*logs, *(f"done: {n}" for n in collapse.RUNS)])


@pytest.mark.parametrize("script", ["anatomy", "diagnostic"])
def test_an_out_that_is_a_file_exits_2_before_the_work(script, tmp_path, monkeypatch, capsys):
    """anatomy.py (a minute) and diagnostic.py (minutes) made their --out only at the end, so a
    file there ended in os.makedirs's FileExistsError traceback with the work lost."""
    import importlib

    module = importlib.import_module(f"studies.{script}")
    monkeypatch.setattr(module, script, lambda args: pytest.fail("ran"))
    out = tmp_path / "figures"
    out.write_text("kept")
    refused(capsys, module.main, ["--out", str(out)],
            f"{script}.py: error: --out: {out} is a file, not a folder for ")  # fmt: skip
    assert out.read_text() == "kept"


def test_a_failed_run_stops_the_sweep_without_starting_the_others(tmp_path, monkeypatch):
    """A run that failed raised only after the pool had run every other queued recipe (hours);
    now the queued ones are cancelled: the two started may finish, no third starts after it."""
    import subprocess
    import time

    started = []

    def fake_run(out, recipe_, seed):
        started.append(os.path.basename(out))
        if len(started) == 1:
            raise subprocess.CalledProcessError(1, ["recast.py"])
        time.sleep(0.3)
        return out

    monkeypatch.setattr(recipe, "run_one", fake_run)
    only = ",".join(list(recipe.RECIPES)[:5])
    with pytest.raises(subprocess.CalledProcessError):
        recipe.sweep(recipe.argparse.Namespace(only=only, seeds="0", out=str(tmp_path / "s")))
    assert len(started) <= 3, started  # the failed one, the one beside it, at most one more
