"""What the CLIP references (pickscore_ref.py, clipscore_ref.py, aesthetic_ref.py) share, run in
the clip venv (clip.txt: transformers 4.30.2): a tiny random transformers `CLIPModel` (2 text and 2
vision layers, 32 wide, 32-d embeddings; CLIP's 224 px input in 14 px patches and 77 tokens), saved
with `save_pretrained` to WORK/model, and a `CLIPProcessor` (a `CLIPTokenizer` on the work folder's
byte vocabulary without merges, a `CLIPImageProcessor` at 224 px with its default OpenAI mean and
std, as the released processors of openai/clip-vit-large-patch14 and
laion/CLIP-ViT-H-14-laion2B-s32B-b79K are) saved beside it and to WORK/processor.
"""

import json
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer


def build(work: Path, act: str) -> None:
    """The tiny CLIP and its processor, with activation `act` (gelu: ViT-H/14's; quick_gelu:
    OpenAI's ViT-L/14's)."""
    vocab = json.loads((work / "clip_vocab.json").read_text())
    (work / "vocab.json").write_text(json.dumps(vocab))
    (work / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        str(work / "vocab.json"), str(work / "merges.txt"), model_max_length=77
    )
    images = CLIPImageProcessor(
        size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}
    )
    processor = CLIPProcessor(images, tokenizer)
    end = vocab["<|endoftext|>"]
    ids = dict(bos_token_id=vocab["<|startoftext|>"], eos_token_id=end, pad_token_id=end)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                         hidden_act=act, projection_dim=32, **ids),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=224, patch_size=14, hidden_act=act,
                           projection_dim=32),  # as openai/clip-vit-large-patch14's file has it
        projection_dim=32,
    )  # fmt: skip
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(work / "model")
    processor.save_pretrained(work / "model")
    processor.save_pretrained(work / "processor")
