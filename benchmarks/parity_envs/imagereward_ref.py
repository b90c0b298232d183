"""ImageReward's side of benchmarks/reward_parity.py, run in the imagereward venv (imagereward.txt):
ImageReward's own class (ImageReward/ImageReward.py, image-reward 1.5) builds a tiny random model
of its released architecture (BLIP's ViT-L/16 at 224 px, its text encoder from the work folder's
med_config.json, 1 layer 768 wide, the MLP head), saves its state dict as ImageReward.pt (the
released file's layout), and scores the work folder's images with its own `score`.

Usage: python imagereward_ref.py WORK. WORK holds images/*.png, prompts.json, med_config.json and
vocab.txt (written by reward_parity.py); this writes WORK/ImageReward.pt and WORK/reference.json.
"""

import json
import os
import sys
from pathlib import Path

work = Path(sys.argv[1])
# BLIP's init_tokenizer asks the hub for bert-base-uncased: give it the work folder's vocabulary
# as that model's cached snapshot, offline
cache = work / "hf" / "models--bert-base-uncased"
(cache / "refs").mkdir(parents=True, exist_ok=True)
(cache / "refs" / "main").write_text("parity")
snapshot = cache / "snapshots" / "parity"
snapshot.mkdir(parents=True, exist_ok=True)
(snapshot / "vocab.txt").write_bytes((work / "vocab.txt").read_bytes())
(snapshot / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
hub = str(work / "hf")  # the variable each hub version reads
os.environ.update(HF_HUB_CACHE=hub, HUGGINGFACE_HUB_CACHE=hub, TRANSFORMERS_CACHE=hub)
os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

import torch  # noqa: E402
from ImageReward.ImageReward import ImageReward  # noqa: E402
from PIL import Image  # noqa: E402

torch.manual_seed(0)
model = ImageReward(med_config=str(work / "med_config.json"), device="cpu").eval()
with torch.no_grad():  # a head whose output moves with its input (its own init is ~1e-3 wide)
    for layer in model.mlp.layers:
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
            torch.nn.init.normal_(layer.bias, std=0.1)
torch.save(model.state_dict(), work / "ImageReward.pt")
prompts = json.loads((work / "prompts.json").read_text())
images = sorted((work / "images").glob("*.png"))
with torch.no_grad():
    scores = [model.score(p, Image.open(i)) for p, i in zip(prompts, images, strict=True)]
(work / "reference.json").write_text(json.dumps({"scores": scores}))
