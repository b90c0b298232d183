"""`recast.py --shard` (FSDP2) on 2 CPU processes (gloo), with the tiny SD3 and FLUX.1-dev
pipelines modelzoo builds (random weights, nothing downloaded):
- a sharded run equals the DDP run of the same flags: the same metrics and LoRA weights within
  SHARD_ATOL (why that much: below);
- one epoch, then --resume, equals two epochs, sharded: bit for bit; it resumes on 1 rank too;
- SIGTERM finishes the epoch on every rank and resumes to the same numbers; a rank killed ends the
  run in seconds naming the --resume command; a second launch on a live run folder exits 2;
- bad input: --shard without torchrun, or with the toy world, exits 2 naming the flag;
- --precision bf16 (CUDA's policy) forced on CPU: a new run, a resume, --grad-accum 2, --profile,
  and the sharded run equals DDP's under it;
- shard_models' bf16 precision (CUDA's), forced on 2 gloo processes: a backward after a first
  forward with the adapters disabled (the base model's evaluation) gives the unsharded model's
  fp32 gradients, and the timestep reaches the transformer in fp32 (seconds);
- a checkpoint's gather lands on rank 0's host alone, and writes what gathering on every rank
  wrote (slow);
- loading: the models built on meta, sharded, and read by rank 0 and broadcast equal the models
  loaded whole in every family, and no rank's host holds a whole copy (slow);
- 4 ranks posing as 2 nodes of 2 take HSDP's 2-D mesh and equal one flat mesh (slow);
- `torchrun --nproc-per-node 1 recast.py --shard` trains two epochs (slow; on CUDA in
  benchmarks/gpu_check.py).
The torchrun tests are slow (minutes on 2 cores): python -m pytest -q -m slow plumbing/test_shard.py
"""

import copy
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from benchmarks import modelzoo
from plumbing.test_faults import hold_lock, start, stopped_message, wait_for_epochs, workers
from test_recast import HERE, metrics_of, ranks_said, torchrun_args

RECAST = os.path.join(HERE, "recast.py")
# DDP all-reduces each gradient whole; FSDP2 reduce-scatters it in shards and clips by a norm summed
# from the shards: the same sums in another order, so fp32 rounding (~1e-7 relative) differs, and
# AdamW's normalised steps at --lr 1e-2 carry it through two epochs. Measured: 4e-6 (SD3) and 7e-6
# (FLUX.1-dev) on weights of size ~1; 1e-4 leaves room, and a wrong shard (a rank's gradient
# dropped or counted twice) moves the weights by ~1e-2.
SHARD_ATOL = 1e-4
FLAGS = ["--rewards", "pickscore,aesthetic", "--lambda", "0.5,0.5", "--prompts", "2",
         "--group-size", "2", "--steps", "3", "--batch-size", "4", "--eval-seeds", "2",
         "--resolution", "32", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2",
         "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{"sd3": folder, "flux-dev": folder, "env": the reward models' variables, "prompts",
    "held_out": files}."""
    root = tmp_path_factory.mktemp("shard")
    torch.manual_seed(0)
    found = {v: modelzoo.tiny_family(v, root / v) for v in ("sd3", "flux-dev")}
    torch.manual_seed(1)
    found["env"] = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    **modelzoo.tiny_reward_models(root / "rewards")}  # fmt: skip
    colours, things = ("red", "green", "blue", "gold"), ("cat", "boat", "tree")
    (root / "prompts.txt").write_text("\n".join(f"a {c} {t}" for c in colours for t in things))
    (root / "held_out.txt").write_text("a purple cat\na purple boat\n")
    found["prompts"], found["held_out"] = str(root / "prompts.txt"), str(root / "held_out.txt")
    return found


def flags_of(models, variant: str, *more: str) -> list[str]:
    guidance = ["--guidance", "3.5"] if variant == "flux-dev" else []
    return ["--model", models[variant], *guidance, "--prompts-file", models["prompts"],
            "--eval-prompts-file", models["held_out"], *FLAGS, *more]  # fmt: skip


def assert_same_runs(a_run: list[dict], b_run: list[dict]) -> None:
    """Two runs whose gradients are the same sums in another order (DDP, --shard, HSDP, another
    --grad-accum): every metrics line within 1e-4 relative (docs/sd35.md's torchrun tolerance),
    except two kinds of number that amplify the scores' rounding, each by a factor the run logs
    or a reason stated here:
    - adv/, share/ and clamp/ divide a reward's deviations by a spread, which multiplies the scores'
      relative rounding by up to adv/cond (harness.advantage_ratios: under joint and unit-joint a
      group whose rewards nearly cancel): 1e-4 × max(10, adv/cond);
    - D and the gains after the first update read the step predictions' scores, and the rewards
      score images rounded to uint8 as their released code does: the two models, equal to ~1e-7,
      can round a step prediction's pixel differently, and with 4 groups of 2 one moved score
      moves a step's D by a few per cent (1.4e-3 of 0.039 seen on one entry, HSDP against the
      flat mesh, the final scores and every number read from them equal). Those lines' D and
      gains are not compared; W, which they feed through the gains' EMA, is, to 1e-4. The first
      epoch's (the same model, the same images) are."""
    assert [m["epoch"] for m in a_run] == [m["epoch"] for m in b_run]
    for a, b in zip(a_run, b_run, strict=True):
        a, b = numbers(a), numbers(b)
        assert a.keys() == b.keys()
        cond = max(a.get("adv/cond", 0.0), b.get("adv/cond", 0.0))
        for k in a:
            if k in ("D", "gains") and a["epoch"] > 1:
                continue
            tol = 1e-4 * max(10.0, cond) if k.startswith(("adv/", "share/", "clamp/")) else 1e-4
            got, want = torch.tensor(a[k], dtype=torch.float64), torch.tensor(b[k]).double()
            assert torch.allclose(got, want, rtol=tol, atol=1e-6), (a["epoch"], k, a[k], b[k])


def torchrun(out, *flags) -> list[str]:
    """2 ranks of recast.py on this machine, each rank's output kept (rank_logs(out))."""
    return torchrun_args(out, "--standalone", "--nproc-per-node=2", RECAST, *flags, "--out",
                         str(out))  # fmt: skip


def run2(models, out, *flags) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *torchrun(out, *flags)], cwd=HERE, env=models["env"],
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, ranks_said(out)
    return done


def lora(out, epoch: int) -> dict[str, torch.Tensor]:
    return load_file(out / "ckpt" / f"epoch_{epoch:04d}" / "model.safetensors")


def numbers(m: dict) -> dict:
    """A metrics line without what may differ between equal runs (times, the ranks' digest)."""
    return {k: v for k, v in m.items() if not k.startswith(("time/", "mem/", "dist/"))}


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["sd3", "flux-dev"])
def test_a_sharded_run_equals_ddp(models, tmp_path, variant):
    """Two epochs under --shard and under DDP: the same rollouts and W, rewards, evals and loss
    (assert_same_runs), the LoRA weights within SHARD_ATOL,
    and the adapters trained (lora_B moved off zero); SD3's --profile gives the same gains and
    W sharded as under DDP."""
    flags = flags_of(models, variant, "--epochs", "2")
    run2(models, tmp_path / "shard", *flags, "--shard")
    run2(models, tmp_path / "ddp", *flags)
    sharded, ddp = metrics_of(tmp_path / "shard"), metrics_of(tmp_path / "ddp")
    assert [m["epoch"] for m in sharded] == [0, 1, 2] == [m["epoch"] for m in ddp]
    assert_same_runs(sharded, ddp)
    x, y = lora(tmp_path / "shard", 2), lora(tmp_path / "ddp", 2)
    assert x.keys() == y.keys()
    assert max((x[k] - y[k]).abs().max().item() for k in x) < SHARD_ATOL
    assert max(x[k].abs().max().item() for k in x if "lora_B.default" in k) > 1e-3
    if variant == "sd3":  # --profile: the same gains and W (the base model: no training)
        run2(models, tmp_path / "profile_shard", *flags_of(models, variant, "--shard", "--profile"))
        run2(models, tmp_path / "profile_ddp", *flags_of(models, variant, "--profile"))
        p, q = (json.loads((tmp_path / f"profile_{k}" / "profile.json").read_text())
                for k in ("shard", "ddp"))  # fmt: skip
        assert torch.allclose(torch.tensor(p["W"]), torch.tensor(q["W"]), atol=1e-6)
        assert torch.allclose(torch.tensor(p["gains"]), torch.tensor(q["gains"]), atol=1e-6)


@pytest.mark.slow
def test_unit_joints_pooled_spread_is_the_same_on_one_process_ddp_and_shard(models, tmp_path):
    """unit-joint, the default, divides each reward by its spread pooled over every rank's groups:
    with the groups scored for the gains split unevenly over 2 ranks (--gain-frac 0.75 of 4
    prompts: 2 and 1), the first epoch's W, shares, |A| and loss under DDP and under --shard are
    one process's, within a_sharded_run_equals_ddp's tolerances (1e-4 relative, 1e-3 for the
    spread-divided adv/ and share/)."""
    flags = flags_of(models, "sd3", "--epochs", "1", "--prompts", "4", "--gain-frac", "0.75")
    one = subprocess.run([sys.executable, RECAST, *flags, "--out", str(tmp_path / "one")],
                         cwd=HERE, env=models["env"], capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    run2(models, tmp_path / "ddp", *flags)
    run2(models, tmp_path / "shard", *flags, "--shard")
    want = numbers(metrics_of(tmp_path / "one")[1])
    assert json.loads((tmp_path / "one" / "args.json").read_text())["normalize"] == "unit-joint"
    for mode in ("ddp", "shard"):
        got = numbers(metrics_of(tmp_path / mode)[1])
        for k in [k for k in want if k.startswith(("W", "share/", "adv/", "reward/"))] + ["loss"]:
            tol = 1e-3 if k.startswith(("adv/", "share/")) else 1e-4
            a, b = torch.tensor(got[k], dtype=torch.float64), torch.tensor(want[k])
            assert torch.allclose(a, b.double(), rtol=tol, atol=1e-6), (mode, k, got[k], want[k])


@pytest.mark.slow
def test_sharded_resume_is_exact_and_sigterm_stops_every_rank(models, tmp_path):
    """One epoch, then --resume to two, equals two epochs without a stop, bit for bit (weights,
    optimizer state, metrics); the checkpoint holds the whole state, so the run resumes on 1
    rank too. A second launch on a folder whose run is live exits 2 (the run lock). A run stopped
    by SIGTERM to the launcher finishes its epoch on every rank, checkpoints it and resumes to
    the same numbers (always: the resume was skipped unless it stopped after epoch 1, and the
    signal, sent once epoch 1 is logged, stops it after epoch 2)."""
    flags = flags_of(models, "sd3", "--shard")
    whole, part = tmp_path / "whole", tmp_path / "part"
    run2(models, whole, *flags, "--epochs", "3")  # its epochs 0-2 for `part`, 0-3 for `stopped`
    run2(models, part, *flags, "--epochs", "1")
    run2(models, part, "--resume", "--epochs", "2")
    assert lora(part, 2).keys() == lora(whole, 2).keys()
    assert all(torch.equal(lora(part, 2)[k], lora(whole, 2)[k]) for k in lora(whole, 2))
    opt = [torch.load(o / "ckpt/epoch_0002/optim.pt")["state"] for o in (part, whole)]
    assert opt[0].keys() == opt[1].keys() and all(
        torch.equal(opt[0][p][s], opt[1][p][s]) for p in opt[1] for s in opt[1][p]
    )
    common = lambda m, n: {k: v for k, v in numbers(m).items() if k in n}  # noqa: E731
    for a, b in zip(metrics_of(part), metrics_of(whole)[:3], strict=True):
        assert common(a, b) == common(b, a)

    fewer = tmp_path / "fewer"  # the whole state is saved, so another number of ranks resumes
    shutil.copytree(whole, fewer)
    again = subprocess.run([sys.executable, *torchrun_args(fewer, "--standalone",
                            "--nproc-per-node=1", RECAST, "--out", str(fewer), "--resume",
                            "--epochs", "4")], cwd=HERE, env=models["env"],
                           capture_output=True)  # fmt: skip
    assert again.returncode == 0, ranks_said(fewer)
    assert [m["epoch"] for m in metrics_of(fewer)] == [0, 1, 2, 3, 4]

    held = hold_lock(part)  # a live run holds its folder: a second launch exits 2 at once
    try:
        second = subprocess.run([sys.executable, *torchrun(part, "--resume")], cwd=HERE,
                                env=models["env"], capture_output=True, text=True)  # fmt: skip
    finally:
        held.kill()
    assert second.returncode != 0 and "error: --out" in second.stderr, second.stderr[-2000:]

    stopped = tmp_path / "stopped"  # SIGTERM once epoch 1 is logged: it stops after 1 or 2
    proc = start(*torchrun(stopped, *flags, "--epochs", "4"), env=models["env"])
    wait_for_epochs(stopped, 2, proc, poll=0.1)
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    done = metrics_of(stopped)[-1]["epoch"]
    assert proc.returncode != 0 and "lost contact" not in stderr, ranks_said(stopped)
    assert f"stopped after epoch {done}; continue: torchrun" in stdout and done < 3
    assert sorted(os.listdir(stopped / "ckpt"))[-1] == f"epoch_{done:04d}"
    run2(models, stopped, "--resume", "--epochs", "3")  # resumed after the stop, to `whole`'s 3
    assert all(torch.equal(lora(stopped, 3)[k], lora(whole, 3)[k]) for k in lora(whole, 3))
    for a, b in zip(metrics_of(stopped), metrics_of(whole), strict=True):
        assert common(a, b) == common(b, a)


@pytest.mark.slow
def test_the_cuda_precision_policy_trains_resumes_profiles_and_equals_ddp(models, tmp_path):
    """--precision bf16 (CUDA's default: bf16 weights and forwards, FSDP2 gathering in bf16 and
    reducing in fp32) forced on 2 gloo ranks: a new sharded run trains (its first forward is the
    base model's, adapters disabled), one epoch then --resume equals two epochs bit for bit, with
    --grad-accum 2 too, --profile runs, and the sharded run equals DDP's under the same policy
    (FSDP2 casts no input, so both see the fp32 timestep; the same SHARD_ATOL and 1e-4 metrics:
    measured equal to the bit on CPU)."""
    flags = flags_of(models, "sd3", "--precision", "bf16", "--shard")
    whole, part = tmp_path / "whole", tmp_path / "part"
    run2(models, whole, *flags, "--epochs", "2", "--grad-accum", "2")
    run2(models, part, *flags, "--epochs", "1", "--grad-accum", "2")
    run2(models, part, "--resume", "--epochs", "2")
    assert all(torch.equal(lora(part, 2)[k], lora(whole, 2)[k]) for k in lora(whole, 2))
    assert max(lora(whole, 2)[k].abs().max().item() for k in lora(whole, 2)
               if "lora_B.default" in k) > 1e-3  # fmt: skip
    assert all(v.dtype == torch.float32 for v in lora(whole, 2).values())
    ddp = tmp_path / "ddp"
    run2(models, ddp, *flags[:-1], "--epochs", "2", "--grad-accum", "2")
    assert_same_runs(metrics_of(whole), metrics_of(ddp))
    x, y = lora(whole, 2), lora(ddp, 2)
    assert max((x[k] - y[k]).abs().max().item() for k in x) < SHARD_ATOL
    run2(models, tmp_path / "profile", *flags, "--profile")
    assert (tmp_path / "profile" / "profile.json").is_file()


@pytest.mark.slow
def test_a_dead_rank_ends_a_sharded_run_in_seconds(models, tmp_path):
    out = tmp_path / "run"
    proc = start(*torchrun(out, *flags_of(models, "sd3", "--shard", "--epochs", "20")),
                 env=models["env"])  # fmt: skip
    wait_for_epochs(out, 2, proc, poll=0.2)
    os.kill(workers(proc.pid)[1], signal.SIGKILL)
    tic = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.monotonic() - tic < 60
    said = stopped_message("\n".join(line for line in stderr.splitlines() if "[rank" not in line))
    assert "rank 0 lost contact: rank 1 stopped answering" in said
    assert f"recast.py --out {out} --resume" in said


def _gradient_worker(rank: int, world: int, port: int, flags: list[str], said: str) -> None:
    """recast.nft_update on fixed images, r and W, on one of `world` gloo ranks (world 1: one
    process, no process group): the whole gradient each optimizer step receives (after DDP's
    all-reduce or FSDP2's reduce-scatter, gathered whole), and the loss it returns, saved in
    the file `said` + rank (a queue's pipe would block on them until the parent reads it)."""
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(1)
    import harness
    import recast

    run = harness.setup(recast.Args, flags, "")
    args, world_ = run.args, run.world
    grads, step = [], run.optimizer.step

    def recorded(*a, **k):  # each step's gradient, whole, before AdamW moves the weights
        whole = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in run.params]
        grads.append([g.detach().double().clone() for g in whole])
        return step(*a, **k)

    run.optimizer.step = recorded
    gen = torch.Generator().manual_seed(5)
    N, K, T = args.prompts * args.group_size, len(run.names), args.steps
    x0 = torch.randn(N, *world_.latent_shape, generator=gen)
    r = torch.rand(K, N, generator=gen)
    W = torch.rand(K, T, generator=gen) + 0.1
    loss, steps = recast.nft_update(run, 1, world_.train_prompts[: args.prompts], x0, r, W, 0)
    torch.save({"grads": grads, "loss": loss.item(), "steps": steps}, f"{said}{rank}")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def gradients(flags: list[str], world: int, out) -> dict:
    """What _gradient_worker says on each of `world` processes, {rank: {...}}; `out`: the run
    folder (--out)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    said = f"{out}.rank"
    mp.spawn(_gradient_worker, args=(world, port, [*flags, "--out", str(out)], said), nprocs=world)
    return {rank: torch.load(f"{said}{rank}") for rank in range(world)}


# (--train-frac, --grad-accum) of 18 pairs (2 prompts × G 3 × T 3) in micro-batches of 4, split in
# halves between 2 ranks: 9 pairs (4, 4, 1: the last one's pair on rank 1, none on rank 0), in
# one step and in one step a micro-batch; 7 pairs (4, 3: 1 and 2) in one step
UNEVEN = [("0.5", "3"), ("0.5", "1"), ("0.39", "2")]


@pytest.mark.parametrize(("frac", "accum"), UNEVEN)
def test_uneven_shares_give_the_single_process_gradient_under_ddp(tmp_path, frac, accum):
    """Each rank's loss is the sum over its pairs over the step's count of pairs, so the ranks'
    gradients add up to one process's on any split (G·T odd, a rank one pair short, a rank with
    none: it joins DDP's all-reduce with a zero gradient): every step's gradient and the loss
    within fp32 rounding of the same update in one process (2 gloo ranks, the toy world)."""
    flags = ["--lambda", "0.4,0.2,0.2,0.2", "--prompts", "2", "--group-size", "3", "--steps",
             "3", "--batch-size", "4", "--train-frac", frac, "--grad-accum", accum,
             "--grad-clip", "1e9", "--device", "cpu"]  # fmt: skip
    one = gradients(flags, 1, tmp_path / "one")[0]
    two = gradients(flags, 2, tmp_path / "two")
    assert one["steps"] == (1 if accum != "1" else 3)
    for rank, x in two.items():
        assert x["steps"] == one["steps"] and len(x["grads"]) == one["steps"], rank
        for got_step, want_step in zip(x["grads"], one["grads"], strict=True):
            scale = max(g.abs().max().item() for g in want_step)  # the step's largest element
            assert scale > 0
            for got, want in zip(got_step, want_step, strict=True):
                assert (got - want).abs().max().item() <= 1e-5 * scale, rank
        assert x["loss"] == pytest.approx(one["loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(("frac", "accum"), [("0.75", "3"), ("0.58", "2")])
def test_uneven_shares_give_the_single_process_gradient_sharded(models, tmp_path, monkeypatch,
                                                                frac, accum):  # fmt: skip
    """As under DDP (above), under --shard: 12 pairs of the tiny SD3 (2 prompts × G 2 × T 3) in
    micro-batches of 4, 9 of them (4, 4, 1: a rank with none runs its stand-in forwards, FSDP2's
    all-gathers, and joins the reduce-scatter) or 7 (4, 3) in one step: the gradient gathered
    whole equals one unsharded process's within fp32 rounding: 1e-4 of the largest element
    (measured: 1.1e-5; each rank's forwards run on its own batch shapes and the shards reduce in
    another order; the mean of means the loss was is off by 3e-2 in the DDP test above)."""
    for k, v in models["env"].items():
        monkeypatch.setenv(k, v)
    flags = flags_of(models, "sd3", "--train-frac", frac, "--grad-accum", accum, "--grad-clip",
                     "1e9")  # fmt: skip
    one = gradients(flags, 1, tmp_path / "one")[0]
    two = gradients([*flags, "--shard"], 2, tmp_path / "two")
    assert one["steps"] == 1
    for rank, x in two.items():
        assert x["steps"] == 1 and len(x["grads"]) == 1, rank
        scale = max(g.abs().max().item() for g in one["grads"][0])
        assert scale > 0
        for got, want in zip(x["grads"][0], one["grads"][0], strict=True):
            assert (got - want).abs().max().item() <= 1e-4 * scale, rank
        assert x["loss"] == pytest.approx(one["loss"], rel=1e-5)


def nodes(models, out, *flags, n: int = 2, per_node: int = 2) -> str:
    """One torchrun launcher per node, as on a cluster (static rendezvous at node 0's address),
    all on this machine and sharing the run folder; node 0's output."""
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = [f"--nnodes={n}", f"--nproc-per-node={per_node}", "--master-addr=127.0.0.1",
            f"--master-port={port}"]  # fmt: skip
    run = [RECAST, *flags, "--out", str(out)]
    launch = lambda i: [sys.executable, *torchrun_args(out, *node, f"--node-rank={i}", *run)]  # noqa: E731
    procs = [subprocess.Popen(launch(i), cwd=HERE, env=models["env"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(n)]  # fmt: skip
    said = [p.communicate(timeout=1200) for p in procs]
    for p in procs:
        assert p.returncode == 0, ranks_said(out)
    return said[0][0]


@pytest.mark.slow
def test_two_nodes_shard_within_each_node_and_equal_one_flat_mesh(models, tmp_path):
    """4 gloo ranks posing as 2 nodes × 2 (two torchrun launchers, --nnodes 2, a rendezvous on
    localhost) take HSDP's 2-D mesh: each node shards, the nodes replicate; the same 4 ranks on one
    node take the flat mesh. Two epochs of each give the same metrics (assert_same_runs) and LoRA
    weights within SHARD_ATOL: the gradients are the same sums in another order (a reduce-scatter
    within the node, then an all-reduce between the replicas, against one reduce-scatter over 4),
    as for DDP against --shard."""
    held_out = tmp_path / "held_out.txt"  # one held-out prompt a rank at least
    held_out.write_text("a purple cat\na purple boat\na purple tree\na silver cat\n")
    flags = flags_of(models, "sd3", "--shard", "--epochs", "2", "--prompts", "4",
                     "--eval-prompts-file", str(held_out))  # fmt: skip
    said = nodes(models, tmp_path / "hsdp", *flags)
    assert "--shard on 2 nodes of 2 ranks" in said and "(HSDP)" in said
    flat = subprocess.run([sys.executable, *torchrun_args(
        tmp_path / "flat", "--standalone", "--nproc-per-node=4", RECAST, *flags, "--out",
        str(tmp_path / "flat"))], cwd=HERE, env=models["env"], capture_output=True, text=True,
        timeout=1200)  # fmt: skip
    assert flat.returncode == 0, ranks_said(tmp_path / "flat")
    assert "HSDP" not in flat.stdout
    a_run, b_run = metrics_of(tmp_path / "hsdp"), metrics_of(tmp_path / "flat")
    assert [m["epoch"] for m in a_run] == [0, 1, 2] == [m["epoch"] for m in b_run]
    assert_same_runs(a_run, b_run)
    x, y = lora(tmp_path / "hsdp", 2), lora(tmp_path / "flat", 2)
    assert x.keys() == y.keys()
    assert max((x[k] - y[k]).abs().max().item() for k in x) < SHARD_ATOL
    assert max(x[k].abs().max().item() for k in x if "lora_B.default" in k) > 1e-3


@pytest.mark.slow
def test_one_rank_shards_two_epochs(models, tmp_path):
    """`torchrun --nproc-per-node 1 recast.py --shard` on the tiny SD3 for two epochs, on
    RECAST_TEST_DEVICE (cpu; cuda: benchmarks/gpu_check.py, where --precision is bf16 by default):
    it trains, and the checkpoint holds fp32 adapters."""
    device = os.environ.get("RECAST_TEST_DEVICE", "cpu")
    out = tmp_path / "run"
    flags = [*flags_of(models, "sd3", "--shard", "--epochs", "2"), "--device", device]
    done = subprocess.run([sys.executable, *torchrun_args(out, "--standalone",
                           "--nproc-per-node=1", RECAST, *flags, "--out", str(out))], cwd=HERE,
                          env=models["env"], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, ranks_said(out)
    assert [m["epoch"] for m in metrics_of(out)] == [0, 1, 2]
    state = lora(out, 2)
    assert state and all(v.dtype == torch.float32 for v in state.values())
    assert max(state[k].abs().max().item() for k in state if "lora_B.default" in k) > 1e-3


def sd35_proportions(folder) -> str:
    """An SD3 pipeline saved in `folder` (random weights, 32 px) whose text encoders outweigh its
    transformer as SD3.5-Medium's do (5.6 B against 2.2 B parameters): 57 M transformer
    parameters (6 MMDiT blocks 512 wide), two CLIP text encoders of 57 M (8 layers 768 wide); about
    690 MB in fp32, so a whole copy stands far above what a process's RSS does by itself."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(0)
    pipe = modelzoo.tiny_sd3_pipeline(modelzoo.clip_tokenizer(os.path.join(folder, "tok")))
    text = dict(modelzoo.TINY_TEXT, hidden_size=768, intermediate_size=3072, num_hidden_layers=8,
                num_attention_heads=12, projection_dim=16)  # fmt: skip
    encoders = [CLIPTextModelWithProjection(CLIPTextConfig(**text)) for _ in range(2)]
    pipe.register_modules(
        transformer=SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=6,
            num_attention_heads=8, attention_head_dim=64, joint_attention_dim=768,
            caption_projection_dim=512, pooled_projection_dim=32, pos_embed_max_size=16,
        ), text_encoder=encoders[0], text_encoder_2=encoders[1],
    )  # fmt: skip
    pipe.save_pretrained(folder)
    return str(folder)


def _rss(field: str) -> int:
    """A field of /proc/self/status in bytes: VmRSS, VmHWM (its peak since the last reset), RssAnon
    (what the process itself allocated: RSS less the pages of files it maps, such as the weights'
    safetensors, which the kernel may drop and read again)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


class HostPeak:
    """Within it, this process's peak host memory over what it held on entry, in bytes: `hwm`,
    VmHWM's (reset on entry by writing 5 to /proc/self/clear_refs), which counts the mapped pages
    of the files read too; `anon` and `file`, RssAnon's and RssFile's largest rises, sampled
    every millisecond by a thread (the kernel keeps no peak of them): what it allocated, and the
    pages of files it read through a map or ran (libraries' code and data first touched)."""

    def __enter__(self):
        import threading

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base_rss, self.base_anon, self.anon = _rss("VmRSS"), _rss("RssAnon"), 0
        self.base_file, self.file = _rss("RssFile"), 0
        self.done = threading.Event()

        def sample():
            while not self.done.wait(0.001):
                self.anon = max(self.anon, _rss("RssAnon") - self.base_anon)
                self.file = max(self.file, _rss("RssFile") - self.base_file)

        self.thread = threading.Thread(target=sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.done.set()
        self.thread.join()
        self.anon = max(self.anon, _rss("RssAnon") - self.base_anon)
        self.file = max(self.file, _rss("RssFile") - self.base_file)
        self.hwm = _rss("VmHWM") - self.base_rss


def _attributes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's plain tensor attributes (neither parameters nor buffers), by module.name."""
    return {f"{owner}.{k}": v for owner, m in model.named_modules() for k, v in vars(m).items()
            if isinstance(v, torch.Tensor)}  # fmt: skip


def _load_worker(rank: int, init_file: str, flags: list[str], results) -> None:
    """One of 2 gloo ranks: --shard's loading (meta models, sharded, rank 0 reading and
    broadcasting), its host memory, then each model's whole state gathered and, on rank 0,
    compared with the same models loaded whole as without --shard (DDP's loading)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        import diffusers  # what loading imports, imported before the measure
        import peft  # noqa: F401
        import transformers
        from torch.distributed.checkpoint import state_dict as dsd
        from torch.distributed.fsdp import fully_shard  # noqa: F401

        import recast
        from plumbing import cli
        from plumbing.distributed import shard_models
        from worlds import families

        for name in ("StableDiffusion3Pipeline", "SD3Transformer2DModel", "AutoencoderKL"):
            getattr(diffusers, name)
        transformers.CLIPTextModelWithProjection  # noqa: B018
        args = cli.parse(recast.Args, flags, "")
        cpu = torch.device("cpu")
        with HostPeak() as peak:  # the loading alone
            world = families.load(args, cpu)
            shard_models(world.shardable(), cpu, args.precision.replace("auto", "fp32"),
                         load=world.load_shards)  # fmt: skip
        out = {"peak": peak.anon, "hwm": peak.hwm, "file": peak.file}
        options = dsd.StateDictOptions(full_state_dict=True)
        sharded = [dsd.get_model_state_dict(m, options=options) for m in world.shardable()]
        sharded_buffers = [dict(m.named_buffers()) for m in world.shardable()]
        attributes = [_attributes(m) for m in world.shardable()]
        args.shard = False
        whole = families.load(args, cpu)  # as without --shard
        models = whole.shardable()
        out["whole_bytes"] = sum(t.nbytes for m in models for t in m.state_dict().values())
        out["largest_bytes"] = max(sum(t.nbytes for t in m.state_dict().values()) for m in models)
        pairs = list(zip(sharded, sharded_buffers, models, strict=True))
        out["names"] = [sorted(sd) == sorted(m.state_dict()) for sd, _, m in pairs]
        out["differ"] = [k for sd, _, m in pairs for k, t in m.state_dict().items()
                         if k not in sd or not torch.equal(sd[k], t)]  # fmt: skip
        out["buffers_differ"] = [k for _, b, m in pairs for k, t in m.named_buffers()
                                 if not torch.equal(b[k], t)]  # fmt: skip
        out["attributes_differ"] = [k for a, m in zip(attributes, models, strict=True)
                                    for k, t in _attributes(m).items()
                                    if k not in a or not torch.equal(a[k], t)]  # fmt: skip
        out["attributes"] = sum(len(a) for a in attributes)
        out["adapters"] = len(whole.lora)
        out["trained"] = sorted({str(p.dtype) for p in world.trainable.parameters()
                                 if p.requires_grad})  # fmt: skip
        results.put((rank, out))
    except Exception as e:  # said to the test, which fails naming it
        import traceback

        results.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def sharded_load(models, tmp_path, variant: str, folder=None, *more: str) -> dict:
    """What _load_worker says on each of 2 gloo ranks, {rank: {...}}."""
    import torch.multiprocessing as mp

    flags = flags_of(models, variant, *more)
    if folder is not None:
        flags[1] = folder
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_load_worker, args=(str(tmp_path / "init"), [*flags, "--shard"], results), nprocs=2)
    return dict(results.get() for _ in range(2))


@pytest.mark.parametrize("variant", ["sd3", "flux-dev", "qwen-image", "flux2-klein"])
def test_sharded_loading_gives_the_weights_loaded_whole(models, tmp_path, variant):
    """--shard builds the transformer and the text encoders on the meta device, shards them, and
    loads them with rank 0 reading each model and broadcasting it: gathered back whole, every
    weight, both adapters (drawn from --seed as without --shard), every buffer (CLIP's position
    ids, rotary frequencies) and every plain tensor attribute (Qwen-Image's rotary tables) equal
    the models loaded whole as without --shard, bit for bit, in every family (T5, Qwen2.5-VL and
    Qwen3 text encoders among them)."""
    folder = None
    if variant not in models:
        torch.manual_seed(0)
        folder = modelzoo.tiny_family(variant, tmp_path / variant)
    said = sharded_load(models, tmp_path, "sd3" if folder else variant, folder)
    for rank, x in said.items():
        assert "error" not in x, (rank, x.get("error"))
        assert x["trained"] == ["torch.float32"] and x["adapters"] > 0
    x = said[0]
    assert all(x["names"]) and x["differ"] == [] and x["buffers_differ"] == [], x
    assert x["attributes_differ"] == [], x["attributes_differ"]
    assert x["attributes"] == (2 if variant == "qwen-image" else 0)  # pos_freqs, neg_freqs


@pytest.mark.slow
def test_sharded_loading_holds_less_than_a_whole_copy_per_rank(models, tmp_path):
    """Host memory while loading, on 2 gloo ranks, with an SD3 whose text encoders outweigh its
    transformer as SD3.5-Medium's do (sd35_proportions), in bf16 (--precision bf16, CUDA's: 340 MB
    of weights, read from fp32 files, so every rank's copies are its own memory). Measured from
    /proc/self/status in each rank after the libraries are imported (HostPeak): RssAnon's and
    RssFile's largest rises, sampled every millisecond through the loading, are what the loading
    allocated and the file pages it touched. Under --shard the rank that only receives holds its
    shards (half of every model), and rank 0 one model whole at a time beside its shards: each
    below one whole copy, the least that loading without --shard holds on every rank (its models
    whole, and on a GPU again); 15 % of a whole copy (51 MB) is left for what loading allocates
    besides the weights. Rank 1 maps no weights' file: its file pages rise by the libraries' code
    and data only, bounded at 10 % of a whole copy (34 MB; a sharded model's file: 220-229 MB).
    Measured (min / median / max; idle: `python -m benchmarks.stress_ranks --memory-only --idle
    --repeats 5`; busy: the stress check's 20 repeats at load average 4 to 7): rank 1 allocated
    194.6 / 195.7 / 199.6 MB idle and 195.2 / 197.5 / 204.6 busy (bound 221.2), and touched
    24.2 / 24.2 / 24.3 and 24.2 / 24.3 / 24.3 MB of file pages (bound 34); rank 0 allocated
    311.2 / 311.5 / 322.2 and 309.5 / 311.3 / 321.6 MB (bound 340.3). VmHWM, which the test once
    bounded at 221.2 MB, adds the two for rank 1 (219 to 224 MB idle, 219.5 / 221.8 / 228.8 busy:
    crossed in half the repeats), so each is bounded on its own. Before --shard loaded this way,
    rank 1 held the whole copy too, then sharded it."""
    folder = sd35_proportions(tmp_path / "sd35")
    said = sharded_load(models, tmp_path, "sd3", folder, "--precision", "bf16")
    measured = {r: {k: x[k] for k in ("peak", "hwm", "file") if k in x} for r, x in said.items()}
    (tmp_path / "memory.json").write_text(json.dumps(measured))  # benchmarks/stress_ranks.py
    for rank, x in said.items():
        assert "error" not in x, (rank, x.get("error"))
    whole, largest = said[0]["whole_bytes"], said[0]["largest_bytes"]
    assert whole > 3e8 and largest < 0.35 * whole, said
    assert all(said[0]["names"]) and said[0]["differ"] == [], said[0]
    besides = 0.15 * whole  # what loading allocates besides the weights
    assert said[1]["peak"] < 0.5 * whole + besides, said  # its shards
    assert said[1]["file"] < 0.1 * whole, said  # it maps no weights' file: libraries' pages only
    assert said[0]["peak"] < largest + 0.5 * whole + besides < whole, said


def _tensors(obj) -> int:
    """How many tensors a (nested) state dict holds."""
    if isinstance(obj, torch.Tensor):
        return 1
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else []
    return sum(_tensors(x) for x in items)


def _save_worker(rank: int, init_file: str, flags: list[str], out: str, results) -> None:
    """One of 2 gloo ranks: the tiny SD3 loaded sharded, one AdamW step on made-up gradients,
    then what a checkpoint gathers (world.state_dict, distributed.optimizer_state) beside the
    same state gathered whole on every rank (each DTensor's full_tensor; the optimizer's
    full_state_dict without cpu_offload); rank 0 writes a checkpoint of each."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))  # fmt: skip
    try:
        from torch.distributed.checkpoint import state_dict as dsd

        import recast
        from plumbing import checkpoints, cli
        from plumbing.distributed import optimizer_state, shard_models
        from worlds import families

        args = cli.parse(recast.Args, flags, "")
        cpu = torch.device("cpu")
        world = families.load(args, cpu)
        shard_models(world.shardable(), cpu, "fp32", load=world.load_shards)
        params = [p for p in world.trainable.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        for i, p in enumerate(params):
            p.grad = torch.full_like(p, 0.1 * (i + 1))
        optimizer.step()
        lora, optim = world.state_dict(), optimizer_state(world.trainable, optimizer, True)
        everywhere = {k: p.detach().full_tensor() for k, p in world.lora.items()}
        options = dsd.StateDictOptions(full_state_dict=True)
        optim_everywhere = dsd.get_optimizer_state_dict(world.trainable, optimizer,
                                                        options=options)  # fmt: skip
        said = {"lora": _tensors(lora), "optim": _tensors(optim), "whole": _tensors(everywhere),
                "optim_whole": _tensors(optim_everywhere)}  # fmt: skip
        if rank == 0:
            said["devices"] = sorted({str(t.device) for t in lora.values()})
            state = {"opt_steps": 1, "gains_ema": None}
            for name, (t, o) in {"now": (lora, optim), "before": (everywhere, optim_everywhere)
                                 }.items():  # fmt: skip
                checkpoints.save(os.path.join(out, name), 1, t, o, state)
        results.put((rank, said))
    except Exception as e:  # said to the test, which fails naming it
        import traceback

        results.put((rank, {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow  # 73 s under load (2 spawned ranks loading the tiny SD3)
def test_a_sharded_save_gathers_onto_rank_0_alone(models, tmp_path):
    """A checkpoint under --shard gathers the adapters and AdamW's state onto rank 0's host only:
    on 2 gloo ranks, rank 1 gets empty dicts (no gathered tensor), rank 0 the whole state, and
    the checkpoint rank 0 writes from it equals, byte for byte, the one written from the same
    state gathered whole on every rank (each adapter's full_tensor, the optimizer's
    full_state_dict without cpu_offload), as saves gathered before."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    flags = [*flags_of(models, "sd3"), "--shard"]
    mp.spawn(_save_worker, args=(str(tmp_path / "init"), flags, str(tmp_path), results),
             nprocs=2)  # fmt: skip
    said = dict(results.get() for _ in range(2))
    for rank, x in said.items():
        assert "error" not in x, (rank, x.get("error"))
    assert said[1]["lora"] == 0 and said[1]["optim"] == 0, said[1]
    assert said[1]["whole"] == said[0]["lora"] > 0 and said[1]["optim_whole"] > 0, said
    assert said[0]["optim"] == said[0]["optim_whole"] == said[1]["optim_whole"], said
    assert said[0]["devices"] == ["cpu"]
    for name in ("model.safetensors", "optim.pt"):
        now, before = (tmp_path / d / "ckpt" / "epoch_0001" / name for d in ("now", "before"))
        assert now.read_bytes() == before.read_bytes(), name
    optim = torch.load(tmp_path / "now" / "ckpt" / "epoch_0001" / "optim.pt")
    assert len(optim["state"]) == said[0]["lora"] // 2  # AdamW's state of each trained tensor


def _optimizer_worker(rank: int, init_file: str, results) -> None:
    """One gloo process (a group of 1): two sharded layers, AdamW stepped on gradients of the
    first only, its state saved as a checkpoint keeps it and loaded into a new AdamW: which
    parameters have state after the load, and each state's step."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    try:
        from plumbing.distributed import load_optimizer_state, optimizer_state, shard_models

        torch.manual_seed(0)
        model = torch.nn.Module()
        model.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        shard_models([model], torch.device("cpu"), "fp32")
        first = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for p in model.blocks[0].parameters():  # the second layer never gets a gradient
            p.grad = torch.ones_like(p)
        first.step()
        first.zero_grad()  # as the loop leaves them; a resumed run's parameters have none
        saved = optimizer_state(model, first, sharded=True)
        second = torch.optim.AdamW(model.parameters(), lr=1e-2)
        load_optimizer_state(model, second, saved, sharded=True)
        names = {p: n for n, p in model.named_parameters()}
        loaded = {names[p]: s["step"].item() for p, s in second.state.items()}
        results.put({"saved": sorted(saved["state"]), "loaded": loaded})
    except Exception as e:  # said to the test, which fails naming it
        import traceback

        results.put({"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"})
    finally:
        dist.destroy_process_group()


def test_a_sharded_resume_gives_no_state_to_a_parameter_without_one(tmp_path):
    """torch's set_optimizer_state_dict gives every parameter a state before it loads the saved
    ones (an AdamW step on zero gradients): a parameter the checkpoint holds no state for (one
    that never had a gradient, as Qwen-Image's last text-side adapters) kept step 1 and zero
    moments, which the unbroken run never made. load_optimizer_state drops them: after the load
    only the saved parameters have state, at their saved step."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_optimizer_worker, args=(str(tmp_path / "init"), results), nprocs=1)
    said = results.get()
    assert "error" not in said, said
    assert said["saved"] == ["blocks.0.bias", "blocks.0.weight"]
    assert said["loaded"] == {"blocks.0.bias": 1.0, "blocks.0.weight": 1.0}


def test_shard_needs_torchrun_and_a_diffusers_model(models, tmp_path, capsys, monkeypatch):
    """--shard with the toy world, or with a diffusers model but without torchrun: exit 2 naming
    the flag and the fix, nothing written."""
    import recast

    for k, v in models["env"].items():
        monkeypatch.setenv(k, v)
    out = str(tmp_path / "run")
    toy = ["--lambda", "0.4,0.2,0.2,0.2"]
    for flags, said in ((toy, "toy world"), (flags_of(models, "sd3"), "torchrun")):
        with pytest.raises(SystemExit) as e:
            recast.main([*flags, "--shard", "--out", out])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "error: --shard" in err and said in err, err
    assert not os.path.exists(out)


def _bf16_checks() -> dict:
    """The tiny SD3 transformer as the world holds it on CUDA (bf16 weights; the two adapters,
    fp32, "default" trainable), sharded with the bf16 precision, then as the loop uses it: a first
    forward with the adapters disabled, then the policy's forward and backward, every forward
    under bf16 autocast as the world runs them on CUDA. The same forward and backward on an
    unsharded copy give the reference gradients."""
    from diffusers import SD3Transformer2DModel
    from peft import LoraConfig

    from plumbing.distributed import shard_models
    from worlds import sd3world
    from worlds.diffusersworld import lora_targets

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        num_attention_heads=2, attention_head_dim=8, joint_attention_dim=32,
        caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=16,
    ).to(torch.bfloat16).requires_grad_(False)  # fmt: skip
    targets = lora_targets(model, sd3world.LORA_TARGETS)
    for name in ("default", "old"):
        model.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                     target_modules=targets), adapter_name=name)  # fmt: skip
    model.set_adapter("default")
    for k, p in model.named_parameters():
        if ".default." in k or ".old." in k:  # fp32 and lora_B off zero: every adapter learns
            p.data = (p.data + 0.1 * torch.randn_like(p) * ("lora_B" in k)).float()
    whole = copy.deepcopy(model)
    shard_models([model], torch.device("cpu"), precision="bf16")

    t = torch.tensor([0.9993, 0.5003])  # 1000·t: 999.3 and 500.3, which bf16 rounds to 1000, 500
    inputs = dict(hidden_states=torch.randn(2, 4, 16, 16), timestep=1000 * t,
                  encoder_hidden_states=torch.randn(2, 8, 32),
                  pooled_projections=torch.randn(2, 32))  # fmt: skip
    seen = []  # the timestep as the transformer's time embedding reads it
    model.time_text_embed.register_forward_pre_hook(
        lambda m, args: seen.append((str(args[0].dtype), args[0].double().tolist()))
    )
    autocast = lambda: torch.autocast("cpu", torch.bfloat16)  # noqa: E731
    with torch.no_grad(), autocast():  # the base model's evaluation, the loop's first forward
        model.disable_adapters()
        model(**inputs, return_dict=False)
        model.enable_adapters()
    out, grads = {"timestep": seen}, {}
    for m in (model, whole):
        with autocast():
            v = m(**inputs, return_dict=False)[0]
        try:
            v.float().square().mean().backward()
        except RuntimeError as e:
            return {**out, "error": str(e).splitlines()[0]}
        grads[m is model] = {k: p.grad for k, p in m.named_parameters() if p.grad is not None}
    sharded, reference = grads[True], grads[False]
    out["trained"] = sorted(sharded) == sorted(reference) and all(".default." in k for k in sharded)
    out["grad_dtypes"] = sorted({str(g.dtype) for g in sharded.values()})
    out["max_err"] = max((sharded[k].full_tensor() - reference[k]).abs().max().item()
                         for k in reference)  # fmt: skip
    out["max_grad"] = max(g.abs().max().item() for g in reference.values())
    return out


def _bf16_worker(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        results.put((rank, _bf16_checks()))
    except Exception as e:  # said to the test, which fails naming it
        results.put((rank, {"error": f"{type(e).__name__}: {e}"}))
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def bf16_sharded(tmp_path_factory):
    """What _bf16_checks says on each of 2 gloo processes, {rank: {...}}."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    init = tmp_path_factory.mktemp("bf16") / "init"
    mp.spawn(_bf16_worker, args=(str(init), results), nprocs=2)
    return dict(results.get() for _ in range(2))


@pytest.mark.xdist_group("bf16_sharded")  # one worker spawns the ranks once for both
def test_bf16_shards_train_after_a_first_forward_with_the_adapters_off(bf16_sharded):
    """FSDP2 sets a layer's gradient dtypes up at the first forward from the parameters that
    require grad then; the base model's evaluation disables the adapters (no parameter requires
    grad), and every later backward failed: "attempting to assign a gradient with dtype
    'c10::BFloat16' to a tensor with grad_dtype 'Float'". shard_models sets them up itself: the
    backward gives each rank the unsharded model's gradients, fp32, for the trained adapter only."""
    for rank, said in bf16_sharded.items():
        assert "error" not in said, (rank, said)
        assert said["trained"] and said["grad_dtypes"] == ["torch.float32"], said
        # the same bf16 computation (bf16 weights, adapters cast to bf16 by autocast or by the
        # gather), summed in fp32 over 2 ranks of the same inputs and halved: measured equal
        assert said["max_err"] <= 1e-5 * said["max_grad"], said


@pytest.mark.xdist_group("bf16_sharded")
def test_bf16_shards_take_the_timestep_in_fp32(bf16_sharded):
    """FSDP2's default casts each sharded module's floating-point inputs to bf16 before its
    forward: SD3's timestep 1000·t reached the model rounded (999.3 → 1000). shard_models leaves
    them as passed, as DDP does: both forwards read 999.3 and 500.3 in fp32."""
    want = (1000 * torch.tensor([0.9993, 0.5003])).double().tolist()
    for rank, said in bf16_sharded.items():
        assert said["timestep"] == [("torch.float32", want)] * 2, (rank, said)
