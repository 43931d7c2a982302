"""The copy-engine transport (dispatch/copy_engine.py) on 2 and 4 GPUs (marker `gpu`, NCCL groups
for the reference): its exchange equals `dist.all_to_all_single` byte for byte over 200 exchanges
of random sizes enqueued back to back on two streams with random per-rank delays (the slots are reused while peers
lag behind, the buffer grows, empty blocks pass), and the all_to_all backend's capacity mode over it
passes every data-movement check of the NCCL transport (test_all_to_all's `_check_dispatch`)."""

import pytest
import torch
import torch.distributed as dist

from test_all_to_all import CASES_2, CASES_4, _check_dispatch, _check_wire_formats, _need_gpus, spawn


def _exchanges(rank, world, dev):
    from moefp8.dispatch.copy_engine import CopyEngineExchange

    ce = CopyEngineExchange()
    ce.reserve(70 * 16 * 64)  # the largest random block: one allocation up to the last exchange
    shapes = torch.Generator().manual_seed(0)  # the same sizes on every rank
    delays = torch.Generator().manual_seed(100 + rank)  # each rank lags at other times
    data = torch.Generator(device=dev).manual_seed(rank)
    side = torch.cuda.Stream()  # as the overlap calls it: on a side stream, nothing synchronized
    sends, outs = [], []
    sizes = [(5, 64), (0, 16), (3, 7296)] + [
        (int(torch.randint(0, 70, (), generator=shapes)), 16 * int(torch.randint(1, 64, (), generator=shapes)))
        for _ in range(196)] + [(40, 16 * 1024)]  # the last one grows the buffer after 199 exchanges
    main = torch.cuda.current_stream()
    for i, (n, nb) in enumerate(sizes):
        st = main if i % 10 == 9 else side  # now and then another stream, unsynchronized (all tensors stay alive)
        with torch.cuda.stream(st):
            send = torch.randint(0, 256, (world * n, nb), dtype=torch.uint8, device=dev, generator=data)
            if torch.rand((), generator=delays) < 0.3:
                torch.cuda._sleep(int(torch.randint(0, 2_000_000, (), generator=delays)))  # ~0-1 ms
            sends.append(send)
            outs.append(ce(send))
    main.wait_stream(side)
    for i, (send, out) in enumerate(zip(sends, outs)):
        want = torch.empty_like(send)
        dist.all_to_all_single(want, send)
        assert torch.equal(out, want), f"exchange {i} of {sizes[i]} differs from all_to_all_single"
    assert ce.calls == 1 and ce.block >= 40 * 16 * 1024  # the last exchange reallocated the buffer


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
