"""studies/recipe.py's sweep: a bad --only or --seeds exits 2 before the sweep's folder is made;
a count below one (--threads 0) in recipe.py, anatomy.py and diagnostic.py exits 2, as does
diagnostic.py's --group-size 1."""

import pytest

from studies import recipe


def test_an_unknown_recipe_or_a_malformed_seed_list_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "sweep"
    for only, seeds, flag in (("nosuch", "0", "--only"), ("", "0,x", "--seeds"),
                              ("", "0,,1", "--seeds"), ("", "-1", "--seeds")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            recipe.sweep(recipe.argparse.Namespace(only=only, seeds=seeds, out=str(out)))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"recipe.py: error: {flag}: ")
        assert err.count("\n") == 1 and not out.exists()
    assert recipe.sweep_plan("", "0,3") == (list(recipe.RECIPES), [0, 3])


@pytest.mark.parametrize("script", ["recipe", "anatomy", "diagnostic"])
def test_a_count_below_one_exits_2_naming_the_flag(script, tmp_path, capsys):
    """--threads 0 (and diagnostic's --prompts, --steps, --eval-seeds): one line, exit 2, before
    torch.set_num_threads's traceback or anything written."""
    import importlib

    main = importlib.import_module(f"studies.{script}").main
    out = ["--out", str(tmp_path / "out")] if script != "recipe" else []
    cases = [["--threads", "0"], ["--threads", "-2"], ["--threads", "x"]]
    if script == "diagnostic":
        cases += [["--prompts", "0"], ["--steps", "0"], ["--eval-seeds", "0"]]
    for argv in cases:
        with pytest.raises(SystemExit) as e:
            main(["signal", *argv] if script == "recipe" else [*argv, *out])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
        prog = "recipe.py signal" if script == "recipe" else f"{script}.py"
        assert err.startswith(f"{prog}: error: {argv[0]}: takes a whole number ≥ 1, got ")
        assert not (tmp_path / "out").exists()


def test_diagnostic_without_a_group_to_compare_exits_2_naming_the_flag(tmp_path, capsys):
    """--group-size 1 ran the whole diagnostic (minutes) on every gain 0 and every r 1/2, 0 and
    below failed in the rollout; --eval-prompts below 0 and --delta 0 are checked alike."""
    from studies import diagnostic

    cases = {
        "--group-size 1": "--group-size: needs ≥ 2 images per prompt",
        "--group-size 0": "--group-size: needs ≥ 2 images per prompt",
        "--eval-prompts -1": "--eval-prompts: must be ≥ 0 (0: all), got -1",
        "--delta 0": "--delta: must be > 0 and finite, got 0.0",
        "--delta nan": "--delta: must be > 0 and finite, got nan",
    }
    for argv, said in cases.items():
        with pytest.raises(SystemExit) as e:
            diagnostic.main([*argv.split(), "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1
        assert err.startswith(f"diagnostic.py: error: {said}")
    assert not (tmp_path / "out").exists()
