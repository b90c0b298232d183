"""HPS v2.1's side of benchmarks/reward_parity.py, run in the hpsv2 venv (hpsv2.txt: the hpsv2
package 1.2.0, as hpsv2x 1.2.0 ships it). The package's own open_clip fork builds its model as its
`hpsv2.img_score.initialize_model` does (`create_model_and_transforms('ViT-H-14', ...)` with the
same arguments), at ViT-H-14's full size with random weights, except that no pretrained CLIP is
named (the released call downloads laion2B-s32B-b79K, which the checkpoint then overwrites in full);
its state dict is saved as HPS_v2.1_compressed.pt is laid out ({"state_dict": ...}). That model
and its `preprocess_val` are put in img_score's `model_dict` (what `initialize_model` fills and
then keeps), and `hpsv2.img_score.score(path, prompt, cp=...)` (hps_version v2.1's file) scores
each image with its prompt as released: the checkpoint loaded into the model, the image through
`preprocess_val` (longest side to 224, padded square), image_features · text_features.

Usage: python hpsv2_ref.py WORK. WORK holds images/*.png and prompts.json (written by
reward_parity.py); this writes WORK/HPS_v2.1_compressed.pt (about 4 GB) and WORK/reference.json.
"""

import json
import os
import sys
from pathlib import Path

work = Path(sys.argv[1])
os.environ["HPS_ROOT"] = str(work / "hps")  # where img_score.score makes its cache folder

import torch  # noqa: E402
from hpsv2 import img_score  # noqa: E402
from hpsv2.src.open_clip import create_model_and_transforms  # noqa: E402

torch.manual_seed(0)
model, _, preprocess_val = create_model_and_transforms(
    "ViT-H-14",
    None,
    precision="amp",
    device="cpu",
    jit=False,
    force_quick_gelu=False,
    force_custom_text=False,
    force_patch_dropout=False,
    force_image_size=None,
    pretrained_image=False,
    image_mean=None,
    image_std=None,
    light_augmentation=True,
    aug_cfg={},
    output_dict=True,
    with_score_predictor=False,
    with_region_predictor=False,
)  # fmt: skip  (initialize_model's arguments, pretrained None)
checkpoint = work / "HPS_v2.1_compressed.pt"
torch.save({"state_dict": model.state_dict()}, checkpoint)
img_score.model_dict.update(model=model, preprocess_val=preprocess_val)
prompts = json.loads((work / "prompts.json").read_text())
images = sorted((work / "images").glob("*.png"))
scores = [
    float(img_score.score(str(path), prompt, cp=str(checkpoint), hps_version="v2.1")[0])
    for path, prompt in zip(images, prompts, strict=True)
]
(work / "reference.json").write_text(json.dumps({"scores": scores}))
