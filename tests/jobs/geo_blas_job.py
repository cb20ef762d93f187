"""GeoFP8 on ranks whose BLAS differ: a job for tests/codecs/test_determinism.py.

    mpiexec -n 1 -x OPENBLAS_NUM_THREADS=1 python tests/jobs/geo_blas_job.py : \
            -n 1 -x OPENBLAS_NUM_THREADS=2 -x OPENBLAS_CORETYPE=Sandybridge python ...

50 geofp8 all-reduces of a 1024 x 1024 matrix (a fixed rank-48 signal of
falling strength plus fresh noise per call), with the default geometry (the split) and with
the whitening (``transform="whiten"``: the split and the whitening, whose
basis every rank measures from the result). Rank 0 prints whether every result was
bitwise identical on all ranks, and, as a control, whether NumPy's own
matrix product of the same operands gave the same bits on all ranks (with
these BLAS settings it need not).
"""

import zlib

import numpy as np

import geocomm

comm = geocomm.init()
rank, size = comm.rank, comm.size
rng = np.random.default_rng(0)
u = np.linalg.qr(rng.standard_normal((1024, 48)))[0].astype(np.float32)
v = np.linalg.qr(rng.standard_normal((1024, 48)))[0].astype(np.float32)
# 48 directions of falling strength: the split takes the first, the whitening the next
signal = (u * np.float32(40.0 / (1.0 + np.arange(48)))) @ v.T
whitening = geocomm.get_codec("geofp8", transform="whiten")
crc = white = 0
for call in range(50):
    noise = np.random.default_rng([call, rank]).standard_normal((1024, 1024), np.float32)
    x = signal + np.float32(0.05) * noise
    crc = zlib.crc32(geocomm.allreduce(x, codec="geofp8", key="w").tobytes(), crc)
    white = zlib.crc32(geocomm.allreduce(x, codec=whitening, key="w").tobytes(), white)
a = np.random.default_rng(1).standard_normal((2048, 2048), np.float32)
blas = zlib.crc32((a @ a.T).tobytes())
rows = comm.allgather_int64(np.array([crc, white, blas], np.int64))
if rank == 0:
    print(f"geofp8 results identical on all ranks: {len(set(rows[:, 0])) == 1}")
    print(f"geofp8 whitening results identical on all ranks: {len(set(rows[:, 1])) == 1}")
    print(f"numpy matmul identical on all ranks: {len(set(rows[:, 2])) == 1}")
    print(f"state checksum {geocomm.api.resolve_codec('geofp8').state_checksum()}")
    info = whitening.state_info("w")  # the whitening was measured and scales directions
    assert info["wt"] is not None and max(info["wenergies"]) > 16 * info["wbulk"]
