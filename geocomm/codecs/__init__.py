"""Codecs: the contract, the registry and the built-in formats."""

from geocomm.codecs.auto import AutoCodec
from geocomm.codecs.base import Codec, StatefulCodec, TransformingCodec, parse_frame
from geocomm.codecs.feedback import ErrorFeedbackCodec
from geocomm.codecs.formats import (
    BF16Codec,
    FP8Codec,
    MXFP4Codec,
    MXFP8Codec,
    NoneCodec,
    NVFP4Codec,
)
from geocomm.codecs.geo import GeoFP8Codec, GeoNVFP4Codec, HadamardCodec
from geocomm.codecs.registry import get_codec, register_codec, registered_ids

for _cls in (NoneCodec, BF16Codec, FP8Codec, NVFP4Codec, MXFP8Codec, MXFP4Codec, GeoFP8Codec,
             GeoNVFP4Codec, HadamardCodec, AutoCodec):
    register_codec(_cls)


def decode(buf, out=None):
    """Decode any geocomm frame with the codec its header names."""
    return get_codec(parse_frame(buf).config).decode(buf, out=out)


__all__ = [
    "AutoCodec",
    "BF16Codec",
    "Codec",
    "ErrorFeedbackCodec",
    "FP8Codec",
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
