"""HPSv3 (Ma et al., 2025): Qwen2-VL-7B with a reward head on the last hidden state of a reward
token, μ of its predicted score. The released HPSv3.safetensors converted to transformers' classes
(`hpsv3_keys`), run with HPSv3's own prompt and positions.

Follows hpsv3 1.0.0 (github.com/MizzenAI/HPSv3: hpsv3/inference.py, hpsv3/model/qwen2vl_trainer.py,
hpsv3/dataset/data_collator_qwen.py, config/HPSv3_7B.yaml), which pins transformers 4.45.2.
benchmarks/reward_parity.py scores it beside the package itself (docs/your_reward.md#parity).
"""

import os

import torch
import torch.nn.functional as F

from reward_models import CHUNK, read_weights
from reward_models.vlm import VLM, to_pil

HPSV3_FETCH = (
    "hf download MizzenAI/HPSv3 HPSv3.safetensors --local-dir DIR (RECAST_HPSV3: the file), "
    "hf download Qwen/Qwen2-VL-7B-Instruct --local-dir BASE (RECAST_HPSV3_BASE: the folder)"
)
HPSV3_TOKEN = "<|Reward|>"  # the token whose last hidden state the head scores
HPSV3_PIXELS = 256 * 28 * 28  # every image resized to this area (256 merged tokens), as HPSv3


def hpsv3_prompt() -> tuple[str, str]:
    """HPSv3's instruction (with a {text_prompt} slot) and the line after it that holds
    <|Reward|>, as HPSv3 was trained with them: the INSTRUCTION and prompt_with_special_token
    strings of the hpsv3 package's dataset/data_collator_qwen.py (`pip install --no-deps hpsv3`
    puts it there), or of the Python file RECAST_HPSV3_PROMPT names. Read, not run."""
    import ast
    import importlib.util

    path = os.environ.get("RECAST_HPSV3_PROMPT")
    source = "RECAST_HPSV3_PROMPT" if path else "the hpsv3 package's"
    if not path:
        spec = importlib.util.find_spec("hpsv3")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "reward 'hpsv3' asks its model HPSv3's own question: pip install --no-deps hpsv3 "
                "(its files only: the package pins an old transformers), or set "
                "RECAST_HPSV3_PROMPT to a copy of its hpsv3/dataset/data_collator_qwen.py"
            )
        path = os.path.join(spec.submodule_search_locations[0], "dataset", "data_collator_qwen.py")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError) as e:  # missing, unreadable, or not Python
        raise ValueError(
            f"reward 'hpsv3': {path} ({source}) is not a readable Python file "
            f"({type(e).__name__}: {e}); it should be hpsv3's dataset/data_collator_qwen.py"
        ) from None
    strings = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name) and isinstance(node.value.value, str)
    }
    instruction, closing = strings.get("INSTRUCTION", ""), strings.get("prompt_with_special_token")
    if "{text_prompt}" not in instruction or HPSV3_TOKEN not in (closing or ""):
        raise ValueError(
            f"reward 'hpsv3': {path} ({source}) has no INSTRUCTION with {{text_prompt}} "
            f"and prompt_with_special_token with {HPSV3_TOKEN} (hpsv3's data_collator_qwen.py)"
        )
    return instruction, closing


def hpsv3_keys(state: dict[str, torch.Tensor]) -> tuple[dict, list]:
    """HPSv3.safetensors → (Qwen2VLForConditionalGeneration's state dict in transformers' current
    names, the reward head's (weight, bias or None) layers in order). HPSv3 was saved from
    transformers 4.45, whose Qwen2-VL named the vision tower visual.* and the language model
    model.*; today's nests both under model. (model.visual, model.language_model)."""
    model, head = {}, {}
    for key, value in state.items():
        if key.startswith("rm_head."):
            head[key.removeprefix("rm_head.")] = value
        elif key.startswith("visual."):
            model["model." + key] = value
        elif key.startswith("model.") and not key.startswith(("model.visual.", "model.language_")):
            model["model.language_model." + key.removeprefix("model.")] = value
        else:
            model[key] = value
    weights = sorted(
        (k for k in head if k.endswith("weight")),
        key=lambda k: int(k.split(".")[0]) if k.count(".") else 0,
    )
    layers = [(head[k].float(), head.get(k.removesuffix("weight") + "bias")) for k in weights]
    return model, [(w, None if b is None else b.float()) for w, b in layers]


def load(device: torch.device):
    """HPSv3 (Ma et al., 2025): a Qwen2-VL-7B fine-tuned on human preferences, asked HPSv3's
    question about the image and the prompt; its reward head (linear layers with ReLUs between)
    maps the last hidden state at the <|Reward|> token to (μ, σ), and the score is μ.
    RECAST_HPSV3: the released HPSv3.safetensors; RECAST_HPSV3_BASE: the
    Qwen2-VL-7B-Instruct folder (its configuration, tokenizer and image processor); the question
    from the hpsv3 package's source (`hpsv3_prompt`). Loaded into transformers' Qwen2-VL
    class (`hpsv3_keys`)."""
    from transformers import Qwen2VLForConditionalGeneration

    checkpoint, base = os.environ.get("RECAST_HPSV3"), os.environ.get("RECAST_HPSV3_BASE")
    if not checkpoint or not base:
        raise FileNotFoundError(
            "reward 'hpsv3' needs its model: set RECAST_HPSV3 and RECAST_HPSV3_BASE "
            f"({HPSV3_FETCH})"
        )
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(
            f"reward 'hpsv3': {checkpoint!r} (RECAST_HPSV3) is not a file here ({HPSV3_FETCH})"
        )
    instruction, closing = hpsv3_prompt()
    vlm = VLM(base, device, who="reward 'hpsv3' (RECAST_HPSV3_BASE)")
    if vlm.config.model_type != "qwen2_vl":
        raise ValueError(f"{vlm.who}: {base!r} holds a {vlm.config.model_type!r} model; HPSv3 is "
                         "a Qwen2-VL-7B-Instruct")  # fmt: skip
    vlm.tokenizer.add_special_tokens({"additional_special_tokens": [HPSV3_TOKEN]})
    vlm.image_kwargs = {"size": {"shortest_edge": HPSV3_PIXELS, "longest_edge": HPSV3_PIXELS}}
    weights = read_weights(checkpoint, "reward 'hpsv3' (RECAST_HPSV3)", safetensors=True)
    state, head = hpsv3_keys(weights)
    if not head or "model.language_model.embed_tokens.weight" not in state:
        raise ValueError(
            f"reward 'hpsv3': {checkpoint} (RECAST_HPSV3) has no rm_head.* and model.embed_tokens "
            f"weights: not HPSv3's checkpoint ({HPSV3_FETCH})"
        )
    rows = state["model.language_model.embed_tokens.weight"].shape[0]
    if rows != len(vlm.tokenizer):
        raise ValueError(
            f"reward 'hpsv3': {checkpoint} embeds {rows} tokens; the tokenizer of {base!r} with "
            f"{HPSV3_TOKEN} has {len(vlm.tokenizer)}: RECAST_HPSV3_BASE must be "
            "Qwen2-VL-7B-Instruct"
        )
    config = vlm.config
    width = state["model.language_model.embed_tokens.weight"].shape[1]
    if width != config.text_config.hidden_size:  # Qwen2-VL-2B has the 7B's tokenizer
        raise ValueError(
            f"reward 'hpsv3': {checkpoint} is {width}-wide; the model in {base!r} "
            f"(RECAST_HPSV3_BASE) is {config.text_config.hidden_size}-wide: it must be "
            "Qwen2-VL-7B-Instruct"
        )
    config.text_config.vocab_size = rows
    vlm.model = Qwen2VLForConditionalGeneration.from_pretrained(
        None, config=config, state_dict=state, dtype=vlm.dtype
    )
    vlm.model.to(vlm.device).eval().requires_grad_(False)
    head = [(w.to(vlm.device), None if b is None else b.to(vlm.device)) for w, b in head]
    return hpsv3_scorer(vlm, head, instruction, closing)


def hpsv3_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """The rotary positions HPSv3 was trained and is run with: 0, 1, 2, … over each row's tokens,
    image patches included, the same on all three of Qwen2-VL's (t, h, w) axes; (B, L), padding
    0. HPSv3's Qwen2VLRewardModelBT.forward (hpsv3/model/qwen2vl_trainer.py, hpsv3 1.0.x) calls
    the language model with input_ids=None and position_ids=None, and under the transformers it
    pins (4.45.2) that gives each token its index; its processor pads on the right, so a row's
    tokens start at 0. Left padding here: the index counts the row's own tokens only. Qwen2-VL's
    own forward (M-RoPE) would give the image's patches 3-D (t, h, w) positions and start the
    text after them 240 positions earlier (16 x 16 merged patches take 16 positions, not 256):
    positions HPSv3 was never trained with."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def hpsv3_scorer(vlm: VLM, head, instruction: str, closing: str):
    """HPSv3's score μ, given the loaded `VLM`, the head's layers and HPSv3's question."""
    token = vlm.tokenizer.convert_tokens_to_ids(HPSV3_TOKEN)

    @torch.no_grad()
    def score(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = []
        for s in range(0, len(prompts), CHUNK):
            texts = [
                vlm.chat(
                    [
                        {"type": "image"},
                        {"type": "text", "text": instruction.format(text_prompt=p) + closing},
                    ]
                )  # fmt: skip
                for p in prompts[s : s + CHUNK]
            ]
            inputs = vlm.inputs(to_pil(images[s : s + CHUNK]), texts)
            at = inputs["input_ids"] == token
            if (at.sum(1) != 1).any():
                raise ValueError(f"{vlm.who}: each question must hold {HPSV3_TOKEN} once")
            del inputs["mm_token_type_ids"]  # no 3-D image positions: see hpsv3_positions
            positions = hpsv3_positions(inputs["attention_mask"])
            hidden = vlm.model.model(**inputs, position_ids=positions, use_cache=False)
            hidden = hidden.last_hidden_state[at].float()
            for i, (w, b) in enumerate(head):
                hidden = F.linear(hidden, w, b)
                hidden = hidden if i == len(head) - 1 else F.relu(hidden)
            out.append(hidden[:, 0])  # (μ, σ): μ
        return torch.cat(out).to(images.device)

    score.vlm = vlm  # the model it asks, with its tokenizer and image processor
    return score
