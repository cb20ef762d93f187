"""Ranks started with torchrun's environment, without torchrun's agent (which adds a
second or so to every job), for the tests whose jobs run as torchrun's workers."""

from __future__ import annotations

import os
import socket
import subprocess


def two_torchrun_ranks(argv: list[str], env: dict[str, str], timeout: float) -> list[str]:
    """Run ``argv`` as ranks 0 and 1 of one job, with torchrun's variables (a free port
    of this machine's loopback) and ``env`` added to this environment; each rank's
    output (stdout and stderr). Every rank must exit with status 0; all are killed
    when one outlives ``timeout`` seconds.

    The port stays bound here (with SO_REUSEADDR, not listening) until the ranks
    exit: rank 0's store binds it too, as torch's store sets that option, while no
    other process's bind or connection can take it meanwhile."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        port = str(held.getsockname()[1])
        procs = []
        for rank in range(2):
            torchrun = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "TORCHELASTIC_RUN_ID": "geocomm-test",
                "OMP_NUM_THREADS": "1",
            }
            procs.append(
                subprocess.Popen(
                    argv,
                    env={**os.environ, **torchrun, **env},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        try:
            outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()  # a no-op for those that exited
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-4000:]
    return outputs
