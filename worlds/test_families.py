"""Tests of the diffusers world's family parts, each on a tiny random pipeline of its family built
locally by modelzoo (generated tokenizers; nothing is downloaded):
- the velocity of the world equals the diffusers pipeline's own transformer call on the same
  latents, prompt and σ (which pins each family's time convention, packing and guidance), its
  schedule equals the pipeline's, and its decode equals the pipeline's decode;
- the velocity does not depend on the batch it is computed in;
- bad input (a pipeline class that is not supported, a flag a family needs or refuses, a
  resolution that is not a multiple of the family's latent patch, a LoRA rank, alpha or guidance
  out of range, a prompts file that is not UTF-8) exits 2 naming the flag;
- whole runs per family: two epochs with --resume, and --profile; under torchrun (slow).
To test a new family, add its variants to VARIANTS (and PIPELINE_CALL when its pipeline needs
arguments to sample CFG-free).
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import modelzoo
from plumbing.test_shard import lora, numbers, torchrun
from test_recast import main_here
from worlds import families

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
PROMPTS = [f"a {c} {t}" for c in ("red", "green", "blue", "gold") for t in ("cat", "boat", "tree")]
# variant: (its family part, the recast.py flags it needs); modelzoo.tiny_family builds each
PART = {"sd3": "sd3world", "flux-dev": "fluxworld", "flux-schnell": "fluxworld",
        "qwen-image": "qwenimageworld", "flux2-klein": "flux2world"}  # fmt: skip
VARIANTS = {v: (PART[v], flags) for v, flags in modelzoo.TINY_FAMILIES.items()}
# what each pipeline's __call__ needs to sample CFG-free, as the world does
PIPELINE_CALL = {"sd3": {"guidance_scale": 1.0}, "flux-dev": {"guidance_scale": 3.5},
                 "flux-schnell": {"max_sequence_length": 256}, "qwen-image": {},
                 "flux2-klein": {"guidance_scale": 1.0}}  # fmt: skip
PARTS = {p.__name__: p for p in families.PARTS.values()}


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """{variant: folder of its tiny pipeline}, built on first use."""
    built = {}

    def get(variant: str) -> str:
        if variant not in built:
            torch.manual_seed(0)
            built[variant] = modelzoo.tiny_family(variant, tmp_path_factory.mktemp(variant))
        return built[variant]

    return get


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def reward_env(tmp_path_factory):
    torch.manual_seed(1)
    return modelzoo.tiny_reward_models(tmp_path_factory.mktemp("rewards"))


def world_of(variant, folder, prompts_file):
    import recast

    flags = VARIANTS[variant][1]
    guidance = float(flags[flags.index("--guidance") + 1]) if "--guidance" in flags else 0.0
    args = recast.Args(model=folder, prompts_file=prompts_file, resolution=32, lora_rank=4,
                       lora_alpha=8, guidance=guidance)  # fmt: skip
    return families.load(args, torch.device("cpu")), args


@pytest.mark.parametrize("variant", VARIANTS)
def test_velocity_schedule_and_decode_match_the_pipeline(variant, tiny_dirs, prompts_file):
    """The diffusers pipeline samples 3 steps from its own noise for three prompts of different
    lengths; at each step its transformer's input and output are recorded. The world's reference
    velocity on the recorded latents, the world's encoding of the same prompts (Qwen-Image's
    with a mask) and the world's σ_i equals the recorded output (fp32),
    the world's σ equal the scheduler's, and the world decodes the final latents to the
    pipeline's image."""
    import diffusers

    folder = tiny_dirs(variant)
    world, _ = world_of(variant, folder, prompts_file)
    pipe_cls = getattr(diffusers, world.family.PIPELINE)
    absent = {k: None for k, v in pipe_cls.load_config(folder).items() if v == [None, None]}
    pipe = pipe_cls.from_pretrained(folder, torch_dtype=torch.float32, **absent)
    pipe.set_progress_bar_config(disable=True)
    calls, finals = [], []
    hook = pipe.transformer.register_forward_hook(
        lambda m, a, kw, out: calls.append((kw["hidden_states"].clone(), out[0].clone())),
        with_kwargs=True,
    )
    prompts = [PROMPTS[4], "a cat", "a small gold boat under a tall green tree by a red cat"]
    image = pipe(prompt=prompts, num_inference_steps=3, height=32, width=32, output_type="pt",
                 generator=torch.Generator().manual_seed(0), **PIPELINE_CALL[variant],
                 callback_on_step_end=lambda p, i, t, kw: finals.append(kw["latents"]) or kw,
                 ).images  # fmt: skip
    hook.remove()
    sigmas = world.sigmas(3)
    assert torch.allclose(sigmas, pipe.scheduler.sigmas.float(), atol=1e-6)
    assert len(calls) == 3 and calls[0][0].shape == (3, *world.latent_shape)
    cond = world.encode(prompts)
    if variant == "qwen-image":  # prompts of different lengths: the mask path is compared
        assert not cond[1].all()
    if variant.startswith("flux-"):  # T5 tokens: 256 for -schnell (fluxworld)
        assert cond[0].shape[1] == (256 if variant == "flux-schnell" else 512)
    for i, (x, expected) in enumerate(calls):
        v = world.v("ref", x, cond, sigmas[i].expand(3))
        assert v.abs().max() > 1e-3  # a velocity that could differ
        assert torch.allclose(v, expected, atol=1e-5, rtol=1e-4), (i, (v - expected).abs().max())
    decoded = world.decode(finals[-1])
    assert torch.allclose((decoded + 1) / 2, image.float(), atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_velocity_does_not_depend_on_the_batch(variant, tiny_dirs, prompts_file):
    world, _ = world_of(variant, tiny_dirs(variant), prompts_file)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, *world.latent_shape, generator=gen)
    t = torch.tensor([0.9, 0.6, 0.3, 0.1])
    cond = world.encode(PROMPTS[:4])
    with torch.no_grad():
        for k, p in world.lora.items():  # lora_B ≠ 0: adapters that act ("policy" ≠ the base)
            if "lora_B" in k:
                p.normal_(0, 0.1, generator=gen)
        together = world.v("policy", x, cond, t)
        alone = torch.cat([world.v("policy", x[n : n + 1], tuple(c[n : n + 1] for c in cond),
                                   t[n : n + 1]) for n in range(4)])  # fmt: skip
        assert not torch.allclose(together, world.v("ref", x, cond, t), atol=1e-3)
    assert torch.allclose(together, alone, atol=1e-5, rtol=1e-4)


def test_prompts_of_different_lengths_encode_the_same_in_chunks(tiny_dirs, prompts_file,
                                                               monkeypatch):  # fmt: skip
    """Qwen-Image's prompts take different lengths (with a mask): encoded one prompt a chunk
    (ENCODE_CHUNK 1), each chunk its own length, the chunks are zero-padded at the end to the
    longest (diffusersworld._cat), as the pipeline pads a batch: the same embeddings and mask as
    all three in one chunk, and the same velocity."""
    from worlds import qwenimageworld

    world, _ = world_of("qwen-image", tiny_dirs("qwen-image"), prompts_file)
    prompts = ["a cat", "a small gold boat under a tall green tree by a red cat", PROMPTS[4]]
    together = world.encode(prompts)
    monkeypatch.setattr(qwenimageworld, "ENCODE_CHUNK", 1)
    apart = world.encode(prompts)
    lengths = together[1].sum(1)
    assert len(set(lengths.tolist())) == 3 and lengths.max() == together[1].shape[1]
    assert torch.equal(apart[1], together[1])
    assert torch.allclose(apart[0], together[0], atol=1e-5, rtol=1e-4)
    x = torch.randn(3, *world.latent_shape, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        v = [world.v("ref", x, cond, t) for cond in (together, apart)]
    assert torch.allclose(v[0], v[1], atol=1e-5, rtol=1e-4)


ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
             "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]  # fmt: skip
# variant: {block type: the Linear layers of one block that take adapters (docs/models.md)}
ADAPTED = {
    "sd3": {"transformer_blocks": ATTENTION},
    "flux-dev": {"transformer_blocks": [*ATTENTION, "ff.net.0.proj", "ff.net.2",
                                        "ff_context.net.0.proj", "ff_context.net.2"],
                 "single_transformer_blocks": ["attn.to_q", "attn.to_k", "attn.to_v"]},
    "qwen-image": {"transformer_blocks": [*ATTENTION, "img_mlp.net.0.proj", "img_mlp.net.2",
                                          "txt_mlp.net.0.proj", "txt_mlp.net.2"]},
    "flux2-klein": {"transformer_blocks": [*ATTENTION, "ff.linear_in", "ff.linear_out",
                                           "ff_context.linear_in", "ff_context.linear_out"],
                    "single_transformer_blocks": ["attn.to_qkv_mlp_proj", "attn.to_out"]},
}  # fmt: skip
ADAPTED["flux-schnell"] = ADAPTED["flux-dev"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_adapts_the_expected_layers_of_every_block(variant, tiny_dirs, prompts_file):
    """Every block of each type carries adapters on exactly those of the expected Linear layers
    it has (a layer missing from LORA_TARGETS fails here, as does one adapted that should not
    be), and nothing outside the blocks is adapted."""
    import re

    world, _ = world_of(variant, tiny_dirs(variant), prompts_file)
    adapted = {k.split(".lora_")[0] for k in world.lora}  # "blocks.3.attn.to_q"
    linears = [
        n.removesuffix(".base_layer")
        for n, m in world.transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and ".lora_" not in n
    ]  # peft wraps the adapted
    found: dict[str, dict[str, set]] = {}
    for name in adapted:
        m = re.fullmatch(r"(\w+)\.(\d+)\.(.+?)(\.base_layer)?", name)
        assert m and m.group(1) in ADAPTED[variant], f"adapted outside the blocks: {name}"
        found.setdefault(m.group(1), {}).setdefault(m.group(2), set()).add(m.group(3))
    assert set(found) == set(ADAPTED[variant])
    for kind, expected in ADAPTED[variant].items():
        blocks = {n.split(".")[1] for n in linears if n.startswith(kind + ".")}
        assert set(found[kind]) == blocks, kind  # every block of the type
        seen = set()
        for block, layers in found[kind].items():  # SD3's last block has no text output layer
            has = {n.split(".", 2)[2] for n in linears if n.startswith(f"{kind}.{block}.")}
            assert layers == set(expected) & has, (kind, block, (set(expected) & has) ^ layers)
            seen |= layers
        assert seen == set(expected), kind  # each expected layer is adapted somewhere


def test_flux2_klein_unpacks_as_the_pipeline_does_on_every_diffusers(tiny_dirs, prompts_file):
    """FLUX.2-klein's decode unpacks its tokens itself (flux2world.unpack): the same tensor as the
    pipeline's _unpack_latents_with_ids(latents, ids), the two-argument call that every diffusers
    from 0.37 (requirements.txt's floor) on accepts. (The whole family test against 0.37 itself:
    docs/models.md.)"""
    from worlds import flux2world

    world, _ = world_of("flux2-klein", tiny_dirs("flux2-klein"), prompts_file)
    z = torch.randn(2, *world.latent_shape, generator=torch.Generator().manual_seed(0))
    _, ids = flux2world._grid(world.pipe, z)
    assert torch.equal(flux2world.unpack(z), world.pipe._unpack_latents_with_ids(z, ids))


def test_a_tensor_left_on_meta_is_named_before_any_forward(tiny_dirs):
    """diffusersworld.check_loaded names every tensor still on the meta device, module and
    attribute, whether a parameter, a buffer or a plain attribute: a Qwen-Image transformer built
    on meta (--shard's skeleton) names its rotary tables, which QwenEmbedRope keeps outside its
    buffers; the same transformer read whole passes, and names the one table put back on meta."""
    from worlds import diffusersworld

    folder = tiny_dirs("qwen-image")
    spec = diffusersworld.read_configs(folder)["pipeline"]["transformer"]
    empty = diffusersworld.skeleton(folder, "transformer", spec, torch.float32)
    found = diffusersworld.left_on_meta(empty)
    assert "pos_embed.pos_freqs (attribute)" in found and "pos_embed.neg_freqs (attribute)" in found
    assert "proj_out.weight (parameter)" in found
    with pytest.raises(RuntimeError, match=r"transformer: \d+ tensors left on the meta device"):
        diffusersworld.check_loaded(empty, "transformer")
    whole = diffusersworld.read_whole(folder, "transformer", spec, torch.float32)
    diffusersworld.check_loaded(whole, "transformer")  # nothing on meta: no error
    whole.pos_embed.neg_freqs = whole.pos_embed.neg_freqs.to("meta")
    with pytest.raises(RuntimeError) as e:
        diffusersworld.check_loaded(whole, "transformer")
    assert str(e.value).endswith("1 tensors left on the meta device after loading, without "
                                 "values: pos_embed.neg_freqs (attribute)")  # fmt: skip
    whole.register_buffer("lost", torch.empty(2, device="meta"))
    assert diffusersworld.left_on_meta(whole) == [
        "lost (buffer)",
        "pos_embed.neg_freqs (attribute)",
    ]


def recast_exit(capsys, *flags) -> str:
    import recast

    with pytest.raises(SystemExit) as e:
        recast.main(list(flags))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bad_input_exits_2_naming_the_flag(tiny_dirs, prompts_file, reward_env, tmp_path, capsys,
                                           monkeypatch):  # fmt: skip
    for k, v in reward_env.items():
        monkeypatch.setenv(k, v)
    out = str(tmp_path / "run")
    base = ["--rewards", "pickscore", "--lambda", "1", "--prompts-file", prompts_file,
            "--resolution", "32", "--device", "cpu", "--out", out, "--epochs", "0",
            "--prompts", "2", "--group-size", "2", "--eval-seeds", "1"]  # fmt: skip
    other = tmp_path / "sdxl"
    other.mkdir()
    (other / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusionXLPipeline"})
    )
    err = recast_exit(capsys, *base, "--model", str(other))
    assert "error: --model" in err and "StableDiffusionXLPipeline" in err
    assert all(name in err for name in families.PARTS)
    (other / "model_index.json").write_text("{}")  # names no class
    err = recast_exit(capsys, *base, "--model", str(other))
    assert "error: --model" in err and "names no pipeline class" in err, err
    err = recast_exit(capsys, *base, "--model", tiny_dirs("flux-dev"))
    assert "error: --guidance" in err and "--guidance 3.5" in err
    err = recast_exit(capsys, *base, "--model", tiny_dirs("flux-schnell"), "--guidance", "3.5")
    assert "error: --guidance" in err
    for variant in VARIANTS:
        flags = [*base, "--model", tiny_dirs(variant), *VARIANTS[variant][1]]
        err = recast_exit(capsys, *flags, "--resolution", "34")
        assert "error: --resolution" in err and "e.g. 32" in err, variant
        if "--guidance" not in flags:  # a family without a guidance input refuses one
            err = recast_exit(capsys, *flags, "--guidance", "3.5")
            assert "error: --guidance" in err and "drop --guidance" in err, variant
    shifting = tmp_path / "sd3-dynamic"  # an SD3 whose scheduler shifts by resolution
    shutil.copytree(tiny_dirs("sd3"), shifting)
    scheduler = shifting / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()),
                                     "use_dynamic_shifting": True}))  # fmt: skip
    err = recast_exit(capsys, *base, "--model", str(shifting))
    assert "error: --model" in err and "use_dynamic_shifting" in err
    assert not os.path.exists(out)


OUT_OF_RANGE = [("--lora-rank", "0"), ("--lora-alpha", "0"), ("--lora-alpha", "-8"),
                ("--guidance", "nan"), ("--guidance", "inf"), ("--guidance", "-1")]  # fmt: skip


@pytest.mark.parametrize(("flag", "value"), OUT_OF_RANGE)
def test_diffusers_flags_out_of_range_exit_2_naming_the_flag(flag, value, prompts_file, tmp_path,
                                                             capsys):  # fmt: skip
    """A LoRA rank below 1 (peft refused it at load, and the run blamed --model), an alpha ≤ 0
    (adapters scaled by 0 get no gradient: nothing trains), a guidance that is not finite (NaN
    velocities) or negative: exit 2 naming the flag and the value, before any model is looked
    for (a hub id, never reached), nothing written."""
    out = tmp_path / "run"
    err = recast_exit(capsys, "--model", "org/not-looked-for", "--rewards", "pickscore",
                      "--lambda", "1", "--prompts-file", prompts_file, "--out", str(out),
                      flag, value)  # fmt: skip
    assert f"error: {flag}" in err and f"got {value}" in err, err
    assert not out.exists()


def test_a_prompts_file_in_another_encoding_exits_2_naming_it(prompts_file, tmp_path, capsys):
    """A prompts file that is not UTF-8 (Latin-1's "café") ended in a UnicodeDecodeError's
    traceback: exit 2 naming the flag and the file, nothing written."""
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("a café by the sea\n".encode("latin-1"))
    out = tmp_path / "run"
    base = ["--model", "org/not-looked-for", "--rewards", "pickscore", "--lambda", "1", "--out",
            str(out)]  # fmt: skip
    for flags in (["--prompts-file", str(latin)],
                  ["--prompts-file", prompts_file, "--eval-prompts-file", str(latin)]):  # fmt: skip
        err = recast_exit(capsys, *base, *flags)
        assert f"error: {flags[-2]}" in err and "UTF-8" in err and str(latin) in err, err
    assert not out.exists()


def test_too_few_held_out_prompts_for_the_ranks_exit_2_before_loading(
    prompts_file, tmp_path, capsys, monkeypatch
):
    """Under torchrun (RANK and WORLD_SIZE set, as torchrun sets them; 2 ranks) held-out prompts
    fewer than the ranks, or under --shard not a multiple of them (× --eval-seeds), exit 2 naming
    --eval-prompts-file before any model is looked for (a hub id, never reached) or the process
    group made, not after the models are loaded."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    three = tmp_path / "three.txt"
    three.write_text("a purple cat\na purple boat\na purple tree\n")
    out = tmp_path / "run"
    base = ["--model", "org/not-looked-for", "--rewards", "pickscore", "--lambda", "1",
            "--prompts-file", prompts_file, "--prompts", "2", "--batch-size", "2", "--out",
            str(out)]  # fmt: skip
    err = recast_exit(capsys, *base)  # 12 prompts: the last one held out
    assert "error: --eval-prompts-file" in err and "1 held-out prompts for 2 processes" in err
    err = recast_exit(
        capsys, *base, "--eval-prompts-file", str(three), "--eval-seeds", "1", "--shard"
    )
    assert "error: --eval-prompts-file" in err and "equal shares" in err, err
    assert not out.exists()


def run(*command, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, check=True, capture_output=True, text=True, cwd=HERE, env=env)


RUN = ["--rewards", "pickscore,aesthetic", "--lambda", "0.6,0.4", "--prompts", "2",
       "--group-size", "2", "--steps", "3", "--batch-size", "4", "--eval-seeds", "1",
       "--resolution", "32", "--lora-rank", "4", "--lora-alpha", "8", "--lr", "1e-2",
       "--device", "cpu"]  # fmt: skip


def metrics_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "sd3"])
def test_two_epochs_with_resume_and_profile(variant, tiny_dirs, prompts_file, reward_env,
                                            tmp_path, capsys):  # fmt: skip
    """One epoch, then --resume to two: the same metrics as two epochs without a stop, the
    adapters train, W has λ's rows and 1/T's columns; --profile writes its profile (SD3's runs
    are test_recast.py's)."""
    out, env = tmp_path / "run", {**reward_env, "OMP_NUM_THREADS": "1"}
    flags = ["--model", tiny_dirs(variant), *VARIANTS[variant][1], "--prompts-file", prompts_file,
             *RUN]  # fmt: skip
    main_here(*flags, "--epochs", "1", "--out", out, env=env)  # in this process: no start-up
    main_here(*flags, "--epochs", "2", "--resume", "--out", out, env=env)
    lines = metrics_of(out)
    assert [m["epoch"] for m in lines] == [0, 1, 2]
    whole = tmp_path / "whole"  # the same two epochs without a stop: the same numbers
    main_here(*flags, "--epochs", "2", "--out", whole, env=env)
    for a, b in zip(lines, metrics_of(whole), strict=True):  # epoch 1 was the first run's last,
        assert {k: v for k, v in a.items() if k in b and not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")
        }  # so it was evaluated there too
    for m in lines[1:]:
        W = torch.tensor(m["W"], dtype=torch.float64)
        assert torch.allclose(W.sum(1), torch.tensor([0.6, 0.4], dtype=torch.float64), atol=1e-5)
        assert torch.allclose(W.sum(0), torch.full((3,), 1 / 3, dtype=torch.float64), atol=1e-5)
        assert all(torch.isfinite(torch.tensor(m[k])) for k in ("loss", "reward/pickscore"))
    from safetensors.torch import load_file

    state = load_file(out / "ckpt" / "epoch_0002" / "model.safetensors")
    B = [v for k, v in state.items() if ".default." in k and "lora_B" in k]
    assert B and sum(int(b.abs().max() > 0) for b in B) > len(B) // 2  # trained
    profile = tmp_path / "profile"
    capsys.readouterr()
    main_here(*flags, "--profile", "--out", profile, env=env)
    assert "wrote" in capsys.readouterr().out
    p = json.loads((profile / "profile.json").read_text())
    assert p["names"] == ["pickscore", "aesthetic"] and p["images_scored"] == 4


# pixels in [0, 1], fp32 on CPU; measured: 0 (SD3, FLUX.1, FLUX.2-klein), 6e-7 (Qwen-Image)
EXPORT_ATOL = 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_loads_in_diffusers_and_draws_the_runs_images(variant, tiny_dirs, prompts_file,
                                                             reward_env, tmp_path):  # fmt: skip
    """A one-epoch run, then `recast.py --export RUN --to DIR`: the family's diffusers pipeline
    with `load_lora_weights(DIR)`, called CFG-free (PIPELINE_CALL) on the run's held-out prompts
    and eval noise (the latents, checked against the run's digest of them) with its steps, draws
    the images the run's own sampler draws with its trained policy (the checkpoint's "default"
    adapter) within EXPORT_ATOL, and the run's kept eval images (8-bit PNGs) within one level;
    without the LoRA it draws other images."""
    import diffusers

    import harness
    import recast
    from plumbing import eval_images, export
    from worlds import flux2world

    folder, out, lora = tiny_dirs(variant), tmp_path / "run", tmp_path / "lora"
    flags = ["--model", folder, *VARIANTS[variant][1], "--prompts-file", prompts_file, *RUN]
    main_here(*flags, "--epochs", "1", "--eval-seeds", "2", "--out", out,
              env={**reward_env, "OMP_NUM_THREADS": "1"})  # fmt: skip
    export.main(["--export", str(out), "--to", str(lora)])
    assert sorted(os.listdir(lora)) == [export.WEIGHTS, export.INFO]
    index, kept = eval_images.load(str(out))  # the run's own sampler's images, as PNGs
    world, _ = world_of(variant, folder, prompts_file)
    noise = torch.randn(len(index["prompts"]), *world.latent_shape,
                        generator=torch.Generator().manual_seed(harness.EVAL_SEED))  # fmt: skip
    assert eval_images.noise_digest(noise) == index["noise_sha256"]
    from safetensors.torch import load_file

    world.load_state_dict(load_file(out / "ckpt" / "epoch_0001" / "model.safetensors"))
    _, drawn = harness.evaluate(recast.sample, world, {}, index["prompts"], noise,
                                world.sigmas(3), 4)  # fmt: skip
    drawn = (drawn + 1) / 2  # the trained policy, as the run samples it
    pipe_cls = getattr(diffusers, world.family.PIPELINE)
    absent = {k: None for k, v in pipe_cls.load_config(folder).items() if v == [None, None]}
    pipe = pipe_cls.from_pretrained(folder, torch_dtype=torch.float32, **absent)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora))
    latents = flux2world.unpack(noise) if variant == "flux2-klein" else noise  # its input layout
    call = dict(prompt=index["prompts"], latents=latents, num_inference_steps=3, height=32,
                width=32, output_type="pt", **PIPELINE_CALL[variant])  # fmt: skip
    image = pipe(**call).images.float()
    err = (image - drawn).abs().max().item()
    assert err < EXPORT_ATOL, err
    levels = eval_images.to_uint8(image * 2 - 1).astype(int) - eval_images.to_uint8(kept)
    assert abs(levels).max() <= 1
    pipe.unload_lora_weights()  # the base model: the LoRA changed the images
    assert (pipe(**call).images.float() - drawn).abs().max() > 100 * EXPORT_ATOL


# the matrix's modes: how recast.py is launched, and the flags each adds
MODES = {"one": (1, []), "ddp": (2, []), "shard": (2, ["--shard"]),
         "shard-gc": (2, ["--shard", "--grad-checkpointing"])}  # fmt: skip
MATRIX = ["sd3", "flux-dev", "flux2-klein", "qwen-image"]


def launch(mode: str, out: Path, *flags: str, env: dict) -> None:
    """recast.py with `flags` in `mode`: in this process (one), or on 2 gloo ranks (torchrun)."""
    ranks, more = MODES[mode]
    if ranks == 1:
        main_here(*flags, *more, "--out", out, env={**env, "OMP_NUM_THREADS": "1"})
    else:
        run(sys.executable, *torchrun(out, *flags, *more), env=env)


def loaded_adapter(pipe_cls, folder: str, lora: Path) -> dict[str, torch.Tensor]:
    """The family's diffusers pipeline from `folder` with `load_lora_weights(lora)`: the LoRA
    tensors it put into its transformer, under the export's names."""
    absent = {k: None for k, v in pipe_cls.load_config(folder).items() if v == [None, None]}
    pipe = pipe_cls.from_pretrained(folder, torch_dtype=torch.float32, **absent)
    pipe.load_lora_weights(str(lora), adapter_name="loaded")
    return {"transformer." + k.replace(".loaded.", "."): p.detach()
            for k, p in pipe.transformer.named_parameters() if ".loaded." in k}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", MATRIX)
def test_each_family_trains_resumes_and_exports_in_each_mode(variant, mode, tiny_dirs,
                                                             prompts_file, reward_env,
                                                             tmp_path):  # fmt: skip
    """The family × mode matrix, on the tiny pipelines: one process; DDP on 2 gloo ranks
    (torchrun); --shard (FSDP2) on 2; --shard --grad-checkpointing on 2. In each cell: one epoch
    trains (the adapters' lora_B off zero, the loss finite), one epoch then --resume to two
    ends with the adapters, the optimizer state and the metrics of two epochs without a stop, bit
    for bit, and --export of the run loads into the family's diffusers pipeline
    (load_lora_weights) with every tensor of the trained adapter. The fast tests cover part of
    the one-process cells: test_recast.py's test_sd3_trains_one_epoch_end_to_end (SD3 trains),
    test_two_epochs_with_resume_and_profile (the other families resume, metrics compared) and
    test_export_loads_in_diffusers_and_draws_the_runs_images (each family draws with its export);
    none compares the adapters and AdamW's state after a resume."""
    import diffusers
    from safetensors.torch import load_file

    from plumbing import export

    held_out = tmp_path / "held_out.txt"  # a held-out prompt for each rank
    held_out.write_text("a purple cat\na purple boat\n")
    folder = tiny_dirs(variant)
    flags = ["--model", folder, *VARIANTS[variant][1], "--prompts-file", prompts_file,
             "--eval-prompts-file", str(held_out), *RUN]  # fmt: skip
    whole, part = tmp_path / "whole", tmp_path / "part"
    launch(mode, part, *flags, "--epochs", "1", env=reward_env)
    first = metrics_of(part)
    assert [m["epoch"] for m in first] == [0, 1] and math.isfinite(first[1]["loss"])
    trained = lora(part, 1)
    assert max(trained[k].abs().max().item() for k in trained if "lora_B.default" in k) > 1e-3
    launch(mode, part, *flags, "--epochs", "2", "--resume", env=reward_env)
    launch(mode, whole, *flags, "--epochs", "2", env=reward_env)
    x, y = lora(part, 2), lora(whole, 2)
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in y)
    opt = [torch.load(o / "ckpt/epoch_0002/optim.pt")["state"] for o in (part, whole)]
    assert opt[1] and opt[0].keys() == opt[1].keys()
    assert all(torch.equal(torch.as_tensor(opt[0][p][s]), torch.as_tensor(opt[1][p][s]))
               for p in opt[1] for s in opt[1][p])  # fmt: skip
    a_run, b_run = metrics_of(part), metrics_of(whole)
    assert [m["epoch"] for m in a_run] == [0, 1, 2] == [m["epoch"] for m in b_run]
    for a, b in zip(a_run, b_run, strict=True):  # epoch 1 was evaluated in the first run only
        assert {k: v for k, v in numbers(a).items() if k in b} == numbers(b)
    if MODES[mode][0] == 2:  # the ranks agreed after each epoch (recast.py compares digests)
        assert all(len(m["dist/sha256"]) == 64 for m in b_run[1:])

    to = tmp_path / "lora"
    export.main(["--export", str(whole), "--to", str(to)])
    pipe_cls = getattr(diffusers, families.family_of(folder).PIPELINE)
    loaded, written = loaded_adapter(pipe_cls, folder, to), load_file(to / export.WEIGHTS)
    assert loaded.keys() == written.keys() and len(written) > 0
    assert all(torch.equal(loaded[k], written[k]) for k in written)
    assert all(torch.equal(written["transformer." + k], v)
               for k, v in export.policy_adapter(y).items())  # fmt: skip


def test_family_parts_are_leaves():
    """The generic world, the registry and every family part import neither the loop nor its
    plumbing, and never end the process (no sys.exit or exit: a BadInput names the flag)."""
    import ast

    from worlds import diffusersworld

    for module in [diffusersworld, families, *families.PARTS.values()]:
        name, tree = module.__name__, ast.parse(Path(module.__file__).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m == "recast" or m.startswith("plumbing")}, name
        calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert not calls & {"sys.exit", "exit", "quit", "os._exit"}, name
    assert set(families.PARTS) == {"StableDiffusion3Pipeline", "FluxPipeline",
                                   "Flux2KleinPipeline", "QwenImagePipeline"}  # fmt: skip


def test_real_size_configs_give_the_published_sizes():
    """benchmarks/configs at real size (meta device): the parameter counts the model cards give
    (FLUX.1 12 B, FLUX.2-klein 4 B with Qwen3-4B, Qwen-Image 20 B with Qwen2.5-VL-7B's 8.3 B), and
    a forward at 1024 px costs 3-5× one at 512 px (4× the image tokens, the text tokens stay, and
    attention grows faster than the tokens)."""
    from benchmarks import scale_check as sc

    c = modelzoo.load_configs()
    published = {
        "FLUX.1-dev": (11.9, 4.9),
        "FLUX.2-klein 4B": (3.9, 4.0),
        "Qwen-Image": (20.4, 8.3),
    }
    cf = {"clip_h_image": 1.0}  # the reward models' FLOPs are SD3.5's; not needed here
    for family, (transformer, text) in published.items():
        p = sc.family_params(c, family)
        assert p["transformer"] == pytest.approx(transformer, abs=0.05), family
        assert p["text"] == pytest.approx(text, abs=0.05), family
        f = sc.family_flops(c, cf, family, (512, 1024))
        assert 3 < f["transformer_fwd@1024"] / f["transformer_fwd@512"] < 5, family
        assert 1 < f["transformer_bwd@512"] / f["transformer_fwd@512"] < 1.5, family
        assert f["vae_decode@1024"] > f["vae_decode@512"] > 0 and f["text"] > 0, family


def test_the_familys_advice_is_said_once_not_once_a_rank(tiny_dirs, prompts_file, monkeypatch,
                                                         capsys):  # fmt: skip
    """FLUX.1-schnell's note (a weak starting point for RL) was printed by every rank: 8 lines on
    8 GPUs. Rank 0 says it; a rank other than 0 (a process group faked around the load) does not."""
    world_of("flux-schnell", tiny_dirs("flux-schnell"), prompts_file)
    assert capsys.readouterr().out.count("note: FLUX.1: a timestep-distilled") == 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a, **k: 1)
    world_of("flux-schnell", tiny_dirs("flux-schnell"), prompts_file)
    assert "note: FLUX.1" not in capsys.readouterr().out
