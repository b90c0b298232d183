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
