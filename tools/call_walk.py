"""Walk one array through geocomm.allreduce: which geocomm functions a steady call
passes, file by file, as a reader following the code would.

A stop is a call into a geocomm function whose file differs from its caller's,
counted once per (file, function) (the pipeline's stages repeat the same stops);
a return is a stop in a file the walk had left before. Prints the counts and the
stops in order.

    python -m geocomm.launch -n 1 -- python -P tools/call_walk.py host fp8
    TWIN=tests/twin python -m geocomm.launch -n 1 -- python -P tools/call_walk.py twin fp8

``twin``: CuPy arrays over NCCLCommunicator, on the CPU twin of CuPy (the path
named by TWIN).
"""

import os
import sys

import numpy as np


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "host"
    codec = sys.argv[2] if len(sys.argv) > 2 else "fp8"
    if mode == "twin":
        sys.path.insert(0, os.environ["TWIN"])
    import geocomm

    pkg = os.path.dirname(geocomm.__file__)
    if mode == "twin":
        import cupy

        from geocomm.comm.nccl import NCCLCommunicator

        comm = NCCLCommunicator()
        x = cupy.asarray(np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32))
    else:
        comm = geocomm.init()
        x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)
    geocomm.allreduce(x, codec=codec, comm=comm)  # warm: the first call of the signature
    seen, stops = set(), []

    def prof(frame, event, arg):
        if event != "call":
            return
        f = frame.f_code.co_filename
        if not f.startswith(pkg):
            return
        back = frame.f_back
        caller = back.f_code.co_filename if back else ""
        rel = os.path.relpath(f, pkg)
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        if f == caller or (rel, name) in seen:
            return
        seen.add((rel, name))
        stops.append((rel, name))

    sys.setprofile(prof)
    geocomm.allreduce(x, codec=codec, comm=comm)
    sys.setprofile(None)
    files, left, back_count, prev = set(), set(), 0, None
    for rel, _ in stops:
        if prev is not None and rel != prev:
            left.add(prev)
        if rel in left:
            back_count += 1
        files.add(rel)
        prev = rel
    names = len({n for _, n in stops})
    print(
        f"{mode} {codec}: {len(stops)} stops in {len(files)} files, "
        f"{back_count} back in a file already left, {names} names"
    )
    for rel, name in stops:
        print(f"  {rel}: {name}")


if __name__ == "__main__":
    main()
