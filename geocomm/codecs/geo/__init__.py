"""GeoFP8: geometry-aware coordinates before quantizing (docs/design.md, "GeoFP8").

One file per concern: :mod:`.kernels` (the deterministic native/CUDA
kernels), :mod:`.maps` (the split map and the Hadamard rotation),
:mod:`.state` (per-key state and its checksum), :mod:`.policy` (which tensors
are mapped, at what rank), :mod:`.codec` (the codecs and their refresh
rounds), :mod:`.frames` (standalone frames).
"""

from geocomm.codecs.geo.codec import GeoCodec, GeoFP8Codec, GeoNVFP4Codec, HadamardCodec
from geocomm.codecs.geo.policy import DEFAULTS, matrix_shape

__all__ = ["DEFAULTS", "GeoCodec", "GeoFP8Codec", "GeoNVFP4Codec", "HadamardCodec", "matrix_shape"]
