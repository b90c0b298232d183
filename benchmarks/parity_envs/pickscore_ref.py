"""PickScore's side of benchmarks/reward_parity.py, run in the clip venv (clip.txt: transformers
4.30.2). PickScore_v1 is released as weights with usage code, not as a package: its model card
(huggingface.co/yuvalkirstain/PickScore_v1, "How to Get Started", the same code in
github.com/yuvalkirstain/PickScore's README) loads `AutoProcessor` (laion/CLIP-ViT-H-14's) and
`AutoModel`, calls the processor on the images and on the prompt (padding, truncation at 77 tokens),
L2-normalises `get_image_features` and `get_text_features` and takes logit_scale.exp() · text ·
imageᵀ; those lines are run here as the card writes them, on tiny_clip's model (ViT-H/14's GELU)
loaded from WORK/model and its processor from WORK/processor, one image and its prompt at a time.
The card's softmax over one prompt's images is left out: the reward is the score before it.

Usage: python pickscore_ref.py WORK. WORK holds images/*.png, prompts.json and clip_vocab.json
(written by reward_parity.py); this writes WORK/model, WORK/processor and WORK/reference.json.
"""

import json
import sys
from pathlib import Path

import torch
from PIL import Image
from tiny_clip import build
from transformers import AutoModel, AutoProcessor

work = Path(sys.argv[1])
build(work, "gelu")
processor = AutoProcessor.from_pretrained(work / "processor")
model = AutoModel.from_pretrained(work / "model").eval()
prompts = json.loads((work / "prompts.json").read_text())
scores = []
for prompt, path in zip(prompts, sorted((work / "images").glob("*.png")), strict=True):
    image_inputs = processor(
        images=[Image.open(path)], padding=True, truncation=True, max_length=77,
        return_tensors="pt",
    )  # fmt: skip
    text_inputs = processor(
        text=prompt, padding=True, truncation=True, max_length=77, return_tensors="pt"
    )
    with torch.no_grad():
        image_embs = model.get_image_features(**image_inputs)
        image_embs = image_embs / torch.norm(image_embs, dim=-1, keepdim=True)
        text_embs = model.get_text_features(**text_inputs)
        text_embs = text_embs / torch.norm(text_embs, dim=-1, keepdim=True)
        scores.append((model.logit_scale.exp() * (text_embs @ image_embs.T)[0])[0].item())
(work / "reference.json").write_text(json.dumps({"scores": scores}))
