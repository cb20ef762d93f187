"""perf/gpu_check.py's sections over the ranks: ``nccl`` (NCCLCommunicator's byte moves
and reductions over COMM_WORLD) and ``collectives`` (geocomm's collectives on CuPy over
NCCL == on NumPy over MPI, bit for bit, at any number of ranks; then the batched
pipeline on three loopback ranks of rank 0 == the host-driven pipeline).

Every rank makes the same collective calls in the same order; each compares its own
result with the MPI result, and the ranks compare checksums of their results over MPI
(all-reduce and all-gather: identical everywhere)."""

from __future__ import annotations

import traceback
from typing import Any

import numpy as np
from gpu_check_common import after_current, all_equal, digest, gradient, value_diff

#: The collectives' codecs: every format, both fp8 walks, stochastic rounding and
#: error feedback (whose map takes the pipeline's unfused path).
COLLECTIVE_CODECS = {
    "none": "none",
    "bf16": "bf16",
    "fp8-e4m3-128": "fp8",
    "fp8-e5m2-0": {"id": "fp8", "fmt": "e5m2", "block": 0},
    "fp8-e4m3-4097": {"id": "fp8", "fmt": "e4m3", "block": 4097},
    "nvfp4": "nvfp4",
    "mxfp8": "mxfp8",
    "mxfp8-e5m2-rceil": {"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"},
    "mxfp4": "mxfp4",
    "fp8 stochastic": {"id": "fp8", "rounding": "stochastic", "seed": 3},
    "nvfp4 stochastic": {"id": "nvfp4", "rounding": "stochastic", "seed": 3},
    "mxfp4 stochastic": {"id": "mxfp4", "rounding": "stochastic", "seed": 3},
    "fp8 error feedback": {"id": "fp8", "error_feedback": True},
}
DTYPES = ("float32", "float16", "bfloat16")


# ---------------------------------------------------------------------------
# nccl


def pattern(cp: Any, a: int, b: int, length: int) -> Any:
    """A device array of ``length`` bytes that names (a, b)."""
    return cp.asarray(
        ((np.arange(length, dtype=np.int64) + 31 * a + 17 * b) % 251).astype(np.uint8)
    )


def _same(cp: Any, got: Any, want: Any) -> bool:
    return bool(np.array_equal(cp.asnumpy(got), cp.asnumpy(want)))


def check_nccl(ctx: Any) -> dict[str, Any]:
    """The NCCL communicator's byte moves and reductions over every rank (the own
    segment is a device copy), plus a raw grouped ncclSend/ncclRecv around the ring
    (to self on one rank)."""
    cp, comm = ctx.cp, ctx.nccl()
    r, size = comm.rank, comm.size
    checks: dict[str, bool] = {}

    def seg(a: int, b: int) -> int:
        return 100 + 7 * a + 3 * b

    send_counts = np.array([seg(r, p) for p in range(size)])
    recv_counts = np.array([seg(p, r) for p in range(size)])
    send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
    recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
    send = cp.concatenate([pattern(cp, r, p, seg(r, p)) for p in range(size)])
    recv = cp.zeros(int(recv_counts.sum()), cp.uint8)
    comm.alltoallv(send, send_counts, send_displs, recv, recv_counts, recv_displs).wait()
    want = cp.concatenate([pattern(cp, p, r, seg(p, r)) for p in range(size)])
    checks["alltoallv"] = _same(cp, recv, want)

    counts = np.array([50 + 13 * p for p in range(size)])
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    gathered = cp.zeros(int(counts.sum()), cp.uint8)
    comm.allgatherv(pattern(cp, r, 0, int(counts[r])), gathered, counts, displs).wait()
    want = cp.concatenate([pattern(cp, p, 0, int(counts[p])) for p in range(size)])
    checks["allgatherv"] = _same(cp, gathered, want)

    for dtype in (np.float32, np.float64):
        base = np.arange(1000, dtype=dtype)
        values = cp.asarray(base * (r + 1))
        total = cp.empty_like(values)
        comm.allreduce(values, total, "sum")
        checks[f"allreduce sum {np.dtype(dtype).name}"] = bool(
            np.array_equal(cp.asnumpy(total), base * (size * (size + 1) // 2))
        )
        comm.allreduce(values, total, "max")
        checks[f"allreduce max {np.dtype(dtype).name}"] = bool(
            np.array_equal(cp.asnumpy(total), base * size)
        )
    rows = comm.allgather_int64(np.array([r, 2 * r]))
    checks["allgather_int64"] = bool((rows == np.array([[p, 2 * p] for p in range(size)])).all())
    comm.barrier()

    # grouped ncclSend/ncclRecv, the call path alltoallv uses for peers: to the next
    # rank, from the previous one. The fills run on the current stream, NCCL on the
    # communicator's own non-blocking stream: order NCCL after the fills with an
    # event, and the comparison after NCCL by synchronizing its stream.
    nxt, prev = (r + 1) % size, (r - 1) % size
    data, back = pattern(cp, r, 9, 4099), cp.zeros(4099, cp.uint8)
    from cupy.cuda import nccl  # ctx.cp's (the twin's under --twin)

    after_current(cp, comm.stream)
    nccl.groupStart()
    try:
        comm.nccl_comm.send(data.data.ptr, data.size, nccl.NCCL_UINT8, nxt, comm.stream.ptr)
        comm.nccl_comm.recv(back.data.ptr, back.size, nccl.NCCL_UINT8, prev, comm.stream.ptr)
    finally:
        nccl.groupEnd()
    comm.stream.synchronize()
    name = "ncclSend/ncclRecv to self" if size == 1 else "ncclSend/ncclRecv ring"
    checks[name] = _same(cp, back, pattern(cp, prev, 9, 4099))
    return {
        "ok": all(checks.values()),
        "rank": r,
        "size": size,
        "checks": checks,
        "failures": [name for name, good in checks.items() if not good],
    }


# ---------------------------------------------------------------------------
# collectives: CuPy over NCCL == NumPy over MPI


def _host_input(dtype: str, values: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)


def _to_device(cp: Any, host: np.ndarray) -> Any:
    """The device operand the collective sees: the array itself, or for
    bfloat16 (no CuPy dtype) its bits widened to float32, as the torch adapter does."""
    from geocomm.api.arrays import bf16_bits_to_float32

    if host.dtype.name == "bfloat16":
        return bf16_bits_to_float32(cp.asarray(host.view(np.uint16)))
    return cp.asarray(host)


def _to_host(cp: Any, result: Any, dtype: str) -> np.ndarray:
    """A device result as a host array of ``dtype`` (bfloat16: rounded like the adapter)."""
    import ml_dtypes

    from geocomm.api.arrays import float32_to_bf16_bits

    if dtype == "bfloat16":
        return cp.asnumpy(float32_to_bf16_bits(result)).view(ml_dtypes.bfloat16)
    return cp.asnumpy(result)


def run_collective(
    kind: str, x: Any, codec: Any, comm: Any, stage_size: int, in_place: bool
) -> Any:
    """One geocomm collective through the public API (adapters included), as the
    first call with its codec and key: stochastic rounding numbers the calls with
    a codec and key in the process; :func:`geocomm.engine.call.reset_call_counts` gives
    the MPI call and the NCCL call of one process the same number)."""
    import geocomm
    from geocomm.engine import call as calls

    calls.reset_call_counts()
    fn = {
        "allreduce": geocomm.allreduce,
        "reduce_scatter": geocomm.reduce_scatter,
        "allgather": geocomm.allgather,
    }[kind]
    kwargs: dict[str, Any] = {"codec": codec, "comm": comm}
    if kind != "allgather":
        kwargs["stage_size"] = stage_size
    if in_place:
        fn(x, out=x, **kwargs)
        return x
    return fn(x, **kwargs)


def collective_cases() -> list[tuple[str, str, str, bool]]:
    """(collective, dtype, codec name, in place)."""
    out = []
    for kind in ("allreduce", "reduce_scatter", "allgather"):
        for dtype in DTYPES:
            for codec in COLLECTIVE_CODECS:
                for in_place in (False, True) if kind == "allreduce" else (False,):
                    out.append((kind, dtype, codec, in_place))
    return out


def lockstep(
    cp: Any, codec: Any, xs: list[np.ndarray], stage_size: int, gather: bool
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(batched on the device, host-driven on the CPU) results of every rank of one call
    on len(xs) ranks of this process (geocomm.testing.loopback): the batched kernels
    with N - 1 incoming pieces and multi-piece tables, which one NCCL rank never has."""
    from geocomm.engine import device as gpu_pipeline
    from geocomm.engine import device_tables
    from geocomm.engine.host import Pipeline
    from geocomm.engine.layout import Pieces
    from geocomm.testing import loopback, run_lockstep

    size, count = len(xs), xs[0].size
    pieces = Pieces.cut(count, size, stage_size)
    fmt = device_tables.wire_format(codec)
    results = []
    for xp in (cp, np):
        pipes, outs = [], []
        for r, comm in enumerate(loopback(size, "nccl", device_arrays=True)):
            lo, hi = int(pieces.bounds[r]), int(pieces.bounds[r + 1])
            out = xp.full(count if gather else hi - lo, np.nan, dtype=np.float32)
            args = (pieces, xp.asarray(xs[r]), out, 0 if gather else lo, gather)
            pipes.append(
                gpu_pipeline.BatchedPipeline(comm, fmt, *args, rounding_stream=17)
                if xp is cp
                else Pipeline(comm, codec, *args, rounding_stream=17)
            )
            outs.append(out)
        run_lockstep(pipes)
        results.append([cp.asnumpy(o) if xp is cp else o for o in outs])
    return list(zip(*results, strict=True))


def check_lockstep(ctx: Any, n: int | None = None, size: int = 3) -> list[dict[str, Any]]:
    """Rows of the batched pipeline on ``size`` loopback ranks == the host-driven one."""
    import geocomm

    n = ctx.sizes.lockstep_n if n is None else n
    rows = []
    for codec_name, config in COLLECTIVE_CODECS.items():
        if "feedback" in codec_name:
            continue  # a map: covered through the public collectives
        codec = geocomm.get_codec(config)
        xs = [gradient(np.random.default_rng([ctx.args.seed, r, 3]), (n,)) for r in range(size)]
        for gather in (True, False):
            row: dict[str, Any] = {
                "collective": f"{'allreduce' if gather else 'reduce_scatter'} x{size} loopback",
                "dtype": "float32",
                "codec": codec_name,
                "in_place": False,
            }
            try:
                for r, (got, want) in enumerate(lockstep(ctx.cp, codec, xs, 4096 * size, gather)):
                    row[f"rank{r}"] = value_diff(got, want)
                row["ok"] = all_equal(row)
            except Exception:
                row.update(ok=False, error=traceback.format_exc())
            rows.append(row)
    return rows


def collective_row(
    ctx: Any,
    kind: str,
    dtype: str,
    codec_name: str,
    in_place: bool,
    values: np.ndarray,
    stage_size: int,
) -> dict[str, Any]:
    """One case on every rank: this rank's NCCL result == its MPI result, and (all-reduce,
    all-gather) every rank holds the same bits. Every rank makes the same calls, the
    checksum all-gather included, even when a case raised here."""
    from geocomm import get_codec

    cp, nccl, mpi = ctx.cp, ctx.nccl(), ctx.mpi()
    row: dict[str, Any] = {
        "collective": kind,
        "dtype": dtype,
        "codec": codec_name,
        "in_place": in_place,
    }
    codec = COLLECTIVE_CODECS[codec_name]
    got = None
    try:
        host = _host_input(dtype, values)
        # a fresh codec each: error feedback's residuals start alike
        want = run_collective(kind, host.copy(), get_codec(codec), mpi, stage_size, in_place)
        got = _to_host(
            cp,
            run_collective(
                kind, _to_device(cp, host), get_codec(codec), nccl, stage_size, in_place
            ),
            dtype,
        )
        row["vs_numpy_mpi"] = value_diff(got, want)
    except Exception:
        row["error"] = traceback.format_exc()
    if ctx.size > 1 and kind != "reduce_scatter":  # a shard each: nothing to agree on
        sums = ctx.world.allgather(digest(got))
        row["ranks_agree"] = {
            "equal": None not in sums and len(set(sums)) == 1,
            **({} if len(set(sums)) == 1 else {"digests": sums}),
        }
    row["ok"] = "error" not in row and all_equal(row)
    return row


def check_collectives(
    ctx: Any, n: int | None = None, stage_size: int | None = None
) -> dict[str, Any]:
    """The public collectives on CuPy over NCCL == on NumPy over MPI on every rank (many
    stages), then the batched pipeline on three loopback ranks (check_lockstep, on
    rank 0 only)."""
    n = ctx.sizes.collective_n if n is None else n
    stage_size = ctx.sizes.stage_size if stage_size is None else stage_size
    nccl = ctx.nccl()
    rng = np.random.default_rng([ctx.args.seed, nccl.rank])
    values = gradient(rng, (n,))
    values[::97] *= 1e4  # a spread of block scales
    rows = [
        collective_row(ctx, kind, dtype, codec_name, in_place, values, stage_size)
        for kind, dtype, codec_name, in_place in collective_cases()
    ]
    rows += ctx.on_root(lambda: check_lockstep(ctx)) or []
    return {
        "ok": all(r["ok"] for r in rows),
        "n": n,
        "stage_size": stage_size,
        "rows": rows,
        "ranks": ctx.size,
        "failures": [
            f"{r['collective']} {r['dtype']} {r['codec']} "
            f"{'in place ' if r['in_place'] else ''}"
            f"{r.get('error') or {k: v for k, v in r.items() if isinstance(v, dict)}}"
            for r in rows
            if not r["ok"]
        ],
    }
