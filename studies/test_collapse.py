"""studies/collapse.py: a --code without recast.py, or a --out without the study's finished runs,
exits 2 before anything is written."""

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
