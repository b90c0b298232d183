"""The VLM judge (studies/vlm_judge.py) on a tiny random Qwen2.5-VL built here (modelzoo.tiny_vlm):
loading offline, the inputs it builds, the two-order verdicts, determinism, bad folders."""

import json
import re

import pytest
import torch

from benchmarks import modelzoo
from studies.vlm_judge import QUESTION, VLMJudge, both_orders, to_pil

PROMPTS = ["a red circle at the top left", "a small blue square in the centre of the picture"] * 3


@pytest.fixture(scope="module")
def judge(tmp_path_factory) -> VLMJudge:
    folder = modelzoo.tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))
    return VLMJudge(folder, torch.device("cpu"))


def images(n: int, seed: int, size: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g) * 2 - 1


def test_prefer_on_the_tiny_model(judge):
    a, b = images(6, 0), images(6, 1, size=48)  # the two runs' images need not share a size
    verdicts = judge.prefer(a, b, PROMPTS)
    assert verdicts.dtype == torch.int8 and verdicts.shape == (6,)
    assert set(verdicts.tolist()) <= {-1, 0, 1}
    assert torch.isfinite(judge.margins(a, b, PROMPTS)).all()


def test_inputs_show_both_images_and_the_prompt(judge):
    """64 px images become 56 x 56: 4 x 4 patches of 14 px, merged 2 x 2 into 4 image tokens."""
    pairs = list(zip(to_pil(images(2, 0)), to_pil(images(2, 1)), strict=True))
    inputs = judge._inputs(pairs, PROMPTS[:2])
    ids = inputs["input_ids"]
    pad = judge.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (ids == pad).sum(1).tolist() == [8, 8]
    assert inputs["mm_token_type_ids"].sum(1).tolist() == [8, 8]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]] * 4
    assert inputs["pixel_values"].shape[0] == 4 * 16
    each = [judge.image_processor(images=[im], return_tensors="pt") for p in pairs for im in p]
    in_order = torch.cat([e["pixel_values"] for e in each])  # A1, B1, A2, B2
    assert torch.equal(inputs["pixel_values"], in_order)
    assert inputs["attention_mask"][:, -1].all()  # left padding: the answer follows every row
    for row, mask, prompt in zip(ids, inputs["attention_mask"], PROMPTS[:2], strict=True):
        text = judge.tokenizer.decode(row[mask.bool()])
        one_image = "<|vision_start|>" + "<|image_pad|>" * 4 + "<|vision_end|>"
        assert text.count(one_image) == 2
        assert QUESTION.format(prompt=prompt) in text
        assert text.endswith("<|im_start|>assistant\n")


def test_to_pil_rounds_to_8_bits():
    x = torch.tensor([-1.0, 0.0, 1.0, 2.0]).view(1, 1, 1, 4).expand(1, 3, 1, 4)
    assert list(to_pil(x)[0].get_flattened_data()) == [(0,) * 3, (128,) * 3, (255,) * 3, (255,) * 3]


def test_deterministic_and_independent_of_batch_size(judge):
    a, b, prompts = images(5, 2), images(5, 3), PROMPTS[:5]  # batches of 4: one full, one not
    m4 = judge.margins(a, b, prompts, batch_size=4)
    assert torch.equal(m4, judge.margins(a, b, prompts, batch_size=4))
    torch.testing.assert_close(judge.margins(a, b, prompts, batch_size=1), m4, rtol=0, atol=1e-5)
    assert torch.equal(judge.prefer(a, b, prompts, 1), judge.prefer(a, b, prompts, 4))


def test_the_prompt_and_the_images_reach_the_model(judge):
    a, b = images(2, 4), images(2, 5)
    base = judge.margins(a, b, PROMPTS[:2])
    assert not torch.equal(base, judge.margins(a, b, PROMPTS[1:3]))
    assert not torch.equal(base, judge.margins(a, images(2, 6), PROMPTS[:2]))


def brightness_judge(bias: float):
    """A stand-in for the model's margins: prefers the brighter image, plus `bias` towards the
    first one (a position bias)."""

    def margins(first, second, prompts, batch_size=4):
        return first.mean((1, 2, 3)) - second.mean((1, 2, 3)) + bias

    return margins


def test_both_orders_agreement_wins_disagreement_ties(judge, monkeypatch):
    level = torch.tensor([0.5, -0.5, 0.05, -0.05, 0.0])  # A's brightness minus B's
    a = level.view(-1, 1, 1, 1).expand(-1, 3, 4, 4).clone()
    b = torch.zeros_like(a)
    prompts = ["p"] * 5
    monkeypatch.setattr(judge, "margins", brightness_judge(0.0))
    assert judge.prefer(a, b, prompts).tolist() == [1, -1, 1, -1, 0]
    # a position bias of 0.1 outweighs a brightness gap of 0.05: the two orders disagree, a tie
    monkeypatch.setattr(judge, "margins", brightness_judge(0.1))
    assert judge.prefer(a, b, prompts).tolist() == [1, -1, 0, 0, 0]
    # a judge that always chooses the same position ties everything
    for bias in (1.0, -1.0):
        monkeypatch.setattr(judge, "margins", brightness_judge(bias))
        assert judge.prefer(a, b, prompts).tolist() == [0] * 5


def test_swapping_a_and_b_negates(judge, monkeypatch):
    a, b = images(32, 7), images(32, 8)
    monkeypatch.setattr(judge, "margins", brightness_judge(0.01))
    verdicts = judge.prefer(a, b, ["p"] * 32)
    assert set(verdicts.tolist()) == {-1, 0, 1}  # every kind of verdict occurs
    assert torch.equal(judge.prefer(b, a, ["p"] * 32), -verdicts)


def test_both_orders():
    ab = torch.tensor([2.0, -1.0, 1.0, -1.0, 0.0, 3.0])
    ba = torch.tensor([-1.0, 2.0, 1.0, -1.0, -1.0, 0.0])
    assert both_orders(ab, ba).tolist() == [1, -1, 0, 0, 0, 0]
    assert both_orders(ab, ba).dtype == torch.int8


def test_images_must_match_the_prompts(judge):
    with pytest.raises(ValueError, match=r"want \(6, 3, H, W\)"):
        judge.prefer(images(5, 0), images(5, 1), PROMPTS)


def test_a_prompt_holding_a_control_token_is_refused(judge):
    """Written into the chat, <|image_pad|> would take the place of an image of the next pair."""
    with pytest.raises(ValueError, match=re.escape("'<|image_pad|>' is a control token")):
        judge.prefer(images(2, 0), images(2, 1), ["a red circle", "a <|image_pad|> square"])


def test_bad_folders(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match=re.escape(repr(missing))):
        VLMJudge(missing, torch.device("cpu"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        VLMJudge(str(tmp_path), torch.device("cpu"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))  # text only
    with pytest.raises(ValueError, match="not an image-text-to-text"):
        VLMJudge(str(tmp_path), torch.device("cpu"))
