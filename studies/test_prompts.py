"""The generated prompt sets (studies/prompts.py): deterministic, the shipped prompts/ files are
what seed 0 writes, and train and eval are disjoint by scene (geneval) and by text (ocr)."""

import filecmp
import json
import os

import pytest

import rewards
from studies import prompts
from test_recast import refused

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def rows(sets, name, split):
    return sets[name][split]


def test_same_seed_same_files_and_the_shipped_ones_are_seed_0s(tmp_path):
    prompts.main(["--out", str(tmp_path / "a")])
    prompts.main(["--out", str(tmp_path / "b")])
    prompts.main(["--out", str(tmp_path / "c"), "--seed", "1"])
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(f"{n}_{s}.{e}" for n in ("geneval", "ocr") for s in ("train", "eval")
                           for e in ("txt", "jsonl"))  # fmt: skip
    shipped = os.path.join(HERE, "prompts")
    for name in names:
        assert filecmp.cmp(tmp_path / "a" / name, tmp_path / "b" / name, shallow=False), name
        assert filecmp.cmp(tmp_path / "a" / name, os.path.join(shipped, name), shallow=False), name
        assert (tmp_path / "a" / name).read_bytes() != (tmp_path / "c" / name).read_bytes(), name
    for name in [n for n in names if n.endswith(".txt")]:  # the .jsonl: the same prompts
        lines = (tmp_path / "a" / name).read_text().splitlines()
        meta = (tmp_path / "a" / name.replace(".txt", ".jsonl")).read_text().splitlines()
        assert lines == [json.loads(m)["prompt"] for m in meta]
        assert len(set(lines)) == len(lines) and all(line.strip() == line for line in lines)


def test_train_and_eval_are_disjoint_by_construction():
    """geneval: no scene (a canonical form: unordered pairs, a position by its left or upper
    object) is in both splits, so no held-out prompt is a rewording of a training one, and
    every category is in both; ocr: no held-out text is in a training prompt, and reward ocr
    reads each prompt's own text."""
    sets = prompts.generate()
    train, held = rows(sets, "geneval", "train"), rows(sets, "geneval", "eval")
    key = lambda r: (r["category"], json.dumps(r["scene"]))  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held}
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for split in (train, held):
        assert {r["category"] for r in split} == set(prompts.CATEGORIES)
    assert len(held) == 16 * 6 and len({key(r) for r in held}) == len(held)
    position = [r for r in train + held if r["category"] == "position"]
    assert all(r["scene"][1] in prompts.RELATIONS for r in position)  # a mirror is one scene
    assert any(" right of " in r["prompt"] for r in position)  # said from either object
    train, held = rows(sets, "ocr", "train"), rows(sets, "ocr", "eval")
    assert not {r["text"] for r in train} & {r["text"] for r in held}
    for r in train + held:
        assert rewards.quoted(r["prompt"]) == r["text"]
    held_texts = {r["text"].lower() for r in held}
    assert not any(f'"{t}"' in r["prompt"].lower() for r in train for t in held_texts)


def test_every_preset_has_its_prompts_documented():
    """docs/prompts.md names every preset of rewards.PRESETS, and the prompt files it names
    are the generated ones."""
    import re

    text = open(os.path.join(HERE, "docs", "prompts.md"), encoding="utf-8").read()
    for preset in rewards.PRESETS:
        assert f"`{preset}`" in text, preset
    named = set(re.findall(r"prompts/(\w+\.txt)", text))
    assert named and all(os.path.isfile(os.path.join(HERE, "prompts", n)) for n in named), named


def test_a_size_below_one_or_an_out_that_is_a_file_exits_2_in_one_line(tmp_path, capsys):
    """A size below 1 was argparse's usage block; an --out that is a file ended in os.makedirs's
    FileExistsError traceback after every set was drawn. One line naming the flag, exit 2."""
    file = tmp_path / "sets"
    file.write_text("kept")
    cases = {
        f"--ocr-eval 0 --out {tmp_path}/a": "--ocr-eval: must be ≥ 1, got 0",
        f"--train-per -3 --out {tmp_path}/a": "--train-per: must be ≥ 1, got -3",
        f"--out {file}": f"--out: {file} is a file",
        "--seed x": "--seed: invalid int value",
    }
    for argv, said in cases.items():
        with pytest.raises(SystemExit) as e:
            prompts.main(argv.split())
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
        assert err.startswith(f"python -m studies.prompts: error: {said}")
    assert sorted(tmp_path.iterdir()) == [file] and file.read_text() == "kept"


def test_an_eval_size_that_leaves_nothing_to_train_on_exits_2_before_writing(tmp_path, capsys):
    """--eval-per at least single_object's 80 scenes left that category out of training (and at
    all 316,000 colour-attribution scenes an empty geneval_train.txt); --ocr-eval at least the 560
    texts wrote an empty ocr_train.txt. Both wrote with exit 0; now one line, exit 2, nothing
    written. One below the bound is still a set with something to train on."""
    cases = {"--eval-per 80": "--eval-per: must be below 80, the scenes of single_object",
             "--eval-per 400000": "--eval-per: must be below 80",
             "--ocr-eval 560": "--ocr-eval: must be below 560, the OCR set's texts"}  # fmt: skip
    for argv, said in cases.items():
        refused(capsys, prompts.main, [*argv.split(), "--out", str(tmp_path / "out")],
                f"python -m studies.prompts: error: {said}")  # fmt: skip
    assert not (tmp_path / "out").exists()
    sets = prompts.generate(train_per=1, eval_per=79, ocr_eval=559, ocr_per_text=1)
    trained = {r["category"] for r in sets["geneval"]["train"]}
    assert trained == set(prompts.CATEGORIES) and len(sets["ocr"]["train"]) == 1
