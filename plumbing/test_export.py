"""`recast.py --export RUN --to DIR` (plumbing/export.py) on run folders made here: what it writes,
and its bad input. That diffusers loads the export and draws the run's images, family by family,
is worlds/test_families.py's test_export_loads_in_diffusers_and_draws_the_runs_images."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from plumbing import checkpoints, export

LAYERS = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_k_proj"]


def make_run(root, epochs: int = 2, saved: tuple[int, ...] = (1, 2), model: str = "") -> str:
    """A run folder as recast.py leaves it, with a tiny adapter pair (rank 2, alpha 4) per layer
    ("default" and "old") in checkpoints of the epochs `saved`, and summary.json when the last
    one is `epochs`; its --model an SD3 pipeline's model_index.json alone."""
    run, pipe = os.path.join(root, "run"), os.path.join(root, "pipe")
    os.makedirs(pipe, exist_ok=True)
    with open(os.path.join(pipe, "model_index.json"), "w") as f:
        json.dump({"_class_name": "StableDiffusion3Pipeline"}, f)
    os.makedirs(run)
    args = {"model": model or pipe, "epochs": epochs, "lora_rank": 2, "lora_alpha": 4,
            "steps": 3, "resolution": 32, "guidance": 0.0}  # fmt: skip
    with open(os.path.join(run, "args.json"), "w") as f:
        json.dump(args, f)
    g = torch.Generator().manual_seed(0)
    for epoch in saved:
        tensors = {}
        for layer in LAYERS:
            for which in ("default", "old"):
                tensors[f"{layer}.lora_A.{which}.weight"] = torch.randn(2, 8, generator=g)
                tensors[f"{layer}.lora_B.{which}.weight"] = torch.randn(8, 2, generator=g)
        checkpoints.save(run, epoch, tensors, {}, {"opt_steps": epoch, "gains_ema": None})
    if saved and saved[-1] == epochs:
        with open(os.path.join(run, "summary.json"), "w") as f:
            json.dump({"epochs": epochs}, f)
    return run


def exits_2(capsys, *argv) -> str:
    import recast

    with pytest.raises(SystemExit) as e:
        recast.main([str(a) for a in argv])  # recast.py dispatches --export to plumbing/export.py
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_export_writes_the_default_adapter_with_its_lora_config(tmp_path, capsys):
    """The "default" adapter only, under diffusers' names (`transformer.` prefix, no adapter
    name), bit for bit from the last checkpoint, and its rank, alpha and layers as the metadata
    that diffusers builds its LoraConfig from; recast_export.json says how the run sampled."""
    run, to = make_run(tmp_path), tmp_path / "lora"
    export.main(["--export", run, "--to", str(to)])
    tensors, _, _ = checkpoints.load_latest(run)
    with safe_open(to / export.WEIGHTS, "pt") as f:
        written = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert set(written) == {f"transformer.{layer}.lora_{ab}.weight" for layer in LAYERS
                            for ab in "AB"}  # fmt: skip
    for k, v in written.items():
        peft_name = k.removeprefix("transformer.").replace(".weight", ".default.weight")
        assert torch.equal(v, tensors[peft_name]), k
    assert meta == {"transformer.r": 2, "transformer.lora_alpha": 4,
                    "transformer.target_modules": sorted(LAYERS), "transformer.rank_pattern": {},
                    "transformer.alpha_pattern": {}}  # fmt: skip
    info = json.loads((to / export.INFO).read_text())
    assert info["pipeline"] == "StableDiffusion3Pipeline" and info["epoch"] == 2
    assert info["sampling"]["steps"] == 3 and "wrote" in capsys.readouterr().out


def test_export_bad_input_exits_2_naming_the_run_and_writes_nothing(tmp_path, capsys):
    """Not a run, a torn args.json, a toy-world run, a run not finished, a corrupt one (its
    newest checkpoint truncated), a --model that is gone: exit 2 naming --export and the folder;
    a --to that holds files: exit 2 naming --to, unless --overwrite (which keeps the folder's
    other files)."""
    to = tmp_path / "lora"
    err = exits_2(capsys, "--export", tmp_path, "--to", to)
    assert "error: --export" in err and str(tmp_path) in err and "no args.json" in err
    torn = make_run(tmp_path / "torn")
    with open(os.path.join(torn, "args.json"), "r+b") as f:
        f.truncate(20)
    err = exits_2(capsys, "--export", torn, "--to", to)
    assert f"error: --export: {torn}/args.json is not a run's flags (JSONDecodeError" in err
    toy = make_run(tmp_path / "toy", model="toy")
    assert "toy world" in exits_2(capsys, "--export", toy, "--to", to)
    unfinished = make_run(tmp_path / "unfinished", epochs=3)
    err = exits_2(capsys, "--export", unfinished, "--to", to)
    assert "error: --export" in err and f"{unfinished} is not finished" in err
    assert "epoch 2 of --epochs 3" in err and "--resume" in err
    corrupt = make_run(tmp_path / "corrupt")
    with open(os.path.join(corrupt, "ckpt", "epoch_0002", "model.safetensors"), "r+b") as f:
        f.truncate(100)
    err = exits_2(capsys, "--export", corrupt, "--to", to)
    assert "error: --export" in err and f"{corrupt} is corrupt" in err and "epoch_0002" in err
    moved = make_run(tmp_path / "moved", model=str(tmp_path / "gone"))
    err = exits_2(capsys, "--export", moved, "--to", to)
    assert "error: --export" in err and "gone" in err
    assert not to.exists()
    run = make_run(tmp_path / "good")
    to.mkdir()
    (to / "notes.txt").write_text("mine")
    err = exits_2(capsys, "--export", run, "--to", to)
    assert "error: --to" in err and "--overwrite" in err
    assert os.listdir(to) == ["notes.txt"]
    export.main(["--export", run, "--to", str(to), "--overwrite"])
    assert sorted(os.listdir(to)) == sorted(["notes.txt", export.WEIGHTS, export.INFO])


def test_export_help_is_the_exports():
    """`recast.py --export RUN --help` prints the export's flags (--export, --to, --overwrite),
    not a training run's; `recast.py --help` says where they are."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "recast.py", "--export", "RUN", "--help"], cwd=root,
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert "--overwrite" in done.stdout and "--to DIR" in done.stdout, done.stdout
    assert "--lambda" not in done.stdout, done.stdout
    run = subprocess.run([sys.executable, "recast.py", "--help"], cwd=root, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    assert "--export RUN --help" in run and "--overwrite" in run  # where the export's flags are
