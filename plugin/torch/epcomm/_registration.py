"""Registers the torch.distributed backend "epcomm" for cpu and cuda.

torch calls the creator with the group's Store (already prefixed per group and device), the rank and size in
the group and the timeout. The creator builds the inner backends on the same Store under their own prefixes
(gloo for CPU tensors, NCCL for CUDA tensors when CUDA and NCCL are there) and hands them to the C++ backend,
which runs all_to_all_single, all_to_all and barrier on epcomm and passes everything else to them.
"""
import datetime

import torch
import torch.distributed as dist

NAME = "epcomm"


def _create_backend(store, rank, size, timeout):
    from . import _backend  # built against the torch it runs with; absent when torch was missing at build time

    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    cpu_inner = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    cuda_inner = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        cuda_inner = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, timeout)
    return _backend.EpcommBackend(dist.PrefixStore("epcomm/", store), rank, size, cpu_inner, cuda_inner)


def is_registered():
    return hasattr(dist.Backend, NAME.upper())


def register():
    """Makes "epcomm" a torch.distributed backend for cpu and cuda; does nothing when it already is."""
    if not dist.is_available() or is_registered():
        return
    # devices as a list: a bare string was iterated by character in some torch releases.
    dist.Backend.register_backend(NAME, _create_backend, extended_api=False, devices=["cpu", "cuda"])
