"""Tests of benchmarks/ocr_readers.py without its models: the cases are the same for a seed and
garbled as their kinds say, the table's scores and ranks are the arithmetic the docs describe, the
reads show a bar on stderr, and a bad --words exits 2 naming the flag."""

import os

import pytest
import torch

import rewards
from benchmarks import ocr_readers


def test_cases_are_seeded_and_garbled_as_their_kinds_say():
    rows = ocr_readers.cases(3, seed=1)
    again = ocr_readers.cases(3, seed=1)
    assert [r[:3] for r in rows] == [r[:3] for r in again]
    assert all(
        torch.equal(a[3], b[3]) and torch.equal(a[4], b[4])
        for a, b in zip(rows, again, strict=True)
    )
    assert [r[0] for r in rows] == list(ocr_readers.KINDS) * 3
    texts = {r[1] for r in rows}
    with open(os.path.join(ocr_readers.HERE, "prompts", "ocr_eval.txt")) as f:
        assert len(texts) == 3 and texts <= {rewards.quoted(line) for line in f}
    for kind, true, wrong, better, worse in rows:
        assert better.shape == worse.shape == (3, 112, 448) and better.dtype == torch.uint8
        if kind == "clean":
            assert wrong in texts and wrong != true
        elif kind == "swap":
            assert sorted(wrong) == sorted(true) and rewards.edit_distance(wrong, true) == 2
        else:  # a letter missing, or (the visual kinds) either
            assert rewards.edit_distance(wrong, true) in ((1,) if kind == "missing" else (1, 2))
        assert not torch.equal(better, worse)  # the wrong text is drawn, not the true one
    clean = [r for r in rows if r[0] == "clean"][0][3]
    faint = [r for r in rows if r[0] == "faint"][0][3]
    assert clean.min() == 0 and clean.max() == 255 and faint.min() >= 185 and faint.max() == 200


def test_table_scores_against_the_true_text_and_counts_ties_half():
    kinds = list(ocr_readers.KINDS)
    rows = [(k, "OPEN", "OPNE" if k == "swap" else "OPN", None, None) for k in kinds]
    better = [1.0] * len(kinds)
    worse = [0.5 if k == "swap" else 0.75 for k in kinds]
    worse[kinds.index("blur")] = 1.0  # a tie
    lines = ocr_readers.table(rows, {"A": (better, worse)})
    cells = {line.split(" | ")[0].strip("|* "): line.split(" | ") for line in lines[2:]}
    assert cells["swap"][2:5] == ["0.500", "0.500", "1.000 |"]  # ideal, score, ranks
    assert cells["blur"][2:5] == ["1.000", "1.000", "0.500 |"]
    assert cells["missing"][2:4] == ["0.750", "0.750"]


def test_bad_words_exit_2_naming_the_flag(capsys):
    """One line naming the flag (it was argparse's usage block and then the message)."""
    for argv, said in {"--words 65": "--words: 65 is not in 1-64", "--words x": "--words: invalid",
                       "--seed": "--seed: expected one argument"}.items():  # fmt: skip
        with pytest.raises(SystemExit) as e:
            ocr_readers.main(argv.split())
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
        assert err.startswith(f"ocr_readers.py: error: {said}")


def test_timed_reads_show_a_bar_on_stderr_and_print_nothing(capsys):
    """Both readers read 160 images of seconds each for the default table with nothing shown;
    now a bar on stderr, and stdout (the table) untouched."""

    class Reader:
        def read(self, image):
            return f"TEXT{int(image.sum())}"

    images = [torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(3)]
    reads, seconds = ocr_readers.timed_reads(Reader(), images, "A, true texts")
    out, err = capsys.readouterr()
    assert reads == ["TEXT0", "TEXT48", "TEXT96"] and len(seconds) == 3 and min(seconds) >= 0
    assert out == "" and "A, true texts:   0%" in err and "0/3" in err
