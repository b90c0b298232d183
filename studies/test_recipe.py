"""studies/recipe.py's sweep: a bad --only or --seeds exits 2 before the sweep's folder is made."""

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
