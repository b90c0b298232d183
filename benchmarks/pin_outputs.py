"""Did a change leave recast.py's outputs as they were? Three runs from two checkouts, compared.

    python -m benchmarks.pin_outputs --base cdbd59e --out runs/pin    # about 10 minutes on 2 cores

runs each of these from a worktree of --base (made in OUT/base-tree) and from this checkout:
  toy  the default toy run, `python recast.py --lambda 0.4,0.2,0.2,0.2` (20 epochs, --device cpu)
  sd3  a tiny SD3 pipeline with random weights and tiny CLIP rewards, built once here
       (benchmarks/modelzoo.py) and given to both: 2 epochs, recast weighting, every phase
  ddp  the toy world on 2 CPU processes under torchrun (gloo): 3 epochs
and compares every file each run wrote: metrics.jsonl without its time/ and mem/ entries (wall
clock), args.json without "out", and every other file but the run's .lock (checkpoints,
optimizer state, eval images, figures, summary.json) byte for byte. It prints one line a run and
exits 0 when every file is equal, 1 otherwise. `--only toy,ddp` runs a subset; `--base-only`
runs the base's side alone (while the checkout is being changed). Refactors of recast.py land
with this command's output recorded (docs/refactors.md).
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))  # run from anywhere
from plumbing import cli  # noqa: E402

LAMBDA = "0.4,0.2,0.2,0.2"
SD3_PROMPTS = [f"a {c} {t}" for c in ("red", "green", "blue", "gold") for t in ("cat", "boat")]
RUNS = {  # name → (processes, flags); "{sd3}" and "{prompts}" are filled in
    "toy": (1, ["--lambda", LAMBDA, "--device", "cpu"]),
    "sd3": (1, ["--model", "{sd3}", "--rewards", "pickscore,clipscore,aesthetic",
                "--lambda", "0.5,0.3,0.2", "--prompts-file", "{prompts}", "--epochs", "2",
                "--prompts", "2", "--group-size", "2", "--steps", "3", "--batch-size", "4",
                "--eval-seeds", "2", "--resolution", "32", "--lora-rank", "4", "--lora-alpha",
                "8", "--lr", "1e-2", "--eval-every", "1", "--device", "cpu"]),
    "ddp": (2, ["--lambda", LAMBDA, "--epochs", "3", "--prompts", "8", "--batch-size", "32",
                "--eval-every", "2", "--device", "cpu"]),
}  # fmt: skip


def tiny_models(folder: Path) -> dict[str, str]:
    """The tiny SD3 pipeline, its prompts and the tiny reward models (environment variables)."""
    sys.path.insert(0, str(HERE))
    import torch

    from benchmarks import modelzoo

    torch.manual_seed(1)  # the same reward models on every call
    env = modelzoo.tiny_reward_models(folder / "rewards")
    if not (folder / "pipe" / "model_index.json").is_file():
        torch.manual_seed(0)
        pipe = modelzoo.tiny_sd3_pipeline(modelzoo.clip_tokenizer(folder / "tokenizer"))
        pipe.save_pretrained(folder / "pipe")
    (folder / "prompts.txt").write_text("\n".join(SD3_PROMPTS) + "\n")
    return env


def launch(code: Path, name: str, out: Path, fill: dict, env: dict) -> None:
    """One run of `code`'s recast.py into `out` (skipped when it finished before)."""
    if (out / "summary.json").is_file():
        return
    ranks, flags = RUNS[name]
    flags = [f.format(**fill) for f in flags] + ["--out", str(out)]
    cmd = [sys.executable, "recast.py", *flags]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", "recast.py", *flags]  # fmt: skip
    if out.exists():  # an interrupted run: start it again
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=code, env={**os.environ, **env}, stdout=f, stderr=f)
    if done.returncode:
        raise SystemExit(f"{name} from {code} failed (exit {done.returncode}): see {log}")


def digest(path: Path) -> str:
    """A file's sha256, wall-clock entries and the run folder's name left out."""
    data = path.read_bytes()
    if path.name == "metrics.jsonl":
        lines = [json.loads(x) for x in data.decode().splitlines()]
        keep = [{k: v for k, v in m.items() if not k.startswith(("time/", "mem/"))} for m in lines]
        data = "\n".join(json.dumps(m, sort_keys=True) for m in keep).encode()
    elif path.name == "args.json":
        data = json.dumps({k: v for k, v in json.loads(data).items() if k != "out"}).encode()
    return hashlib.sha256(data).hexdigest()


def files(run: Path) -> dict[str, str]:
    """Each file's digest; .lock (the live run's pid and host) left out."""
    return {str(p.relative_to(run)): digest(p) for p in sorted(run.rglob("*"))
            if p.is_file() and p.name != ".lock"}  # fmt: skip


PROG = "pin_outputs.py"


def main(argv: list[str] | None = None) -> int:
    ap = cli.Parser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare this checkout against")
    ap.add_argument("--out", required=True, help="folder for the worktree, models and runs")
    ap.add_argument("--only", default=",".join(RUNS), help="runs to compare (toy,sd3,ddp)")
    ap.add_argument(
        "--base-only",
        action="store_true",
        help="run --base's side only (while this checkout is being changed)",
    )
    a = ap.parse_args(argv)
    names = a.only.split(",")
    if bad := [n for n in names if n not in RUNS]:
        cli.fail("--only", f"unknown run {', '.join(bad)}; choose from {', '.join(RUNS)}", PROG)
    got = subprocess.run(["git", "rev-parse", "--verify", "--quiet", a.base + "^{commit}"],
                         cwd=HERE, capture_output=True, text=True)  # fmt: skip
    if got.returncode:
        cli.fail("--base", f"{a.base!r} is not a commit of this repository: give a hash, tag or "
                 "branch that `git log` shows", PROG)  # fmt: skip
    rev = got.stdout.strip()
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = out / "base-tree"
    if tree.exists() and (tree / ".git").exists():
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
        if head != rev:
            raise SystemExit(f"{tree} holds {head[:8]}, not {rev[:8]}: remove it (git worktree "
                             "remove) or pick another --out")  # fmt: skip
    else:
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=HERE,
                       check=True, capture_output=True)  # fmt: skip
    env, fill = {"OMP_NUM_THREADS": "1"}, {}
    if "sd3" in names:
        env |= tiny_models(out / "models")
        fill = {"sd3": str(out / "models" / "pipe"), "prompts": str(out / "models" / "prompts.txt")}
    same = True
    for name in names:
        runs = {}
        for side, code in (("base", tree), ("here", HERE)):
            if side == "here" and a.base_only:
                break
            launch(code, name, out / side / name, fill, env)
            runs[side] = files(out / side / name)
        if a.base_only:
            print(f"{name}: {len(runs['base'])} files from {rev[:8]}", flush=True)
            continue
        differ = sorted(k for k in runs["base"].keys() | runs["here"].keys()
                        if runs["base"].get(k) != runs["here"].get(k))  # fmt: skip
        same &= not differ
        verdict = "equal" if not differ else f"DIFFER: {', '.join(differ[:6])}"
        print(f"{name}: {len(runs['here'])} files, {verdict}", flush=True)
    if not a.base_only:
        print(f"base {rev[:8]} against this checkout: {'all equal' if same else 'not equal'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
