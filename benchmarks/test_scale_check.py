"""Tests of benchmarks/scale_check.py: `--shrink 16` runs the real loop on the CPU and its report
holds every figure, for the recast, the uniform and the high-resolution run, within a minute;
bad input exits 2 naming the flag and writes nothing; the configurations fit together at every
--shrink; the cost model's arithmetic per phase."""

import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import modelzoo
from benchmarks import scale_check as sc

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.xdist_group("scale_check")  # one worker builds `shrunk` for all
LAM = [0.4, 0.2, 0.2, 0.2]


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    """`python benchmarks/scale_check.py --shrink 16` in a subprocess (one thread, no Triton
    interpreter): (the report's text, its JSON, wall seconds, CPU seconds)."""
    out = tmp_path_factory.mktemp("scale_check") / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    tic = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "benchmarks/scale_check.py", "--shrink", "16", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,  # a hang guard only
    )  # fmt: skip
    wall = time.perf_counter() - tic
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert done.returncode == 0, done.stderr[-4000:]
    text = (out / "scale_check.md").read_text()
    report = json.loads(text.split("```json\n")[1].split("\n```")[0])
    return text, report, wall, cpu


def test_shrunk_check_takes_under_a_minute(shrunk):
    """Under a minute of CPU time (one thread: on an idle machine the wall clock agrees; a
    machine shared with other work stretches the wall clock, not this)."""
    _, report, wall, cpu = shrunk
    print(f"scale_check --shrink 16: {wall:.1f} s wall, {cpu:.1f} s CPU")
    assert cpu <= 60, f"{cpu:.0f} s of CPU ({wall:.0f} s wall)"


def test_recast_and_uniform_runs_were_both_made(shrunk):
    _, report, _, _ = shrunk
    runs = report["runs"]
    assert set(runs) == {"512-recast", "512-uniform", "1024-recast"}
    for name, weighting in (("512-recast", "recast"), ("512-uniform", "uniform")):
        run = runs[name]
        assert run["status"] == "ok" and run["complete"] and run["epoch"] == 2
        flags = run["flags"]
        assert flags[flags.index("--weighting") + 1] == weighting
        assert [m["epoch"] for m in run["metrics"]] == [0, 1, 2]
    rec, uni = runs["512-recast"]["metrics"], runs["512-uniform"]["metrics"]
    T = runs["512-recast"]["settings"]["steps"]
    # recast scored step predictions in both epochs; uniform (DiffusionNFT's work) in neither
    assert "D" in rec[1] and "D" in rec[2] and "D" not in uni[1] and "D" not in uni[2]
    W = torch.tensor(uni[2]["W"], dtype=torch.float64)
    assert torch.allclose(W, torch.tensor(LAM, dtype=torch.float64)[:, None] / T, atol=1e-6)
    W = torch.tensor(rec[2]["W"], dtype=torch.float64)
    assert torch.allclose(W.sum(1), torch.tensor(LAM, dtype=torch.float64), atol=1e-5)
    assert runs["512-uniform"]["recast_step_scoring_s"] == 0
    assert runs["512-recast"]["recast_step_scoring_s"] > 0
    assert report["recast_over_uniform"] > 0 and "recast_minus_uniform_share" in report
    hi = runs["1024-recast"]
    assert hi["complete"] and hi["epoch"] == 1
    assert hi["settings"]["resolution"] == 2 * runs["512-recast"]["settings"]["resolution"]
    assert "--grad-checkpointing" in hi["flags"]


def positive(x) -> bool:
    return isinstance(x, float | int) and math.isfinite(x) and x > 0


def test_every_figure_is_reported(shrunk):
    text, report, _, _ = shrunk
    for name, run in report["runs"].items():
        assert set(run["time_s"]) == set(sc.PHASES), name  # the last epoch evaluates too
        assert set(run["mem_gib"]) == set(sc.PHASES) and all(map(positive, run["mem_gib"].values()))
        assert all(t >= 0 for t in run["time_s"].values())
        for key in ("epoch_s", "epoch_wall_s", "images_per_gpu_s"):
            assert positive(run[key]), (name, key)
        assert 0 <= run["recast_share"] < 1
        nft = run["nft_loss"]
        assert nft["calls"] > 0 and positive(nft["fwd_s"]) and positive(run["update_backward_s"])
        assert 0 < nft["share_of_update"] < 1
        modelled = {ph for ph, v in run["modelled_tflop"].items() if v > 0}
        assert modelled == set(sc.PHASES) - ({"recast"} if name == "512-uniform" else set())
        assert set(run["measured_over_modelled"]) == modelled
        assert all(map(positive, run["measured_over_modelled"].values()))
    assert report["runs"]["512-recast"]["recast_share"] > 0
    assert set(report["loss_memory"]) == {"32", "64"}
    for lm in report["loss_memory"].values():
        assert positive(lm["fused"]) and positive(lm["reference"]) and lm["rows"] == 4
    cm = report["cost_model"]
    for key in ("512", "1024"):
        assert set(cm[key]["tflop"]) == {"rollout", "score", "recast", "update"}
        assert all(map(positive, cm[key]["tflop"].values()))
        for hw in sc.SPEC_TFLOPS:
            assert all(map(positive, cm[key]["s_at_peak"][hw].values()))
    shares = cm["recast_share_by_setting"]
    assert [(x["gain_frac"], x["gain_every"], x["score_precision"]) for x in shares] == list(
        sc.SHARE_SETTINGS
    )
    for x in shares:  # bf16 scoring: the time share is the FLOP share (the transformer's rate)
        if x["score_precision"] == "bf16":
            assert x["time_share_at_peak"] < x["flop_share"] * 1.5
    assert all(0 < x["flop_share"] < 1 and 0 < x["time_share_at_peak"] < 1 for x in shares)
    assert all(map(positive, report["component_tflop"].values()))
    for heading in ("## 512-recast", "## 512-uniform", "## 1024-recast", "## Cost model",
                    "## Fused nft_loss", "## ReCAST against uniform", "## Anchor"):  # fmt: skip
        assert heading in text
    body = text.split("## All figures")[0]
    assert "nan" not in body.lower().split() and "None" not in body


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--shrink", "3"], "--shrink"),
        (["--shrink", "32"], "--shrink"),
        (["--shrink", "16", "--prompts", "-1"], "--prompts"),
        (["--shrink", "16", "--budget", "-5"], "--budget"),
        (["--shrink", "16", "--prompts", "0"], "--prompts"),  # ran the default, as if left out
        (["--shrink", "16", "--budget", "0"], "--budget"),  # ran the default, as if left out
        (["--shrink", "16", "--budget", "nan"], "--budget"),
        (["--shrink", "x"], "--shrink"),
        (["--cost-model", "--shrink", "16"], "--cost-model"),  # printed the model, read neither
    ],
)
def test_bad_input_exits_2_naming_the_flag_and_writes_nothing(flags, flag, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        sc.main([*flags, "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: {flag}:" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_unwritable_out_and_no_gpu_exit_2(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for out in (a_file, a_file / "below"):
        with pytest.raises(SystemExit) as e:
            sc.main(["--shrink", "16", "--out", str(out)])
        assert e.value.code == 2 and "error: --out:" in capsys.readouterr().err
    assert a_file.read_text() == ""
    if torch.cuda.is_available():
        return
    out = tmp_path / "full"
    with pytest.raises(SystemExit) as e:
        sc.main(["--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --shrink:" in err and "GPU" in err
    assert "--shrink 16" in err and not out.exists()


@pytest.mark.parametrize("shrink", [0, *modelzoo.SHRINKS])
def test_configurations_fit_together(shrink):
    """What the pipeline needs of its parts, at the real size and at every --shrink: whole head
    widths, the CLIP embeddings padded to T5's width, the pooled embeddings concatenated."""
    c = modelzoo.load_configs(shrink)
    tr, t5 = c["sd35m_transformer"], c["t5xxl_encoder"]
    clip_l, clip_g = c["clip_l_text"], c["clip_g_text"]
    assert tr["num_attention_heads"] * tr["attention_head_dim"] == tr["caption_projection_dim"]
    assert (
        tr["joint_attention_dim"] == t5["d_model"] >= clip_l["hidden_size"] + clip_g["hidden_size"]
    )
    assert tr["pooled_projection_dim"] == clip_l["projection_dim"] + clip_g["projection_dim"]
    assert t5["num_heads"] * t5["d_kv"] == t5["d_model"]
    towers = [clip_l, clip_g] + [c[m][t] for m in ("clip_vit_h14", "clip_vit_l14")
                                 for t in ("text_config", "vision_config")]  # fmt: skip
    assert all(x["hidden_size"] % x["num_attention_heads"] == 0 for x in towers)
    vae = c["sd35m_vae"]
    assert all(w % vae["norm_num_groups"] == 0 for w in vae["block_out_channels"])
    assert set(tr["dual_attention_layers"]) <= set(range(tr["num_layers"]))
    if not shrink:
        assert tr["num_layers"] == 24 and tr["dual_attention_layers"] == list(range(13))


def test_phase_flops_count_each_phase():
    """phase_flops against the counts written out: T forwards per image in the rollout, a decode
    and K rewards per image in scoring, (T-1) of them per scored image for ReCAST, and per trained
    pair the policy's forward and backward, the old and the reference forward."""
    cf = {"transformer_fwd@512": 2.0, "transformer_bwd@512": 3.0, "vae_decode@512": 5.0,
          "clip_l_text": 0.1, "clip_g_text": 0.2, "t5xxl": 0.7, "clip_h_image": 1.0,
          "clip_h_text": 0.5, "clip_l14_image": 0.25, "clip_l14_text": 0.125,
          "aesthetic_head": 0.0}  # fmt: skip
    rewards = 2 * 1.5 + 0.375 + 0.25
    r = {**sc.FULL_RUN, "train_frac": 0.5, "gain_frac": 1.0, "gain_every": 1,
         "grad_checkpointing": False, "eval_images": 8, "eval": True}  # fmt: skip
    f = sc.phase_flops(cf, r, epoch=1)
    n, T, P = 64, 10, 8
    assert f["rollout"] == {"bf16": n * T * 2.0 + P * 1.0}
    assert f["score"] == {"tf32": n * 5.0, "fp32": n * rewards}
    assert f["recast"] == {"tf32": n * (T - 1) * 5.0, "fp32": n * (T - 1) * rewards}
    assert f["update"] == {"bf16": 320 * (2.0 + 3.0 + 2.0 + 2.0) + P * 1.0}
    assert f["eval"] == {"bf16": 8 * (T * 2.0 + 1.0), "tf32": 8 * 5.0, "fp32": 8 * rewards}
    half = sc.phase_flops(cf, {**r, "gain_frac": 0.5}, epoch=1)["recast"]
    assert half == {k: v / 2 for k, v in f["recast"].items()}
    every2 = {**r, "gain_every": 2}
    assert sc.phase_flops(cf, every2, epoch=2)["recast"] == {"tf32": 0.0, "fp32": 0.0}
    assert sc.phase_flops(cf, every2, epoch=3)["recast"] == f["recast"]
    assert sc.phase_flops(cf, every2, amortised=True)["recast"] == half
    bf16 = sc.phase_flops(cf, {**r, "score_precision": "bf16"}, epoch=1)["recast"]
    assert bf16 == {"bf16": n * (T - 1) * (5.0 + rewards)}  # the same FLOPs, at the bf16 rate
    more = sc.phase_flops(cf, {**r, "grad_checkpointing": True, "kl_coef": 0.0})["update"]
    assert more == {"bf16": 320 * (2.0 + 3.0 + 2.0 + 2.0) + P * 1.0}  # +1 recompute, -1 ref
    secs = sc.modelled_seconds(f, {"bf16": 4.0, "tf32": 2.0, "fp32": 1.0})
    assert secs["score"] == n * 5.0 / 2.0 + n * rewards


def test_shard_costs_count_the_gathers_of_each_forward(monkeypatch):
    """--shard's modelled communication against the counts written out, with made-up sizes: per
    rank, (N-1)/N of the transformer's bf16 bytes for each rollout sampler call and for each of the
    update's 3 forwards and 1 backward per micro-batch, of the text encoder's per encode call, and
    of the fp32 LoRA gradients per optimizer step; a gather exposed only where it outlasts the
    forward it feeds, so larger micro-batches hide it."""
    monkeypatch.setattr(sc, "family_params", lambda c, fam: {"transformer": 1.0, "text": 0.5})
    monkeypatch.setattr(sc, "lora_params", lambda c, fam: 1e7)
    cf = {"transformer_fwd@512": 1e12, "transformer_bwd@512": 2e12, "vae_decode@512": 1e11,
          "text": 1e10, "clip_h_image": 1e11, "clip_h_text": 1e10, "clip_l14_image": 1e10,
          "clip_l14_text": 1e9, "aesthetic_head": 0.0}  # fmt: skip
    r = {**sc.FULL_RUN, "prompts": 32, "train_frac": 0.5, "gain_frac": 0.125, "gain_every": 1,
         "score_precision": "bf16", "grad_checkpointing": False, "eval_images": 0}  # fmt: skip
    x = sc.shard_costs({}, cf, r, "FLUX.2-klein 4B", ranks=8)
    calls, micro = 10 * 2, 80  # 32 images a rank in calls of 16, T = 10; 1280 pairs / 16
    encodes = 1 + 4  # the rollout's 4 prompts, the update's 32, 8 a call
    expected = 7 / 8 * (2e9 * (calls + micro * 4) + 1e9 * encodes)
    assert x["gathered_gb"] == pytest.approx(expected / 1e9)
    assert x["scattered_gb"] == pytest.approx(7 / 8 * 4e7 * micro / 1e9)
    assert x["comm_s"] == pytest.approx((expected + 7 / 8 * 4e7 * micro) / sc.NVLINK_BYTES_S)
    gather = 7 / 8 * 2e9 / sc.NVLINK_BYTES_S  # 3.9 ms; a 2-pair forward computes 2e12 FLOP
    rate = sc.peak_rates("H100/H200 SXM")["bf16"]
    assert x["exposed_s"] == pytest.approx(micro * 3 * max(0, gather - 2e12 / rate)
                                           + micro * max(0, gather - 4e12 / rate))  # fmt: skip
    wider = sc.shard_costs({}, cf, {**r, "batch_size": 64}, "FLUX.2-klein 4B", ranks=8)
    assert wider["gathered_gb"] < x["gathered_gb"] and wider["exposed_s"] <= x["exposed_s"]


def test_shard_costs_on_four_nodes_keep_the_gathers_on_each_node_under_hsdp(monkeypatch):
    """4 nodes of 8, each GPU with one node's work: under HSDP (recast.py's mesh on several nodes)
    a GPU gathers the transformer from its node's 8 on NVLink as on one node, and only the LoRA
    gradients' node shards cross the network (an all-reduce between the 4 replicas: 2·3/4 of 1/8
    of them per step, at NETWORK_BYTES_S); a flat mesh over 32 GPUs gathers 31/32 of every weight
    at the network's share of a GPU, 18× slower than NVLink, and its gathers no longer hide."""
    monkeypatch.setattr(sc, "family_params", lambda c, fam: {"transformer": 1.0, "text": 0.0})
    monkeypatch.setattr(sc, "lora_params", lambda c, fam: 1e7)
    cf = {"transformer_fwd@512": 1e12, "transformer_bwd@512": 2e12, "vae_decode@512": 1e11,
          "text": 1e10, "clip_h_image": 1e11, "clip_h_text": 1e10, "clip_l14_image": 1e10,
          "clip_l14_text": 1e9, "aesthetic_head": 0.0}  # fmt: skip
    r = {**sc.FULL_RUN, "prompts": 32, "train_frac": 0.5, "gain_frac": 0.125, "gain_every": 1,
         "score_precision": "bf16", "grad_checkpointing": False, "eval_images": 0}  # fmt: skip
    one = sc.shard_costs({}, cf, r, "FLUX.2-klein 4B", ranks=8)
    hsdp = sc.shard_costs({}, cf, r, "FLUX.2-klein 4B", ranks=8, nodes=4)
    flat = sc.shard_costs({}, cf, r, "FLUX.2-klein 4B", ranks=8, nodes=4, hsdp=False)
    micro = 80  # 4 × 1280 pairs in micro-batches of 4 × 16: as on one node
    # the same micro-batches; the rollout samples a GPU's 32 images in one call of --batch-size 64
    assert hsdp["gathered_gb"] == pytest.approx(one["gathered_gb"] - 7 / 8 * 2 * 10)
    assert hsdp["exposed_s"] == pytest.approx(one["exposed_s"])
    network = 2 * 3 / 4 * 4e7 / 8 * micro
    assert hsdp["network_gb"] == pytest.approx(network / 1e9)
    on_node = (hsdp["gathered_gb"] + hsdp["scattered_gb"]) * 1e9 / sc.NVLINK_BYTES_S
    assert hsdp["comm_s"] == pytest.approx(on_node + network / sc.NETWORK_BYTES_S)
    assert sc.NETWORK_BYTES_S == 4 * 400e9 / 8 / 8  # 4 × 400 Gb/s a node of 8 GPUs
    assert flat["gathered_gb"] == pytest.approx(hsdp["gathered_gb"] * (31 / 32) / (7 / 8))
    assert flat["comm_s"] > 10 * hsdp["comm_s"] and flat["exposed_s"] > 10 * hsdp["exposed_s"]


def tiny_vlm_spec() -> dict:
    """A tiny Qwen2-VL configuration in benchmarks/configs' format, HPSv3's "hidden" output."""
    text = dict(vocab_size=263, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]})  # fmt: skip
    return {"kind": "vlm", "config": {
        "text_config": text, "image_token_id": 261, "video_token_id": 262,
        "vision_start_token_id": 259, "vision_end_token_id": 260, "min_pixels": 28 * 28,
        "max_pixels": 112 * 112, "text_tokens": 16, "output": "hidden",
        "vision_config": dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                              patch_size=14, spatial_merge_size=2,
                              temporal_patch_size=2)}}  # fmt: skip


def test_paper2_rewards_are_counted_per_image_at_their_precision():
    """A run's reward FLOPs by precision (the VLM's in bf16): scoring and the fp32 step scoring
    keep each precision apart, bf16 step scoring runs all of it at the bf16 rate; and a VLM's
    FLOPs per image follow the tokens its image processor makes: at least 2 × the language
    model's matmul weights × its tokens, and more for a larger image."""
    cf = {"transformer_fwd@512": 2.0, "transformer_bwd@512": 3.0, "vae_decode@512": 5.0,
          "text": 1.0}  # fmt: skip
    r = {**sc.FULL_RUN, "train_frac": 0.5, "gain_frac": 1.0, "gain_every": 1,
         "grad_checkpointing": False, "reward_flops": {"fp32": 0.5, "bf16": 7.0}}  # fmt: skip
    f = sc.phase_flops(cf, r, epoch=1)
    n, T = 64, 10
    assert f["score"] == {"tf32": n * 5.0, "fp32": n * 0.5, "bf16": n * 7.0}
    assert f["recast"] == {"tf32": n * (T - 1) * 5.0, "fp32": n * (T - 1) * 0.5,
                           "bf16": n * (T - 1) * 7.0}  # fmt: skip
    bf16 = sc.phase_flops(cf, {**r, "score_precision": "bf16"}, epoch=1)["recast"]
    assert bf16 == {"bf16": n * (T - 1) * (5.0 + 7.5)}
    assert sc.by_precision({"vqa": 3.0, "hpsv3": 4.0, "ocr": 1.0, "pickscore": 2.0},
                           ("pickscore", "ocr", "vqa")) == {"fp32": 3.0, "bf16": 3.0}  # fmt: skip
    spec = tiny_vlm_spec()
    small, large = sc.model_reward_flops(spec, 56), sc.model_reward_flops(spec, 112)
    lm = 2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64)  # q, o; k, v; the MLP: 2 layers' matmuls
    assert small >= lm * (16 + 4) and large >= lm * (16 + 16) and large > small


def test_score_size_counts_the_step_scoring_at_the_reduced_size():
    """--score-size: the step scoring's rewards cost their FLOPs at the reduced size
    (step_reward_flops), the final scoring keeps the full size's; the decode is full size either
    way. paper2_shares reads each setting's size from `flops` (a size at or above the
    resolution changes nothing), and a smaller size lowers ReCAST's share."""
    cf = {"transformer_fwd@512": 2.0, "transformer_bwd@512": 3.0, "vae_decode@512": 5.0,
          "text": 1.0}  # fmt: skip
    r = {**sc.FULL_RUN, "train_frac": 0.5, "gain_frac": 1.0, "gain_every": 1,
         "grad_checkpointing": False, "reward_flops": {"fp32": 0.5, "bf16": 7.0},
         "step_reward_flops": {"fp32": 0.25, "bf16": 2.0}}  # fmt: skip
    f = sc.phase_flops(cf, r, epoch=1)
    n, T = 64, 10
    assert f["score"] == {"tf32": n * 5.0, "fp32": n * 0.5, "bf16": n * 7.0}
    assert f["recast"] == {"tf32": n * (T - 1) * 5.0, "fp32": n * (T - 1) * 0.25,
                           "bf16": n * (T - 1) * 2.0}  # fmt: skip
    bf16 = sc.phase_flops(cf, {**r, "score_precision": "bf16"}, epoch=1)["recast"]
    assert bf16 == {"bf16": n * (T - 1) * (5.0 + 2.25)}
    per = lambda vqa: {"pickscore": 1.0, "ocr": 1.0, "vqa": vqa, "aesthetic": 1.0}  # noqa: E731
    flops = {512: per(40.0), 256: per(10.0)}
    run = {**r, "prompts": 32, "eval_images": 0}
    rows = sc.paper2_shares(cf, run, flops, ((0.125, 1, 0), (0.125, 1, 256), (0.125, 1, 512)))
    off, small, same = (x["time_share_at_peak"] for x in rows)
    assert small < off and same == off
    assert [x["score_size"] for x in rows] == [0, 256, 512]


SCORING_REPORT = """\
W's L1 distance from full scoring's W in the same seed (mean over seeds), by epoch:

- λ = 0.4,0.2,0.2,0.2, recast-frac0.5: epoch 1 0.104, epoch 20 0.046; mean 0.061
- λ = 0.4,0.2,0.2,0.2, recast-every2: epoch 1 0.000, epoch 20 0.063; mean 0.068
- λ = 0.4,0.2,0.2,0.2, the noise floor (full scoring, seed against seed, every epoch): mean 0.123
- cheaper scoring against full scoring, λ = 0.4,0.2,0.2,0.2: recast-frac0.5 − recast-frac1 = \
-0.000 ± 0.000, tie
- recast-frac0.5 − uniform, gap/position: 0 win, 0 tie, 1 loss (-0.009 ± 0.003 loss)
"""


def test_the_trade_off_reads_both_studies_and_pairs_each_setting_with_its_toy_arm(tmp_path):
    """The trade-off table's toy columns come from the studies' own output: the scoring study's
    per-arm mean W error, floor and paired outcome (its report's lines), studies/score_size.py's
    mean W move per size and its floor; a missing file reads as {}. Each SD3 setting of 32
    prompts pairs with the arm scoring as many groups of 16, and a --score-size with the toy
    size of the same fraction of the side. The committed files hold every arm and size the
    table names."""
    path = tmp_path / "table.md"
    path.write_text(SCORING_REPORT)
    got = sc.read_scoring_study(path)
    assert got["w_error"] == {"recast-frac1": 0.0, "recast-frac0.5": 0.061,
                              "recast-every2": 0.068}  # fmt: skip
    assert got["floor"] == 0.123 and got["vs_full"]["recast-frac0.5"] == "-0.000 ± 0.000, tie"
    sizes = tmp_path / "score_size.md"
    sizes.write_text("| --score-size | per seed | mean | largest | rows | gains |\n|---|\n"
                     "| 16 | 0.1, 0.2 | 0.150 | 0.200 | 0.1 | 0.3 |\n\nnoise floor, "
                     "Σ|W_full(seed a) − W_full(seed b)| over 1 pairs: mean 0.180, smallest "
                     "0.141; a tenth of the mean 0.018\n")  # fmt: skip
    assert sc.read_score_size_study(sizes) == {"move": {16: 0.15}, "largest": {16: 0.2},
                                               "floor": 0.18, "smallest": 0.141}  # fmt: skip
    assert sc.read_scoring_study(tmp_path / "none") == {} == sc.read_score_size_study(tmp_path)
    assert [sc.toy_arm(f, e, 32) for f, e, _ in sc.TRADEOFF] == [
        "recast-frac1", "recast-frac0.5", "recast-frac0.25", "recast-frac0.125", "recast-every2",
        *["recast-frac0.25"] * 3]  # fmt: skip
    assert sc.toy_arm(0.125, 2, 32) is None and sc.toy_arm(0.03125, 1, 32) is None
    cf = {"transformer_fwd@512": 2.0, "transformer_bwd@512": 3.0, "vae_decode@512": 5.0,
          "text": 1.0}  # fmt: skip
    r = {**sc.FULL_RUN, "prompts": 32, "train_frac": 0.5, "grad_checkpointing": False,
         "gain_frac": 0.125, "gain_every": 1, "score_precision": "bf16",
         "eval_images": 0}  # fmt: skip
    per = {"pickscore": 1.0, "ocr": 1.0, "vqa": 4.0, "aesthetic": 1.0}
    flops = {px: per for px in (512, *sc.SCORE_SIZES)}
    rows = sc.tradeoff_rows(cf, r, flops, sc.read_scoring_study(), sc.read_score_size_study())
    for x in rows:
        assert x["w_error"] is not None and x["vs_full"], x
        assert (x["toy_px"], x["size_move"] is None) in ((0, True), (x["toy_px"], False)), x
    assert [x["toy_px"] for x in rows if x["score_size"]] == [24, 16, 8]


def test_reward_timing_scores_one_image_per_reward_on_tiny_configurations():
    """--reward-timing's CPU path: each kind of model reward (EasyOCR's real scorer on random
    weights, ImageReward's, a VLM's forward) is built, scores one image, and is timed."""
    import torch

    specs = {
        "ocr": {"kind": "ocr", "config": {"recogniser_width": 16, "line_height": 64,
                                          "boxes_per_image": 1, "box_width": 64}},
        "imagereward": {"kind": "blip", "config": {
            "vision_config": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=2, image_size=32, patch_size=8),
            "text_config": dict(vocab_size=43, hidden_size=32, encoder_hidden_size=64,
                                intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, max_position_embeddings=64),
            "head": [32, 16, 1], "text_tokens": 35}},
    }  # fmt: skip
    specs["hpsv3"] = tiny_vlm_spec()
    timed = sc.reward_timings(specs, 64, torch.device("cpu"), repeats=1)
    assert list(timed) == ["ocr", "imagereward", "hpsv3"]
    assert all(x["s"] > 0 and x["gflop"] > 0 for x in timed.values()), timed


def test_reward_timing_without_a_gpu_exits_2(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        sc.main(["--reward-timing", "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "error: --reward-timing:" in err and "CUDA GPU" in err
    assert not (tmp_path / "t").exists()
