"""``init_distributed_from_mpi``: the process group of a job that an MPI launcher
started, met on a store that rank 0 opened itself (no port picked beforehand that
another process could take), and a clear error on every rank when it cannot."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

# Each rank prints its group's rank and size and the address the store has, or the
# error it raised; rank 0 first listens on a port itself when asked to pass it on.
_JOB = textwrap.dedent(
    """
    import os, socket, sys
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from geocomm.adapters.torch import init_distributed_from_mpi

    world = MPI.COMM_WORLD
    taken = socket.socket() if world.rank == 0 else None
    if taken is not None:
        taken.bind(("", 0))
        taken.listen()
    port = world.bcast(taken.getsockname()[1] if taken else None, root=0)
    try:
        init_distributed_from_mpi("gloo", port=port if sys.argv[1] == "taken" else None)
    except RuntimeError as error:
        print(f"rank {world.rank} refused: {error}", flush=True)
    else:
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item()} "
              f"port {os.environ['MASTER_PORT']} {port}", flush=True)
        dist.destroy_process_group()
    """
)


def _job(tmp_path, case: str) -> list[str]:
    """Each line the 2-rank job printed, sorted; run outside the MPI job the test may
    run inside, with no rendezvous variables."""
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    drop = ("OMPI_", "PMIX_", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    argv = [sys.executable, "-m", "geocomm.launch", "-n", "2", "--timeout", "120", "--"]
    done = subprocess.run(
        [*argv, sys.executable, "-P", str(script), case],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))


def test_the_ranks_meet_on_the_port_rank_0_opened(tmp_path):
    lines = _job(tmp_path, "free")
    assert [line.split(" port ")[0] for line in lines] == [
        "rank 0 of 2 sum 3.0",
        "rank 1 of 2 sum 3.0",
    ], lines
    ports = {tuple(line.split(" port ")[1].split()) for line in lines}
    assert len(ports) == 1, lines  # both ranks name one store ...
    (store, held) = ports.pop()
    assert store != held, lines  # ... which is not the port rank 0 still holds


def test_every_rank_raises_when_rank_0_cannot_open_the_store(tmp_path):
    lines = _job(tmp_path, "taken")
    assert [line.split(":")[0] for line in lines] == ["rank 0 refused", "rank 1 refused"], lines
    assert all("could not open the store on port" in line for line in lines), lines
