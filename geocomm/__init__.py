"""geocomm: compressed gradient collectives (FP8, NVFP4, GeoFP8) over MPI and NCCL.

The codec layer works without MPI; the collectives need mpi4py (``pip install
geocomm[mpi]``). ``geocomm.native_available`` says whether the C core is built.
"""

from geocomm.api import allgather, allreduce, get_comm, init, reduce_scatter
from geocomm.codecs import Codec, decode, get_codec, register_codec, registered_ids
from geocomm.comm.base import CollectiveTimeout
from geocomm.engine.call import CollectiveMismatchError
from geocomm.kernels.native import available as native_available

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "__version__",
    "allgather",
    "allreduce",
    "decode",
    "get_codec",
    "get_comm",
    "init",
    "native_available",
    "reduce_scatter",
    "register_codec",
    "registered_ids",
]
