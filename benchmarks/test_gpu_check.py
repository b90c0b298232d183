"""benchmarks/gpu_check.py's flags, checked before the CUDA check: one line, exit 2; each step
says on stderr how it ended, as it ends."""

import sys

from benchmarks import gpu_check
from test_recast import refused


def test_a_budget_below_a_step_or_an_out_that_is_a_file_exits_2_naming_it(tmp_path, capsys):
    """--budget 0 (or -5, or nan) skipped every step and wrote a report of skips on a GPU machine;
    an --out that is a file ended in mkdir's FileExistsError traceback."""
    file = tmp_path / "report"
    file.write_text("kept")
    cases = {
        "--budget 0": "--budget: must be a number of seconds ≥ 10",
        "--budget -5": "--budget: must be a number of seconds ≥ 10",
        "--budget nan": "--budget: must be a number of seconds ≥ 10",
        f"--out {file}": f"--out: {file} is a file",
        "--budget x": "--budget: invalid float value",
    }
    for argv, said in cases.items():
        refused(capsys, gpu_check.main, argv.split(), f"gpu_check.py: error: {said}")
    assert file.read_text() == "kept" and sorted(tmp_path.iterdir()) == [file]


def test_each_step_says_how_it_ended_on_stderr_as_it_ends(tmp_path, capsys):
    """The check's minutes of steps showed nothing until the verdict; now a line a step on
    stderr, stdout left to the verdict, and the report's rows as they were."""
    steps = gpu_check.Steps(tmp_path, budget=60)
    ok, text = steps.run("say", [sys.executable, "-c", "print('said')"], 30)
    steps.budget = 0  # spent: the next step is skipped
    skipped, _ = steps.run("late", [sys.executable, "-c", "pass"], 30)
    out, err = capsys.readouterr()
    assert ok and text == "said\n" and not skipped and out == ""
    assert err.startswith("gpu_check: say: passed (")
    assert err.splitlines()[1] == "gpu_check: late: skipped: time budget spent (0 s)"
    rows = [("say", "passed"), ("late", "skipped: time budget spent")]
    assert [r[:2] for r in steps.rows] == rows
    assert (tmp_path / "say.log").read_text() == "said\n"


def test_the_toy_runs_comparison_fails_beyond_each_tolerance(tmp_path):
    """Step 5's verdict can fail: a reward, W or the loss beyond its epoch's tolerance, or an
    epoch missing, each fails it; differences within them pass (plumbing/test_faults.py compares
    two equal runs only, which any comparison passes)."""
    import json

    def runs(name: str, **cuda: float) -> tuple:
        folders = []
        for side in ("cpu", "cuda"):
            moved = cuda if side == "cuda" else {}
            lines = [{"epoch": e, "reward/color": 0.5 + moved.get("reward", 0.0),
                      "eval/color": 0.5, "loss": 1.0 * (1 + moved.get("loss", 0.0)),
                      "W": [[0.025 + moved.get("w", 0.0), 0.025], [0.025, 0.025]]}
                     for e in range(3 - int(moved.get("drop", 0)))]  # fmt: skip
            folder = tmp_path / name / side
            folder.mkdir(parents=True)
            (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
            folders.append(folder)
        return tuple(folders)

    # within epoch 0's tolerances (1 % + 1e-3 of 0.5, W 2e-3, the loss 1 %)
    ok, table = gpu_check.compare_toy_runs(*runs("close", reward=0.005, w=1e-3, loss=0.005))
    assert ok and "DIFFERS" not in table
    for name, moved in (("reward", {"reward": 0.01}), ("w", {"w": 3e-3}),
                        ("loss", {"loss": 0.02}), ("drop", {"drop": 1})):  # fmt: skip
        ok, table = gpu_check.compare_toy_runs(*runs(name, **moved))
        assert not ok, (name, table)
