"""Bad input and dead peers: every rank raises a Python exception that carries epcomm's message, the process
group stays usable after bad input, and a killed rank makes the others raise within the deadline."""
import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import ranks


def _init(rank, world, init_method, backend="epcomm"):
    import epcomm  # noqa: F401

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def bad_input(rank, world, init_method):
    import epcomm

    _init(rank, world, init_method)
    # split sizes on which rank 0 and the last rank disagree: the counts are compared before any data moves; the
    # two ranks of the pair get invalid usage, the others a remote error naming the pair (epcomm.h)
    send = [2] * world
    recv = [2] * world
    if rank == 0:
        recv[world - 1] = 3
    out = torch.empty(sum(recv))
    if rank in (0, world - 1):
        with pytest.raises(RuntimeError, match="epcomm all_to_all_single failed: invalid usage: alltoallv: "
                                               ".*(recv_counts|expects)"):
            dist.all_to_all_single(out, torch.zeros(sum(send)), recv, send)
    else:
        with pytest.raises(RuntimeError, match="epcomm all_to_all_single failed: remote error: alltoallv: "
                                               f"rank {world - 1} sends 2 elements to rank 0"):
            dist.all_to_all_single(out, torch.zeros(sum(send)), recv, send)
    # a local argument error, caught before anything moves
    with pytest.raises(RuntimeError, match="rows do not split evenly"):
        dist.all_to_all_single(torch.empty(world + 1), torch.empty(world + 1))
    # the group still works
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.full((world,), float(rank)))
    assert torch.equal(out, torch.arange(world, dtype=torch.float32))

    # all_to_all_v past the output's capacity
    cap_out = torch.empty((1, 4))
    with pytest.raises(RuntimeError, match="epcomm all_to_all_v failed: capacity"):
        epcomm.all_to_all_v(cap_out, torch.ones((2 * world, 4)), torch.full((world,), 2, dtype=torch.int64),
                            torch.empty(world, dtype=torch.int64))

    buffer = epcomm.Buffer(dist.group.WORLD)
    topk_idx = torch.tensor([[0, 1], [1, -1]], dtype=torch.int64)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2 * world)
    args = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=torch.ones((2, 2)))
    with pytest.raises(epcomm._capi.Error, match="hidden") as info:
        buffer.dispatch(torch.zeros((2, 12), dtype=torch.bfloat16), **args)
    assert info.value.code == 4
    with pytest.raises(epcomm._capi.Error, match="expert"):
        buffer.get_dispatch_layout(torch.tensor([[0, 2 * world]], dtype=torch.int64), 2 * world)
    with pytest.raises(TypeError, match="float64 is not supported"):
        buffer.dispatch(torch.zeros((2, 16), dtype=torch.float64), **args)
    recv_x, *_ = buffer.dispatch(torch.ones((2, 16), dtype=torch.bfloat16), **args)  # still usable
    assert recv_x.dim() == 2
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_bad_input(world):
    ranks.run(world, bad_input)


def killed_rank(rank, world, init_method):
    _init(rank, world, init_method)
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.full((world,), float(rank)))  # the communicator exists on every rank
    dist.barrier()
    if rank == world - 1:
        os._exit(1)
    start = time.monotonic()
    with pytest.raises(dist.DistBackendError, match="epcomm all_to_all_single failed: (timeout|remote)"):
        dist.all_to_all_single(out, torch.full((world,), float(rank)))
    elapsed = time.monotonic() - start
    assert elapsed < 15, f"the dead peer was noticed after {elapsed:.1f} s"


def test_killed_rank():
    ranks.run(4, killed_rank, env={"EPCOMM_TIMEOUT_MS": "3000"}, expect_exit={3}, timeout=120)


def aborted(rank, world, init_method):
    _init(rank, world, init_method)
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.full((world,), float(rank)))
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert type(backend).__name__ == "EpcommBackend"
    backend.abort()  # local and prompt; later operations on it raise
    with pytest.raises(RuntimeError, match="shut down or aborted"):
        dist.all_to_all_single(out, torch.full((world,), float(rank)))


def test_abort():
    ranks.run(2, aborted)
