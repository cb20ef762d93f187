"""Codec state in training checkpoints (docs/design.md, "Checkpoints").

What a compressed job carries across a save and a resume, besides the model and
the optimizer: the codec's state (GeoFP8's bases and call counts, error
feedback's residuals; :meth:`StatefulCodec.state_dict`), the call counts that
draw stochastic rounding's streams (:func:`geocomm.engine.call.call_counts`), and
what the state was made for (world size, parameter names and shapes), so a
state loaded into another job fails with a clear error instead of silently
restarting GeoFP8 or mapping residuals onto the wrong gradients.

The state is made of torch tensors, lists, dicts, strings and numbers only, so
``torch.save`` writes it and ``torch.load(..., weights_only=True)`` (torch's
default) reads it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from geocomm.codecs import Codec, StatefulCodec
from geocomm.engine import call as calls

VERSION = 1


def to_torch(tree: Any) -> Any:
    """``tree`` with NumPy arrays as torch tensors (copies) and NumPy scalars as Python
    numbers (what ``weights_only`` loading accepts); tuples stay tuples (GeoFP8 keys)."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(np.array(tree, copy=True))
    if isinstance(tree, np.generic):
        return tree.item()
    if isinstance(tree, dict):
        return {key: to_torch(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_torch(value) for value in tree)
    return tree


def to_numpy(tree: Any) -> Any:
    """Inverse of :func:`to_torch`: tensors back to NumPy arrays."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, dict):
        return {key: to_numpy(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_numpy(value) for value in tree)
    return tree


def check_world_size(expected: int | None, size: int, owner: str) -> None:
    """Raise ValueError if a loaded state was saved on another number of ranks."""
    if expected is not None and expected != size:
        raise ValueError(
            f"{owner}: the loaded codec state was saved by a job of {expected} ranks, this "
            f"job has {size}; GeoFP8 bases and error-feedback residuals do not carry over "
            "to another world size (start this job without the codec state)"
        )


def namespace(device: torch.device) -> Any:
    """The array namespace geocomm's codecs use for tensors on ``device`` (where their
    state lives)."""
    if device.type == "cuda":
        import cupy

        return cupy
    return np


def parameter_layout(module: torch.nn.Module) -> list[list[Any]]:
    """[name, shape] of every parameter that has a gradient, in module order."""
    return [[name, list(p.shape)] for name, p in module.named_parameters() if p.requires_grad]


def codec_state(codec: Codec, world_size: int | None, parameters: Sequence[Any]) -> dict[str, Any]:
    """A checkpointable state of ``codec`` as used by one job."""
    config = codec.get_config()
    inner = codec.state_dict() if isinstance(codec, StatefulCodec) else None
    return {
        "version": VERSION,
        "config": config,
        "world_size": world_size,
        "parameters": to_torch(list(parameters)),
        "codec": None if inner is None else to_torch(inner),
        "rounding_calls": calls.call_counts(config),
    }


def load_stateful(codec: StatefulCodec, state: Any, xp: Any = np) -> None:
    """Load a saved codec state (:func:`to_torch` of its ``state_dict()``) into
    ``codec``, its arrays in namespace ``xp``."""
    arrays = to_numpy(state)
    if xp is np:
        codec.load_state_dict(arrays)
    else:  # the stateful codecs take the namespace their arrays live in
        codec.load_state_dict(arrays, xp=xp)  # type: ignore[call-arg]


def load_codec_state(
    codec: Codec, data: dict[str, Any], parameters: Sequence[Any], owner: str, xp: Any = np
) -> int | None:
    """Restore :func:`codec_state` output into ``codec`` (state arrays in namespace
    ``xp``). Checks the codec and the parameters now; returns the saved world size for
    the caller to check against its communicator (:func:`check_world_size`)."""
    if not isinstance(data, dict) or data.get("version") != VERSION:
        raise ValueError(f"{owner}: not a geocomm codec state (version {VERSION} expected)")
    config = codec.get_config()
    if data["config"] != config:
        raise ValueError(f"{owner}: state saved by codec {data['config']}, this is {config}")
    current, saved = to_torch(list(parameters)), data["parameters"]
    if current != saved:
        names = {str(entry[0]) for entry in saved} ^ {str(entry[0]) for entry in current}
        detail = f"names differ: {sorted(names)[:6]}" if names else "shapes differ"
        raise ValueError(
            f"{owner}: the codec state was saved for another parameter layout ({detail})"
        )
    if data["codec"] is not None:
        if not isinstance(codec, StatefulCodec):
            raise ValueError(f"{owner}: the saved state has codec state, {config} has none")
        load_stateful(codec, data["codec"], xp)
    calls.restore_call_counts(data["rounding_calls"])
    world_size = data["world_size"]
    return None if world_size is None else int(world_size)
