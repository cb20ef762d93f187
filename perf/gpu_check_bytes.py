"""perf/gpu_check.py's single-process sections: ``bytes`` (the codec kernels and the
batched pipeline kernels == the C core, byte for byte) and ``errors`` (geocomm.kernels.cuda's
argument checks raise like the C core's)."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
from gpu_check_common import (
    F32,
    REFERENCE_MAX_N,
    after_current,
    all_equal,
    byte_diff,
    cases,
    configs,
    value_diff,
    wide,
)


def check_case(
    cp: Any, fmt: str, block: int, name: str, x: np.ndarray, base: np.ndarray, variant: str = ""
) -> dict[str, Any]:
    """One format/block/input: GPU vs C core (vs reference for small inputs)."""
    from geocomm.codecs import reference as ref
    from geocomm.kernels import cuda, native

    code = native.FORMATS[fmt]
    n = x.size
    size = native.wire_size(code, n, block)
    use_ref = n <= REFERENCE_MAX_N
    row: dict[str, Any] = {
        "fmt": fmt,
        "block": block,
        "case": name + variant,
        "n": n,
        "wire_size": {"equal": cuda.wire_size(fmt, n, block) == size},
    }
    cpu_wire = np.zeros(size, np.uint8)
    native.encode(code, x, block, cpu_wire)
    stream = cp.cuda.Stream(non_blocking=True) if variant == " stream" else None
    offset = 1 if variant == " offset" else 0
    x_dev = cp.asarray(x)
    store = cp.full(size + offset, 0xA5, dtype=cp.uint8)  # poison: unwritten bytes show
    after_current(cp, stream)
    cuda.encode(fmt, x_dev, block, store[offset:], stream=stream)
    if stream is not None:
        stream.synchronize()
    gpu_wire = cp.asnumpy(store[offset:])
    row["encode_vs_native"] = byte_diff(gpu_wire, cpu_wire)
    if use_ref:
        with np.errstate(all="ignore"):  # the reference casts NaN/inf on purpose
            row["encode_vs_reference"] = byte_diff(gpu_wire, ref.encode(fmt, x, block))

    wire_dev = cp.full(size + offset, 0xA5, dtype=cp.uint8)
    wire_dev[offset:] = cp.asarray(cpu_wire)
    for acc in (False, True):
        want = base.copy() if acc else np.zeros(n, F32)
        native.decode(code, cpu_wire, block, want, accumulate=acc)
        out_dev = cp.asarray(base) if acc else cp.full(n, np.nan, dtype=cp.float32)
        after_current(cp, stream)
        cuda.decode(fmt, wire_dev[offset:], block, out_dev, accumulate=acc, stream=stream)
        if stream is not None:
            stream.synchronize()
        got = cp.asnumpy(out_dev)
        key = "accumulate" if acc else "decode"
        row[f"{key}_vs_native"] = value_diff(got, want)
        if use_ref:
            with np.errstate(all="ignore"):
                ref_vals = ref.decode(fmt, cpu_wire, n, block)
                row[f"{key}_vs_reference"] = value_diff(got, (base + ref_vals) if acc else ref_vals)
    row["ok"] = all_equal(row)
    return row


#: Codecs the batched kernels (native/gc_pipeline.cu) are checked with: every format,
#: both sides of every walk switch (fp8 teams up to 1024 values, tiles above and for
#: block 0), both scale rules; each also with stochastic rounding (bar "none").
BATCHED_CODECS: dict[str, Any] = {
    "none": "none",
    "bf16": "bf16",
    "nvfp4": "nvfp4",
    **{
        f"fp8-{f}-{b}": {"id": "fp8", "fmt": f, "block": b}
        for f in ("e4m3", "e5m2")
        for b in (0, 1, 16, 33, 128, 1000, 1024, 1025, 4096, 5000)
    },
    "mxfp8-e4m3": {"id": "mxfp8", "fmt": "e4m3"},
    "mxfp8-e5m2-rceil": {"id": "mxfp8", "fmt": "e5m2", "scale_rule": "rceil"},
    "mxfp4": "mxfp4",
    "mxfp4-rceil": {"id": "mxfp4", "scale_rule": "rceil"},
}
STOCHASTIC = {"rounding": "stochastic", "seed": 11}
#: Pieces of one batched launch: odd sizes, an empty piece, a superblock and more.
BATCHED_COUNTS = (5000, 0, 4097, 1, 12_299, 3 * 4096 + 5, 33)


def batched_configs() -> list[tuple[str, Any]]:
    """(name, codec config) of every batched check, nearest and stochastic."""
    out = []
    for name, config in BATCHED_CODECS.items():
        config = {"id": config} if isinstance(config, str) else config
        out.append((name, config))
        if name != "none":
            out.append((name + " stochastic", {**config, **STOCHASTIC}))
    return out


def batched_pieces(fmt: Any, counts: tuple[int, ...]) -> tuple[list[Any], int, int]:
    """Pieces at odd value and byte offsets with a large rounding index; (pieces,
    values needed, wire bytes needed)."""
    from geocomm.engine.device_tables import Piece

    pieces, at, byte = [], 3, 1
    for n in counts:
        pieces.append(Piece(at, n, byte, 10**12 + 7 * at))
        at, byte = at + n + 7, byte + fmt.wire_size(n)
    return pieces, at, byte


def check_batched(
    cp: Any, name: str, config: Any, x: np.ndarray, others: list[np.ndarray]
) -> dict[str, Any]:
    """The batched kernels (CudaKernels) == their contract run by the C core
    (HostKernels), bit for bit: a multi-piece encode (bytes), a multi-piece decode,
    the owner's encode of its piece plus the bodies of ``others`` (the fused sum;
    compared decoded) and the same sum as fp32 (NaN payloads exempt throughout)."""
    import geocomm
    from geocomm.engine import device as gp
    from geocomm.engine import device_tables as gpl

    fmt = gpl.wire_format(geocomm.get_codec(config))
    host, device = gp.HostKernels(), gp.CudaKernels()
    pieces, nvalues, nbytes = batched_pieces(fmt, BATCHED_COUNTS)
    rows, amax = gpl.segment_rows(fmt, pieces)
    on_host, on_device = gp.Segments(rows, rows), gp.Segments(rows, cp.asarray(rows))
    values = np.resize(x, nvalues)
    row: dict[str, Any] = {"codec": name, "pieces": len(pieces)}

    def both(run_host: Callable, run_device: Callable, empty: Callable) -> tuple:
        want, got = empty(np), empty(cp)
        run_host(want)
        run_device(got)
        return cp.asnumpy(got), want

    def wire(xp: Any) -> Any:
        return xp.full(nbytes, 0xA5, dtype=np.uint8)  # poison: unwritten bytes show

    scratch = cp.zeros(max(amax, 1), cp.uint32)
    got, want = both(
        lambda w: host.encode(fmt, values, on_host, w, None, rounding_stream=5),
        lambda w: device.encode(fmt, cp.asarray(values), on_device, w, scratch, rounding_stream=5),
        wire,
    )
    row["encode"] = byte_diff(got, want)
    encoded = want
    got, want = both(
        lambda o: host.decode(fmt, encoded, on_host, o),
        lambda o: device.decode(fmt, cp.asarray(encoded), on_device, o),
        lambda xp: xp.full(nvalues, np.nan, dtype=np.float32),
    )
    row["decode"] = value_diff(got, want)

    # the owner: its piece plus the others' bodies of the same piece, in order
    n = 3 * 4096 + 5
    own_rows, own_amax = gpl.segment_rows(fmt, [gpl.Piece(0, n, 0, 12_345)])
    own_host, own_device = (
        gp.Segments(own_rows, own_rows),
        gp.Segments(own_rows, cp.asarray(own_rows)),
    )
    stride = fmt.wire_size(n)
    bodies = np.zeros(len(others) * stride, np.uint8)
    for r, other in enumerate(others):
        host.encode(
            fmt, np.resize(other, n), own_host, bodies[r * stride :], None, rounding_stream=r
        )
    incoming_host = gp.Incoming(bodies, len(others), stride)
    incoming_device = gp.Incoming(cp.asarray(bodies), len(others), stride)
    own = np.resize(x[::-1], n)
    scratch = cp.zeros(max(own_amax, 1), cp.uint32)
    got, want = both(
        lambda w: host.encode(fmt, own, own_host, w, None, incoming_host, rounding_stream=9),
        lambda w: device.encode(
            fmt, cp.asarray(own), own_device, w, scratch, incoming_device, rounding_stream=9
        ),
        lambda xp: xp.full(stride, 0xA5, dtype=np.uint8),
    )
    # compared decoded: a sum that is NaN is the canonical NaN on the GPU and keeps an
    # operand's sign on the CPU, which an fp8 code keeps (only NaN positions must agree)
    decoded = [np.empty(n, np.float32) for _ in range(2)]
    for body, out in zip((got, want), decoded, strict=True):
        host.decode(fmt, body, own_host, out)
    row["sum_encode"] = value_diff(*decoded)
    got, want = both(
        lambda o: host.reduce(fmt, own, own_host, incoming_host, o),
        lambda o: device.reduce(fmt, cp.asarray(own), own_device, incoming_device, o),
        lambda xp: xp.full(n, np.nan, dtype=np.float32),
    )
    row["sum"] = value_diff(got, want)
    row["ok"] = all_equal(row)
    return row


def check_bytes(
    ctx: Any, config_list: list | None = None, inputs: list | None = None
) -> dict[str, Any]:
    """Every format/block on every input (and the odd-offset and explicit-stream
    variants), then every batched config; single-process: rank 0 only."""
    if not ctx.is_root:
        return ctx.root_only()
    rows = []
    if inputs is None:
        inputs = cases(np.random.default_rng(ctx.args.seed), ctx.sizes)
    by_name = dict(inputs)
    # what decode+accumulate adds onto, one per input
    bases = {name: wide(np.random.default_rng(x.size), x.size, -10, 10) for name, x in inputs}
    variants = [(name, x, "") for name, x in inputs]
    variants += [
        (name, by_name[name], v)
        for name, v in (("wide", " offset"), ("edges", " stream"))
        if name in by_name
    ]
    for fmt, block in configs() if config_list is None else config_list:
        for name, x, variant in variants:
            try:
                row = check_case(ctx.cp, fmt, block, name, x, bases[name], variant)
            except Exception:
                row = {
                    "fmt": fmt,
                    "block": block,
                    "case": name + variant,
                    "n": x.size,
                    "ok": False,
                    "error": traceback.format_exc(),
                }
            rows.append(row)
    batched = []
    rng = np.random.default_rng([ctx.args.seed, 14])
    source = by_name.get("edges", wide(rng, 65_537))
    others = [by_name.get("wide", wide(rng, 70_000))[r::3] for r in range(3)]
    for name, config in batched_configs() if config_list is None else []:
        try:
            batched.append(check_batched(ctx.cp, name, config, source, others))
        except Exception:
            batched.append({"codec": name, "ok": False, "error": traceback.format_exc()})
    failing = [r for r in rows if not r["ok"]]
    return {
        "ok": not failing and all(r["ok"] for r in batched),
        "rows": rows,
        "batched": batched,
        "failures": [
            f"{r['fmt']} block={r['block']} {r['case']}: "
            f"{ {k: v for k, v in r.items() if k not in ('fmt', 'block', 'case')} }"
            for r in failing
        ]
        + [
            f"batched {r['codec']}: { {k: v for k, v in r.items() if k != 'codec'} }"
            for r in batched
            if not r["ok"]
        ],
    }


def unknown_format_id() -> int:
    """An id that names no format: one past the largest of the C core's ids."""
    from geocomm.kernels import native

    return max(native.FORMATS.values()) + 1


def check_errors(ctx: Any) -> dict[str, Any]:
    """The argument checks of geocomm.kernels.cuda raise like geocomm.kernels.native (every rank: no
    collective, no kernel runs)."""
    from geocomm.kernels import cuda

    cp = ctx.cp
    x = cp.zeros(100, cp.float32)
    wire = cp.zeros(cuda.wire_size("e4m3", 100, 16), cp.uint8)
    bad = unknown_format_id()
    calls = {
        "float64 x -> TypeError": (
            TypeError,
            lambda: cuda.encode("e4m3", x.astype(cp.float64), 16, wire),
        ),
        "strided x -> TypeError": (TypeError, lambda: cuda.encode("e4m3", x[::2], 16, wire)),
        "numpy x -> TypeError": (TypeError, lambda: cuda.encode("e4m3", cp.asnumpy(x), 16, wire)),
        "int8 wire -> TypeError": (
            TypeError,
            lambda: cuda.encode("e4m3", x, 16, wire.view(cp.int8)),
        ),
        "short wire -> ValueError": (ValueError, lambda: cuda.encode("e4m3", x, 16, wire[:-1])),
        "short wire decode -> ValueError": (
            ValueError,
            lambda: cuda.decode("e4m3", wire[:-1], 16, x),
        ),
        f"unknown format {bad} -> ValueError": (ValueError, lambda: cuda.encode(bad, x, 16, wire)),
        f"unknown format {bad} decode -> ValueError": (
            ValueError,
            lambda: cuda.decode(bad, wire, 16, x),
        ),
        "negative block -> ValueError": (ValueError, lambda: cuda.encode("e4m3", x, -1, wire)),
    }
    rows = []
    for name, (exc, call) in calls.items():
        try:
            call()
            rows.append({"check": name, "ok": False, "why": "no exception"})
        except exc:
            rows.append({"check": name, "ok": True})
        except Exception as other:
            rows.append({"check": name, "ok": False, "why": repr(other)})
    return {
        "ok": all(r["ok"] for r in rows),
        "rows": rows,
        "unknown_format": bad,
        "failures": [f"{r['check']}: {r['why']}" for r in rows if not r["ok"]],
    }
