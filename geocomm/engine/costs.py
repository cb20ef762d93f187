"""What a backend costs: the model behind the stage size and ``auto``'s crossover
(docs/design.md, "The collective"), and the codec ``auto`` chooses by it.

Host backends (``mpi``, ``gloo``, anything not listed in
:data:`DEVICE`) keep the numbers measured on the machine they were tuned on
(perf/results/crossover.md): :data:`HOST_STAGE_SIZE` values per pipeline
stage and a crossover of :data:`HOST_CROSSOVER_BYTES`. A device backend
(``nccl``) is described by a :class:`Profile` and both numbers follow from
this model of a compressed all-reduce of ``B`` fp32 bytes on ``N`` ranks in
``K`` stages, through a codec that sends ``r`` wire bytes per fp32 byte
(fp8 with block 128: about 0.26):

    link   L = 2 (N - 1) / N * r * B / link_Bps      (all-to-all, then all-gather)
    codec  C = B / codec_Bps                           (encode, sum, re-encode, decode)
    T(K) = call_s + K * stage_s + max(C, L) + min(C, L) / K

The codec and the link overlap across stages; one stage's share of the smaller
one fills and drains the pipe (K = 1 is C + L: nothing overlaps). ``T`` is
smallest at ``K = sqrt(min(C, L) / stage_s)``: more stages hide more of the
smaller cost but pay a fixed ``stage_s`` each. The plain all-reduce moves
``2 (N - 1) / N * B`` over the same link; ``call_s`` is what a compressed call
costs beyond a plain one whatever its size. ``auto`` compresses from the
smallest power-of-two size from which the compressed call is faster at every
larger power of two; on one rank (no link to save) never.

Everything here is a pure function of its arguments: every rank computes the
same numbers, and the tests check them on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from geocomm._environ import positive_number
from geocomm.codecs.auto import AutoCodec

#: Host backends: values of the whole buffer per pipeline stage, measured on a
#: 2-core machine (a stage there costs microseconds; 1M values keep the codec's
#: loops long and three stages of scratch small).
HOST_STAGE_SIZE = 1 << 20
#: Host backends: the middle of the crossover measured on an emulated 10 Gbit/s link,
#: 2 ranks, where plain fp32 wins below it and fp8 above (perf/results/crossover.md).
HOST_CROSSOVER_BYTES = 2 << 20
#: Wire bytes per fp32 byte the model assumes when the codec is not known (fp8, block 128).
FP8_RATIO = (1 + 4 / 128) / 4
#: At most this many values per stage on a device: a stage's scratch (double-buffered
#: wire buffers) is about 1.5 times its fp32 bytes.
MAX_STAGE_SIZE = 1 << 26


@dataclass(frozen=True)
class Profile:
    """A device backend's costs, per rank; the inputs of the model above.

    ``stage_s``: fixed seconds of one pipeline stage (its kernel launches, two
    grouped collectives, the host enqueueing them); ``call_s``: fixed seconds a
    compressed call adds to a plain one (planning, tables, scratch);
    ``link_Bps``: bytes per second a rank sends (and receives) in a collective;
    ``codec_Bps``: fp32 bytes per second the codec's kernels pass through.
    """

    stage_s: float
    call_s: float
    link_Bps: float
    codec_Bps: float


#: Device backends by ``Communicator.backend``. ``nccl``: 8 H100/H200-class GPUs over
#: NVLink. A plain 256 MiB all-reduce there takes 1-2 ms, i.e. 2 * 7/8 * 268 MB / 1.5 ms
#: ~ 300 GB/s per rank; the batched kernels move about 10-12 bytes of HBM per value at
#: ~3 TB/s, ~1 TB/s of fp32 data; a stage's host side (CuPy launches of 3-4 kernels,
#: two NCCL groups of 2 (N - 1) calls, event records) is ~100 us, more than its
#: launch and NCCL latency on the GPU (~20 us), so it sets stage_s; call_s likewise.
DEVICE: dict[str, Profile] = {
    "nccl": Profile(stage_s=100e-6, call_s=100e-6, link_Bps=300e9, codec_Bps=1e12),
}


def profile(backend: str | None) -> Profile | None:
    """The device profile of ``backend`` (a ``Communicator.backend``), None for a host one."""
    return DEVICE.get(backend) if backend is not None else None


def _link_codec_s(profile: Profile, nbytes: float, size: int, ratio: float) -> tuple[float, float]:
    link = 2 * (size - 1) / size * ratio * nbytes / profile.link_Bps
    return link, nbytes / profile.codec_Bps


def compressed_seconds(
    profile: Profile, nbytes: float, size: int, ratio: float, stages: int
) -> float:
    """T(K) of the model: a compressed all-reduce of ``nbytes`` fp32 bytes in ``stages`` stages."""
    link, codec = _link_codec_s(profile, nbytes, size, ratio)
    return profile.call_s + stages * profile.stage_s + max(link, codec) + min(link, codec) / stages


def plain_seconds(profile: Profile, nbytes: float, size: int) -> float:
    """The plain all-reduce of ``nbytes`` (beyond the fixed cost both calls share)."""
    return 2 * (size - 1) / size * nbytes / profile.link_Bps


def best_stages(profile: Profile, nbytes: float, size: int, ratio: float) -> int:
    """The stage count K >= 1 that minimizes T(K): an integer next to sqrt(min(C, L) / stage_s)."""
    link, codec = _link_codec_s(profile, nbytes, size, ratio)
    best = math.sqrt(min(link, codec) / profile.stage_s)
    candidates = {max(1, math.floor(best)), max(1, math.ceil(best))}
    return min(
        sorted(candidates), key=lambda k: compressed_seconds(profile, nbytes, size, ratio, k)
    )


def stage_size(backend: str | None, count: int, size: int, ratio: float = FP8_RATIO) -> int:
    """Values of the whole buffer per pipeline stage for ``count`` fp32 values on
    ``size`` ranks (``stage_size`` of the collectives): the host constant, or
    ``count / K`` with the model's best K, at most :data:`MAX_STAGE_SIZE`."""
    device = profile(backend)
    if device is None or count <= 0:
        return HOST_STAGE_SIZE
    stages = best_stages(device, 4.0 * count, size, ratio)
    return min(-(-count // stages), MAX_STAGE_SIZE)


def crossover_bytes(backend: str | None, size: int, ratio: float = FP8_RATIO) -> int | None:
    """fp32 bytes from which ``auto`` compresses on ``size`` ranks of ``backend``: the host
    constant, or the model's smallest power of two (4 KiB .. 1 TiB) from which the
    compressed all-reduce beats the plain one at every larger power of two; None when it
    never does (one rank, or a codec slower than the link it saves)."""
    device = profile(backend)
    if device is None:
        return HOST_CROSSOVER_BYTES
    found = None
    for shift in range(40, 11, -1):  # from 1 TiB down to 4 KiB
        nbytes = float(1 << shift)
        stages = best_stages(device, nbytes, size, ratio)
        if compressed_seconds(device, nbytes, size, ratio, stages) >= plain_seconds(
            device, nbytes, size
        ):
            break
        found = 1 << shift
    return found


def codec_for(codec: Any, count: int, backend: str | None = None, size: int = 2) -> Any:
    """The codec that carries ``count`` values on ``size`` ranks of ``backend``: ``codec``
    itself, except ``auto`` (:class:`geocomm.codecs.auto.AutoCodec`), which is its
    compressing codec from its crossover on (its own ``crossover_bytes``, else
    :func:`crossover_bytes` for the inner codec's wire ratio) and the plain codec below.
    Depends on what every rank shares only, so all ranks choose alike."""
    if not isinstance(codec, AutoCodec):
        return codec
    crossover = codec.crossover_bytes
    if crossover is None:
        ratio = codec.inner.wire_size(_RATIO_VALUES) / (4 * _RATIO_VALUES)
        crossover = crossover_bytes(backend, size, ratio)
    return codec.inner if crossover is not None and 4 * count >= crossover else codec.plain


#: Values whose wire size gives a codec's wire bytes per fp32 byte (the model's ratio).
_RATIO_VALUES = 1 << 20


# ---------------------------------------------------------------------------
# two levels: ranks grouped into nodes (docs/design.md, "Node-aware collectives")


@dataclass(frozen=True)
class Links:
    """What a rank of a two-level machine moves and computes per second: ``intra_Bps``,
    bytes to the ranks of its node; ``inter_Bps``, bytes to other nodes (its share of
    the node's NICs: one NIC of R bytes/s per rank gives R, one per node of G ranks
    R / G); ``latency_s``, the fixed cost of one collective phase; ``codec_Bps``,
    fp32 bytes per second through a compressed pipeline's codec work (encode, sums,
    re-encode, decode)."""

    intra_Bps: float
    inter_Bps: float
    latency_s: float
    codec_Bps: float


#: Host backends: shared memory or loopback TCP inside a node (~4 GB/s), a 10 Gbit/s
#: NIC per rank, 50 us per phase, ~0.5 GB/s of fp32 through the C codec per core.
HOST_LINKS = Links(intra_Bps=4e9, inter_Bps=1.25e9, latency_s=50e-6, codec_Bps=0.5e9)
#: Device backends: NVLink inside the node (~300 GB/s per GPU), a 400 Gbit/s NIC per
#: GPU (50 GB/s), the stage cost of :data:`DEVICE` per phase, its codec throughput.
DEVICE_LINKS: dict[str, Links] = {
    "nccl": Links(intra_Bps=300e9, inter_Bps=50e9, latency_s=100e-6, codec_Bps=1e12),
}
#: Environment overrides, GB/s (1e9 bytes per second) per rank.
ENV_INTRA = "GEOCOMM_INTRA_GBPS"
ENV_INTER = "GEOCOMM_INTER_GBPS"


def links(backend: str | None, env: dict[str, str] | None = None) -> Links:
    """The :class:`Links` of ``backend``, with ``GEOCOMM_INTRA_GBPS`` and
    ``GEOCOMM_INTER_GBPS`` (from ``env``, a mapping like ``os.environ``) overriding
    the bandwidths."""
    base = DEVICE_LINKS.get(backend or "", HOST_LINKS)
    env = env or {}
    intra, inter = positive_number(ENV_INTRA, env), positive_number(ENV_INTER, env)
    return Links(
        base.intra_Bps if intra is None else intra * 1e9,
        base.inter_Bps if inter is None else inter * 1e9,
        base.latency_s,
        base.codec_Bps,
    )


def flat_seconds(links: Links, nbytes: float, sizes: list[int], ratio: float) -> float:
    """A flat compressed all-reduce of ``nbytes`` fp32 bytes on nodes of ``sizes`` ranks:
    a rank of the smallest node (g ranks of N) sends ``2 (N - g) / N r B`` to other
    nodes and ``2 (g - 1) / N r B`` inside its own, the codec overlapping both:
    ``2 latency + max(cross / inter, inside / intra, B / codec)``."""
    n, g = sum(sizes), min(sizes)
    cross = 2 * (n - g) / n * ratio * nbytes / links.inter_Bps
    inside = 2 * (g - 1) / n * ratio * nbytes / links.intra_Bps
    return 2 * links.latency_s + max(cross, inside, nbytes / links.codec_Bps)


def node_seconds(links: Links, nbytes: float, sizes: list[int], ratio: float) -> float:
    """The node-aware all-reduce: in the largest node (G ranks) an exact reduce-scatter
    and an all-gather of fp32 onto the w shard owners (w: the smallest node's ranks),
    each owner receiving and sending ``(G - 1) B / w``, and a compressed all-reduce of
    its ``1 / w`` shard over the ``M`` nodes:
    ``4 latency + 2 (G - 1) / w B / intra + max(2 (M - 1) / M r B / w / inter, B / w / codec)``."""
    m, g, w = len(sizes), max(sizes), min(sizes)
    inside = 2 * (g - 1) / w * nbytes / links.intra_Bps
    shard = nbytes / w
    cross = 2 * (m - 1) / m * ratio * shard / links.inter_Bps
    return 4 * links.latency_s + inside + max(cross, shard / links.codec_Bps)


def node_aware_pays(
    backend: str | None,
    nbytes: float,
    sizes: list[int],
    ratio: float = FP8_RATIO,
    env: dict[str, str] | None = None,
) -> bool:
    """Whether ``auto`` goes node-aware: never on one node or one rank per node (the two
    algorithms are then one), else when :func:`node_seconds` beats :func:`flat_seconds`."""
    if len(sizes) <= 1 or max(sizes) <= 1:
        return False
    model = links(backend, env)
    return node_seconds(model, nbytes, sizes, ratio) < flat_seconds(model, nbytes, sizes, ratio)
