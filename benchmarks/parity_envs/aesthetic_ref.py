"""The aesthetic reward's side of benchmarks/reward_parity.py, run in the clip venv (clip.txt:
simple-aesthetics-predictor 0.1.2, transformers 4.30.2). LAION's improved-aesthetic-predictor is
released as a script (simple_inference.py, on OpenAI's clip package) and .pth heads, not as a
package; simple-aesthetics-predictor runs its heads on transformers' CLIP ViT-L/14:
`AestheticsPredictorV2Linear` (aesthetics_predictor/v2.py) is the vision tower and projection,
the embedding L2-normalised, then LAION's MLP (Linear 768→1024→128→64→16→1 with dropout between,
its `layers`). Here it loads tiny_clip's vision tower and projection (QuickGELU) from WORK/model,
its head re-drawn 1/sqrt(fan-in) wide, the first layer 10 times that (so that scores move with
the image); the head is saved as LAION's .pth is laid out (the MLP's state dict, keys
layers.{0,2,4,6,7}.*) to WORK/head.pth, and the predictor scores each image as preprocessed by
WORK/model's processor.

Usage: python aesthetic_ref.py WORK. WORK holds images/*.png and clip_vocab.json (written by
reward_parity.py); this writes WORK/model, WORK/head.pth and WORK/reference.json.
"""

import json
import sys
from pathlib import Path

import torch
from aesthetics_predictor import AestheticsPredictorV2Linear
from PIL import Image
from tiny_clip import build
from transformers import CLIPProcessor

work = Path(sys.argv[1])
build(work, "quick_gelu")
predictor = AestheticsPredictorV2Linear.from_pretrained(work / "model").eval()
processor = CLIPProcessor.from_pretrained(work / "model")
torch.manual_seed(1)
with torch.no_grad():  # the first layer 10x wider: the images' tiny-CLIP embeddings differ little
    for i, layer in enumerate(predictor.layers):
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=(10 if i == 0 else 1) * layer.in_features**-0.5)
            torch.nn.init.normal_(layer.bias, std=0.1)
torch.save({f"layers.{k}": v for k, v in predictor.layers.state_dict().items()}, work / "head.pth")
scores = []
for path in sorted((work / "images").glob("*.png")):
    pixels = processor(images=Image.open(path), return_tensors="pt").pixel_values
    with torch.no_grad():
        scores.append(predictor(pixel_values=pixels).logits[0, 0].item())
(work / "reference.json").write_text(json.dumps({"scores": scores}))
