"""torchrun's processes: the process group, the collectives the loop uses (gather, mean_all, the
bit-identity check of every rank's weights), and a lost rank or node ending the run in seconds
with the --resume command (docs/failure_modes.md#a-lost-rank-or-node). On one process every
collective is the identity."""

import datetime
import hashlib
import math
import os
import socket
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from plumbing import cli
from plumbing.checkpoints import newest, resume_command
from plumbing.seeding import seed_all

COLLECTIVE_TIMEOUT = 300  # seconds a rank waits inside one collective: see collective_timeout
STARTUP_TIMEOUT = 1800  # the same until the loop starts (loading): see startup_timeout
_timeout_variable = "RECAST_STARTUP_TIMEOUT"  # the one in force: the start-up's, then the loop's


def _seconds(variable: str, default: float) -> datetime.timedelta:
    text = os.environ.get(variable, str(default))
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        cli.fail(variable, f"must be a number of seconds > 0, got {text!r}")
    return datetime.timedelta(seconds=seconds)


def collective_timeout() -> datetime.timedelta:
    """How long a rank waits inside one collective of the training loop for the others before it
    gives up: seconds in RECAST_COLLECTIVE_TIMEOUT, default 300. A rank that dies is noticed at
    once whatever this is (its connections close, and torchrun stops its node's other workers);
    this bounds a silent hang (a node without power or network, a stuck GPU). It must exceed the
    longest legitimate wait of an epoch: ranks wait for rank 0 to write checkpoints and pictures
    (docs/failure_modes.md#a-lost-rank-or-node). Loading has its own: startup_timeout."""
    return _seconds("RECAST_COLLECTIVE_TIMEOUT", COLLECTIVE_TIMEOUT)


def startup_timeout() -> datetime.timedelta:
    """collective_timeout until the training loop starts: seconds in RECAST_STARTUP_TIMEOUT,
    default 1800. The first collectives wait for the slowest rank to start, load the models and
    reward models (32 ranks reading tens of GB each from a network filesystem: minutes), and read
    a resumed run's checkpoint."""
    return _seconds("RECAST_STARTUP_TIMEOUT", STARTUP_TIMEOUT)


def _set_timeout(timeout: datetime.timedelta) -> bool:
    """Set `timeout` on every process group this rank is in (the default group, and any other: a
    2-D mesh's); False where this torch cannot. torch sets a group's timeout when it is made
    (init_process_group(timeout=...)); a group made later without one, as init_device_mesh makes
    a 2-D mesh's, takes torch's default: 10 min on nccl, 30 on gloo.
    torch.distributed.distributed_c10d._set_pg_timeout changes it for the collectives issued
    after the call, on gloo (ProcessGroupGloo's options and contexts; measured: a 2 s timeout set
    after a 60 s one ends a wait after 2.0 s, and the reverse waits out a 6 s late rank) and on
    nccl (ProcessGroupNCCL's options, which each new work's watchdog deadline reads: from torch's
    code, not run here). It is private: if a torch lacks it, the groups keep theirs."""
    c10d = dist.distributed_c10d
    try:
        groups = [g for g in c10d._world.pg_map if not c10d._rank_not_in_group(g)]
        for group in groups:
            c10d._set_pg_timeout(timeout, group)
    except AttributeError as e:
        if dist.get_rank() == 0:
            print(f"note: this torch cannot change a process group's timeout ({e}): a group "
                  "keeps the timeout it was made with")  # fmt: skip
        return False
    return True


def start_training() -> None:
    """From here on every collective waits collective_timeout, no longer startup_timeout: called
    once the models are loaded and the base model evaluated; every group takes the loop's
    (_set_timeout). If this torch cannot change it, the loop keeps the start-up timeout."""
    global _timeout_variable
    if dist.is_initialized() and _set_timeout(collective_timeout()):
        _timeout_variable = "RECAST_COLLECTIVE_TIMEOUT"


# NCCL's own handling of a failed or timed-out collective, set where the environment does not:
# docs/failure_modes.md#on-nccl says what each does and what a lost rank then looks like
NCCL_ENVIRONMENT = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",  # the watchdog ends the process (torchrun's default)
    "TORCH_NCCL_ENABLE_MONITORING": "1",  # needed for the dump below (torch's default)
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",  # the flight recorder: each group's last collectives
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # written by every rank when one times out
}
NCCL_DUMP = "/tmp/nccl_trace_rank_"  # torch's TORCH_NCCL_DEBUG_INFO_TEMP_FILE, a rank's suffixed


def nccl_environment() -> dict[str, str]:
    """Set NCCL_ENVIRONMENT's variables that are not set already (a value given wins); returns
    what it set."""
    unset = {k: v for k, v in NCCL_ENVIRONMENT.items() if k not in os.environ}
    os.environ.update(unset)
    return unset


def check_device(text: str, distributed: bool) -> None:
    """--device names a device this machine has: cpu, cuda or cuda:N (N below the GPU count; under
    torchrun the index is not read: each rank takes its LOCAL_RANK's GPU), or auto; else exit 2
    naming --device, before the process group or any model, instead of a traceback at the first
    tensor moved there."""
    if text == "auto":
        return
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        cli.fail("--device", f"{text!r} is not one of cpu, cuda, cuda:N or auto")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and not gpus:
        cli.fail("--device", f"{text}: torch finds no CUDA GPU here: use --device cpu (or auto)")
    if device.type == "cuda" and not distributed and (device.index or 0) >= gpus:
        cli.fail("--device", f"{text}: this machine has {gpus} CUDA GPU(s), cuda:0 to "
                 f"cuda:{gpus - 1}")  # fmt: skip


def init_processes(args, distributed: bool) -> tuple[int, torch.device]:
    """(rank, device), the process group started under torchrun with startup_timeout (the loop
    runs with collective_timeout: start_training); seeds set per rank. On CUDA each rank takes
    its GPU (LOCAL_RANK) before the group is made, and the group is bound to it (device_id, as
    torchtitan does): NCCL then sets up its communicator for that GPU at once, instead of at the
    first collective, and a barrier needs no guess of which GPU is this rank's. On nccl its
    diagnostics are on (nccl_environment), and rank 0 says what a lost rank will print and how to
    resume. On the CPU (gloo) the group is made without device_id. A --device this machine lacks
    exits 2 first (check_device)."""
    check_device(args.device, distributed)
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device(("cuda" if use_cuda else "cpu") if args.device == "auto" else args.device)
    if device.type == "cuda" and distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if distributed:
        collective_timeout()  # a bad value exits 2 now, not once the models are loaded
        if use_cuda:
            nccl_environment()  # read when the process group is made
        bound = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=startup_timeout(),
                                **bound)  # fmt: skip
        if use_cuda and dist.get_rank() == 0:  # said now: a lost rank's message will be torch's
            dump = os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", NCCL_DUMP)
            print(f"note: nccl: a collective that fails or times out ends every process from "
                  f"NCCL's watchdog, with PyTorch's message (each rank's last collectives in "
                  f"{dump}<rank>); the newest checkpoint is kept: continue with "
                  f"{resume_command(args.out)} (docs/failure_modes.md#on-nccl)")  # fmt: skip
    rank = dist.get_rank() if distributed else 0
    seed_all(args.seed + rank)
    return rank, device


def gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate a tensor across ranks along `dim` (rank order); every rank gets the result."""
    if not dist.is_initialized():
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim)


def gather_uneven(x: torch.Tensor, sizes: list[int], dim: int = -1) -> torch.Tensor:
    """gather for ranks holding different lengths along `dim`: rank r's is sizes[r], which every
    rank knows (all_gather moves equal shapes, so each is padded to the largest and cut back)."""
    if not dist.is_initialized():
        return x
    pad = list(x.shape)
    pad[dim] = max(sizes) - x.shape[dim]
    mine = torch.cat([x, x.new_zeros(pad)], dim).contiguous()
    parts = [torch.empty_like(mine) for _ in sizes]
    dist.all_gather(parts, mine)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes, strict=True)], dim)


def mean_all(x: torch.Tensor) -> float:
    """Mean of x's elements over every rank; ranks may hold different numbers (eval shares)."""
    total = torch.stack([x.double().sum(), x.new_tensor(x.numel(), dtype=torch.float64)])
    if dist.is_initialized():
        dist.all_reduce(total)
    return (total[0] / total[1]).item()


def same_on_all_ranks(tensors: dict[str, torch.Tensor], when: str) -> str:
    """SHA-256 of the tensors' bytes, key by key; a RuntimeError unless every rank's is the same.
    DDP averages gradients whatever each rank holds, so a rank that drifted (its own W, weights
    initialised from its own seed) would train on silently: this is what catches it."""
    digest = hashlib.sha256()
    for k in sorted(tensors):
        digest.update(k.encode())
        digest.update(tensors[k].detach().cpu().contiguous().flatten().view(torch.uint8).numpy())
    mine, digests = digest.hexdigest(), [None] * dist.get_world_size()
    dist.all_gather_object(digests, mine)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise RuntimeError(f"ranks {differ} hold another W or other weights than rank 0 {when}")
    return mine


# What a collective raises when another rank is gone: gloo's RuntimeError (its connection closed,
# or it timed out) names gloo; nccl's, torch's DistBackendError, is a DistError.
LOST = ("gloo", "NCCL", "Connection closed by peer", "Connection reset by peer", "Timed out")


def exit_if_rank_lost(e: BaseException, run_dir: str | None) -> None:
    """Under torchrun, when `e` is a collective that failed because another rank died or stopped
    answering: print which ranks do not answer and the --resume command of `run_dir` (None: the
    run has saved nothing yet), and end this process at once with exit 1 (a broken process group
    can hang in its destructor). Otherwise return."""
    if not dist.is_initialized() or not (
        isinstance(e, dist.DistError) or any(s in str(e) for s in LOST)
    ):
        return
    me, silent = dist.get_rank(), _silent_ranks()
    if silent == []:  # every rank answers: not a lost rank but an error they all met
        return
    who = f"rank {', '.join(map(str, silent))} stopped answering" if silent else (
        f"the rendezvous store does not answer either: the node hosting it "
        f"({os.environ.get('MASTER_ADDR', '?')}) is lost")  # fmt: skip
    error = (str(e).strip().splitlines() or [type(e).__name__])[0][:240]
    if "Timed out" in error:
        loop = _timeout_variable == "RECAST_COLLECTIVE_TIMEOUT"  # the one in force
        now = (collective_timeout() if loop else startup_timeout()).total_seconds()
        error += (f"; if the ranks were only slow, raise {_timeout_variable} (now "
                  f"{now:g} s)")  # fmt: skip
    then = "nothing was saved yet" if run_dir is None else (
        f"the newest checkpoint ({newest(run_dir)}) is kept; once every node is back, "
        f"continue: {resume_command(run_dir)}")  # fmt: skip
    sys.stdout.flush()
    print(f"recast.py: stopped: rank {me} lost contact: {who} ({error}); {then}",
          file=sys.stderr, flush=True)  # fmt: skip
    os._exit(1)


def _silent_ranks(wait_s: float = 5.0) -> list[int] | None:
    """The other ranks that do not check in through the rendezvous store within wait_s (every
    rank whose collective failed checks in here); None when the store itself does not answer."""
    me, attempt = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = lambda r: f"recast/lost/{attempt}/{r}"  # noqa: E731
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(key(me), socket.gethostname())
        silent = [r for r in range(dist.get_world_size()) if r != me]
        deadline = time.monotonic() + wait_s
        while silent and time.monotonic() < deadline:
            time.sleep(0.2)
            silent = [r for r in silent if not store.check([key(r)])]
        return silent
    except (AttributeError, RuntimeError, OSError):  # DistStoreError is a RuntimeError
        return None


def finish() -> None:
    """End this rank's part of a multi-rank run, once its work is done: wait for every rank
    (rank 0 last saves the run's summary) through the rendezvous store, not a collective, then
    destroy the process groups. A gloo barrier keeps the last collectives' works (and the
    tensors they hold) alive until a worker thread releases them just after the barrier returns,
    while this thread goes on to exit: under load that release came after Python began to shut
    down, and the worker, asking for the interpreter's lock then, was ended inside code that may
    not throw: `terminate called without an active exception`, SIGABRT (docs/failure_modes.md).
    The store's wait leaves no such work behind; rundir.run_main then ends the process without
    the interpreter's shutdown, which is what removes the race (a collective of the epoch can
    still finish within milliseconds of the end)."""
    if not dist.is_initialized():
        return
    me, attempt = dist.get_rank(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = lambda r: f"recast/done/{attempt}/{r}"  # noqa: E731
    store = dist.distributed_c10d._get_default_store()
    store.set(key(me), "1")
    store.wait([key(r) for r in range(dist.get_world_size())], collective_timeout())
    dist.destroy_process_group()


@contextmanager
def lost_rank_exits(run_dir: str):
    """Within it, a collective that fails because another rank is lost ends this process with
    exit 1 and a message naming `run_dir`'s newest checkpoint and its --resume command."""
    try:
        yield
    except RuntimeError as e:
        exit_if_rank_lost(e, run_dir)  # returns for any other error
        raise


@contextmanager
def gradient_sync(world, sync: bool):
    """Within it, a backward reduces the gradients across the ranks only when `sync` (the last
    micro-batch of an optimizer step); before it each rank adds its micro-batches' gradients into
    its own, reduced with the last one's: one reduction a step instead of one a micro-batch
    (--grad-accum). DDP: its no_sync() around the forward and backward; --shard (FSDP2):
    set_requires_gradient_sync on every sharded model (the reduce-scatter, and across nodes the
    all-reduce, skipped; the adapters' gradients held whole meanwhile). One process: nothing."""
    from torch.distributed.fsdp import FSDPModule

    policy = world.policy
    if isinstance(policy, torch.nn.parallel.DistributedDataParallel) and not sync:
        with policy.no_sync():
            yield
        return
    shardable = getattr(world, "shardable", list)  # the toy world shards nothing
    for module in shardable():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(sync)
    yield


# ---------------------------------------------------------------------------------------------
# --shard: FSDP2 (torch.distributed.fsdp.fully_shard) instead of DDP
# ---------------------------------------------------------------------------------------------
def layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated layers of a model: the children of each outermost ModuleList whose children
    all share one class and hold parameters (a transformer's blocks, a text encoder's layers; one
    block is a layer too). The adapters live in them, never in the root, whose parameters FSDP2
    keeps gathered after a forward: peft's switching of adapters must meet the sharded ones."""
    found, inside = [], []
    for name, m in module.named_modules():
        if any(name.startswith(p + ".") for p in inside) or not isinstance(m, torch.nn.ModuleList):
            continue
        kids = list(m)
        if (
            kids
            and len({type(k) for k in kids}) == 1
            and next(kids[0].parameters(), None) is not None
        ):
            found += kids
            inside.append(name)
    return found


PRECISIONS = ("bf16", "fp32")  # shard_models' precision: see there


def default_precision(device: torch.device) -> str:
    """shard_models' precision on `device` when none is asked for: bf16 on CUDA (where the frozen
    weights are bf16 and every forward runs under bf16 autocast), fp32 elsewhere."""
    return "bf16" if device.type == "cuda" else "fp32"


def resolve_precision(args, device: torch.device) -> str:
    """recast.py's --precision on `device`: "bf16" or "fp32" ("auto": default_precision)."""
    return default_precision(device) if args.precision == "auto" else args.precision


def node_layout() -> tuple[int, int]:
    """(nodes, ranks per node) of this torchrun run: torchrun's LOCAL_WORLD_SIZE and GROUP_RANK
    in every rank, agreed by all of them (a collective). Several nodes only when each node runs
    the same number of ranks and a node's ranks are consecutive (RANK = GROUP_RANK ×
    LOCAL_WORLD_SIZE + LOCAL_RANK, as torchrun numbers them); otherwise, or without torchrun's
    variables, one node of every rank."""
    ranks = dist.get_world_size()
    env = os.environ
    try:
        mine = (int(env["LOCAL_WORLD_SIZE"]), int(env["GROUP_RANK"]), int(env["LOCAL_RANK"]))
    except (KeyError, ValueError):
        mine = None
    every = [None] * ranks
    dist.all_gather_object(every, mine)
    if any(m is None for m in every):
        return 1, ranks
    local = every[0][0]
    laid_out = all(m[0] == local and r == m[1] * local + m[2] for r, m in enumerate(every))
    if not laid_out or local < 1 or ranks % local:
        return 1, ranks
    return ranks // local, local


def shard_mesh(device: torch.device):
    """--shard's device mesh: on one node a flat one over every rank (each keeps 1/N of every
    parameter); on several, HSDP's 2-D ("replicate", "shard") mesh: each node's ranks shard the
    models among themselves and the nodes hold replicas, so a forward's all-gathers stay on the
    node's own links (NVLink) and only the adapters' gradients (all-reduced between the replicas
    after each node's reduce-scatter) cross the network (docs/models.md#many-nodes)."""
    from torch.distributed.device_mesh import init_device_mesh

    nodes, local = node_layout()
    if nodes == 1:
        mesh = init_device_mesh(device.type, (local,))
    else:
        if dist.get_rank() == 0:
            print(f"note: --shard on {nodes} nodes of {local} ranks: each node shards the models "
                  "among its ranks, and the nodes hold replicas (HSDP)")  # fmt: skip
        mesh = init_device_mesh(device.type, (nodes, local), mesh_dim_names=("replicate", "shard"))
    # a group the mesh made has torch's default timeout (10 min on nccl), and the base model's
    # evaluation and a resume's first collectives run on it: the start-up's, as every group's
    if _timeout_variable == "RECAST_STARTUP_TIMEOUT":
        _set_timeout(startup_timeout())
    return mesh


def shard_models(
    modules: list[torch.nn.Module], device: torch.device, precision: str | None = None,
    load=None,
) -> None:  # fmt: skip
    """Shard each module across the ranks with FSDP2 (on the mesh of shard_mesh: every rank, or
    each node's): each of its repeated layers, then the rest (the root). Each rank keeps 1/N of
    every parameter, frozen or trained (N: the ranks of its node under several nodes), and gathers
    a layer's whole for its forward and backward. Call it while the parameters to train, and only
    they, require grad (the adapter "default", as the world leaves it after loading).

    `load`: for modules built on the meta device (DiffusersWorld under --shard), a function called
    once they are sharded, that gives every rank its shards' weights (the world's load_shards);
    FSDP2's set-up below needs them.

    `precision` (default: default_precision(device)): "bf16" gathers each layer in bf16 (the
    frozen weights are bf16 already; the fp32 adapters are cast for the gather) and reduces the
    gradients in fp32 into the fp32 adapter shards, so their gradients and AdamW's state stay fp32.
    The forwards must then run under torch.autocast(dtype=torch.bfloat16), as the diffusers world
    runs every CUDA forward: FSDP2 leaves the inputs as the caller passes them (below). "fp32"
    gathers and reduces every parameter in the dtype it is stored in."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    precision = precision or default_precision(device)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    mesh = shard_mesh(device)
    # cast_forward_inputs=False: by default FSDP2 casts every floating-point tensor argument of
    # every sharded module's forward to param_dtype before the forward runs (FSDPState._pre_forward
    # → _cast_forward_inputs), the root's too: the timestep (SD3's 1000·t, which bf16's 8
    # significant bits round to a multiple of 4 near 1000: 999.3 → 1000), FLUX's t and guidance,
    # the pooled projections, FLUX's rotary embeddings handed to each block, all rounded before
    # the model's own code (sinusoidal embeddings computed in fp32) reads them. Left alone they
    # reach each module as under DDP, and bf16 autocast runs the matmuls in bf16 on the
    # bf16-gathered weights, as it does on DDP's bf16 weights and fp32 adapters: a sharded forward
    # computes what the DDP forward computes.
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                              reduce_dtype=torch.float32, cast_forward_inputs=False)  # fmt: skip
    for module in modules:  # every group gathered only while it computes (the root too)
        for layer in layers(module):
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(module, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    if load is not None:  # FSDP2's set-up (below) refuses parameters still on the meta device
        load()
    for module in modules:
        # FSDP2 finishes its set-up lazily, at the first forward through the root
        # (FSDPState._lazy_init → FSDPParamGroup.lazy_init → _init_mp_dtypes), and only then: each
        # layer's group records the dtypes of its gradients, _orig_dtype and _reduce_dtype, from
        # the parameters that require grad at that moment, and keeps them for the run. The loop's
        # first forward is the reference's, with the adapters disabled, and peft's
        # disable_adapters() turns requires_grad off on every adapter: the groups record none
        # (None), so every backward after it reduce-scatters the bf16 gradients in bf16 and hands
        # them uncast to the fp32 shards (foreach_reduce: `reduce_dtype or grad_dtype`,
        # `_to_dtype_if_needed(reduce_output, orig_dtype)`), which autograd refuses ("attempting
        # to assign a gradient with dtype 'c10::BFloat16' to a tensor with grad_dtype 'Float'"). A
        # resumed run escaped only because its first forward is the "old" adapter's, which
        # requires grad then. Set up here, while the trained adapter requires grad, each group
        # records fp32 whatever the first forward enables: the root's forwards find the set-up
        # done and do not redo it (only FSDPModule.unshard(), which nothing here calls, would).
        # _lazy_init is FSDP2's own (private) entry: if torch renames it, this fails at once.
        fully_shard.state(module)._lazy_init()


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, sharded: bool):
    """The optimizer's state as a checkpoint keeps it: under --shard gathered whole (every rank
    must call it; parameters keyed by name, so a run resumes on any number of ranks) onto rank 0's
    host, one tensor at a time (cpu_offload: each is gathered on the GPU and copied out at once;
    the other ranks get an empty dict: only rank 0 writes the checkpoint)."""
    if not sharded:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model, optimizer, state: dict, sharded: bool) -> None:
    """optimizer_state's inverse: every rank reads the whole state and keeps its shard. A trained
    parameter without state stays without, as optimizer.load_state_dict leaves it: AdamW makes a
    parameter's state at its first gradient, and some never get one (Qwen-Image's last block
    discards its text stream, so that block's text-side adapters have no gradient), which
    strict=True (torch's default here) refuses. set_optimizer_state_dict first gives every
    parameter a state (one AdamW step on zero gradients at lr 0: its _init_optim_state), and a
    parameter the checkpoint holds none for kept that one (step 1, zero moments): a resumed run
    then saved state the unbroken run never made, and a parameter whose first gradient came
    after the resume would have taken its bias correction from step 2. That made-up state is
    dropped here."""
    if not sharded:
        return optimizer.load_state_dict(state)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, strict=False)
    set_optimizer_state_dict(model, optimizer, state, options=options)
    names = {p: name for name, p in model.named_parameters()}  # the state's keys (full_state_dict)
    unknown = set(state["state"]) - set(names.values())
    if unknown:  # names that are not the model's would drop the state of every parameter below
        raise KeyError(f"the optimizer state names {len(unknown)} parameters the model does not "
                       f"hold: {sorted(unknown)[:3]}")  # fmt: skip
    for group in optimizer.param_groups:
        for p in group["params"]:
            if names[p] not in state["state"]:
                optimizer.state.pop(p, None)
