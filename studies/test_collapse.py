"""studies/collapse.py: a --code without recast.py, a --out without the study's finished runs, or
a --to that is a file, exits 2 before anything is written; variance_parts."""

import statistics

import pytest

from studies import collapse


def test_a_wrong_code_or_out_exits_2_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    out, to = tmp_path / "runs", tmp_path / "report"
    for argv, flag in ((["run", "--code", str(tmp_path / "empty"), "--out", str(out)], "--code"),
                       (["report", "--out", str(tmp_path / "empty"), "--to", str(to)], "--out"),
                       (["report", "--out", str(out), "--to", str(to)], "--out")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            collapse.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"collapse.py: error: {flag}: ")
        assert err.count("\n") == 1 and not out.exists() and not to.exists()
    to.write_text("kept")  # a file: it ended in os.makedirs's traceback after reading the runs
    with pytest.raises(SystemExit) as e:
        collapse.main(["report", "--out", str(tmp_path / "empty"), "--to", str(to)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"collapse.py: error: --to: {to} is a file, ")
    assert to.read_text() == "kept"


def test_variance_parts_split_the_weighted_gaps_variance_and_sum_to_one():
    """Each reward's part of the across-seed variance of the final λ-weighted gap: Cov(λ_k gap_k,
    Σ_j λ_j gap_j) over the 5 seeds, summed over budgets, over the summed variance. The parts of
    an arm sum to 1 (both with the n − 1 of statistics.variance), a reward whose gap does not
    move across seeds has part 0, and an arm missing a run of every budget has none."""
    import random

    from studies import comparison

    rng = random.Random(0)
    names = collapse.SETTING3
    records = {}
    for lam in comparison.BUDGETS:
        for arm in ("uniform", "joint"):
            for s in range(5):
                gaps = {f"gap/{n}": rng.gauss(0, 1) for n in names} | {"gap/outline": 0.25}
                records[f"{lam.replace(',', '_')}-t3-{arm}-s{s}"] = [{"epoch": 0}, gaps]
    parts = collapse.variance_parts(records, "t3", names)
    assert parts["sum"] == {} and parts["recast"] == {}  # no runs: no parts
    for arm in ("uniform", "joint"):
        assert sum(parts[arm].values()) == pytest.approx(1, abs=1e-12)
        assert parts[arm]["outline"] == 0 and min(parts[arm].values()) != max(parts[arm].values())
    one = {k: v for k, v in records.items() if k.startswith("0.4_0.2_0.2_0.2-t3-joint")}
    lam = [0.4, 0.2, 0.2, 0.2]  # one budget: the part is the plain covariance share
    runs = [one[f"0.4_0.2_0.2_0.2-t3-joint-s{s}"][-1] for s in range(5)]
    c = [[b * r[f"gap/{n}"] for b, n in zip(lam, names, strict=True)] for r in runs]
    w = [sum(row) for row in c]
    want = statistics.covariance([row[0] for row in c], w) / statistics.variance(w)
    assert collapse.variance_parts(one, "t3", names)["joint"]["color"] == pytest.approx(want)
