"""Standalone GeoFP8 frames: the side channel that makes a frame decodable alone.

A frame has no per-key state to lean on, so ``encode`` computes the basis
from the tensor itself (the cold-start power iterations of a refresh, on one
rank) and stores it. Body of a mapped tensor::

    [u32 flag][basis V^T: k x n fp32][coefficients A: m x k bfloat16][quantized residual]

flag 1: the residual is X - A V^T and decoding adds A V^T back; flag 0: no
map (side zero-filled; a tensor with inf/NaN, whose basis cannot be
measured, is stored this way). Hadamard frames and tensors the policy leaves
plain hold the quantized body alone.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np

from geocomm.codecs.formats import BF16Codec
from geocomm.codecs.geo import kernels
from geocomm.codecs.geo.maps import HadamardPlan, SplitPlan
from geocomm.codecs.geo.policy import SIDE_BYTES
from geocomm.codecs.geo.state import KeyState

_FLAG = struct.Struct("<I")
_BF16 = BF16Codec()


def run_locally(rounds: Any) -> None:
    """Drive refresh rounds on one rank: each partial sum is its own total."""
    try:
        value = next(rounds)
        while True:
            value = rounds.send(value)
    except StopIteration:
        pass


def _side_bytes(codec: Any, shape: tuple[int, ...]) -> tuple[Any, int]:
    dims = codec.map_shape(shape, framed=True)
    if dims is None or dims.k == 0:
        return dims, 0
    return dims, _FLAG.size + dims.k * (4 * dims.n + SIDE_BYTES * dims.m)


def body_size(codec: Any, shape: tuple[int, ...]) -> int:
    """Bytes of the frame body of a tensor of ``shape``."""
    result: int = _side_bytes(codec, shape)[1] + codec.quantizer.wire_size(math.prod(shape))
    return result


def encode_body(codec: Any, x: np.ndarray, body: np.ndarray) -> None:
    """Encode float32 ``x`` (its own shape) into ``body``."""
    dims, side = _side_bytes(codec, x.shape)
    flat = np.ascontiguousarray(x, np.float32).reshape(-1)
    if dims is not None and dims.k == 0:  # hadamard
        mapped = np.empty_like(flat)
        HadamardPlan(dims, codec.seed, [0, flat.size]).forward(flat, mapped)
        flat = mapped
    if side == 0:
        codec.quantizer.encode_wire(flat, body)
        return
    state = KeyState(dims)
    run_locally(codec.measure(state, flat, 0))
    codec._settle()  # the measure commits when the state is read: now
    if state.vt is None:  # nothing to measure (inf/NaN): no map
        body[:side] = 0
        codec.quantizer.encode_wire(flat, body[side:])
        return
    plan = SplitPlan(dims, state.vt, steps=False)
    residual = np.empty_like(flat)
    plan.forward(flat, residual)
    body[: _FLAG.size] = np.frombuffer(_FLAG.pack(1), np.uint8)
    basis_end = _FLAG.size + 4 * dims.k * dims.n
    body[_FLAG.size : basis_end] = np.asarray(state.vt, "<f4").reshape(-1).view(np.uint8)
    _BF16.encode_wire(np.ascontiguousarray(plan.side, np.float32).reshape(-1), body[basis_end:side])
    codec.quantizer.encode_wire(residual, body[side:])


def decode_body(codec: Any, body: np.ndarray, out: np.ndarray) -> None:
    """Decode ``body`` into float32 ``out`` (the frame's shape); ValueError if malformed."""
    dims, side = _side_bytes(codec, out.shape)
    flat = out.reshape(-1)
    codec.quantizer.decode_frame_body(body[side:], flat)  # its scales checked too
    if dims is not None and dims.k == 0:
        HadamardPlan(dims, codec.seed, [0, flat.size]).inverse(flat, 0, None)
        return
    if side == 0:
        return
    (flag,) = _FLAG.unpack(bytes(body[: _FLAG.size]))
    if flag not in (0, 1):
        raise ValueError(f"GeoFP8 frame flag is {flag}, expected 0 or 1")
    if flag == 0:
        return
    basis_end = _FLAG.size + 4 * dims.k * dims.n
    vt = body[_FLAG.size : basis_end].copy().view("<f4").astype(np.float32)
    coef = np.empty(dims.m * dims.k, np.float32)
    _BF16.decode_wire(body[basis_end:side], coef)
    if not (np.isfinite(vt).all() and np.isfinite(coef).all()):
        raise ValueError("GeoFP8 frame side channel holds non-finite values")
    vt, coef = vt.reshape(dims.k, dims.n), coef.reshape(dims.m, dims.k)
    kernels.expand(flat, 0, dims.n, coef, vt, 1.0, flat)
