"""HPSv3's side of benchmarks/reward_parity.py, run in the hpsv3 venv (hpsv3.txt: hpsv3 1.0.0,
transformers 4.45.2): a tiny random Qwen2-VL base folder (2 text layers and 2 vision blocks, 32
wide; the work folder's byte-level vocabulary and chat template), then HPSv3's own
`create_model_and_processor` (hpsv3/train.py) makes its reward model from it as its
HPSv3_7B.yaml says (<|Reward|> added, the ranknet head), in float32 with SDPA attention; its state
dict is saved as HPSv3.safetensors (the released file's layout), and HPSv3's own
`HPSv3RewardInferencer` (hpsv3/inference.py) loads that file and scores the work folder's images.

Usage: python hpsv3_ref.py WORK. WORK holds images/*.png, prompts.json and tokenizer_spec.json
(vocabulary, special tokens, chat template; written by reward_parity.py); this writes WORK/base,
WORK/HPSv3.safetensors, WORK/data_collator_qwen.py (hpsv3's, for its question) and
WORK/reference.json.
"""

import json
import shutil
import sys
from pathlib import Path

import hpsv3
import torch
import yaml
from hpsv3.inference import HPSv3RewardInferencer
from hpsv3.train import create_model_and_processor
from hpsv3.utils.parser import (
    DataConfig,
    ModelConfig,
    PEFTLoraConfig,
    TrainingConfig,
    parse_args_with_yaml,
)
from safetensors.torch import save_file
from transformers import (
    Qwen2Tokenizer,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
    Qwen2VLProcessor,
)

work = Path(sys.argv[1])
spec = json.loads((work / "tokenizer_spec.json").read_text())
vocab = spec["vocab"]
base = work / "base"
base.mkdir(parents=True, exist_ok=True)
(work / "vocab.json").write_text(json.dumps(vocab))
(work / "merges.txt").write_text("#version: 0.2\n")
tokenizer = Qwen2Tokenizer(
    str(work / "vocab.json"), str(work / "merges.txt"), eos_token="<|im_end|>",
    pad_token="<|endoftext|>", additional_special_tokens=spec["special"],
)  # fmt: skip
images = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=512 * 28 * 28)
Qwen2VLProcessor(images, tokenizer, chat_template=spec["chat_template"]).save_pretrained(base)
config = Qwen2VLConfig(
    vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]},
    initializer_range=0.2,  # as modelzoo.tiny_hpsv3: attention that sees positions
    vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
    image_token_id=vocab["<|image_pad|>"], video_token_id=vocab["<|video_pad|>"],
    vision_start_token_id=vocab["<|vision_start|>"], vision_end_token_id=vocab["<|vision_end|>"],
    eos_token_id=vocab["<|im_end|>"], pad_token_id=vocab["<|endoftext|>"], bos_token_id=None,
)  # fmt: skip
torch.manual_seed(0)
Qwen2VLForConditionalGeneration(config).save_pretrained(base)

# HPSv3's own configuration, pointed at the tiny base, in float32 on the CPU
package = Path(hpsv3.__file__).parent
settings = yaml.safe_load((package / "config" / "HPSv3_7B.yaml").read_text())
settings |= dict(
    model_name_or_path=str(base), torch_dtype="float32", bf16=False, disable_flash_attn2=True,
    output_dir=str(work / "out"), report_to="none",
)  # fmt: skip
(work / "HPSv3_tiny.yaml").write_text(yaml.safe_dump(settings))
(data, training, model_config, lora), _ = parse_args_with_yaml(
    (DataConfig, TrainingConfig, ModelConfig, PEFTLoraConfig), str(work / "HPSv3_tiny.yaml"),
    is_train=False,
)  # fmt: skip
model, _, _ = create_model_and_processor(model_config, lora, training)
with torch.no_grad():  # the head re-drawn 1/sqrt(fan-in) wide, so that μ moves with its input
    for layer in model.rm_head.modules():
        if isinstance(layer, torch.nn.Linear):
            torch.nn.init.normal_(layer.weight, std=layer.in_features**-0.5)
            if layer.bias is not None:
                torch.nn.init.normal_(layer.bias, std=0.1)
save_file({k: v.contiguous() for k, v in model.state_dict().items()}, work / "HPSv3.safetensors")
shutil.copy(package / "dataset" / "data_collator_qwen.py", work / "data_collator_qwen.py")

reference = HPSv3RewardInferencer(
    config_path=str(work / "HPSv3_tiny.yaml"), checkpoint_path=str(work / "HPSv3.safetensors"),
    device="cpu",
)  # fmt: skip
prompts = json.loads((work / "prompts.json").read_text())
paths = [str(p) for p in sorted((work / "images").glob("*.png"))]
mu = reference.reward(paths, prompts)[:, 0]  # (μ, σ): μ, all six in one right-padded batch
(work / "reference.json").write_text(json.dumps({"scores": mu.float().tolist()}))
