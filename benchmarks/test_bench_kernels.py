"""benchmarks/bench_kernels.py's --json, checked before the benchmark: one line, exit 2."""

from benchmarks import bench_kernels
from test_recast import refused


def test_a_json_in_a_folder_that_does_not_exist_exits_2_before_the_benchmark(tmp_path, capsys):
    """It failed with a FileNotFoundError traceback only after every table had been measured."""
    cases = {
        f"--json {tmp_path}/no/bench.json": f"--json: {tmp_path}/no/bench.json's folder does not",
        "--no-such-flag": "--no-such-flag: no such flag (flags are given by their whole name",
    }
    for argv, said in cases.items():
        refused(capsys, bench_kernels.main, argv.split(), f"bench_kernels.py: error: {said}")
    assert list(tmp_path.iterdir()) == []
