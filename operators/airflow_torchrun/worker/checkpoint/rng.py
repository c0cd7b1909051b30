"""Every RNG a training step may draw from (torch, CUDA, numpy, ``random``), captured and restored."""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


# -- RNG --------------------------------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """This rank's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    except ImportError:
        pass
    # Only the current device, and only once CUDA is in use: touching every GPU from every rank
    # would create contexts on devices that belong to other ranks.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
        state["cuda_device"] = torch.cuda.current_device()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    # The states may have been loaded with a map_location that put them on a GPU.
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            saved = state["numpy"]
            np.random.set_state(
                (
                    saved["name"],
                    saved["keys"].cpu().numpy().astype("uint32"),
                    saved["pos"],
                    saved["has_gauss"],
                    saved["cached_gaussian"],
                )
            )
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu(), device=torch.cuda.current_device())


def restore_rank_rng(states: list[Any] | None, uri: str) -> None:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
    if not states:
        log.warning("Checkpoint %s has no RNG states; random draws will not match the uninterrupted run", uri)
        return
    if rank >= len(states):
        log.warning(
            "Checkpoint %s holds RNG states of %d rank(s), this is rank %d: its RNG is not restored",
            uri,
            len(states),
            rank,
        )
        return
    restore_rng(states[rank])
