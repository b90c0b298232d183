"""benchmarks/pin_outputs.py compares what two runs wrote: wall clock and the run folder's name
left out, every other byte counted."""

import json

import pytest

from benchmarks import pin_outputs


def write_run(folder, loss: float, seconds: float, out: str, pid: int) -> None:
    folder.mkdir(parents=True)
    lines = [{"epoch": 1, "loss": loss, "time/update": seconds, "mem/update": seconds / 10}]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in lines) + "\n")
    (folder / "args.json").write_text(json.dumps({"lam": "1", "out": out}))
    (folder / ".lock").write_text(f"pid {pid} on host vm\n")
    (folder / "ckpt").mkdir()
    (folder / "ckpt" / "model.safetensors").write_bytes(bytes([1, 2, 3]))


def test_wall_clock_and_the_folder_name_do_not_count_and_everything_else_does(tmp_path):
    write_run(tmp_path / "a", 0.5, 1.0, "runs/a", 1)
    write_run(tmp_path / "b", 0.5, 7.0, "runs/b", 2)  # other times, folder, pid: equal
    assert pin_outputs.files(tmp_path / "a") == pin_outputs.files(tmp_path / "b")
    assert set(pin_outputs.files(tmp_path / "a")) == {"metrics.jsonl", "args.json",
                                                      "ckpt/model.safetensors"}  # fmt: skip
    write_run(tmp_path / "c", 0.5000001, 1.0, "runs/a", 1)  # another loss
    assert pin_outputs.files(tmp_path / "a") != pin_outputs.files(tmp_path / "c")
    write_run(tmp_path / "d", 0.5, 1.0, "runs/a", 1)
    (tmp_path / "d" / "ckpt" / "model.safetensors").write_bytes(bytes([1, 2, 4]))  # one byte
    diff = {k for k, v in pin_outputs.files(tmp_path / "d").items()
            if pin_outputs.files(tmp_path / "a")[k] != v}  # fmt: skip
    assert diff == {"ckpt/model.safetensors"}


def test_an_unknown_run_or_base_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "pin"
    for argv, flag in ((["--base", "HEAD", "--only", "toy,nosuch"], "--only"),
                       (["--base", "no-such-commit", "--only", "toy"], "--base")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            pin_outputs.main([*argv, "--out", str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"pin_outputs.py: error: {flag}: ")
        assert err.count("\n") == 1 and not out.exists()
