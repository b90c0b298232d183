"""A pairwise judge from a local vision-language model: which of two images made for the same
prompt is better? The counterpart of the paper's LLM-as-a-Judge, held out from training.

`VLMJudge(path, device).prefer(images_a, images_b, prompts)` shows a model of the Qwen2.5-VL class
(loaded with transformers' AutoModelForImageTextToText) both images of each pair and one fixed
question with the prompt in it (QUESTION), in the model's own chat template, and reads the answer
from the next-token logits of "1" against "2": no sampling, so the same inputs give the same
verdict. Each pair is asked twice, A shown first and then B shown first, because VLMs favour a
position (the first or the last image, whatever it holds): A wins only if both orders choose A, B
only if both choose B, and a pair whose two orders disagree is a tie. A judge that always says "1"
thus ties every pair instead of crowning whichever run was shown first. Verdicts: +1 (A preferred),
0 (tie), -1 (B preferred).

Models that fit: Qwen2.5-VL-3B-Instruct and Qwen2.5-VL-7B-Instruct. Their weights take 7.5 GB
(3.755 B parameters) and 16.6 GB (8.292 B) in bf16, the judge's dtype on a GPU (fp32 on a CPU):
parameters counted by building each model from its released config.json on the meta device. Cost:
two forwards a pair, each with both images. A 512 x 512 image is resized to 504 x 504: 36 x 36
patches of 14 px, merged 2 x 2 into 324 tokens; a forward reads ~740 tokens (648 of images, ~90 of
question and prompt) and 2,592 patches. At 2 FLOP per parameter and token (the vision tower on the
patches, the language model on the tokens, the output layer on the last token only) plus attention,
a forward is 7.7 TFLOP for the 3B (3.6 of them in the vision tower) and 13.3 for the 7B: ~15 and
~27 TFLOP a pair, ~0.04 s and ~0.07 s a pair at an assumed 400 TFLOP/s (bf16 on an H100/H200; not
measured). studies/judge_cost.py computes these; docs/judge.md has the table. Activations are
small beside the weights: nothing is cached.

The model is loaded by rewards.VLM (shared with the `vqa` reward): a local folder as released,
nothing downloaded, a missing or wrong folder a FileNotFoundError or ValueError that says what is
missing and what would work.
"""

import os

import torch
from tqdm import tqdm

from rewards import VLM, VLM_IMAGE_TOKEN, control_token, to_pil

QUESTION = (
    'Two images were generated for the prompt: "{prompt}". Which image follows the prompt more '
    "faithfully and looks better? Answer with 1 for the first image or 2 for the second."
)
IMAGE_TOKEN = VLM_IMAGE_TOKEN
PROGRESS_OVER = 8  # pairs: a progress bar for more than this many


def check_prompts(prompts: list[str]) -> None:
    """A ValueError naming the first prompt that holds one of the chat's control tokens
    (<|image_pad|>, <|im_end|>, …): written into the question, it would take an image's place or
    end the question early (the `vqa` and `hpsv3` rewards refuse such prompts too)."""
    for prompt in prompts:
        if token := control_token(prompt):
            raise ValueError(f"the VLM judge writes each prompt into its model's chat, where "
                             f"{token!r} is a control token; {prompt!r} holds it")  # fmt: skip


def both_orders(ab: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
    """Verdicts (B,) int8 from the margins of the two orders: `ab` with A shown first, `ba` with B
    shown first (a margin > 0 chooses the first image). +1 where both orders choose A, -1 where
    both choose B, 0 where they disagree or a margin is exactly 0."""
    vote_ab = torch.sign(ab).to(torch.int8)  # +1: A
    vote_ba = -torch.sign(ba).to(torch.int8)  # +1: A (shown second)
    return torch.where(vote_ab == vote_ba, vote_ab, 0)


class VLMJudge:
    """Pairwise preferences of the vision-language model in the local folder `path`, on `device`
    (bf16 on a GPU, fp32 otherwise, unless `dtype` is given)."""

    def __init__(
        self,
        path: str | os.PathLike,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
    ):
        self.vlm = VLM(path, device, dtype, who="VLM judge")
        self.tokenizer, self.image_processor = self.vlm.tokenizer, self.vlm.image_processor
        self.device = self.vlm.device
        if self._text("x").count(IMAGE_TOKEN) != 2:
            raise ValueError(f"VLM judge: the chat template of {path!r} does not place 2 images")
        self.answer_ids = [self.vlm.one_token(answer) for answer in ("1", "2")]
        self.vlm.load()
        self.model = self.vlm.model

    def _text(self, prompt: str) -> str:
        """The chat-formatted question about `prompt`, up to where the model's answer starts."""
        content = [{"type": "image"}, {"type": "image"}]
        return self.vlm.chat([*content, {"type": "text", "text": QUESTION.format(prompt=prompt)}])

    def _inputs(self, pairs: list[tuple], prompts: list[str]) -> dict:
        """The model's inputs for len(pairs) sequences, each showing its pair's images in order:
        the image processor's patches, and each image's placeholder widened to one token per
        merged patch (as transformers' Qwen2-VL processor does)."""
        images = [im for pair in pairs for im in pair]
        return self.vlm.inputs(images, [self._text(p) for p in prompts])

    @torch.no_grad()
    def margins(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        prompts: list[str],
        batch_size: int = 4,
    ) -> torch.Tensor:
        """logit("1") - logit("2") (B,) float32 on the CPU for each pair shown in this order:
        `first[i]` as image 1, `second[i]` as image 2 (both (B, 3, H, W) in [-1, 1]); > 0 chooses
        the first. `batch_size` pairs a forward."""
        for name, images in (("first", first), ("second", second)):
            if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
                raise ValueError(
                    f"VLM judge: {name} images have shape {tuple(images.shape)}; want "
                    f"({len(prompts)}, 3, H, W), one image per prompt"
                )
        check_prompts(prompts)
        pairs = list(zip(to_pil(first), to_pil(second), strict=True))
        out = []
        starts = range(0, len(prompts), batch_size)
        for s in tqdm(starts, desc="VLM judge", disable=len(prompts) <= PROGRESS_OVER):
            inputs = self._inputs(pairs[s : s + batch_size], prompts[s : s + batch_size])
            logits = self.model(**inputs, use_cache=False, logits_to_keep=1).logits[:, -1]
            answers = logits[:, self.answer_ids].float()  # (b, 2): "1", "2"
            out.append((answers[:, 0] - answers[:, 1]).cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def prefer(
        self,
        images_a: torch.Tensor,
        images_b: torch.Tensor,
        prompts: list[str],
        batch_size: int = 4,
    ) -> torch.Tensor:
        """(B,) int8: +1 where A is preferred in both orders, -1 where B is, 0 (tie) where the two
        orders disagree. images_a, images_b: (B, 3, H, W) in [-1, 1], made for `prompts`."""
        ab = self.margins(images_a, images_b, prompts, batch_size)
        ba = self.margins(images_b, images_a, prompts, batch_size)
        return both_orders(ab, ba)
