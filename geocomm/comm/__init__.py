"""Communicators: the protocol and its MPI (and, on GPUs, NCCL) backends."""

from geocomm.comm.base import Communicator, Request
from geocomm.comm.mpi import MPICommunicator

__all__ = ["Communicator", "MPICommunicator", "Request"]
