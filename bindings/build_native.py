"""cffi build description of ``geocomm._native``.

The C header ``native/geocomm.h`` is the binding contract: its declarations,
minus preprocessor lines, are the cdef. meson runs this file through
``cffi-gen-src exec-python`` to emit the extension's C source.
"""

from pathlib import Path

import cffi

HEADER = Path(__file__).resolve().parent.parent / "native" / "geocomm.h"


def _cdef_text(header: str) -> str:
    """Keep declarations and the integer ``#define`` constants cffi understands."""
    kept = []
    for line in header.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            words = stripped.split()
            # "#define GC_E4M3 1": a constant cffi can expose; guards are skipped
            if len(words) == 3 and words[0] == "#define" and words[1].startswith("GC_"):
                kept.append(line)
            continue
        kept.append(line)
    return "\n".join(kept)


ffibuilder = cffi.FFI()
ffibuilder.cdef(_cdef_text(HEADER.read_text()))
ffibuilder.set_source("geocomm._native", '#include "geocomm.h"')
