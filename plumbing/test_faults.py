"""The faults of a real cluster, each injected: two runs in one folder, SIGTERM from a scheduler, a
full disk, a torn metrics.jsonl, a rank or a whole node lost under torchrun (docs/failure_modes.md).

    python -m pytest -q plumbing/test_faults.py          # fault injection, one-process runs
    python -m pytest -q -m slow plumbing/test_faults.py  # + torchrun: 2 CPU processes, 2 nodes

The bar is the SIGKILL test's in test_recast.py: the fault is injected, the run stops (or goes on)
with a clear message, and after --resume the final metrics.jsonl matches the uninterrupted run's
(every field but time/*; under torchrun within the tolerances of docs/sd35.md).
"""

import contextlib
import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from plumbing import checkpoints, rundir
from test_recast import HERE, TINY, metrics_of, rank_lines, ranks_said, run_recast, torchrun_args

RECAST = os.path.join(HERE, "recast.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# 3 epochs of the tiny toy run, evaluated every epoch: a run stopped early evaluates its last epoch,
# so the uninterrupted run must too for the two metrics.jsonl to be compared line by line
FLAGS = ["--lambda", "0.4,0.2,0.2,0.2", *TINY[2:], "--epochs", "3", "--eval-every", "1"]


def without_times(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time/")} for m in lines]


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of the uninterrupted one-process run every fault is compared with."""
    out = tmp_path_factory.mktemp("whole") / "run"
    run_recast(*FLAGS, "--out", str(out), env=ENV)
    return metrics_of(out)


def run_patched(tmp_path, patch: str, *flags) -> subprocess.CompletedProcess:
    """`python recast.py flags` (its __main__ block included) after `patch` has run in the same
    process: how a fault is injected into a whole run."""
    script = tmp_path / "patched.py"
    script.write_text(
        f"import runpy, sys\nsys.path.insert(0, {HERE!r})\n{patch}\n"
        f"sys.argv = ['recast.py', *{list(flags)!r}]\n"
        f"runpy.run_path({RECAST!r}, run_name='__main__')\n"
    )
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=HERE, env=ENV, timeout=900)  # fmt: skip


def stopped_message(stderr: str) -> str:
    """The run's one-line `recast.py: stopped: …` message: exactly one such line, found by its
    prefix rather than its place (progress bars and any other process's note written to the
    same stderr around it do not move it)."""
    found = [line for line in rank_lines(stderr) if line.startswith("recast.py: stopped:")]
    assert len(found) == 1, stderr
    return found[0]


def start(*command, env=None) -> subprocess.Popen:
    """`python command` in the background, its output kept."""
    return subprocess.Popen([sys.executable, *command], cwd=HERE, env=env or ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def wait_for_epochs(out, n: int, proc: subprocess.Popen, poll: float = 0.1) -> None:
    """Until metrics.jsonl holds n lines (epoch 0 is the base model's), while `proc` runs."""
    while not (out / "metrics.jsonl").exists() or len(metrics_of(out)) < n:
        assert proc.poll() is None, proc.communicate()
        time.sleep(poll)


# ---------------------------------------------------------------------------------------------
# One run per folder: OUT/.lock
# ---------------------------------------------------------------------------------------------
HOLD = (
    "import sys\nsys.path.insert(0, {here!r})\nfrom plumbing import rundir\n"
    "rundir.lock_run({out!r})\n"
)


def hold_lock(out) -> subprocess.Popen:
    """Another process holding the run folder's lock, as a live run does, until it is killed."""
    code = HOLD.format(here=HERE, out=str(out)) + "print('held', flush=True)\nsys.stdin.read()\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_run_on_a_live_folder_exits_2_and_a_stale_lock_does_not_block(
    tmp_path, monkeypatch, capsys
):
    import recast

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    saved = recast.Args(lam="0.4,0.2,0.2,0.2", out="run")
    (out / "args.json").write_text(json.dumps(dataclasses.asdict(saved)))
    live = hold_lock(out)
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in out.iterdir()}
    tic = time.monotonic()
    with pytest.raises(SystemExit) as e:
        recast.main(["--out", "run", "--resume"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and time.monotonic() - tic < 5  # at once: before any model loads
    assert f"pid {live.pid} on host {socket.gethostname()}" in err
    assert "run/.lock" in err and err.startswith("recast.py: error: --out: run is in use by")
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in out.iterdir()} == before
    live.kill()  # SIGKILL: no clean-up ran, the lock file stays, its flock went with the process
    live.wait()
    assert (out / ".lock").read_text().startswith(f"pid {live.pid} ")
    rundir.lock_run("run")  # as --resume does: the stale lock does not block it
    try:
        assert (out / ".lock").read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    finally:
        os.close(rundir._locks.pop(str(out.resolve())))


# ---------------------------------------------------------------------------------------------
# SIGTERM: as the first SIGINT, on every rank
# ---------------------------------------------------------------------------------------------
def test_stop_signals_sigterm_asks_once_and_a_second_sigint_aborts(capsys):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = rundir.Stop()
        assert not stop.agreed() and stop.signum == 0
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler signals the launcher and each worker
        assert stop.received == [signal.SIGTERM, signal.SIGTERM]
        assert stop.agreed() and stop.signum == signal.SIGTERM  # exit 128 + 15 = 143
        assert capsys.readouterr().out.count("SIGTERM: finishing this epoch, then saving") == 1
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C after it: abort at once, as today
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


# the whole run and a --resume cost a minute or two more on the 2-core machine: slow
THEN_RESUME = [False, pytest.param(True, marks=pytest.mark.slow, id="then-resume")]


@pytest.mark.parametrize("resume", THEN_RESUME)
def test_sigterm_finishes_the_epoch_exits_143_and_resumes_exactly(tmp_path, request, resume):
    out = tmp_path / "run"
    proc = start(RECAST, *FLAGS, "--out", str(out))
    wait_for_epochs(out, 2, proc)  # epoch 1 done: the signal lands in epoch 2
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=900)  # a hang guard: one epoch, on a loaded machine
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr and "SIGTERM: finishing this epoch" in stdout
    done = metrics_of(out)[-1]["epoch"]
    assert done < 3 and f"stopped after epoch {done}; continue: python recast.py" in stdout
    assert sorted(os.listdir(out / "ckpt"))[-1] == f"epoch_{done:04d}"
    if resume:
        run_recast("--out", str(out), "--resume", env=ENV)
        assert without_times(metrics_of(out)) == without_times(request.getfixturevalue("whole"))


# ---------------------------------------------------------------------------------------------
# A full disk: the writer fails with ENOSPC part-way through a file
# ---------------------------------------------------------------------------------------------
def full_disk(monkeypatch, name: str, at_byte: int) -> None:
    """From now on checkpoint's writer, at a file whose path ends with `name`, writes its first
    `at_byte` bytes and fails with ENOSPC, as a write onto a full disk does."""
    write = checkpoints._write_synced

    def full(path, data, append=False):
        if path.endswith(name):
            write(path, data[:at_byte], append)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        write(path, data, append)

    monkeypatch.setattr(checkpoints, "_write_synced", full)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    return {"policy.w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))}


@pytest.mark.parametrize(
    "name,at_byte",
    [("model.safetensors", 5000), ("optim.pt", 0), ("optim.pt", 3000), ("state.json", 100)],
)
def test_a_full_disk_while_checkpointing_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, name, at_byte
):
    run = str(tmp_path)
    optim = {"state": {0: {"exp_avg": torch.ones(64, 64)}}, "param_groups": []}
    checkpoints.save(run, 1, _tensors(1), optim, {"opt_steps": 5, "gains_ema": None})
    with monkeypatch.context() as m:
        full_disk(m, os.path.join("epoch_0002.tmp", name), at_byte)
        with pytest.raises(checkpoints.WriteFailed) as e:
            checkpoints.save(run, 2, _tensors(2), optim, {"opt_steps": 10, "gains_ema": None})
    message = str(e.value)
    assert "\n" not in message and f"checkpoint {run}/ckpt/epoch_0002 in {run}" in message
    assert "the disk holding it is full ([Errno 28] No space left on device" in message
    assert f"({run}/ckpt/epoch_0001) is kept" in message
    assert f"continue: python recast.py --out {run} --resume" in message
    assert os.listdir(tmp_path / "ckpt") == ["epoch_0001"]  # the half-written one is gone
    tensors, _, state = checkpoints.load_latest(run)
    assert state["epoch"] == 1 and torch.equal(tensors["policy.w"], _tensors(1)["policy.w"])
    checkpoints.save(
        run, 2, _tensors(2), optim, {"opt_steps": 10, "gains_ema": None}
    )  # space freed
    assert checkpoints.load_latest(run)[2]["epoch"] == 2


def test_a_checkpoint_half_written_by_a_crash_is_never_picked_and_is_cleared(tmp_path):
    run, optim = str(tmp_path), {"state": {}, "param_groups": []}
    checkpoints.save(run, 1, _tensors(1), optim, {"opt_steps": 5, "gains_ema": None})
    half = tmp_path / "ckpt" / "epoch_0002.tmp"  # what SIGKILL (or a failed clean-up) leaves
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"\0" * 100)
    assert checkpoints.load_latest(run)[2]["epoch"] == 1
    checkpoints.save(run, 3, _tensors(3), optim, {"opt_steps": 15, "gains_ema": None})
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch_0001", "epoch_0003"]


@pytest.mark.parametrize(
    "edit,said",
    [
        (lambda s: s.pop("rng"), "state.json lacks rng"),
        (lambda s: s.update(sha256={}), "records no SHA-256 of model.safetensors and optim.pt"),
        (lambda s: s.update(epoch=7), "its state.json is epoch 7's"),
        (lambda s: s.update(epoch=2.0), "its state.json is epoch 2.0's"),
    ],
    ids=["a-key-missing", "no-hashes", "another-epoch", "not-a-whole-number"],
)
def test_a_checkpoint_whose_state_is_not_its_own_falls_back_to_the_previous_one(
    tmp_path, edit, said
):
    """A state.json that save did not write for its folder (something else's): unusable, named,
    and the previous checkpoint used. Before, a key missing stopped the resume in a KeyError
    traceback, and empty hashes vouched for files never checked."""
    run, optim = str(tmp_path), {"state": {}, "param_groups": []}
    for epoch in (1, 2):
        checkpoints.save(run, epoch, _tensors(epoch), optim, {"opt_steps": 5, "gains_ema": None})
    path = tmp_path / "ckpt" / "epoch_0002" / "state.json"
    state = json.loads(path.read_text())
    edit(state)
    path.write_text(json.dumps(state))
    notes = []
    assert checkpoints.load_latest(run, notes.append)[2]["epoch"] == 1
    assert len(notes) == 1 and "epoch_0002 is unusable (ValueError: " in notes[0]
    assert said in notes[0]


def test_unusable_checkpoints_never_prune_a_new_one_and_all_unusable_exits_2(tmp_path, capsys):
    """Both kept checkpoints truncated: --resume exits 2 naming them, having written nothing (it
    started the run over, cut metrics.jsonl back to epoch 0, and each checkpoint it wrote was
    pruned at once, the two unusable ones being the newest two). A checkpoint written below
    later ones removes those (load_latest skipped them) and is kept."""
    import recast

    run, optim = str(tmp_path), {"state": {}, "param_groups": []}
    for epoch in (5, 6):
        checkpoints.save(run, epoch, _tensors(epoch), optim, {"opt_steps": 5, "gains_ema": None})
        weights = tmp_path / "ckpt" / f"epoch_{epoch:04d}" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    write_lines(tmp_path / "metrics.jsonl", range(7))
    (tmp_path / "args.json").write_text("{}")
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    args = recast.Args(lam="0.4,0.2,0.2,0.2", out=run, resume=True, epochs=8)
    with pytest.raises(SystemExit) as e:
        rundir.start_or_resume(args, None, None, 0)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out.count("is unusable") == 2
    assert err.startswith(f"recast.py: error: --resume: {run} has checkpoints, and none is usable")
    assert f"move {run}/ckpt away to start the run over" in err
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    checkpoints.save(run, 1, _tensors(1), optim, {"opt_steps": 5, "gains_ema": None})
    assert os.listdir(tmp_path / "ckpt") == ["epoch_0001"]
    assert checkpoints.load_latest(run)[2]["epoch"] == 1


def test_checkpoints_past_epoch_9999_are_ordered_by_their_number(tmp_path):
    """epoch_10000 sorts before epoch_9999 by name: ordered so, the prune deleted the checkpoint
    just written and --resume took epoch 9999's. The newest two by number are kept and loaded."""
    run, optim = str(tmp_path), {"state": {}, "param_groups": []}
    for epoch in (9998, 9999, 10000):
        state = {"opt_steps": epoch, "gains_ema": None}
        checkpoints.save(run, epoch, _tensors(epoch), optim, state)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["epoch_10000", "epoch_9999"]
    assert checkpoints.load_latest(run)[2]["epoch"] == 10000
    assert checkpoints.newest(run) == os.path.join(run, "ckpt", "epoch_10000")


def test_a_full_disk_on_a_write_that_names_no_file_names_the_run_folder(
    tmp_path, monkeypatch, capsys
):
    """An OSError of a full disk raised by a write to an open file names no file (a third-party
    writer's): the one line still names this run's folder (the newest of the process), its
    newest checkpoint and the resume command of that folder, not '.'; on a rank other than 0
    too, which holds no lock."""
    monkeypatch.setattr(rundir, "_locks", {})
    monkeypatch.setattr(rundir, "_folders", [])
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "earlier").mkdir()
    rundir.lock_run(str(tmp_path / "earlier"))  # a run before it in this process (tests do)

    def main():
        rundir.lock_run(str(tmp_path))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(SystemExit) as e:
        rundir.run_main(main, ())
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1
    assert err.startswith(f"recast.py: stopped: could not write a file in {tmp_path}: the disk ")
    assert f"continue: python recast.py --out {tmp_path} --resume" in err

    def bare():  # a file named without its folder: not 'in ' and '--out '' --resume'
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "log.txt")

    with pytest.raises(SystemExit):
        rundir.run_main(bare, ())
    err = capsys.readouterr().err
    assert err.startswith(f"recast.py: stopped: could not write log.txt in {tmp_path}: the disk ")
    assert f"continue: python recast.py --out {tmp_path} --resume" in err
    os.close(rundir._locks.pop(str(tmp_path)))
    os.close(rundir._locks.pop(str(tmp_path / "earlier")))

    def other_rank():  # rank 1 of a run in `later`: rank 0 holds the lock, this rank none
        rundir.remember(str(tmp_path / "later"))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(SystemExit):
        rundir.run_main(other_rank, ())
    assert f"could not write a file in {tmp_path / 'later'}: " in capsys.readouterr().err


@pytest.mark.parametrize("ranked", [False, True], ids=["one process", "torchrun"])
@pytest.mark.parametrize("how", ["returns", "stops"])
def test_a_finished_rank_ends_without_the_interpreters_shutdown(ranked, how):
    """rundir.run_main under torchrun (RANK and WORLD_SIZE set): once main has returned, or
    stopped with the agreed signal's exit (143), the process ends at once with that code, its
    output flushed, the interpreter's shutdown (atexit, the process groups' threads' last
    release) skipped; in one process it ends as Python does."""
    main = "print('saved', end='')" if how == "returns" else "raise SystemExit(143)"
    code = ("import atexit, sys\nfrom plumbing import rundir\n"
            "atexit.register(lambda: sys.stdout.write(' atexit'))\n"
            f"def main():\n    {main}\nrundir.run_main(main, ())\n")  # fmt: skip
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE")}
    env.update({"RANK": "1", "WORLD_SIZE": "2"} if ranked else {})
    done = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True,
                          text=True)  # fmt: skip
    assert done.returncode == (0 if how == "returns" else 143), done.stderr
    said = "saved" if how == "returns" else ""
    assert done.stdout == (said if ranked else f"{said} atexit")


def test_a_full_disk_while_appending_metrics_leaves_no_torn_line(tmp_path, monkeypatch):
    run = str(tmp_path)
    checkpoints.append_metrics(run, {"epoch": 0, "eval/color": 0.5})
    before = (tmp_path / "metrics.jsonl").read_bytes()
    full_disk(monkeypatch, "metrics.jsonl", 7)
    with pytest.raises(checkpoints.WriteFailed) as e:
        checkpoints.append_metrics(run, {"epoch": 1, "loss": 1.0})
    assert f"could not write epoch 1 to metrics.jsonl in {run}: the disk" in str(e.value)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before  # the part written is cut off


@pytest.mark.parametrize("at_byte", [0, 5])
def test_a_full_disk_while_writing_a_json_file_keeps_the_old_one_whole(
    tmp_path, monkeypatch, at_byte
):
    path = str(tmp_path / "profile.json")
    checkpoints.write_json_atomic(path, {"epoch": 1, "rows": [1, 2, 3]})
    checkpoints.write_json_atomic(path, {"epoch": 2})  # a shorter one replaces it whole
    assert json.loads((tmp_path / "profile.json").read_text()) == {"epoch": 2}
    before = (tmp_path / "profile.json").read_bytes()
    full_disk(monkeypatch, "profile.json.tmp", at_byte)
    with pytest.raises(checkpoints.WriteFailed) as e:
        checkpoints.write_json_atomic(path, {"epoch": 3, "rows": list(range(100))})
    message = str(e.value)
    assert f"could not write profile.json in {tmp_path}: the disk holding it is full" in message
    assert (tmp_path / "profile.json").read_bytes() == before
    assert os.listdir(tmp_path) == ["profile.json"]  # the half-written temporary file is removed


def test_a_full_disk_while_a_new_run_writes_its_args_json_says_start_it_again(
    tmp_path, monkeypatch
):
    """A new run's args.json refused: the folder holds no run (its lock, no args.json), so the
    line says to start it again with the same command, not --resume (which would find no run),
    and that command is let into the folder."""
    import harness
    import recast
    from plumbing import cli

    monkeypatch.setattr(rundir, "_locks", {})
    args = recast.Args(lam="0.4,0.2,0.2,0.2", out=str(tmp_path / "run"))
    full_disk(monkeypatch, "args.json.tmp", 10)
    with pytest.raises(checkpoints.WriteFailed) as e:
        rundir.start_or_resume(args, None, None, 0)
    os.close(rundir._locks.pop(os.path.realpath(args.out)))
    assert "could not write args.json in" in str(e.value) and "--resume" not in str(e.value)
    assert "start it again with the same command" in str(e.value)
    assert os.listdir(args.out) == [".lock"]
    cli.check(args, 1, harness.RESUMABLE)  # no exit: the same command goes ahead


def test_a_resume_with_epochs_below_those_done_exits_2_writing_nothing(tmp_path, capsys):
    """--resume --epochs 2 of a run checkpointed at epoch 3: exit 2 naming --epochs, before any
    write (it wrote args.json with epochs 2 and a summary.json giving epoch 3's eval as that of
    2 epochs, which --export then called unfinished)."""
    import recast

    run, optim = str(tmp_path), {"state": {}, "param_groups": []}
    checkpoints.save(run, 3, _tensors(3), optim, {"opt_steps": 15, "gains_ema": None})
    write_lines(tmp_path / "metrics.jsonl", range(4))
    (tmp_path / "args.json").write_text("{}")
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    args = recast.Args(lam="0.4,0.2,0.2,0.2", out=run, resume=True, epochs=2)
    with pytest.raises(SystemExit) as e:
        rundir.start_or_resume(args, None, None, 0)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"recast.py: error: --epochs: {run} has done 3")
    assert "give --epochs 3 or more" in err
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


def test_a_finished_run_resumed_for_more_epochs_is_unfinished_until_it_ends(tmp_path):
    """--resume --epochs 5 of a run that finished at 3: its summary.json goes when it resumes and
    comes back at its end (kept, the run looked finished while it trained: comparison.py's `done`
    skipped it, and a kill left the old summary for a run of 5 epochs). A resume with nothing to
    run keeps it."""
    import types

    import recast

    run = str(tmp_path)
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    world = types.SimpleNamespace(load_state_dict=lambda d: None, device="cpu", trainable=model)
    checkpoints.save(run, 3, _tensors(3), optimizer.state_dict(), {"opt_steps": 15,
                                                                  "gains_ema": None})  # fmt: skip
    write_lines(tmp_path / "metrics.jsonl", range(4))
    (tmp_path / "args.json").write_text("{}")
    for epochs, kept in ((3, True), (5, False)):
        (tmp_path / "summary.json").write_text("{}")
        args = recast.Args(lam="0.4,0.2,0.2,0.2", out=run, resume=True, epochs=epochs)
        start = rundir.start_or_resume(args, world, optimizer, 0, log=lambda _: None)[0]
        assert start == 4 and (tmp_path / "summary.json").exists() == kept, epochs


def test_a_torn_environment_json_is_a_note_not_a_traceback(tmp_path):
    """A resumed run whose environment.json is torn goes on (the file is a record, not its
    state), saying that a change of environment since its start cannot be noticed; the file is
    left as it is. It ended the resume in a JSONDecodeError traceback."""
    (tmp_path / "environment.json").write_text('{"python": "3.1')
    notes = []
    rundir.keep_environment(str(tmp_path), notes.append)
    assert len(notes) == 1 and "environment.json is unreadable (JSONDecodeError" in notes[0]
    assert (tmp_path / "environment.json").read_text() == '{"python": "3.1'
    (tmp_path / "environment.json").unlink()
    rundir.keep_environment(str(tmp_path), notes.append)  # a new run's: written, no note
    assert len(notes) == 1 and json.loads((tmp_path / "environment.json").read_text())["torch"]
    rundir.keep_environment(str(tmp_path), notes.append)  # resumed where it started: no note
    assert len(notes) == 1


def test_a_stop_between_the_eval_images_renames_keeps_the_previous_set_readable(tmp_path):
    """eval_images.save moves the previous set aside (eval_images.old), then the new one in: a run
    stopped between the two renames has no eval_images/, and the readers (studies/judge.py,
    comparison.py) read the previous set, whole, instead of saying the run has none; the next
    eval puts a set back in place."""
    from plumbing import eval_images

    def images(value: float) -> torch.Tensor:
        return torch.full((2, 3, 4, 4), value)

    index = {"prompts": ["a", "b"], "noise_sha256": "0"}
    eval_images.save(str(tmp_path), images(-1.0), 0, {"epoch": 1, **index}, rank=0)
    os.replace(tmp_path / "eval_images", tmp_path / "eval_images.old")  # the stop, mid-swap
    (tmp_path / "eval_images.tmp").mkdir()  # the new set, not yet in place
    got, pixels = eval_images.load(str(tmp_path))
    assert got["epoch"] == 1 and torch.equal(pixels, images(-1.0))
    eval_images.save(str(tmp_path), images(1.0), 0, {"epoch": 3, **index}, rank=0)
    assert sorted(os.listdir(tmp_path)) == ["eval_images"]
    assert eval_images.load(str(tmp_path))[0]["epoch"] == 3


def test_a_scripts_result_file_is_replaced_whole_or_not_at_all(tmp_path):
    """The scripts' result files (diagnostic.json, anatomy.json, decode_memory.py's --convs) come
    at the end of minutes of work: an error part-way through json.dump (or a stop) must leave
    the earlier good file, not a half one in its place, and no part-written file beside it."""
    path = str(tmp_path / "diagnostic.json")
    checkpoints.write_whole(path, {"effect": [1.0, 2.0]})
    with pytest.raises(TypeError):  # json.dump has written "effect" before it fails
        checkpoints.write_whole(path, {"effect": [3.0], "bad": object()})
    assert json.loads(open(path).read()) == {"effect": [1.0, 2.0]}
    assert sorted(os.listdir(tmp_path)) == ["diagnostic.json"]  # the part written is removed
    checkpoints.write_whole(path, {"effect": [3.0]})
    assert json.loads(open(path).read()) == {"effect": [3.0]}
    assert sorted(os.listdir(tmp_path)) == ["diagnostic.json"]


@pytest.mark.parametrize("resume", THEN_RESUME)
def test_a_full_disk_stops_the_run_with_exit_1_and_resume_is_exact(tmp_path, request, resume):
    """ENOSPC 4 kB into optim.pt of epoch 2's checkpoint: a one-line message, exit 1; then, the
    disk freed, --resume redoes epoch 2 from epoch 1's checkpoint and matches the whole run."""
    patch = (
        "import errno, os\nfrom plumbing import checkpoints\nwrite = checkpoints._write_synced\n"
        "def full(path, data, append=False):\n"
        "    if path.endswith(os.path.join('epoch_0002.tmp', 'optim.pt')):\n"
        "        write(path, data[:4096], append)\n"
        "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)\n"
        "    write(path, data, append)\n"
        "checkpoints._write_synced = full"
    )
    out = tmp_path / "run"
    done = run_patched(tmp_path, patch, *FLAGS, "--out", str(out))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    message = stopped_message(done.stderr)
    assert message.startswith(f"recast.py: stopped: could not write checkpoint {out}/ckpt/")
    assert "the disk holding it is full ([Errno 28] No space left on device" in message
    assert f"continue: python recast.py --out {out} --resume" in message
    assert os.listdir(out / "ckpt") == ["epoch_0001"]
    if resume:
        run_recast("--out", str(out), "--resume", env=ENV)
        assert without_times(metrics_of(out)) == without_times(request.getfixturevalue("whole"))


# a write to an open file that a full disk refuses: a few bytes written, an OSError naming no file
FULL_WHEN = (
    "import errno, os, sys\n"
    "def full_at_epoch_2(path):\n"
    "    run = sys.argv[sys.argv.index('--out') + 1]\n"
    "    if os.path.isdir(os.path.join(run, 'ckpt', 'epoch_0001')):\n"
    "        with open(path, 'wb') as f:\n"
    "            f.write(b'PNG')\n"
    "        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))\n"
)
PICTURES = {  # (the patch that fills the disk as the picture is written, its name in the line)
    "W.png": ("import matplotlib.figure as mf\nsave = mf.Figure.savefig\n"
              "def full(self, fname, *args, **kwargs):\n"
              "    if str(fname).endswith('W.png'):\n"
              "        full_at_epoch_2(str(fname))\n"
              "    return save(self, fname, *args, **kwargs)\n"
              "mf.Figure.savefig = full", "W.png"),
    "eval-image": ("from PIL import Image\nsave = Image.Image.save\n"
                   "def full(self, fp, *args, **kwargs):\n"
                   "    if 'eval_images.tmp' in str(fp):\n"
                   "        full_at_epoch_2(str(fp))\n"
                   "    return save(self, fp, *args, **kwargs)\n"
                   "Image.Image.save = full", "eval_images/0000.png"),
}  # fmt: skip


@pytest.mark.parametrize("picture", PICTURES)
@pytest.mark.parametrize("resume", THEN_RESUME)
def test_a_full_disk_while_drawing_a_picture_stops_the_run_with_exit_1(
    tmp_path, request, resume, picture
):
    """ENOSPC while W.png, or an eval image, is written at epoch 2, as a write to an open file
    fails (a few bytes written, an OSError naming no file): exit 1, one line naming the file, the
    run folder, the disk, the newest checkpoint (epoch 1's: epoch 2's is written after its
    pictures) and the --resume command; then, the disk freed, --resume matches the whole run."""
    patch, name = PICTURES[picture]
    out = tmp_path / "run"
    done = run_patched(tmp_path, FULL_WHEN + patch, *FLAGS, "--out", str(out))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    message = stopped_message(done.stderr)
    assert message.startswith(f"recast.py: stopped: could not write {name} in {out}: the disk")
    assert "the disk holding it is full ([Errno 28] No space left on device" in message
    assert f"({out}/ckpt/epoch_0001) is kept" in message
    assert f"continue: python recast.py --out {out} --resume" in message
    assert os.listdir(out / "ckpt") == ["epoch_0001"]
    if resume:
        run_recast("--out", str(out), "--resume", env=ENV)
        assert without_times(metrics_of(out)) == without_times(request.getfixturevalue("whole"))


# ---------------------------------------------------------------------------------------------
# A torn metrics.jsonl: the last line cut by a crash while appending
# ---------------------------------------------------------------------------------------------
def write_lines(path, epochs, tail: str = "") -> None:
    path.write_text("".join(json.dumps({"epoch": e, "loss": 1.0}) + "\n" for e in epochs) + tail)


TORN = '{"epoch": 3, "loss": 0.9, "W": [[0.1, 0.'  # no newline
GARBAGE = "\0\0\0\0\n"  # a power loss after the file grew, before its data landed


@pytest.mark.parametrize("tail", [TORN, GARBAGE])
def test_readers_skip_a_torn_last_line_with_a_warning(tmp_path, capsys, tail):
    write_lines(tmp_path / "metrics.jsonl", range(3), tail)
    assert [m["epoch"] for m in checkpoints.read_metrics(str(tmp_path))] == [0, 1, 2]
    assert "metrics.jsonl: its torn last line" in capsys.readouterr().err
    write_lines(tmp_path / "metrics.jsonl", range(3), '{"epoch": 3, "loss": 0.9}')  # whole
    assert [m["epoch"] for m in checkpoints.read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 0}\n{"epo\n{"epoch": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not JSON"):
        checkpoints.read_metrics(str(tmp_path))  # not a crash's tear: a damaged file


def test_benchmark_readers_skip_a_torn_last_line(tmp_path, capsys):
    """summarize.py and gpu_check.py's comparison read runs whose log a crash tore (comparison.py
    and recipe.py read through checkpoints.read_metrics too)."""
    from benchmarks import gpu_check
    from studies import summarize
    from studies.test_summarize import fake_run

    runs = [fake_run(tmp_path / s, seed, {"position": 0.5, "background": 0.1, "iou": 0.2})
            for s, seed in (("s0", 0), ("s1", 1))]  # fmt: skip
    for run in runs:
        with open(os.path.join(run, "metrics.jsonl"), "a") as f:
            f.write(TORN)
    summarize.main(runs)
    out, err = capsys.readouterr()
    assert "| position | +0.000 | +0.500 ± 0.000 |" in out
    assert err.count("its torn last line") == 2
    lines = [{"epoch": e, "reward/color": 0.1 * e, "W": [[0.25, 0.25], [0.25, 0.25]],
              "loss": 1.0} for e in range(3)]  # fmt: skip
    for run in ("cpu", "cuda"):
        (tmp_path / run).mkdir()
        text = "".join(json.dumps(m) + "\n" for m in lines)
        (tmp_path / run / "metrics.jsonl").write_text(text + GARBAGE)
    ok, table = gpu_check.compare_toy_runs(tmp_path / "cpu", tmp_path / "cuda")
    assert ok and "| 2 | reward/color | 0.2 | 0.2 | 0 |" in table
    assert capsys.readouterr().err.count("its torn last line") == 2


@pytest.mark.parametrize(
    "epochs,tail,ckpt,kept,note",
    [
        (range(3), TORN, 2, 3, "dropped its torn last line"),  # torn while appending epoch 3
        (range(3), GARBAGE, 2, 3, "dropped its torn last line"),
        (range(5), TORN, 2, 3, "dropped its torn last line"),  # lines after the checkpoint go
        (range(3), '{"epoch": 3, "loss": 0.9}', 2, 3, "dropped its last line (epoch 3"),
        (range(3), '{"epoch": 2, "loss": 0.9}', 1, 2, "dropped its last line (epoch 2"),
        ([], TORN, None, 0, "with no checkpoint yet"),  # killed while writing the base eval
        (range(1), TORN, None, 1, "with no checkpoint yet"),
        (range(2), TORN, 2, None, "stop at epoch 1, while the checkpoint holds epoch 2"),
        ([0, 2], "", 2, None, "holds epochs [0, 2] up to the checkpoint's epoch 2"),
        ([0, 1, 1, 2], "", 2, None, "holds epochs [0, 1, 1, 2]"),
    ],
)
def test_resume_drops_a_torn_line_after_the_checkpoint_and_refuses_one_it_needs(
    tmp_path, capsys, epochs, tail, ckpt, kept, note
):
    write_lines(tmp_path / "metrics.jsonl", epochs, tail)
    if kept is None:  # the checkpoint's own epochs are not all there: exit 2 naming the file
        with pytest.raises(SystemExit) as e:
            checkpoints.resume_metrics(str(tmp_path), ckpt)
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"--resume: {tmp_path}/metrics.jsonl" in err
        assert note in err
        return
    history = checkpoints.resume_metrics(str(tmp_path), ckpt)
    assert [m["epoch"] for m in history] == list(range(kept))  # each epoch once
    printed = capsys.readouterr().out
    assert (note in printed) if note else printed == ""


@pytest.mark.parametrize(
    "line,said",
    [
        ("[1, 2]", "JSON, but not an epoch's record: a list"),
        ('{"loss": 1.0}', "JSON, but not an epoch's record: it has no epoch"),
        ('{"epoch": "1", "loss": 1.0}', "JSON, but not an epoch's record: its epoch is '1'"),
    ],
)
def test_a_metrics_line_that_is_not_an_epochs_record_exits_2_naming_it(
    tmp_path, capsys, line, said
):
    """A metrics.jsonl that something else wrote or damaged, its line 2 JSON but not an epoch's
    record: --resume exits 2 naming the file and the line (it ended in a TypeError or KeyError
    traceback), and the readers raise the ValueError of a line that is not JSON."""
    (tmp_path / "metrics.jsonl").write_text(f'{{"epoch": 0}}\n{line}\n{{"epoch": 2}}\n')
    with pytest.raises(SystemExit) as e:
        checkpoints.resume_metrics(str(tmp_path), 2)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--resume: {tmp_path}/metrics.jsonl, line 2: {said}" in err
    with pytest.raises(ValueError, match=f"metrics.jsonl, line 2: {re.escape(said)}"):
        checkpoints.read_metrics(str(tmp_path))


@pytest.mark.slow
def test_a_crash_mid_append_tears_the_log_and_resume_drops_it(tmp_path, whole):
    """The process dies (SIGKILL) half-way through appending epoch 2's line: --resume says it
    drops the torn line, and the final metrics.jsonl has each epoch once, as the whole run's."""
    patch = (
        "import os, signal\nfrom plumbing import checkpoints\nwrite = checkpoints._write_synced\n"
        "def crash(path, data, append=False):\n"
        "    if append and data.startswith(b'{\"epoch\": 2,'):\n"
        "        write(path, data[:len(data) // 2], append)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    write(path, data, append)\n"
        "checkpoints._write_synced = crash"
    )
    out = tmp_path / "run"
    assert run_patched(tmp_path, patch, *FLAGS, "--out", str(out)).returncode == -signal.SIGKILL
    assert not (out / "metrics.jsonl").read_text().endswith("\n")
    done = run_recast("--out", str(out), "--resume", env=ENV)
    assert "metrics.jsonl: dropped its torn last line" in done.stdout
    assert "resuming" in done.stdout and "after epoch 1" in done.stdout
    assert without_times(metrics_of(out)) == without_times(whole)


@pytest.mark.slow
def test_a_live_run_refuses_a_second_one_and_after_sigkill_resume_is_exact(tmp_path, whole):
    """The run in --out holds its lock: a second recast.py exits 2 before loading anything; once
    the first is killed (SIGKILL: no clean-up), the lock it leaves does not block --resume."""
    out = tmp_path / "run"
    first = start(RECAST, *FLAGS, "--out", str(out))
    wait_for_epochs(out, 2, first)
    second = run_recast("--out", str(out), "--resume", check=False, env=ENV)
    assert second.returncode == 2 and "resuming" not in second.stdout, second.stderr
    assert f"{out} is in use by pid {first.pid} on host {socket.gethostname()}" in second.stderr
    assert first.poll() is None  # untouched
    first.kill()
    first.communicate()
    run_recast("--out", str(out), "--resume", env=ENV)
    assert without_times(metrics_of(out)) == without_times(whole)


def test_the_two_timeouts_come_from_their_variables_and_a_bad_one_exits_2(monkeypatch, capsys):
    """Loading waits RECAST_STARTUP_TIMEOUT (1800 s), the loop RECAST_COLLECTIVE_TIMEOUT (300 s);
    a value that is not a number of seconds > 0 exits 2 naming the variable."""
    from plumbing import distributed

    for name in ("RECAST_STARTUP_TIMEOUT", "RECAST_COLLECTIVE_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.startup_timeout().total_seconds() == 1800
    assert distributed.collective_timeout().total_seconds() == 300
    monkeypatch.setenv("RECAST_STARTUP_TIMEOUT", "3600")
    assert distributed.startup_timeout().total_seconds() == 3600
    for name, read in (("RECAST_STARTUP_TIMEOUT", distributed.startup_timeout),
                       ("RECAST_COLLECTIVE_TIMEOUT", distributed.collective_timeout)):  # fmt: skip
        for bad in ("soon", "0", "-5", "inf", "nan", ""):
            monkeypatch.setenv(name, bad)
            with pytest.raises(SystemExit) as e:
                read()
            assert e.value.code == 2 and f"error: {name}" in capsys.readouterr().err, (name, bad)
        monkeypatch.delenv(name)


def test_nccl_diagnostics_are_set_where_the_environment_does_not(monkeypatch):
    """On nccl the watchdog's teardown, its monitoring, the flight recorder and its dump on a
    timeout are on unless the environment says otherwise: a variable already set is kept."""
    from plumbing import distributed

    for name in distributed.NCCL_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    set_now = distributed.nccl_environment()
    assert set_now == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1",
                       "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}  # fmt: skip
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    assert all(os.environ[k] == v for k, v in set_now.items())
    assert distributed.nccl_environment() == {}  # all set now: nothing more


def test_a_cuda_rank_binds_its_process_group_to_its_gpu(monkeypatch):
    """On CUDA a rank takes its GPU (LOCAL_RANK) first, then makes the nccl group bound to it
    (init_process_group's device_id, after torch.cuda.set_device); on the CPU the gloo group gets
    no device_id and no GPU is set. torch.cuda and init_process_group are stand-ins here that
    record their calls in order (this machine has no GPU); the timeouts are the start-up's."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from plumbing import distributed

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw)))  # fmt: skip
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed, "seed_all", lambda seed: calls.append(("seed", seed)))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RECAST_STARTUP_TIMEOUT", "77")
    for name in distributed.NCCL_ENVIRONMENT:  # set by init_processes: restored afterwards
        monkeypatch.setenv(name, "1")
        monkeypatch.delenv(name)
    cuda = torch.device("cuda", 1)
    rank, device = distributed.init_processes(SimpleNamespace(device="auto", seed=5, out="run"),
                                              distributed=True)  # fmt: skip
    startup = distributed.startup_timeout()  # 77 s
    assert (rank, device) == (1, cuda) and startup.total_seconds() == 77
    nccl = ("init", "nccl", {"timeout": startup, "device_id": cuda})
    assert calls == [("set_device", cuda), nccl, ("seed", 6)]
    calls.clear()
    rank, device = distributed.init_processes(SimpleNamespace(device="cpu", seed=5, out="run"),
                                              distributed=True)  # fmt: skip
    assert (rank, device) == (1, torch.device("cpu"))
    assert calls == [("init", "gloo", {"timeout": startup}), ("seed", 6)]


def _timeouts_worker(rank: int, world: int, port: int, per_node: int, results) -> None:
    """One of `world` gloo ranks, numbered as torchrun numbers `per_node` ranks a node: the
    seconds each of its process groups would wait after init_processes and --shard's mesh, and
    after start_training."""
    from types import SimpleNamespace

    from plumbing import distributed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % per_node),
                      LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node),
                      RECAST_STARTUP_TIMEOUT="77", RECAST_COLLECTIVE_TIMEOUT="11")  # fmt: skip
    import torch.distributed as dist

    def held() -> list[float]:  # each group's, as its gloo backend holds it
        c10d, cpu = dist.distributed_c10d, torch.device("cpu")
        groups = [g for g in c10d._world.pg_map if not c10d._rank_not_in_group(g)]
        return [g._get_backend(cpu).options._timeout.total_seconds() for g in groups]

    try:
        distributed.init_processes(SimpleNamespace(device="cpu", seed=0), distributed=True)
        distributed.shard_mesh(torch.device("cpu"))
        before = held()
        distributed.start_training()
        results.put((rank, {"startup": before, "loop": held()}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("nodes", [1, 2])
def test_every_group_waits_the_startup_timeout_then_the_loops(tmp_path, nodes):
    """Under --shard, every process group a rank is in, the default one and the mesh's (HSDP's
    2-D mesh on 2 nodes of 2 ranks: init_device_mesh makes its groups with torch's default
    timeout, 30 min on gloo), waits RECAST_STARTUP_TIMEOUT until training starts and
    RECAST_COLLECTIVE_TIMEOUT after (4 gloo ranks)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_timeouts_worker, args=(4, port, 4 // nodes, results), nprocs=4)
    said = dict(results.get() for _ in range(4))
    for rank, x in said.items():
        assert len(x["startup"]) == (3 if nodes == 2 else 1) == len(x["loop"]), (rank, x)
        assert set(x["startup"]) == {77.0} and set(x["loop"]) == {11.0}, (rank, x)


# ---------------------------------------------------------------------------------------------
# torchrun on 2 CPU processes (gloo): SIGTERM, a dead rank, a rank that stops answering, a node
# ---------------------------------------------------------------------------------------------
TORCH_FLAGS = [*FLAGS, "--device", "cpu"]


def torchrun(out, *flags, node: int | None = None, port: int = 0, launcher=()) -> list[str]:
    """torchrun's command line: 2 ranks on this machine, or (node 0 or 1) one of two nodes of one
    rank each, meeting through a c10d rendezvous on localhost:port."""
    if node is None:
        launch = ["--standalone", "--nproc-per-node=2"]
    else:
        launch = ["--nnodes=2", "--nproc-per-node=1", "--max-restarts=0", "--rdzv-id=faults",
                  "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]  # fmt: skip
    return torchrun_args(out, *launch, *launcher, RECAST, *flags, "--out", str(out))


def workers(launcher: int) -> dict[int, int]:
    """{rank: pid} of the worker processes a torchrun launcher started."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        rank = [e[5:] for e in env if e.startswith(b"RANK=")]
        if ppid == launcher and rank:
            found[int(rank[0])] = int(pid)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def assert_matches(got: list[dict], expected: list[dict]) -> None:
    """Within the torchrun tolerances of docs/sd35.md: W within 1e-5, rewards, evals and the
    loss within 1e-4 relative; the same epochs, each once."""
    assert [m["epoch"] for m in got] == [m["epoch"] for m in expected]
    for a, b in zip(got[1:], expected[1:], strict=True):
        assert torch.allclose(torch.tensor(a["W"]), torch.tensor(b["W"]), atol=1e-5)
        for k in [k for k in b if k.startswith(("reward/", "eval/"))] + ["loss"]:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


@pytest.fixture(scope="module")
def whole_2ranks(tmp_path_factory) -> list[dict]:
    """metrics.jsonl of the uninterrupted 2-rank run."""
    out = tmp_path_factory.mktemp("whole_2ranks") / "run"
    subprocess.run([sys.executable, *torchrun(out, *TORCH_FLAGS)], cwd=HERE, env=ENV, check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    return metrics_of(out)


def resume_2ranks(out) -> None:
    done = subprocess.run([sys.executable, *torchrun(out, "--resume")], cwd=HERE, env=ENV,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, ranks_said(out)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_torchrun_sigterm_stops_every_rank_after_the_same_epoch_and_resume_matches(
    tmp_path, whole_2ranks, target
):
    """SIGTERM to the launcher (which forwards it to each worker), or to rank 1 alone: every rank
    finishes the epoch and stops after the same one (they agree at each epoch's end), rank 0
    checkpoints it and prints the --resume command; torchrun --resume then matches."""
    out = tmp_path / "run"
    proc = start(*torchrun(out, *TORCH_FLAGS))
    wait_for_epochs(out, 2, proc)  # epoch 1 done
    os.kill(proc.pid if target == "launcher" else workers(proc.pid)[1], signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    done = metrics_of(out)[-1]["epoch"]
    assert proc.returncode != 0 and "lost contact" not in stderr, ranks_said(out)
    assert f"stopped after epoch {done}; continue: torchrun --standalone --nproc-per-node=2 " \
           f"recast.py --out {out} --resume" in stdout  # fmt: skip
    assert set(re.findall(r"exitcode\s*: (-?\d+)", stderr)) <= {"143"}, ranks_said(out)
    assert sorted(os.listdir(out / "ckpt"))[-1] == f"epoch_{done:04d}" and done < 3
    resume_2ranks(out)
    assert_matches(metrics_of(out), whole_2ranks)


@pytest.mark.slow
def test_torchrun_a_dead_rank_stops_the_survivor_within_60s_and_resume_matches(
    tmp_path, whole_2ranks
):
    out = tmp_path / "run"
    proc = start(*torchrun(out, *TORCH_FLAGS))
    wait_for_epochs(out, 2, proc)
    time.sleep(0.5)  # into epoch 2
    os.kill(workers(proc.pid)[1], signal.SIGKILL)
    tic = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.monotonic() - tic < 60
    assert "recast.py: stopped: rank 0 lost contact: rank 1 stopped answering" in stderr
    assert f"continue: torchrun --standalone --nproc-per-node=2 recast.py --out {out} --resume" \
        in stderr  # fmt: skip
    resume_2ranks(out)
    assert_matches(metrics_of(out), whole_2ranks)


@pytest.mark.slow
def test_torchrun_a_rank_that_stops_answering_is_named_after_the_collective_timeout(tmp_path):
    """SIGSTOP rank 1: its connections stay open, so only the collective timeout (here
    RECAST_COLLECTIVE_TIMEOUT=10 s) ends rank 0's wait; rank 0 names it and exits."""
    out = tmp_path / "run"
    env = {**ENV, "RECAST_COLLECTIVE_TIMEOUT": "10"}
    proc = start(*torchrun(out, *TORCH_FLAGS, launcher=["--shutdown-timeout=2"]), env=env)
    wait_for_epochs(out, 2, proc)
    hung = workers(proc.pid)[1]
    os.kill(hung, signal.SIGSTOP)
    tic = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # torchrun may have killed it already
            os.kill(hung, signal.SIGKILL)
    assert proc.returncode != 0 and time.monotonic() - tic < 60
    assert "rank 0 lost contact: rank 1 stopped answering" in stderr
    assert "Timed out" in stderr and "raise RECAST_COLLECTIVE_TIMEOUT (now 10 s)" in stderr


@pytest.mark.slow
@pytest.mark.parametrize("lost", [1, 0], ids=["other-node", "store-host-node"])
def test_torchrun_a_lost_node_stops_the_other_within_60s_and_resume_matches(
    tmp_path, whole_2ranks, lost
):
    """Two launchers on this machine as two nodes (one rank each); SIGKILL one node's launcher and
    its worker. The other node's rank names the lost rank (or, when the lost node hosted the
    rendezvous store, says so), prints --resume and exits; two launchers then finish the run."""
    out = tmp_path / "run"

    def two_nodes(*flags) -> list[subprocess.Popen]:
        port, nodes = free_port(), []
        for node in (0, 1):  # node 0 first: it hosts the rendezvous store
            nodes.append(start(*torchrun(out, *flags, node=node, port=port)))
            while node == 0 and not listening(port):
                assert nodes[0].poll() is None, nodes[0].communicate()
                time.sleep(0.1)
        return nodes

    nodes = two_nodes(*TORCH_FLAGS)
    wait_for_epochs(out, 2, nodes[0])
    time.sleep(0.5)  # into epoch 2
    (rank, worker), = workers(nodes[lost].pid).items()  # fmt: skip
    nodes[lost].kill()  # the node's launcher and its worker, both SIGKILL
    os.kill(worker, signal.SIGKILL)
    nodes[lost].wait()
    tic = time.monotonic()
    _, stderr = nodes[1 - lost].communicate(timeout=120)
    assert nodes[1 - lost].returncode != 0 and time.monotonic() - tic < 60
    said = f"lost contact: rank {rank} stopped answering" if lost == 1 else (
        "lost contact: the rendezvous store does not answer either")  # fmt: skip
    assert said in stderr and f"recast.py --out {out} --resume" in stderr, ranks_said(out)
    resumed = two_nodes("--resume")
    for node in resumed:
        node.communicate(timeout=600)
        assert node.returncode == 0, ranks_said(out)
    assert_matches(metrics_of(out), whole_2ranks)


# ---------------------------------------------------------------------------------------------
# torchrun: a run folder that a rank does not see, a rank that reads another checkpoint, a rank
# slow to load (the start-up timeout)
# ---------------------------------------------------------------------------------------------
WRAPPED = (
    "import os, runpy, sys, time\nsys.path.insert(0, {here!r})\n{patch}\n"
    "sys.argv = ['recast.py', *sys.argv[1:]]\nrunpy.run_path({recast!r}, run_name='__main__')\n"
)


def torchrun_patched(tmp_path, cwd, patch: str, *flags, env=None) -> subprocess.CompletedProcess:
    """torchrun on 2 ranks of recast.py, with `patch` run first in each worker, launched in
    `cwd`."""
    script = tmp_path / "wrapped.py"
    script.write_text(WRAPPED.format(here=HERE, patch=patch, recast=RECAST))
    logged = torchrun_args(tmp_path / "run", "--standalone", "--nproc-per-node=2", str(script),
                           *flags)  # each rank's output under tmp_path/run-ranks  # fmt: skip
    return subprocess.run([sys.executable, *logged], cwd=cwd, env=env or ENV,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


RANK_1_ELSEWHERE = "if os.environ['RANK'] == '1':\n    os.chdir({other!r})"  # its own ./run
STALE_LISTING = (  # rank 1's node lists ckpt/ without its newest checkpoint
    "from plumbing import checkpoints\nlisted = checkpoints._checkpoints\n"
    "if os.environ['RANK'] == '1':\n    checkpoints._checkpoints = lambda root: listed(root)[:-1]"
)


@pytest.mark.slow
def test_torchrun_a_run_folder_a_rank_does_not_see_exits_2_naming_it_and_the_rank(tmp_path):
    """`--out run` (relative) with rank 1 in another folder, as on a node where --out is not the
    shared folder: a new run exits 2 naming the folder and rank 1, leaving nothing on either side;
    a copy of a finished run (the same files, another folder) too, on --resume. A rank whose
    listing of ckpt/ is stale (it reads the previous checkpoint) exits 2 naming what each rank
    read, before anything is written."""
    here, there = tmp_path / "node0", tmp_path / "node1"
    here.mkdir()
    there.mkdir()
    env = {**ENV, "RECAST_SHARED_WAIT": "1"}
    elsewhere = RANK_1_ELSEWHERE.format(other=str(there))
    flags = [*TORCH_FLAGS, "--epochs", "2", "--out", "run"]
    done = torchrun_patched(tmp_path, here, elsewhere, *flags, env=env)
    said = stopped_lines(done.stderr, "recast.py: error: --out: run is not one folder")
    assert done.returncode != 0 and "rank 1 (" in said, ranks_said(tmp_path / "run")
    assert not (here / "run").exists() and not (there / "run").exists()

    done = torchrun_patched(tmp_path, here, "", *flags, env=env)  # both ranks in node0
    assert done.returncode == 0, ranks_said(tmp_path / "run")
    before = files(here / "run")
    shutil.copytree(here / "run", there / "run")  # rank 1's node: a copy, not the folder
    resume = ["--out", "run", "--resume", "--epochs", "3"]
    done = torchrun_patched(tmp_path, here, elsewhere, *resume, env=env)
    said = stopped_lines(done.stderr, "recast.py: error: --out: run is not one folder")
    assert done.returncode != 0 and "rank 1 (" in said, ranks_said(tmp_path / "run")

    done = torchrun_patched(tmp_path, here, STALE_LISTING, *resume, env=env)
    said = stopped_lines(done.stderr, "recast.py: error: --resume: the ranks read different")
    assert done.returncode != 0, ranks_said(tmp_path / "run")
    assert "rank 0 (" in said and "read ckpt/epoch_0002; rank 1 (" in said, said
    assert "read ckpt/epoch_0001" in said
    assert files(here / "run") == before  # no token left; metrics.jsonl, args.json as they were


def files(out) -> dict:
    """{path: bytes} of a run folder's files but its lock (which each launch rewrites)."""
    return {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_torchrun_a_rank_slow_to_load_waits_the_start_up_timeout_not_the_loops(tmp_path):
    """Rank 1 takes 15 s longer to build its world than rank 0, past RECAST_COLLECTIVE_TIMEOUT=6
    (the loop's) but within the start-up's (RECAST_STARTUP_TIMEOUT, default 1800 s): the run
    trains. (The loop's own timeout: test_torchrun_a_rank_that_stops_answering_*.)"""
    slow = (
        "from worlds import toyworld\nbuild = toyworld.ToyWorld.__init__\n"
        "def slow(self, *a, **k):\n    time.sleep(15 * (os.environ['RANK'] == '1'))\n"
        "    build(self, *a, **k)\ntoyworld.ToyWorld.__init__ = slow"
    )
    env = {**ENV, "RECAST_COLLECTIVE_TIMEOUT": "6"}
    flags = [*TORCH_FLAGS, "--epochs", "1", "--out", str(tmp_path / "run")]
    done = torchrun_patched(tmp_path, HERE, slow, *flags, env=env)
    assert done.returncode == 0, ranks_said(tmp_path / "run")
    assert [m["epoch"] for m in metrics_of(tmp_path / "run")] == [0, 1]


def stopped_lines(stderr: str, prefix: str) -> str:
    """The lines of stderr that start with `prefix` (one per rank that says it; torchrun's
    `[default0]:` before a rank's line, torchrun_args' --tee, does not count), joined."""
    return "\n".join(line for line in rank_lines(stderr) if line.startswith(prefix))
