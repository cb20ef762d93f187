"""A small MPI job for tests/comm/test_faults.py: rank 1 misbehaves in one of several ways.

    python -m geocomm.launch -n 2 -- python tests/jobs/fault_job.py SCENARIO [TAG]
    mpiexec -n 3 python tests/jobs/fault_job.py SCENARIO [TAG]

TAG is ignored: it makes the command line unique, so a test can look for
processes of its own job only.
"""

import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import geocomm

scenario = sys.argv[1]
comm = geocomm.init()
# the ranks start together: the tests' short GEOCOMM_TIMEOUT bounds the healthy first
# call too, and one rank's start-up on a loaded machine may take longer than that
MPI.COMM_WORLD.Barrier()
x = np.ones(1 << 16, np.float32)
geocomm.allreduce(x, codec="fp8")  # everyone healthy first
print(f"rank {comm.rank}: first all-reduce done", flush=True)
if comm.rank == 1:
    if scenario == "raise":
        raise RuntimeError("injected failure on rank 1")
    if scenario == "exit":
        os._exit(3)
    if scenario == "absent":
        time.sleep(3600)  # never arrives at the next collective
    if scenario == "mismatch":
        x = np.ones(1 << 15, np.float32)
    if scenario == "refuse-late":
        x = x.astype(np.float64)  # refused on its own: fp8 takes no float64
    if scenario == "thread":
        # a worker thread dies; the main thread never reaches the next collective
        def work():
            raise RuntimeError("injected failure in a worker thread of rank 1")

        worker = threading.Thread(target=work, name="worker")
        worker.start()
        worker.join()
        time.sleep(3600)
if scenario == "refuse-late" and comm.rank == 0:
    time.sleep(3600)  # never arrives at the check rank 1's refusal takes part in
geocomm.allreduce(x, codec="fp8")
print(f"rank {comm.rank}: second all-reduce done", flush=True)
