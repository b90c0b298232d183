"""studies/score_size.py: bad input exits 2 naming the flag, before any rollout."""

import pytest

from studies import score_size


@pytest.mark.parametrize("argv,flag", [(["--seeds", "1"], "--seeds"),
                                       (["--sizes", "32"], "--sizes"),
                                       (["--sizes", "16,0"], "--sizes"),
                                       (["--sizes", "half"], "--sizes")])  # fmt: skip
def test_bad_input_exits_2_naming_the_flag(argv, flag, capsys, monkeypatch):
    monkeypatch.setattr(score_size, "scored", lambda *a: pytest.fail("rolled out"))
    with pytest.raises(SystemExit) as e:
        score_size.main(argv)
    assert e.value.code == 2 and flag in capsys.readouterr().err
