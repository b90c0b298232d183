"""Which family part serves a diffusers --model: the pipeline class its model_index.json names.

To add a family: write its part (a module like fluxworld.py, see diffusersworld.py's docstring and
docs/models.md), add it to PARTS, add its tiny pipeline to benchmarks/modelzoo.py's TINY_FAMILIES,
and its variant to test_families.py.
"""

import torch

from worlds import diffusersworld, flux2world, fluxworld, hub, qwenimageworld, sd3world
from worlds.diffusersworld import BadInput

PARTS = {part.PIPELINE: part for part in (sd3world, fluxworld, flux2world, qwenimageworld)}


def family_of(model: str):
    """The family part of the pipeline in folder or hub id `model`; a BadInput naming --model
    and the supported pipeline classes when its model_index.json names another."""
    from diffusers import DiffusionPipeline

    source = hub.locate(model, "--model", "model_index.json")  # fails fast offline
    name = DiffusionPipeline.load_config(source).get("_class_name")
    if name is None:
        raise BadInput("--model", f"{model}'s model_index.json names no pipeline class "
                       "(_class_name): is it a diffusers pipeline's folder?")  # fmt: skip
    if name not in PARTS:
        raise BadInput("--model", f"{model} holds a {name}, which is not supported: supported "
                       f"pipelines are {', '.join(PARTS)} (docs/models.md)")  # fmt: skip
    return PARTS[name]


def load(args, device: torch.device) -> diffusersworld.DiffusersWorld:
    """The diffusers world of --model, with its family's part."""
    return diffusersworld.DiffusersWorld(args, device, family_of(args.model))
