"""A stand-in for the Python API of `deep_ep` (v1.2.1: Buffer, Config, events) on torch.distributed
(gloo on CPU), so that `moefp8.dispatch.deepep` -- argument plumbing, handle reuse, the fp32
combine path, the bad-id flag riding the per-expert counts, events, SM configs, buffer sizing --
runs in CI. Installed as `sys.modules["deep_ep"]` by test_deepep.py. The semantics mirror
DeepEP's where the wrapper relies on them: received ids local (-1 elsewhere) with those slots'
weights zeroed, rows in (source rank, token) order, the per-local-expert counts summed over the
sources returned as a host list, `allocate_on_comm_stream` only with `previous_event` and
`async_finish`, a handle tied to its SM count. The data moves through the all_to_all backend
(exact mode, fp32 scales); DeepEP's own kernels are tested by the GPU tests with the real module.
DeepEP v1.2.1 semantics checked against its source (csrc/kernels/intranode.cu) and mirrored here:
fresh and cached dispatch receive in (source rank, channel, token) order = (source rank, token),
bytes moved as is (NaN payloads included); combine sums each token's rows and its fp32 top-k
weights per slot over the ranks that received it, in rank order, starting from 0, one rounding for
BF16; tokens sent nowhere combine to 0.
"""

import torch
import torch.distributed as dist

from moefp8.dispatch.all_to_all import AllToAllDispatcher
from moefp8.fp8 import Fp8Tensor


class EventOverlap:
    def __init__(self, event=None):
        self.event = event

    def current_stream_wait(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class Config:
    def __init__(self, num_sms=20, *_):
        self.num_sms = num_sms

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self.num_sms * num_ranks * hidden_bytes


class Buffer:
    num_sms = 20

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=False, comm=None):
        self.group, self.num_nvl_bytes, self.num_rdma_bytes = group, num_nvl_bytes, num_rdma_bytes
        self.group_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.destroyed = False
        dist.barrier(group)  # collective, as DeepEP's IPC handle exchange

    @staticmethod
    def set_num_sms(n):
        assert n % 2 == 0
        Buffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks):
        return Config(Buffer.num_sms)

    @staticmethod
    def capture():
        return EventOverlap("captured")

    def get_comm_stream(self):
        return None  # torch.cuda.stream(None) is a no-op context

    def destroy(self):
        assert not self.destroyed
        dist.barrier(self.group)
        self.destroyed = True

    def _check(self, config, previous_event, async_finish, allocate_on_comm_stream):
        assert not self.destroyed
        assert config is None or config.num_sms % 2 == 0
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        return EventOverlap("done" if async_finish else None)

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        ev = self._check(None, previous_event, async_finish, allocate_on_comm_stream)
        assert topk_idx.dtype == torch.int64
        R, E_l = self.group_size, num_experts // self.group_size
        ok = (topk_idx >= 0) & (topk_idx < num_experts)  # other ids are ignored, as DeepEP's kernel does
        in_rank = torch.stack([(ok & (topk_idx // E_l == r)).any(1) for r in range(R)], 1)
        per_expert = torch.bincount(topk_idx[ok], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, ev

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, previous_event=None, async_finish=False, allocate_on_comm_stream=False):
        ev = self._check(config, previous_event, async_finish, allocate_on_comm_stream)
        fp8 = isinstance(x, tuple)
        assert (x[0] if fp8 else x).is_contiguous() and num_worst_tokens == 0
        if fp8:  # DeepEP: e4m3 data [T, H], scales fp32 (or int) [T, H/128], any strides
            assert x[0].element_size() == 1 and x[1].dtype in (torch.float32, torch.int32) and x[1].dim() == 2
            assert x[1].shape[0] == x[0].shape[0]
        else:
            assert x.dtype == torch.bfloat16 and (2 * x.shape[1]) % 16 == 0
        xin = Fp8Tensor(x[0], x[1].float(), "1x128") if fp8 else x
        if handle is not None:
            assert topk_idx is None and topk_weights is None and handle[2] == config.num_sms
            d = handle[0].dispatch(xin, handle=handle[1])
            return ((d.x.data, d.x.scale) if fp8 else d.x), None, None, None, None, ev
        assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
        R, E = self.group_size, num_tokens_per_expert.numel()
        counts = torch.empty_like(num_tokens_per_expert)  # notify: per-expert counts to their ranks
        dist.all_to_all_single(counts, num_tokens_per_expert, group=self.group)
        per_expert = counts.view(R, E // R).sum(0).tolist()
        disp = AllToAllDispatcher(E, self.group, "fp32", mode="exact")
        ids = torch.where((topk_idx >= 0) & (topk_idx < E), topk_idx, -1)
        d = disp.dispatch(xin, ids, topk_weights)
        w = torch.where(d.topk_idx >= 0, d.topk_w, 0.0)
        recv = (d.x.data, d.x.scale) if fp8 else d.x
        return recv, d.topk_idx, w, per_expert, (disp, d.handle, config.num_sms), ev

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None, async_finish=False,
                allocate_on_comm_stream=False):
        ev = self._check(config, previous_event, async_finish, allocate_on_comm_stream)
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and (2 * x.shape[1]) % 16 == 0
        assert handle[2] == config.num_sms
        disp, h = handle[0], handle[1]
        if topk_weights is not None:  # summed over the ranks in rank order from 0.0 in fp32, per slot
            assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous()
            assert topk_weights.dim() == 2 and topk_weights.shape[0] == x.shape[0] and topk_weights.shape[1] <= 32
        out = disp.combine(x, h)
        w = disp.combine(topk_weights, h) if topk_weights is not None else None
        return out, w, ev
