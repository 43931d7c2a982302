"""Node-limited routing (issue 5, item 5): with the EP group spanning nodes, the router's
group-limited top-k with one group per node caps the nodes each token is sent to. The mapping
(`node_limited_groups`), its effect on the dispatch's routes, the config keys and their errors,
and the wiring in train.py (CPU, no process group)."""

import pytest
import torch

from moefp8.config import Config, validate
from moefp8.dispatch import node_limited_groups
from moefp8.kernels.pack import dispatch_layout_ref
from moefp8.model import Transformer
from moefp8.recipe import Recipe
from moefp8.router import Router
from moefp8.launch import check_launch, dispatch_capacity, routing_config


@pytest.mark.parametrize("ep,rpn,E,K,max_nodes,want", [
    (64, 8, 256, 8, 4, (8, 4)),  # DeepSeek-V3: 8 nodes of 8 GPUs, each token on at most 4 nodes
    (16, 8, 256, 8, 1, (2, 1)),
    (16, 8, 256, 8, 4, (2, 2)),  # more nodes allowed than the group spans: all of them
    (16, 8, 256, 8, 0, (1, 1)),  # off
    (8, 8, 256, 8, 1, (1, 1)),  # the EP group within one node: nothing to limit
])
def test_groups(ep, rpn, E, K, max_nodes, want):
    assert node_limited_groups(ep, rpn, E, K, max_nodes) == want


@pytest.mark.parametrize("args,msg", [
    ((12, 8, 240, 8, 2), "the EP group of 12 ranks does not cover whole nodes of 8 ranks"),
    ((16, 4, 16, 8, 1), "top-8 experts cannot come from 1 node\\(s\\) of 4 experts each"),
    ((16, 8, 256, 8, -1), "dispatch.max_nodes=-1: must be an integer >= 0"),
])
def test_group_errors(args, msg):
    with pytest.raises(ValueError, match=msg):
        node_limited_groups(*args)


def test_routes_span_at_most_max_nodes():
    """E = 32 experts over 8 ranks, 2 ranks per node (4 nodes), top-6 within 2 nodes: every token's
    destination ranks, as the dispatch computes them, lie on at most 2 nodes; unlimited, many do not."""
    E, R, rpn, K, T, H = 32, 8, 2, 6, 500, 64
    n_groups, topk_groups = node_limited_groups(R, rpn, E, K, 2)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(0))
    for groups, limit in (((n_groups, topk_groups), 2), ((1, 1), None)):
        torch.manual_seed(1)
        router = Router(H, E, K, n_groups=groups[0], topk_groups=groups[1])
        idx = router(x).topk_idx_TK
        pos = dispatch_layout_ref(idx, E, R, 16)[1]  # [T, R]: where each token goes, -1 if not there
        nodes = torch.stack([(pos[:, n * rpn:(n + 1) * rpn] >= 0).any(1) for n in range(R // rpn)], 1).sum(1)
        if limit:
            assert int(nodes.max()) <= limit and int(nodes.min()) >= 1
        else:
            assert int(nodes.max()) > 2


def _cfg(**dispatch) -> Config:
    cfg = Config()
    cfg.train.device = "cpu"
    cfg.model.n_experts, cfg.model.topk = 16, 4
    for k, v in dispatch.items():
        setattr(cfg.dispatch, k, v)
    return cfg


@pytest.mark.parametrize("dispatch,model,msg", [
    (dict(max_nodes=-1), {}, "dispatch.max_nodes=-1: must be >= 0"),
    (dict(capacity=-5), {}, "dispatch.capacity=-5: must be >= 0"),
    (dict(ranks_per_node=-2), {}, "dispatch.ranks_per_node=-2: must be >= 0"),
    (dict(mode="fast"), {}, "dispatch.mode='fast': expected one of 'auto', 'exact', 'capacity'"),
    (dict(max_nodes=2), {}, "dispatch.max_nodes=2: node-limited routing needs expert parallelism across nodes"),
    (dict(backend="all_to_all", ep_size=4, max_nodes=2), dict(n_groups=4, topk_groups=2),
     "dispatch.max_nodes=2: .* leave model.n_groups=1 \\(got 4\\)"),
])
def test_config_errors(dispatch, model, msg):
    cfg = _cfg(**dispatch)
    for k, v in model.items():
        setattr(cfg.model, k, v)
    with pytest.raises(ValueError, match=msg):
        validate(cfg)


def test_train_wiring():
    cfg = _cfg(backend="all_to_all", ep_size=4, max_nodes=1)
    validate(cfg)
    m = routing_config(cfg, 8, {"LOCAL_WORLD_SIZE": "2"})  # EP 4 over nodes of 2 ranks: 2 groups, keep 1
    assert (m.n_groups, m.topk_groups) == (2, 1) and (cfg.model.n_groups, cfg.model.topk_groups) == (1, 1)
    routers = [b.mlp.router for b in Transformer(m, Recipe("bf16")).layers if b.is_moe]
    assert routers and all((r.n_groups, r.topk_groups) == (2, 1) for r in routers)
    m = routing_config(cfg, 8, {"LOCAL_WORLD_SIZE": "4"})  # the EP group within one node: nothing to limit
    assert (m.n_groups, m.topk_groups) == (1, 1)
    cfg.dispatch.ranks_per_node = 1  # given: LOCAL_WORLD_SIZE ignored; 4 nodes of 4 experts, top-4 from 1
    m = routing_config(cfg, 8, {"LOCAL_WORLD_SIZE": "2"})
    assert (m.n_groups, m.topk_groups) == (4, 1)
    cfg.model.topk = 6
    with pytest.raises(ValueError, match="top-6 experts cannot come from 1 node"):  # before any process starts
        check_launch(cfg, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2"})
    cfg = _cfg()
    assert dispatch_capacity(cfg) == cfg.train.micro_batch * cfg.train.seq_len
    cfg.dispatch.overlap = True  # the larger micro-batch: half the sequences, rounded up
    cfg.train.micro_batch, cfg.train.seq_len = 5, 64
    assert dispatch_capacity(cfg) == 3 * 64
    cfg.train.micro_batch = 1  # a lone sequence is split in token halves
    assert dispatch_capacity(cfg) == 32
    cfg.dispatch.capacity = 100
    assert dispatch_capacity(cfg) == 100
