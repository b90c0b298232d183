"""benchmarks/gpu_check.py's flags, checked before the CUDA check: one line, exit 2."""

import pytest

from benchmarks import gpu_check


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
        with pytest.raises(SystemExit) as e:
            gpu_check.main(argv.split())
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith(f"gpu_check.py: error: {said}")
    assert file.read_text() == "kept" and sorted(tmp_path.iterdir()) == [file]
