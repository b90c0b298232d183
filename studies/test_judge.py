"""Tests of the pairwise judge (studies/judge.py) on made-up runs' saved eval images."""

import json
import os

import pytest
import torch

from plumbing import eval_images
from studies import judge
from test_recast import refused
from worlds import toyworld as tw

P = tw.HELDOUT_PROMPTS[:6]
PROMPTS = [p for p in P for _ in range(2)]  # 6 prompts × 2 seeds


def fake_run(path, images: torch.Tensor, prompts=PROMPTS, noise_seed: int = 0) -> str:
    """A run folder holding only eval_images/ of `images` (as recast.py writes it)."""
    noise = torch.randn(len(prompts), 3, 4, 4, generator=torch.Generator().manual_seed(noise_seed))
    index = {"epoch": 20, "prompts": prompts, "noise_sha256": eval_images.noise_digest(noise)}
    os.makedirs(path)
    eval_images.save(str(path), images, 0, index, rank=0)
    return str(path)


def test_ssim_is_one_for_the_same_image_and_falls_with_each_kind_of_flaw():
    ideal = tw.render(PROMPTS)
    assert torch.allclose(judge.ssim(ideal, ideal), torch.ones(len(ideal)), atol=1e-5)
    assert judge.toy_distances(ideal, PROMPTS).abs().max() < 1e-5
    moved = tw.render([f"{c} {s} {'left' if p != 'left' else 'right'}"
                       for c, s, p in tw.parse(PROMPTS)])  # fmt: skip
    blurred = tw.blur(ideal.flatten(0, 1), 1.0).view_as(ideal)
    specks = ideal.clone()
    specks[:, :, 1:3, 1:3] += 0.8
    recoloured = tw.render([f"{'red' if c != 'red' else 'blue'} {s} {p}"
                            for c, s, p in tw.parse(PROMPTS)])  # fmt: skip
    for flawed in (moved, blurred, specks, recoloured):  # place, edges, background, colour
        assert (judge.toy_distances(flawed, PROMPTS) > 0.01).all()
    # more of a flaw is further: the judge orders images, not just tells flawed from ideal
    more = tw.blur(ideal.flatten(0, 1), 2.0).view_as(ideal)
    assert (judge.toy_distances(more, PROMPTS) > judge.toy_distances(blurred, PROMPTS)).all()


def test_votes_ties_and_rate():
    d_a = torch.tensor([0.1, 0.2, 0.30, 0.5])
    d_b = torch.tensor([0.2, 0.1, 0.302, 0.5])
    votes = judge.prefer_by_distance(d_a, d_b)
    assert votes.tolist() == [1, -1, 0, 0]  # closer wins; within TIE or equal: a tie
    assert judge.preference_rate(votes) == 0.5
    assert judge.prefer_by_distance(d_b, d_a).tolist() == [-1, 1, 0, 0]  # swapping negates
    assert judge.preference_rate(torch.tensor([1, 1, 0, -1])) == 0.625


def test_bootstrap_interval_resamples_prompts():
    votes = torch.tensor([1, 1, -1, -1, 1, 0] * 2)
    lo, hi = judge.bootstrap_interval(votes, PROMPTS)
    assert 0 <= lo < judge.preference_rate(votes) < hi <= 1
    assert judge.bootstrap_interval(torch.ones(12, dtype=torch.int8), PROMPTS) == (1.0, 1.0)
    # the unit resampled is the prompt, all its seeds together: where each prompt's seeds agree,
    # four seeds a prompt give the interval of two (resampling images would narrow it)
    agree = torch.tensor([1, 1, -1, -1, 1, 1, 0, 0, -1, -1, 1, 1])
    four = [p for p in P for _ in range(4)]
    assert judge.bootstrap_interval(agree.repeat_interleave(2), four) == pytest.approx(
        judge.bootstrap_interval(agree, PROMPTS), abs=1e-6
    )


def test_judge_command_prefers_the_ideal_and_reads_both_orders(tmp_path, capsys):
    ideal = tw.render(PROMPTS)
    blurred = tw.blur(ideal.flatten(0, 1), 1.5).view_as(ideal)
    a, b = fake_run(tmp_path / "a", ideal), fake_run(tmp_path / "b", blurred)
    index, images = eval_images.load(a)
    assert index["prompts"] == PROMPTS and (images - ideal).abs().max() < 1 / 127.5  # 8-bit
    judge.main([a, b])
    said = capsys.readouterr().out
    assert "A preferred 100.0%, ties 0.0%, B preferred 0.0%" in said
    assert "12 pairs (6 prompts × 2 seeds)" in said and "1.000 [95 % bootstrap" in said
    judge.main([b, a])
    assert "over B (a tie counts half): 0.000" in capsys.readouterr().out


def test_judge_bad_input_exits_2_naming_what_is_wrong(tmp_path, capsys):
    ideal = tw.render(PROMPTS)
    a = fake_run(tmp_path / "a", ideal)
    other_noise = fake_run(tmp_path / "n", ideal, noise_seed=1)
    other_prompts = fake_run(tmp_path / "p", ideal, prompts=PROMPTS[::-1])
    token = fake_run(tmp_path / "t", ideal, prompts=[p + " <|im_end|>" for p in PROMPTS])
    (tmp_path / "empty").mkdir()
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    cases = [
        ([a, other_noise], "different eval noise"),
        ([a, other_prompts], "different prompts"),
        ([a, str(tmp_path / "empty")], "RUN_B: " + str(tmp_path / "empty") + " has no saved"),
        ([a, a, "--judge", "vlm"], "--judge-model: --judge vlm needs --judge-model"),
        # checked before the model loads (its folder is missing here)
        (
            [token, token, "--judge", "vlm", "--judge-model", str(tmp_path / "nowhere")],
            "RUN_A: the VLM judge writes each prompt into its model's chat, where '<|im_end|>'",
        ),
        ([a, a, "--judge", "llm"], "--judge: invalid choice: 'llm'"),  # was the usage block
        ([a], "usage: the following arguments are required: RUN_B"),
    ]
    for argv, message in cases:
        err = refused(capsys, judge.main, argv, "judge.py: error: ")
        assert message in err, message
    index = json.loads((tmp_path / "a" / "eval_images" / "index.json").read_text())
    assert index["epoch"] == 20 and len(before) > 2
    after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before  # nothing written over, nothing added, in any run folder


def test_judge_command_with_a_tiny_local_vlm(tmp_path, capsys):
    """--judge vlm: the tiny random Qwen2.5-VL built here answers every pair (its verdicts are
    ties: a random model favours one position in both orders); a missing folder exits 2."""
    from benchmarks import modelzoo

    model = modelzoo.tiny_vlm(tmp_path / "vlm")
    ideal = tw.render(PROMPTS)
    a = fake_run(tmp_path / "a", ideal)
    b = fake_run(tmp_path / "b", tw.blur(ideal.flatten(0, 1), 1.5).view_as(ideal))
    judge.main([a, b, "--judge", "vlm", "--judge-model", model, "--device", "cpu"])
    said = capsys.readouterr().out
    assert "judge: vlm; 12 pairs (6 prompts × 2 seeds)" in said
    assert "A preferred 0.0%, ties 100.0%, B preferred 0.0%" in said  # one position, both orders
    with pytest.raises(SystemExit) as e:
        judge.main([a, b, "--judge", "vlm", "--judge-model", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--judge-model" in err and "nowhere" in err
