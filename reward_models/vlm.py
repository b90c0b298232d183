"""A local vision-language model of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL), loaded offline
with transformers' classes: the `vqa` reward's, `hpsv3`'s backbone, and the pairwise judge's
(studies/vlm_judge.py). Follows transformers' Qwen2-VL / Qwen2.5-VL model and processor classes
(transformers >= 5.0) and the models' own chat templates.
"""

import os

import torch

VLM_IMAGE_TOKEN = "<|image_pad|>"  # one per image in the template; one per merged patch in input
VLM_MODELS = "Qwen2.5-VL-3B-Instruct or Qwen2.5-VL-7B-Instruct"
VLM_FETCH = "hf download Qwen/Qwen2.5-VL-7B-Instruct --local-dir DIR, where there is network"


def to_pil(images: torch.Tensor) -> list:
    """(B, 3, H, W) in [-1, 1] → B RGB PIL images, rounded to 8 bits as a saved PNG is."""
    from PIL import Image

    x = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return [Image.fromarray(a) for a in x.permute(0, 2, 3, 1).cpu().numpy()]


class VLM:
    """A vision-language model of the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL) in the local folder
    `path`, on `device` (bf16 on a GPU, fp32 otherwise, unless `dtype` is given), loaded offline
    with transformers' Auto classes: its tokenizer (left padding), image processor and chat
    template. `who` starts every error message (the judge, or a reward and its variable); `model`
    loads the weights (`model_class`, default AutoModelForImageTextToText), after every check.

    The model must be a folder as released (config.json, weights, tokenizer files with the chat
    template, preprocessor_config.json): nothing is downloaded, and a missing or wrong folder is a
    FileNotFoundError or ValueError that says what is missing and what would work. Images go
    through the tokenizer and the image processor directly: transformers' processor object for
    this family also builds a video processor, which needs torchvision, and still images need
    neither."""

    def __init__(self, path, device, dtype=None, who: str = "VLM", model_class=None):
        from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

        path, self.who = os.fspath(path), who
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"{who}: {path!r} is not a folder here; give the local folder of a "
                f"vision-language model such as {VLM_MODELS} ({VLM_FETCH})"
            )
        self._require(path, "config.json", "the model's configuration")
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
            raise ValueError(
                f"{who}: {path!r} holds a {config.model_type!r} model, not an image-text-to-text "
                f"one; it needs a vision-language model such as {VLM_MODELS}"
            )
        self._require(path, "preprocessor_config.json", "the image processor's settings")
        self._require(path, "tokenizer_config.json", "the tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.tokenizer.padding_side = "left"  # every row's last position is where the answer starts
        self.image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.image_token_id = self.tokenizer.get_vocab().get(VLM_IMAGE_TOKEN)
        if not hasattr(self.image_processor, "merge_size") or self.image_token_id is None:
            raise ValueError(
                f"{who}: {path!r} is a {config.model_type!r} model; images are laid out as the "
                f"Qwen2-VL family does ({VLM_IMAGE_TOKEN} tokens, merged patches): use {VLM_MODELS}"
            )
        self.chat_template = self._chat_template(path)
        self.path, self.config = path, config
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.model_class = model_class
        self.image_kwargs: dict = {}  # passed to the image processor (e.g. its size)

    def load(self) -> None:
        """The weights, frozen, on the device (after the caller's own checks)."""
        if self.model_class is None:
            from transformers import AutoModelForImageTextToText as model_class
        else:
            model_class = self.model_class
        self.model = model_class.from_pretrained(self.path, local_files_only=True, dtype=self.dtype)
        self.model.to(self.device).eval().requires_grad_(False)

    def _require(self, path: str, name: str, what: str) -> None:
        if not os.path.isfile(os.path.join(path, name)):
            raise FileNotFoundError(
                f"{self.who}: {path!r} has no {name} ({what}); a model folder as released has it "
                f"({VLM_MODELS}: {VLM_FETCH})"
            )

    def _chat_template(self, path: str) -> str:
        """The processor's chat template (chat_template.json) if the folder has one, else the
        tokenizer's (tokenizer_config.json or chat_template.jinja)."""
        import json

        processor_template = os.path.join(path, "chat_template.json")
        if os.path.isfile(processor_template):
            try:
                with open(processor_template, encoding="utf-8") as f:
                    template = json.load(f)["chat_template"]
            except (OSError, ValueError, KeyError, TypeError) as e:  # torn, or another file
                raise ValueError(
                    f"{self.who}: {processor_template} is not a processor's chat template (JSON "
                    f"with a chat_template string: {type(e).__name__}: {e})"
                ) from None
            if isinstance(template, str):
                return template
            raise ValueError(f"{self.who}: {processor_template}'s chat_template is not a string")
        if self.tokenizer.chat_template:
            return self.tokenizer.chat_template
        raise ValueError(
            f"{self.who}: {path!r} has no chat template (chat_template.json or .jinja)"
        )

    def chat(self, content: list[dict]) -> str:
        """One user turn (`content`: {"type": "image"} and {"type": "text", "text": ...} parts) in
        the model's chat template, up to where its answer starts."""
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}],
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )

    def one_token(self, text: str) -> int:
        """The token id of `text`, which must be a single token of this tokenizer."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"{self.who}: {self.path!r}'s tokenizer splits {text!r} into {ids}")
        return ids[0]

    def inputs(self, images: list, texts: list[str]) -> dict:
        """The model's inputs for len(texts) sequences, the images shown in order (each text's
        placeholders take the next images): the image processor's patches, and each image's
        placeholder widened to one token per merged patch (as transformers' Qwen2-VL processor
        does)."""
        import re

        pixels = self.image_processor(images=images, return_tensors="pt", **self.image_kwargs)
        merged = pixels["image_grid_thw"].prod(-1) // self.image_processor.merge_size**2
        widths = iter(merged.tolist())
        token = re.escape(VLM_IMAGE_TOKEN)
        texts = [re.sub(token, lambda _: VLM_IMAGE_TOKEN * next(widths), t) for t in texts]
        tokens = self.tokenizer(texts, padding=True, return_tensors="pt")
        # which tokens are image patches: the model builds its 3-D rotary positions from this
        mm_token_type_ids = (tokens["input_ids"] == self.image_token_id).int()
        inputs = {**tokens, **pixels, "mm_token_type_ids": mm_token_type_ids}
        return {k: torch.as_tensor(v).to(self.device) for k, v in inputs.items()}
