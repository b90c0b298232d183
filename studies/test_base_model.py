"""studies/base_model.py: an --out that is a file exits 2, one line, before the model runs."""

import pytest

from studies import base_model


def test_an_out_that_is_a_file_exits_2_naming_it(tmp_path, capsys):
    """It ended in os.makedirs's FileExistsError traceback; the file is left as it was."""
    out = tmp_path / "figures"
    out.write_text("kept")
    with pytest.raises(SystemExit) as e:
        base_model.main(["--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"base_model.py: error: --out: {out} is a file, not a folder")
    assert out.read_text() == "kept"
