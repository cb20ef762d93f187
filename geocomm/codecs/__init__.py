"""Codecs in three roles: the contract (``base``), frames (``frames``) and the registry
(``registry``); the built-in formats; ``checks`` for codec authors."""

from typing import Any

import numpy as np

from geocomm.codecs.auto import AutoCodec
from geocomm.codecs.base import Codec, StatefulCodec, TransformingCodec
from geocomm.codecs.feedback import ErrorFeedbackCodec
from geocomm.codecs.formats import (
    BF16Codec,
    FP8Codec,
    MXFP4Codec,
    MXFP8Codec,
    NoneCodec,
    NVFP4Codec,
)
from geocomm.codecs.frames import FramedCodec, parse_frame
from geocomm.codecs.geo import GeoFP8Codec, GeoNVFP4Codec, HadamardCodec
from geocomm.codecs.registry import frame_body_size, get_codec, register_codec, registered_ids

for _cls in (
    NoneCodec,
    BF16Codec,
    FP8Codec,
    NVFP4Codec,
    MXFP8Codec,
    MXFP4Codec,
    GeoFP8Codec,
    GeoNVFP4Codec,
    HadamardCodec,
    AutoCodec,
):
    register_codec(_cls)


def decode(buf: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Decode any geocomm frame with the codec its header names.

    Args:
        buf: a frame (uint8 array or any bytes-like object) from :meth:`Codec.encode`.
        out: an array of the frame's shape and any float dtype to fill, or None.

    Returns:
        ``out``, or a new NumPy array of the frame's shape and dtype.

    Raises:
        ValueError: a malformed or corrupted frame, or one naming an unknown codec.
    """
    return get_codec(parse_frame(buf, frame_body_size).config).decode(buf, out=out)


__all__ = [
    "AutoCodec",
    "BF16Codec",
    "Codec",
    "ErrorFeedbackCodec",
    "FP8Codec",
    "FramedCodec",
    "GeoFP8Codec",
    "GeoNVFP4Codec",
    "HadamardCodec",
    "MXFP4Codec",
    "MXFP8Codec",
    "NVFP4Codec",
    "NoneCodec",
    "StatefulCodec",
    "TransformingCodec",
    "decode",
    "get_codec",
    "register_codec",
    "registered_ids",
]
