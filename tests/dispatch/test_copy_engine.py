"""The copy-engine transport (dispatch/copy_engine.py) on 2 and 4 GPUs (marker `gpu`, NCCL groups
for the reference): its exchange equals `dist.all_to_all_single` byte for byte over 200 exchanges
of random sizes enqueued back to back on two streams with random per-rank delays, with rings of
2 and 3 send slots (the slots are reused while peers lag behind, the buffer grows, empty blocks
pass; sends staged from plain tensors or made in the send slots, two slots claimed before either
is exchanged), and the all_to_all backend's capacity mode over it passes every data-movement
check of the NCCL transport (test_all_to_all's `_check_dispatch`)."""

import pytest
import torch
import torch.distributed as dist

from test_all_to_all import CASES_2, CASES_4, _check_dispatch, _check_wire_formats, _need_gpus, spawn


def _exchanges(rank, world, dev):
    for slots in (2, 3):  # the default ring and an odd one
        _exchanges_with(rank, world, dev, slots)


def _exchanges_with(rank, world, dev, slots):
    from moefp8.dispatch.copy_engine import CopyEngineExchange

    ce = CopyEngineExchange(slots=slots)
    ce.reserve(70 * 16 * 64)  # the largest random block: one allocation up to the last exchange
    shapes = torch.Generator().manual_seed(0)  # the same sizes and kinds of call on every rank
    delays = torch.Generator().manual_seed(100 + rank)  # each rank lags at other times
    data = torch.Generator(device=dev).manual_seed(rank)
    side = torch.cuda.Stream()  # as the overlap calls it: on a side stream, nothing synchronized
    sends, outs = [], []
    sizes = [(5, 64), (0, 16), (3, 7296)] + [
        (int(torch.randint(0, 70, (), generator=shapes)), 16 * int(torch.randint(1, 64, (), generator=shapes)))
        for _ in range(196)] + [(40, 16 * 1024)]  # the last one grows the buffer after 199 exchanges
    main = torch.cuda.current_stream()

    def make(n, nb):
        send = torch.randint(0, 256, (world * n, nb), dtype=torch.uint8, device=dev, generator=data)
        if torch.rand((), generator=delays) < 0.3:
            torch.cuda._sleep(int(torch.randint(0, 2_000_000, (), generator=delays)))  # ~0-1 ms
        sends.append(send)
        return send

    i = 0
    while i < len(sizes):
        st = main if i % 10 == 9 else side  # now and then another stream, unsynchronized (all tensors stay alive)
        kind = int(torch.randint(0, 3, (), generator=shapes)) if i < len(sizes) - 2 else 0
        with torch.cuda.stream(st):
            if kind == 0:  # a plain tensor: staged into the slot
                outs.append(ce(make(*sizes[i])))
                i += 1
            elif kind == 1:  # made in the send slot (as the dispatch's pack and the combine's input)
                buf = ce.send_buffer(world * sizes[i][0], sizes[i][1], dev)
                outs.append(ce(buf.copy_(make(*sizes[i]))))
                i += 1
            else:  # two slots made before either is exchanged, exchanged in random order
                bufs = [ce.send_buffer(world * n, nb, dev).copy_(make(n, nb)) for n, nb in sizes[i:i + 2]]
                order = [1, 0] if torch.rand((), generator=shapes) < 0.5 else [0, 1]
                got = {j: ce(bufs[j]) for j in order}
                outs += [got[0], got[1]]
                i += 2
    main.wait_stream(side)
    for i, (send, out) in enumerate(zip(sends, outs)):
        want = torch.empty_like(send)
        dist.all_to_all_single(want, send)
        assert torch.equal(out, want), f"exchange {i} of {sizes[i]} differs from all_to_all_single"
    assert ce.block >= 40 * 16 * 1024 and not ce.pending  # the last exchange reallocated the buffer
    # a slot is not handed out again while its last reservation was not exchanged
    bufs = [ce.send_buffer(world, 16, dev) for _ in range(slots)]
    with pytest.raises(RuntimeError, match=f"reuses the slot of send buffer {ce.calls - slots}"):
        ce.send_buffer(world, 16, dev)
    for b in bufs:
        ce(b.fill_(rank))
    torch.cuda.synchronize()


def _dispatch_cases(rank, world, dev):
    for T_r, E, K, case in (CASES_2 if world == 2 else CASES_4):
        _check_dispatch(rank, world, dev, T_r, E, K, case, "capacity", transport="copy_engine")
    _check_wire_formats(rank, world, dev, "capacity", transport="copy_engine")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_exchange_equals_all_to_all(world):
    _need_gpus(world)
    spawn(_exchanges, world, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_copy_engine_dispatch_combine(world):
    _need_gpus(world)
    spawn(_dispatch_cases, world, backend="nccl")


def test_copy_engine_slots_checked():
    from moefp8.dispatch.copy_engine import CopyEngineExchange

    for bad in (1, 0, 2.0, True):
        with pytest.raises(ValueError, match=f"slots={bad!r}, expected an integer >= 2"):
            CopyEngineExchange(slots=bad)
