"""benchmarks/stress_ranks.py without its minutes of runs: what it counts as an abort, and its
bad input (exit 2, nothing written)."""

import pytest

from benchmarks import stress_ranks


def test_an_abort_is_a_rank_log_that_ended_in_std_terminate(tmp_path):
    ranks = tmp_path / "run-ranks" / "x_1" / "attempt_0"
    for rank, said in ((0, "done: run/summary.json\n"), (1, f"{stress_ranks.ABORT}\n")):
        (ranks / str(rank)).mkdir(parents=True)
        (ranks / str(rank) / "stderr.log").write_text(said)
        (ranks / str(rank) / "stdout.log").write_text(stress_ranks.ABORT)  # stdout: not counted
    assert stress_ranks.aborts(tmp_path) == [ranks / "1" / "stderr.log"]


@pytest.mark.parametrize("argv,flag", [(["--load", "-1"], "--load"), (["--repeats", "0"],
                                                                       "--repeats")])  # fmt: skip
def test_bad_input_exits_2_naming_the_flag(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        stress_ranks.main([*argv, "--out", str(tmp_path / "new")])
    assert e.value.code == 2 and flag in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_folder_with_earlier_logs_is_refused(tmp_path, capsys):
    (tmp_path / "old.log").write_text("x")
    with pytest.raises(SystemExit) as e:
        stress_ranks.main(["--repeats", "1", "--out", str(tmp_path)])
    assert e.value.code == 2 and "--out" in capsys.readouterr().err
