"""benchmarks/stress_ranks.py without its minutes of runs: what it counts as an abort, and its
bad input (exit 2, nothing written)."""

import json

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


def test_another_checkout_must_be_one_of_this_project(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        stress_ranks.main(["--code", str(tmp_path), "--out", str(tmp_path / "new")])
    assert e.value.code == 2 and "--code" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_the_memory_spread_reads_each_repeats_loading_measures(tmp_path):
    for i, mb in enumerate((200, 210, 230)):
        folder = tmp_path / f"repeat_{i:02d}" / "test_sharded_loading0"
        folder.mkdir(parents=True)
        said = {"0": {"peak": 3e8, "file": 5e7, "hwm": 4.9e8}, "1": {"peak": mb * 1e6}}
        (folder / "memory.json").write_text(json.dumps(said))
    measured = [stress_ranks.memory(tmp_path / f"repeat_{i:02d}") for i in range(3)]
    measured.append(stress_ranks.memory(tmp_path / "none"))  # a repeat whose test did not run
    lines = stress_ranks.spread(measured)
    assert "rank 1 peak: 200.0 / 210.0 / 230.0 MB over 3 repeats" in lines
    assert "rank 0 file: 50.0 / 50.0 / 50.0 MB over 3 repeats" in lines
    assert not any(line.startswith("rank 1 file") for line in lines)
