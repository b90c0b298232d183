"""--log's views of a run (plumbing/tblog.py): TensorBoard and wandb, the latter in its offline
mode (no network, no account), read back from the files it writes; and --log's bad input."""

import json
import os
import struct
import sys

import pytest

from test_recast import TINY, main_here, metrics_of, recast_exit


def wandb_records(path):
    """The records of a wandb run's transaction log (its run-ID.wandb file): wandb's protobuf
    Records in LevelDB's log format, after a 7-byte header (":W&B", magic, version): 32 KiB
    blocks of chunks (CRC32 4 bytes, length 2, type 1: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or a record's last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_dirs) -> tuple[dict, dict]:
    """({(name, step): number} logged, {(image name, step): the image file}) of the wandb runs
    in `run_dirs` (one per process that logged to it), wandb's own _runtime, _step, … left out.
    A number or image sent twice for one step (by two launches, or twice by one) fails here: kept
    in a dict, the second would hide the first."""
    scalars, images = {}, {}
    for run_dir in run_dirs:
        (log,) = [f for f in os.listdir(run_dir) if f.endswith(".wandb")]
        for record in wandb_records(os.path.join(run_dir, log)):
            if record.WhichOneof("record_type") != "history":
                continue
            step = record.history.step.num
            items = {}
            for item in record.history.item:
                key = [item.key] if item.key else list(item.nested_key)
                items[tuple(key)] = json.loads(item.value_json)
            for key, value in items.items():
                if len(key) == 1 and not key[0].startswith("_"):
                    assert (key[0], step) not in scalars, f"{key[0]} sent twice at step {step}"
                    scalars[(key[0], step)] = value
                elif len(key) == 2 and key[1] == "path":
                    assert items[(key[0], "_type")] == "image-file"
                    assert (key[0], step) not in images, f"{key[0]} sent twice at step {step}"
                    images[(key[0], step)] = os.path.join(run_dir, "files", value)
    return scalars, images


def numbers_of(lines: list[dict]) -> dict:
    return {(k, m["epoch"]): v for m in lines for k, v in m.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and k != "epoch"}  # fmt: skip


def logged(*flags) -> None:
    """main_here(flags), then wandb's service process shut down and waited for (wandb.teardown,
    as when `python recast.py` exits). The service, not this process, writes a run's .wandb
    file, through LevelDB's log writer, which holds the records in a 32 KiB block in memory and
    writes the last, partial block when the file is closed; it closes it when it handles the
    message that the run is over, which run.finish() sends without waiting for it to be handled.
    So when main_here returns the file may still lack its last records (measured: its 7-byte
    header alone right after run.finish(), whole after wandb.teardown()): reading it right away
    raced the service, and lost on a busy CPU."""
    import wandb

    main_here(*flags)
    wandb.teardown()


def test_wandb_offline_logs_what_tensorboard_does_and_a_resumed_run_continues_it(
    tmp_path, monkeypatch
):
    """--log tensorboard,wandb on one epoch, then --resume to two: wandb (offline) holds every
    number of metrics.jsonl at its epoch, as TensorBoard does, and samples.png and W.png at each
    eval (epochs 1 and 2, each run's last), byte for byte; the resumed run logs to the same wandb
    run (its id kept in OUT/wandb.json), and sends no epoch twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")  # its service starts slowly on a busy CPU
    (tmp_path / "wandb_dir").mkdir()
    out, flags = tmp_path / "run", [*TINY, "--lambda", "0.4,0.2,0.2,0.2"]
    logged(*flags, "--epochs", "1", "--log", "tensorboard,wandb", "--out", out)
    pictures = {n: (out / f"{n}.png").read_bytes() for n in ("W", "samples")}  # epoch 1's
    logged(*flags, "--epochs", "2", "--log", "tensorboard,wandb", "--resume", "--out", out)
    run_id = json.loads((out / "wandb.json").read_text())["id"]
    root = tmp_path / "wandb_dir" / "wandb"
    runs = sorted(root / d for d in os.listdir(root) if d.startswith("offline-run-"))
    assert len(runs) == 2 and all(d.name.endswith("-" + run_id) for d in runs)
    scalars, images = wandb_history(runs)
    numbers = numbers_of(metrics_of(out))
    assert scalars.keys() == numbers.keys()
    assert all(scalars[k] == pytest.approx(v, rel=1e-12, abs=0) for k, v in numbers.items())
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert {(k, e.step) for k in events.Tags()["scalars"] for e in events.Scalars(k)} == set(
        numbers
    )  # the same numbers as TensorBoard's
    assert sorted(images) == [("W", 1), ("W", 2), ("samples", 1), ("samples", 2)]
    for name, before in pictures.items():
        assert open(images[(name, 1)], "rb").read() == before
        assert open(images[(name, 2)], "rb").read() == (out / f"{name}.png").read_bytes()


def test_a_resumed_tensorboard_holds_each_epoch_once_as_metrics_jsonl_does(tmp_path):
    """A launch logs epochs 0-3 and dies with its last checkpoint at epoch 1; the resumed launch
    runs 2 and 3 again (other seconds) and is handed the base model's line, as recast.main does:
    the view holds each epoch once, the resumed run's 2 and 3, as metrics.jsonl does (before, it
    held epoch 0 twice and 2 and 3 from both launches)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from plumbing import tblog

    first = tblog.TensorBoard(str(tmp_path))  # a new run: its folder is new
    for epoch in range(4):
        first.epoch({"epoch": epoch, "loss": float(epoch), "time/update": 1.0}, str(tmp_path))
    first.close()
    resumed = tblog.TensorBoard(str(tmp_path), 2)
    resumed.epoch({"epoch": 0, "loss": 0.0}, str(tmp_path), pictures=False)
    for epoch in (2, 3):
        resumed.epoch({"epoch": epoch, "loss": float(epoch), "time/update": 2.0}, str(tmp_path))
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, s) for s in range(4)]
    assert [(e.step, e.value) for e in events.Scalars("time/update")] == [
        (0, 1.0), (1, 1.0), (2, 2.0), (3, 2.0)]  # fmt: skip


def test_a_torn_wandb_json_exits_2_naming_it(tmp_path, capsys):
    """OUT/wandb.json that is not the run's wandb id (torn, not JSON): exit 2 naming --log and
    the file, before wandb starts (it ended in a JSONDecodeError traceback)."""
    from plumbing import tblog

    (tmp_path / "wandb.json").write_text('{"id": "ab')
    with pytest.raises(SystemExit) as e:
        tblog.WandB(str(tmp_path), {})
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert f"--log: {tmp_path}/wandb.json is not the run's wandb id (JSONDecodeError" in err


def test_log_bad_input_exits_2_and_writes_nothing(tmp_path, monkeypatch, capsys):
    """--log wandb without wandb installed names the package; an unknown target is named with
    the known ones; nothing is written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    err = recast_exit(capsys, "--lambda", "1,1,1,1", "--log", "tensorboard,wandb")
    assert "error: --log" in err and "pip install wandb" in err
    err = recast_exit(capsys, "--lambda", "1,1,1,1", "--log", "tensorboard,mlflow")
    assert "error: --log" in err and "mlflow" in err and "tensorboard, wandb" in err
    assert os.listdir(tmp_path) == []


def test_wandb_that_cannot_start_its_run_exits_2_with_the_resume_command(
    tmp_path, monkeypatch, capsys
):
    """wandb.init failing as wandb fails without an account or network (wandb.errors.Error):
    exit 2 naming --log, the fixes (wandb login, WANDB_MODE=offline) and the command that
    continues the run, no traceback; the base model's epoch 0 is kept, no wandb.json written
    (the resumed run starts a wandb run of its own), and the run continues on --resume (here
    with --log tensorboard: the resumed run would try wandb again)."""
    import wandb

    def refuse(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty)")

    out, flags = tmp_path / "run", [*TINY, "--epochs", "1", "--lambda", "0.4,0.2,0.2,0.2"]
    monkeypatch.setattr(wandb, "init", refuse)
    with pytest.raises(SystemExit) as e:
        main_here(*flags, "--log", "wandb", "--out", out)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "error: --log: wandb could not start its run (api_key not configured" in err
    assert "wandb login" in err and "WANDB_MODE=offline" in err
    assert f"recast.py --out {out} --resume" in err and "Traceback" not in err
    assert [m["epoch"] for m in metrics_of(out)] == [0] and not (out / "wandb.json").exists()
    main_here(*flags, "--out", out, "--resume", "--log", "tensorboard")  # --log may change
    assert [m["epoch"] for m in metrics_of(out)] == [0, 1]
