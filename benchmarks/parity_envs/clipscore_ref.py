"""CLIPScore's side of benchmarks/reward_parity.py, run in the clip venv (clip.txt: torchmetrics
1.0.0, transformers 4.30.2): torchmetrics' `CLIPScore` (torchmetrics/multimodal/clip_score.py) on
tiny_clip's model and processor (OpenAI ViT-L/14's QuickGELU) from WORK/model, called on each image
(a uint8 (3, H, W) tensor) with its prompt. torchmetrics documents its score as
max(100 · cos, 0); Hessel et al.'s CLIPScore, which rewards.py's docstring names, is
2.5 · max(cos, 0): the reference's scores are written multiplied by 2.5 / 100.

Usage: python clipscore_ref.py WORK. WORK holds images/*.png, prompts.json and clip_vocab.json
(written by reward_parity.py); this writes WORK/model and WORK/reference.json.
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tiny_clip import build
from torchmetrics.multimodal import CLIPScore

work = Path(sys.argv[1])
build(work, "quick_gelu")
metric = CLIPScore(model_name_or_path=str(work / "model"))
prompts = json.loads((work / "prompts.json").read_text())
scores = []
for prompt, path in zip(prompts, sorted((work / "images").glob("*.png")), strict=True):
    image = torch.from_numpy(np.asarray(Image.open(path).convert("RGB"))).permute(2, 0, 1)
    with torch.no_grad():
        scores.append(2.5 / 100 * metric(image, prompt).item())  # this call's score alone
(work / "reference.json").write_text(json.dumps({"scores": scores}))
