"""benchmarks/bench_kernels.py's --json, checked before the benchmark: one line, exit 2."""

import pytest

from benchmarks import bench_kernels


def test_a_json_in_a_folder_that_does_not_exist_exits_2_before_the_benchmark(tmp_path, capsys):
    """It failed with a FileNotFoundError traceback only after every table had been measured."""
    cases = {
        f"--json {tmp_path}/no/bench.json": f"--json: {tmp_path}/no/bench.json's folder does not",
        "--no-such-flag": "usage: unrecognized arguments: --no-such-flag",
    }
    for argv, said in cases.items():
        with pytest.raises(SystemExit) as e:
            bench_kernels.main(argv.split())
        out, err = capsys.readouterr()
        assert e.value.code == 2 and out == "" and err.count("\n") == 1
        assert err.startswith(f"bench_kernels.py: error: {said}")
    assert list(tmp_path.iterdir()) == []
