"""Seeding: the per-rank global seeds, the global RNG states a checkpoint keeps, and the per-epoch
generators every random draw of an epoch comes from (what makes resume exact)."""

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch's global generators (recast.py passes seed + rank)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Global RNG states (python, numpy, torch CPU), JSON-serialisable."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, mt, py_gauss = random.getstate()
    return {
        "python": [version, list(mt), py_gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.random.get_rng_state().tolist(),
    }


def set_rng_state(state: dict) -> None:
    version, mt, py_gauss = state["python"]
    random.setstate((version, tuple(mt), py_gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.random.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def epoch_generator(seed: int, epoch: int, purpose: int) -> torch.Generator:
    """Every random draw of an epoch comes from generators seeded by (seed, epoch, purpose): the
    same on every rank and after a resume, which is what makes resume exact."""
    return torch.Generator().manual_seed(((seed * 100_003 + epoch) * 7 + purpose) % 2**63)
