"""Creating an epcomm communicator (epcomm._capi.Comm) over an existing torch process group or an mpi4py
communicator: the C API's all-gather callback runs torch.distributed.all_gather_object (or mpi4py's
allgather), so no extra rendezvous or port is needed."""
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import _capi


def group_allgather(group: Optional[dist.ProcessGroup]) -> Callable[[bytes], bytes]:
    def allgather(mine: bytes) -> bytes:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
        return b"".join(parts)
    return allgather


def mpi_allgather(comm) -> Callable[[bytes], bytes]:
    return lambda mine: b"".join(comm.allgather(mine))


def create(nranks: int, rank: int, allgather: Callable[[bytes], bytes], engine: int = _capi.ENGINE_AUTO,
           **config) -> _capi.Comm:
    """A communicator of nranks over allgather. engine AUTO honours EPCOMM_ENGINE, else takes the GPU engine
    when the library has one and a CUDA device is visible; config holds epConfig_t fields by name."""
    cuda_device = torch.cuda.current_device() if engine != _capi.ENGINE_HOST and torch.cuda.is_available() else -1
    return _capi.Comm(nranks, rank, allgather, engine=engine, cuda_device=cuda_device, **config)


def engine_device(comm: _capi.Comm) -> torch.device:
    """The device whose tensors comm takes: CPU for the host engine, the current CUDA device for the GPU one."""
    if comm.engine == _capi.ENGINE_GPU:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
