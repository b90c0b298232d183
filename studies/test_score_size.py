"""studies/score_size.py: bad input exits 2 naming the flag, before any rollout; the seeds'
rollouts show a bar on stderr and leave the table on stdout as it was."""

import pytest
import torch

from studies import score_size
from test_recast import refused


@pytest.mark.parametrize("argv,flag", [(["--seeds", "1"], "--seeds"),
                                       (["--sizes", "32"], "--sizes"),
                                       (["--sizes", "16,0"], "--sizes"),
                                       (["--sizes", "half"], "--sizes"),
                                       (["--seeds", "x"], "--seeds")])  # fmt: skip
def test_bad_input_exits_2_naming_the_flag(argv, flag, capsys, monkeypatch):
    """One line, exit 2 (--seeds x was argparse's usage block), here and in bf16_scoring.py."""
    from studies import bf16_scoring

    monkeypatch.setattr(score_size, "scored", lambda *a: pytest.fail("rolled out"))
    refused(capsys, score_size.main, argv, f"score_size.py: error: {flag}: ")
    if flag == "--seeds":
        monkeypatch.setattr(bf16_scoring, "profile", lambda *a: pytest.fail("profiled"))
        refused(capsys, bf16_scoring.main, argv, "bf16_scoring.py: error: --seeds: ")


def test_the_seeds_show_a_bar_on_stderr_and_the_table_is_unchanged(capsys, monkeypatch):
    """About 10 minutes of rollouts printed nothing until the table; now a bar on stderr."""
    W = {0: torch.zeros(2, 3), 8: torch.full((2, 3), 0.5)}

    def fake(seed, sizes, tmp):
        return ["a", "b"], {px: (W[px] + seed, torch.ones(2, 3)) for px in (0, *sizes)}

    monkeypatch.setattr(score_size, "scored", fake)
    score_size.main(["--seeds", "2", "--sizes", "8"])
    out, err = capsys.readouterr()
    assert "seeds (rollout, scoring at each size)" in err and "0/2" in err
    assert "| 8 | 3.000, 3.000 | 3.000 | 3.000 | 1.500, 1.500 | 0.000 |" in out.splitlines()
    assert out.splitlines()[-1].startswith("noise floor, Σ|W_full(seed a) − W_full(seed b)| over 1")
