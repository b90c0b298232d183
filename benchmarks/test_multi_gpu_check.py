"""Tests of benchmarks/multi_gpu_check.py: which steps run for a number of GPUs and why the
others are skipped; bad input exits 2 naming the flag and writes nothing; the comparisons fail on
runs that differ; and (slow) the whole check end to end on 2 gloo processes, and on 1 (the steps
a one-GPU machine runs):

    python -m pytest -q benchmarks/test_multi_gpu_check.py           # seconds
    python -m pytest -q -m slow benchmarks/test_multi_gpu_check.py   # + the two checks: ~6 min
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import multi_gpu_check as mgc

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("gpus", "skipped"), [(1, {"toy", "hsdp"}), (2, {"hsdp"}), (3, {"hsdp"}), (4, set())]
)
def test_the_plan_runs_what_the_gpus_allow_and_says_why_not(gpus, skipped, tmp_path, capsys,
                                                             monkeypatch):  # fmt: skip
    """--plan lists every step, in order, with "to run" or the reason it is skipped, and writes
    nothing; one GPU runs the single-device steps (shard, kill, resume) only."""
    monkeypatch.chdir(tmp_path)
    assert mgc.main(["--gpus", str(gpus), "--device", "cpu", "--plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["toy", "shard", "hsdp", "kill", "resume"]
    said = {line.split()[0]: line for line in lines}
    for name, line in said.items():
        if name in skipped:
            assert line.endswith(": skipped: " + dict((s[0], s[3]) for s in mgc.STEPS)[name])
            assert "GPUs" in line
        else:
            assert line.endswith(": to run"), line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "flag", "said"),
    [
        (["--gpus", "0", "--device", "cpu"], "--gpus", "must be ≥ 1, got 0"),
        (["--gpus", "-2", "--device", "cpu"], "--gpus", "must be ≥ 1, got -2"),
        (["--gpus", "2", "--device", "cpu", "--budget", "0"], "--budget", "seconds > 0"),
        (["--gpus", "2", "--device", "cpu", "--budget", "nan"], "--budget", "seconds > 0"),
        (["--gpus", "two", "--device", "cpu"], "--gpus", "invalid int value"),  # argparse's:
        (["--gpus", "2", "--device", "gpu"], "--device", "invalid choice"),  # one line too
    ],
)
def test_bad_input_exits_2_naming_the_flag_and_writes_nothing(flags, flag, said, tmp_path,
                                                              capsys):  # fmt: skip
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        mgc.main([*flags, "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"multi_gpu_check.py: error: {flag}: " in err and said in err
    assert err.count("\n") == 1 and not out.exists()


def test_more_gpus_than_visible_or_none_exit_2(tmp_path, capsys, monkeypatch):
    """On CUDA, --gpus beyond the GPUs visible exits 2 naming --gpus and how many there are; no
    GPU at all names --device and the CPU's way; an --out that holds files names --out."""
    out = tmp_path / "out"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as e:
        mgc.main(["--gpus", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --gpus: 2 asked for, 1 visible" in err
    assert "use --gpus 1 or fewer" in err
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as e:
        mgc.main(["--gpus", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --device: cuda: no CUDA device" in err
    assert "--device cpu" in err and not out.exists()
    out.mkdir()
    (out / "report.md").write_text("an earlier report")
    with pytest.raises(SystemExit) as e:
        mgc.main(["--gpus", "2", "--device", "cpu", "--out", str(out)])
    assert e.value.code == 2 and "error: --out: " in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["report.md"]


def fake_run(folder: Path, w: float = 0.25, loss: float = 1.0, lora_b: float = 0.05,
             reward: float = 0.0) -> Path:  # fmt: skip
    """A run folder: metrics.jsonl of epochs 0-3 (the rewards moved by `reward`), and epoch 3's
    checkpoint of two LoRA tensors."""
    folder.mkdir(parents=True)
    lines = [{"epoch": 0, "eval/pickscore": 0.5}]
    lines += [{"epoch": e, "reward/pickscore": 0.1 * e + reward, "eval/pickscore": 0.5,
               "loss": loss, "W": [[w, 0.25], [0.25, 0.25]]} for e in (1, 2, 3)]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    ckpt = folder / "ckpt" / "epoch_0003"
    ckpt.mkdir(parents=True)
    save_file({"t.lora_A.default.weight": torch.ones(4, 8),
               "t.lora_B.default.weight": torch.full((8, 4), lora_b)},
              ckpt / "model.safetensors")  # fmt: skip
    return folder


def test_comparisons_pass_within_tolerance_and_fail_beyond(tmp_path):
    """The verdict can fail: W, the loss, a reward, the adapters or a missing epoch beyond the CUDA
    tolerances of the tiny SD3 each fail the comparison; within them it passes."""
    tol, epochs = mgc.TOLERANCES["sd3", "cuda"], [0, 1, 2, 3]
    ref = fake_run(tmp_path / "ref")
    close = fake_run(tmp_path / "close", w=0.25 + 1e-3, loss=1.01, lora_b=0.05 * 1.01)
    ok, rows = mgc.compare(close, ref, tol, epochs)
    assert ok and {r[0] for r in rows} >= {"loss", "W (largest entry difference)",
                                           "reward/pickscore", "eval/pickscore"}  # fmt: skip
    assert rows[-1][0].startswith("LoRA B") and rows[-1][-1]
    for name, kwargs, failing in (("w", {"w": 0.26}, "W (largest entry difference)"),
                                  ("loss", {"loss": 1.05}, "loss"),
                                  ("reward", {"reward": 0.05}, "reward/pickscore"),
                                  ("lora", {"lora_b": 0.06}, "LoRA B")):  # fmt: skip
        ok, rows = mgc.compare(fake_run(tmp_path / name, **kwargs), ref, tol, epochs)
        assert not ok and [r[0] for r in rows if not r[-1]][0].startswith(failing), rows
    ok, rows = mgc.compare(ref, ref, tol, [0, 1, 2, 3, 4])
    assert not ok and rows[0][0] == "epochs"
    toy = mgc.TOLERANCES["toy", "cpu"]  # no adapters: metrics only
    assert math.isnan(toy.lora)
    ok, rows = mgc.compare(ref, ref, toy, epochs)
    assert ok and not any(r[0].startswith("LoRA") for r in rows)


def check_on_cpu(out: Path, gpus: int) -> tuple[dict, str]:
    """`python benchmarks/multi_gpu_check.py --gpus N --device cpu`: (its report.json, its
    report.md)."""
    done = subprocess.run([sys.executable, "benchmarks/multi_gpu_check.py", "--gpus", str(gpus),
                           "--device", "cpu", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=2400)  # a hang guard only  # fmt: skip
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


@pytest.mark.slow
def test_the_check_runs_end_to_end_on_two_gloo_ranks(tmp_path):
    """Every step 2 ranks allow passes: the toy world on 2 ranks equals one process, --shard
    equals DDP, the last rank killed in epoch 2 ends the other within KILL_LIMIT_S naming the
    --resume command, and the run resumed on 1 rank equals the unbroken one; HSDP is skipped,
    saying it needs 4 GPUs. The report holds each comparison's rows and each survivor's lines."""
    out = tmp_path / "out"
    report, text = check_on_cpu(out, 2)
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["toy", "shard", "hsdp", "kill", "resume"]
    assert steps["hsdp"]["status"].startswith("skipped: needs 4 GPUs")
    for name in ("toy", "shard", "kill", "resume"):
        assert steps[name]["status"] == "passed", (name, steps[name])
    for name in ("toy", "shard", "resume"):
        rows = steps[name]["figures"]["rows"]
        assert rows and all(r["ok"] for r in rows)
        assert any(r["metric"] == "loss" for r in rows)
    lora = [r for r in steps["shard"]["figures"]["rows"] if r["metric"].startswith("LoRA B")]
    assert len(lora) == 1 and lora[0]["epoch"] == mgc.EPOCHS
    kill = steps["kill"]["figures"]
    assert kill["killed"].startswith("rank 1 ") and kill["in_epoch"] >= 2
    (rank, survivor), = kill["survivors"].items()  # fmt: skip
    assert rank in ("0", 0) and survivor["seconds to exit"] <= mgc.KILL_LIMIT_S
    assert survivor["names --resume"], survivor
    assert kill["launcher"]["exit"] != 0 and kill["checkpoint kept"].startswith("runs/sd3_killed")
    resumed = [r for r in steps["resume"]["runs"] if "--resume" in r["command"]]
    assert resumed and "--nproc-per-node=1" in resumed[0]["command"]
    assert "| shard | tiny SD3: --shard against DDP on N ranks | passed |" in text
    assert "rank 0: exited" in text and "recast.py: stopped: rank 0 lost contact" in text
    assert (out / "logs" / "sd3_shard.log").is_file()


@pytest.mark.slow
def test_one_rank_runs_the_single_gpu_steps(tmp_path):
    """--gpus 1, as on a one-GPU machine: shard, kill and resume run and pass (the only rank
    killed: no survivor, a non-zero exit and the checkpoint kept), toy and HSDP are skipped."""
    report, text = check_on_cpu(tmp_path / "out", 1)
    steps = {s["name"]: s for s in report["steps"]}
    assert [n for n, s in steps.items() if s["status"] == "passed"] == ["shard", "kill", "resume"]
    assert steps["toy"]["status"].startswith("skipped: needs 2 GPUs")
    assert steps["hsdp"]["status"].startswith("skipped: needs 4 GPUs")
    kill = steps["kill"]["figures"]
    assert kill["killed"].startswith("rank 0 ") and kill["survivors"] == {}
    assert kill["launcher"]["exit"] != 0 and kill["checkpoint kept"].startswith("runs/sd3_killed")
    assert "- survivors: none (one rank)" in text


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8])
def test_every_run_of_the_check_passes_recast_py_s_checks_on_its_ranks(gpus, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    """Each recast.py command the steps launch, through recast.py's own flag checks on the ranks
    it runs on (the commands recorded, none run). docs/gpu/README.md's `--gpus 8` launched the toy
    world's 4 prompts and the tiny SD3's --batch-size 4 on 8 ranks, which recast.py refuses: the
    toy, shard, kill and resume steps failed at once on 3, 5, 6, 7 or 8 GPUs."""
    import harness
    import recast
    from plumbing import cli

    launched = []  # (ranks, recast.py's flags)

    def record(command, ranks):
        if mgc.RECAST in command:
            launched.append((ranks, command[command.index(mgc.RECAST) + 1 :]))

    def run(self, step, name, command, env=None):
        nproc = [w for w in command if w.startswith("--nproc-per-node=")]
        record(command, int(nproc[0].split("=")[1]) if nproc else 1)
        return True

    monkeypatch.setattr(mgc.Check, "run", run)
    monkeypatch.setattr(mgc, "build_models", lambda folder, n: (["--model", "tiny", *mgc.SD3], {}))
    monkeypatch.setattr(mgc, "hsdp_step", lambda check, step, flags, env: record(
        [mgc.RECAST, *flags, "--shard"], 4))  # fmt: skip
    monkeypatch.setattr(mgc, "kill_mid_epoch", lambda check, step, flags, env, run, n: record(
        [mgc.RECAST, *flags, "--epochs", "20"], n))  # fmt: skip
    check = mgc.Check(mgc.argparse.Namespace(budget=600, device="cpu"), tmp_path)
    mgc.run_steps(check, gpus)
    assert launched and all("--resume" in f or "--prompts" in f for _, f in launched)
    for ranks, flags in launched:
        if "--resume" in flags:  # the killed run's flags, checked when it was launched
            continue
        args = cli.parse(recast.Args, flags, recast.__doc__, harness.BEFORE)
        cli.check(args, ranks, harness.RESUMABLE, harness.BEFORE)  # exits 2 where recast.py would


@pytest.mark.parametrize(("visible", "nodes"), [(None, ["0,1", "2,3"]),
                                                ("4,5,6,7", ["4,5", "6,7"])])  # fmt: skip
def test_hsdp_s_nodes_take_the_gpus_this_process_sees(visible, nodes, tmp_path, monkeypatch):
    """On CUDA the two posed nodes each take 2 of the GPUs the check sees: under
    CUDA_VISIBLE_DEVICES=4,5,6,7 they were given GPUs 0-1 and 2-3 all the same (others' GPUs, or
    none). The launchers are recorded, not run."""
    given = []

    class Launched:
        pid = 0

        def __init__(self, command, env, **_):
            given.append(env.get("CUDA_VISIBLE_DEVICES"))

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(mgc.subprocess, "Popen", Launched)
    monkeypatch.setattr(mgc.Check, "run", lambda self, step, name, command, env=None: True)
    check = mgc.Check(mgc.argparse.Namespace(budget=600, device="cuda"), tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({"CUDA_VISIBLE_DEVICES": visible} if visible else {})
    mgc.hsdp_step(check, mgc.Step("hsdp", ""), ["--model", "tiny"], env)
    assert given == nodes
