"""Tests of benchmarks/memtrace.py's GPU form on what a CPU can check: the emulated autocast on meta
tensors keeps what torch.autocast keeps for backward, on a LoRA'd block of the ops whose autocast
policy the CPU and CUDA share (linear, GELU), against the CPU allocator."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import memtrace
from test_recast import refused

WIDTH, RANK, ROWS = 512, 16, 256


def lora_block(device) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module]:
    """A frozen bf16 linear layer and a trainable fp32 LoRA pair (rank RANK) beside it."""
    torch.manual_seed(0)
    with torch.device(device):
        base = torch.nn.Linear(WIDTH, WIDTH).to(torch.bfloat16).requires_grad_(False)
        down, up = (
            torch.nn.Linear(WIDTH, RANK, bias=False),
            torch.nn.Linear(RANK, WIDTH, bias=False),
        )
    return base, down, up


def forward(base, down, up, x) -> torch.Tensor:
    """peft's LoRA forward (its input cast to the adapter's fp32) twice, GELU, a loss."""
    h = base(x) + up(down(x.float())).to(x.dtype)
    y = torch.nn.functional.gelu(base(h) + up(down(h.float())).to(h.dtype))
    return y.float().square().mean()


def cpu_peak(autocast: bool) -> int:
    """Peak bytes the CPU allocator held above the start: the forward under torch.autocast, the
    backward after it (as recast.py calls them)."""
    base, down, up = lora_block("cpu")
    x = torch.randn(ROWS, WIDTH).to(torch.bfloat16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = forward(base, down, up, x)
        loss.backward()
    nodes, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children)
    return max(n.extra_fields.total_allocated for n in nodes if n.name == "[memory]")


def planned_peak(autocast: bool) -> int:
    """The tracer's peak above the start for the same calls on meta tensors, the forward under
    GpuForm's autocast."""
    base, down, up = lora_block("meta")
    x = torch.empty(ROWS, WIDTH, device="meta", dtype=torch.bfloat16)
    tracker, form = memtrace.StorageTracker("meta", round_to=1), memtrace.GpuForm("cuda")
    with tracker, form:
        for m in (base, down, up):  # there before the start, as on the CPU
            tracker.add_module(m)
        tracker.add(x, "data")
        tracker.reset_peak()
        start = tracker.peak
        with form.autocasting() if autocast else torch.enable_grad():
            loss = forward(base, down, up, x)
        loss.backward()
    return tracker.peak - start


def test_emulated_autocast_keeps_what_torch_autocast_keeps():
    """Within 1 %: the emulation casts a trainable weight at each use where torch.autocast caches
    one cast (+16 KiB here, the adapter serving twice; once per forward in SD3's blocks). The CPU's
    bf16 matmuls also allocate fp32 scratch of their own, freed before the backward's peak."""
    real = cpu_peak(autocast=True)
    print(f"peak above the start: planned {planned_peak(True)} B, CPU allocator {real} B")
    assert planned_peak(True) == pytest.approx(real, rel=0.01)
    # the check can fail: without the emulation the meta trace keeps other copies
    assert planned_peak(False) != pytest.approx(real, rel=0.05)
    assert cpu_peak(autocast=False) != pytest.approx(real, rel=0.05)


def test_gradients_are_counted_for_the_parameters_that_get_one():
    """A two-stream block whose text output feeds nothing (Qwen-Image's last block: its
    `to_add_out` and `txt_mlp` adapters get no gradient in training). Under a full backward hook
    (the sharded plan's) the text layer's post-accumulate hooks fire with `.grad` None; the
    tracker counts the image layer's gradients only, as training holds only those."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.img, self.txt = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x, c):
            return self.img(x + c), self.txt(c)

    with torch.device("meta"):
        block = Block()
    block.register_full_backward_hook(lambda *_: None)
    fired = []
    for p in block.txt.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is None))
    tracker = memtrace.StorageTracker("meta", round_to=1)
    hooks = tracker.watch_grads(block.parameters())
    x, c = torch.randn(2, 8, device="meta"), torch.randn(2, 8, device="meta")
    with pytest.warns(UserWarning, match="no inputs require gradients"):
        block(x, c)[0].sum().backward()
    for h in hooks:
        h.remove()
    assert fired == [True, True]  # the hooks fired, on no gradient
    assert block.txt.weight.grad is None and block.img.weight.grad is not None
    assert tracker.live["gradients"] == (8 * 8 + 8) * 4  # the image layer's weight and bias


def test_a_convolution_holds_its_workspace_unless_its_input_was_just_upsampled():
    """With conv_workspace, a convolution's run holds a copy of its input and output beside them
    (cuDNN's workspace as one H200 measured it: docs/gpu/h200_decode_memory.md), counted in the
    peak and gone after; a convolution straight after a nearest upsampling holds none."""
    conv = torch.nn.Conv2d(8, 4, 3, padding=1, device="meta").requires_grad_(False)
    x = torch.empty(2, 8, 16, 16, device="meta")
    x_bytes, out_bytes = x.nbytes, 2 * 4 * 16 * 16 * 4

    def peak_above_start(workspace: bool, upsample: bool) -> tuple[int, int]:
        tracker = memtrace.StorageTracker("meta", round_to=1, conv_workspace=workspace)
        with tracker, torch.no_grad():
            tracker.add(x, "data")
            tracker.reset_peak()
            start = tracker.peak
            out = conv(torch.nn.functional.interpolate(x, scale_factor=1.0) if upsample else x)
            held = sum(tracker.live.values()) - start
        assert out.shape == (2, 4, 16, 16)
        return tracker.peak - start, held

    assert peak_above_start(False, False) == (out_bytes, out_bytes)
    assert peak_above_start(True, False) == (out_bytes + x_bytes + out_bytes, out_bytes)
    # the upsampled copy of x and the output, no workspace; the copy is freed after
    assert peak_above_start(True, True) == (x_bytes + out_bytes, out_bytes)


def test_the_decode_probe_plans_at_least_what_it_traces():
    """benchmarks/decode_memory.py on the CPU (a shrunk VAE): the trace and the plan, no GPU."""
    from benchmarks import decode_memory

    c = decode_memory.modelzoo.load_configs(16)
    traced = decode_memory.traced(c, "SD3.5-Medium", 2, 64, False)
    planned = decode_memory.traced(c, "SD3.5-Medium", 2, 64, False, workspace=True)
    assert 0 < traced < planned


def test_the_decode_probe_rejects_a_shrink_the_zoo_does_not_know(tmp_path, capsys):
    """--shrink 3 (or -2) ended in a GroupNorm ValueError traceback after the table's header, and
    --convs in a missing folder failed after every measurement, and --convs beside --shrink
    wrote nothing (the trace alone): one line, exit 2, nothing run."""
    from benchmarks import decode_memory

    cases = {
        "--shrink 3": "--shrink: must be one of 2, 4, 8, 16, got 3",
        "--shrink -2": "--shrink: must be one of 2, 4, 8, 16, got -2",
        f"--convs {tmp_path}/no/c.json": f"--convs: {tmp_path}/no is not a folder",
        # the CPU's trace alone: --convs was ignored, its file never written, nothing said
        f"--shrink 16 --convs {tmp_path}/c.json": "--convs: the convolutions' scratch is "
        "measured on a CUDA GPU at the real sizes: drop --shrink",
    }
    for argv, said in cases.items():
        refused(capsys, decode_memory.main, argv.split(), f"decode_memory.py: error: {said}")
