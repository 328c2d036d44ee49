"""The process-group face: init_process_group("epcomm") and its collectives on CPU tensors (host engine for the
all-to-alls and barrier, gloo for the rest), at 2 and 4 ranks."""
import datetime

import pytest
import torch
import torch.distributed as dist

import ranks


def _init(rank, world, init_method, backend="epcomm"):
    import epcomm  # noqa: F401 - registers the backend

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _expected_a2a(world, rank, splits_of, rows_of_value):
    """What rank receives when every rank r sends splits_of(r)[p] rows valued rows_of_value(r, p) to p."""
    parts = [torch.full((splits_of(r)[rank], 3), rows_of_value(r, rank), dtype=torch.float32) for r in range(world)]
    return torch.cat(parts)


def collectives(rank, world, init_method):
    _init(rank, world, init_method)
    assert dist.get_backend() == "epcomm"

    # all_to_all_single, equal splits, several dtypes (bf16 and one the C API has no code for: float64)
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        inp = (torch.arange(world * 4, dtype=torch.float32).view(world * 2, 2) + 100 * rank).to(dtype)
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp)
        expect = torch.cat([(torch.arange(world * 4, dtype=torch.float32).view(world * 2, 2) + 100 * r)[2 * rank:2 * rank + 2]
                            for r in range(world)]).to(dtype)
        assert torch.equal(out, expect), (dtype, out, expect)

    # with split sizes, including zero-size splits and an empty input on the last rank
    def splits_of(r):
        return [0 if r == world - 1 else (r + p) % 3 for p in range(world)]
    send = splits_of(rank)
    recv = [splits_of(r)[rank] for r in range(world)]
    inp = torch.cat([torch.full((send[p], 3), float(10 * rank + p)) for p in range(world)])
    out = torch.empty((sum(recv), 3))
    dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
    assert torch.equal(out, _expected_a2a(world, rank, splits_of, lambda r, p: float(10 * r + p)))

    # nothing at all to exchange (empty tensors have NULL data pointers)
    empty = torch.empty((0, 3))
    dist.all_to_all_single(empty, torch.empty((0, 3)), [0] * world, [0] * world)

    # async_op=True: a Work whose wait() and future give the result
    inp = torch.full((world, 5), float(rank))
    out = torch.empty_like(inp)
    work = dist.all_to_all_single(out, inp, async_op=True)
    work.wait()
    assert work.is_completed() and work.is_success()
    assert torch.equal(work.get_future().wait()[0], torch.arange(world, dtype=torch.float32).repeat_interleave(5).view(world, 5))

    # all_to_all (lists of different sizes)
    ins = [torch.full((p + 1,), float(rank * 10 + p)) for p in range(world)]
    outs = [torch.empty(rank + 1) for _ in range(world)]
    dist.all_to_all(outs, ins)
    for r in range(world):
        assert torch.equal(outs[r], torch.full((rank + 1,), float(r * 10 + rank)))

    # delegated collectives
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2
    gathered = torch.empty(world * 2)
    dist.all_gather_into_tensor(gathered, torch.tensor([float(rank), float(rank)]))
    assert torch.equal(gathered, torch.arange(world, dtype=torch.float32).repeat_interleave(2))
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(world * 2, dtype=torch.float32))
    assert torch.equal(rs, torch.arange(world * 2, dtype=torch.float32)[2 * rank:2 * rank + 2] * world)
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=world - 1)
    assert b.item() == world - 1
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)]
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=world - 1)
    elif rank == world - 1:
        got = torch.empty(1)
        dist.recv(got, src=0)
        assert got.item() == 42.0
    dist.barrier()

    # a subgroup of the even ranks
    members = list(range(0, world, 2))
    sub = dist.new_group(members, backend="epcomm")
    if rank in members:
        inp = torch.full((len(members),), float(rank))
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=sub)
        assert torch.equal(out, torch.tensor([float(m) for m in members]))
        dist.barrier(group=sub)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world):
    ranks.run(world, collectives)


def device_split(rank, world, init_method):
    _init(rank, world, init_method, backend="cpu:gloo,cuda:epcomm")
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.full((world,), float(rank)))
    assert torch.equal(out, torch.arange(world, dtype=torch.float32))
    dist.destroy_process_group()


def test_device_backend_string():
    ranks.run(2, device_split)


def functional(rank, world, init_method):
    import torch.distributed._functional_collectives as funcol

    import epcomm

    _init(rank, world, init_method)
    group = dist.group.WORLD
    x = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    expect = torch.cat([torch.arange(world * 2, dtype=torch.float32)[2 * rank:2 * rank + 2] + 100 * r for r in range(world)])
    assert torch.equal(funcol.all_to_all_single(x, None, None, group).wait(), expect) if hasattr(
        funcol.all_to_all_single(x, None, None, group), "wait") else torch.equal(
        funcol.all_to_all_single(x, None, None, group), expect)

    def step(x):
        y = funcol.all_to_all_single(x * 2, None, None, group)
        return y + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), expect * 2 + 1)

    # epcomm.all_to_all_v: device counts, fixed capacity; eager and compiled
    send_counts = torch.tensor([(rank + p) % 3 for p in range(world)], dtype=torch.int64)
    rows = int(send_counts.sum())
    inp = torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 1000 * rank
    capacity = 3 * world
    out = torch.zeros((capacity, 4))
    recv_counts = torch.empty(world, dtype=torch.int64)
    epcomm.all_to_all_v(out, inp, send_counts, recv_counts)
    expect_counts = torch.tensor([(r + rank) % 3 for r in range(world)], dtype=torch.int64)
    assert torch.equal(recv_counts, expect_counts), (recv_counts, expect_counts)
    parts = []
    for r in range(world):
        sc = [(r + p) % 3 for p in range(world)]
        src = torch.arange(sum(sc) * 4, dtype=torch.float32).view(sum(sc), 4) + 1000 * r
        parts.append(src[sum(sc[:rank]):sum(sc[:rank]) + sc[rank]])
    expect = torch.cat(parts)
    assert torch.equal(out[:expect.size(0)], expect)

    out.zero_()
    work = epcomm.all_to_all_v(out, inp, send_counts, recv_counts, async_op=True)
    work.wait()
    assert torch.equal(recv_counts, expect_counts) and torch.equal(out[:expect.size(0)], expect)

    def v_step(inp, send_counts):
        out = torch.zeros((capacity, 4))
        rc = torch.empty(world, dtype=torch.int64)
        epcomm.all_to_all_v(out, inp, send_counts, rc, group=group)
        return out, rc

    c_out, c_rc = torch.compile(v_step, backend="aot_eager", fullgraph=True)(inp, send_counts)
    assert torch.equal(c_rc, expect_counts) and torch.equal(c_out[:expect.size(0)], expect)
    dist.destroy_process_group()


def test_functional_and_compile():
    ranks.run(2, functional)


def without_import(rank, world, init_method):
    import sys

    # torch's plugin entry point registered "epcomm" at `import torch`; epcomm itself loads with the group
    assert "epcomm" not in sys.modules
    dist.init_process_group("epcomm", init_method=init_method, rank=rank, world_size=world)
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.full((world,), float(rank)))
    assert torch.equal(out, torch.arange(world, dtype=torch.float32))
    dist.destroy_process_group()


def test_entry_point_registers_without_import():
    ranks.run(2, without_import)
