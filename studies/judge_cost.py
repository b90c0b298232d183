"""What the VLM judge (vlm_judge.py) costs with the models that fit: weights, tokens, FLOP a pair
and the time a pair at an assumed rate — the table of docs/judge.md. An estimate, not a timing:
nothing runs but model construction on the meta device.

python studies/judge_cost.py                       # 512 px images, 400 TFLOP/s
python studies/judge_cost.py --size 1024 --tflops 300

- Parameters: each model is built from its released config.json (CONFIGS) on the meta device and
  its parameters counted, split into vision tower, embeddings, output layer and the rest.
- Tokens: Qwen2-VL's image processor rounds each side to a multiple of 28 px (patch 14, merge 2);
  a forward shows both images of a pair, and TEXT_TOKENS of chat format, question and prompt.
- FLOP: 2 per parameter and token (the vision tower on the patches, the language model without its
  embeddings on the tokens, the output layer on the last token only) plus attention: causal in the
  language model, over each image in 4 vision blocks and over windows of 8 x 8 patches in the
  other 28. A pair is two forwards (both orders).
"""

import math
import os
import sys

import torch
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plumbing import cli

SIZES = (56, 3584)  # px a side that Qwen2-VL's image processor keeps within its pixel bounds
TEXT_TOKENS = 90  # chat format (~20), QUESTION (~40) and a prompt of ~30 tokens
VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
              spatial_merge_size=2, temporal_patch_size=2, window_size=112,
              fullatt_block_indexes=[7, 15, 23, 31])  # fmt: skip
ROPE = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}
# the values of Qwen/Qwen2.5-VL-3B-Instruct's and Qwen/Qwen2.5-VL-7B-Instruct's config.json
CONFIGS = {
    "Qwen2.5-VL-3B-Instruct": dict(
        text=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                  num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2),
        out_hidden_size=2048, tie_word_embeddings=True,
    ),
    "Qwen2.5-VL-7B-Instruct": dict(
        text=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4),
        out_hidden_size=3584, tie_word_embeddings=False,
    ),
}  # fmt: skip


def parameters(name: str) -> dict[str, int]:
    """Parameter counts of model `name`: total, vision, embed, head (0 when tied), body."""
    c = CONFIGS[name]
    config = Qwen2_5_VLConfig(
        text_config={**c["text"], "rope_parameters": ROPE},
        vision_config={**VISION, "out_hidden_size": c["out_hidden_size"]},
        tie_word_embeddings=c["tie_word_embeddings"],
    )
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    n = {"total": sum(p.numel() for p in model.parameters())}  # tied weights counted once
    n["vision"] = sum(p.numel() for p in model.model.visual.parameters())
    n["embed"] = model.model.language_model.embed_tokens.weight.numel()
    n["head"] = 0 if c["tie_word_embeddings"] else model.lm_head.weight.numel()
    n["body"] = n["total"] - n["vision"] - n["embed"] - n["head"]
    return n


def image_patches(size: int) -> int:
    """Patches of 14 px of one size x size image after Qwen2-VL's resizing (sides to multiples of
    28 px; sizes between 56 and 3584 px stay within its default pixel bounds)."""
    side = max(28, round(size / 28) * 28)
    return (side // 14) ** 2


def forward_flop(name: str, n: dict[str, int], size: int) -> dict[str, float]:
    """FLOP of one forward with two size x size images: vision, language model, total."""
    text = CONFIGS[name]["text"]
    patches = 2 * image_patches(size)
    tokens = patches // 4 + TEXT_TOKENS
    d, layers = text["hidden_size"], text["num_hidden_layers"]
    attention = 2 * layers * tokens**2 * d  # QK^T and AV, 2 FLOP a multiply-add, half: causal
    full = len(VISION["fullatt_block_indexes"])  # vision blocks attending over the whole image
    window = (VISION["window_size"] // VISION["patch_size"]) ** 2  # patches a window elsewhere
    per_image = patches // 2
    attended = per_image * (full * per_image + (VISION["depth"] - full) * window)  # q-k pairs
    vision_attention = 2 * 4 * VISION["hidden_size"] * attended  # 2 images, QK^T and AV
    f = {
        "vision": 2.0 * n["vision"] * patches + vision_attention,
        "lm": 2.0 * n["body"] * tokens + attention,
    }
    f["total"] = f["vision"] + f["lm"] + 2.0 * d * text["vocab_size"]  # last token's logits
    f["tokens"], f["patches"] = tokens, patches
    return f


def main(argv: list[str] | None = None) -> None:
    ap = cli.Parser(prog="judge_cost.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=512,
                    help=f"image side in pixels, {SIZES[0]} to {SIZES[1]}")  # fmt: skip
    ap.add_argument("--tflops", type=float, default=400.0, help="assumed bf16 rate, TFLOP/s")
    args = ap.parse_args(argv)
    if not SIZES[0] <= args.size <= SIZES[1]:  # image_patches's resizing holds there only
        cli.fail("--size", f"must be {SIZES[0]} to {SIZES[1]} px (within Qwen2-VL's pixel bounds, "
                 f"where image_patches counts), got {args.size}", ap.prog)  # fmt: skip
    if not 0 < args.tflops < math.inf:
        cli.fail("--tflops", f"must be > 0 and finite, got {args.tflops}", ap.prog)
    print(f"{args.size} px images; {args.tflops:g} TFLOP/s assumed\n")
    print("| model | parameters | weights in bf16 | tokens (patches) a forward | TFLOP a forward "
          "| TFLOP a pair | s a pair |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in CONFIGS:
        n = parameters(name)
        f = forward_flop(name, n, args.size)
        pair = 2 * f["total"] / 1e12
        print(f"| {name} | {n['total'] / 1e9:.3f} B | {2 * n['total'] / 1e9:.1f} GB "
              f"| {f['tokens']} ({f['patches']}) "
              f"| {f['total'] / 1e12:.1f} ({f['vision'] / 1e12:.1f} vision) "
              f"| {pair:.1f} | {pair / args.tflops:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
