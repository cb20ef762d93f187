"""Coverage-guided fuzzing of frame decoding (atheris / libFuzzer).

    python tests/jobs/fuzz_frames.py -max_total_time=20        # CI's bounded run
    python tests/jobs/fuzz_frames.py -max_total_time=3600      # the long version

Every input is offered to geocomm.decode; the only acceptable outcomes are a
decoded array or ValueError. Seeds are valid frames of every codec, so the
fuzzer starts from deep inside the format. Any other exception (or a crash in
the native decoder, which the sanitized build turns into a report) is a bug.
"""

import sys

import atheris

with atheris.instrument_imports():
    import zlib

    import numpy as np

    import geocomm
    from geocomm.codecs import frames


def seeds() -> list[bytes]:
    x = np.linspace(-3, 3, 300, dtype=np.float32).reshape(12, 25)
    codecs = [
        "none",
        "bf16",
        "fp8",
        {"id": "fp8", "fmt": "e5m2", "block": 0},
        "nvfp4",
        "geofp8",
        "hadamard",
    ]
    return [geocomm.get_codec(c).encode(x).tobytes() for c in codecs]


def test_one_input(data: bytes) -> None:
    try:
        geocomm.decode(data)
    except ValueError:
        pass


def main() -> None:
    corpus = seeds()

    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        # half the time start from a valid frame, so CRC-guarded fields are
        # reached; re-sealing the CRC lets mutations past the header through
        rng = np.random.default_rng(seed)
        frame = bytearray(corpus[seed % len(corpus)] if seed % 2 else data)
        mutated = bytearray(atheris.Mutate(bytes(frame), max_size))
        if rng.random() < 0.5 and len(mutated) > frames.CRC.size:
            body = bytes(mutated[: -frames.CRC.size])
            mutated[-frames.CRC.size :] = frames.CRC.pack(zlib.crc32(body))
        return bytes(mutated)

    atheris.Setup(sys.argv, test_one_input, custom_mutator=mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
