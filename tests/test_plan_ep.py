"""tools/plan_ep.py: its closed-form rows per token against counting the rows of sampled tokens
(uniform routing, node-limited too) by each scheme's sending rule; the table runs."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("plan_ep", Path(__file__).resolve().parent.parent / "tools" / "plan_ep.py")
plan_ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_ep)


def counted(E, K, N, G, scheme, M, tokens=20000, seed=0):
    """Mean rows per token by link class, counted: a token on a random rank, its K experts uniform
    (node-limited: M nodes first, then K of their experts), rows sent by the scheme's rule."""
    rng, R = random.Random(seed), N * G
    inter = intra = 0
    for _ in range(tokens):
        src = rng.randrange(R)
        src_node, src_local = divmod(src, G)
        pool = range(E)
        if scheme == "node-limited":
            nodes = rng.sample(range(N), M)
            pool = [e for n in nodes for e in range(n * E // N, (n + 1) * E // N)]
        ranks = {e // (E // R) for e in rng.sample(list(pool), K)}
        if scheme == "flat":
            inter += sum(r // G != src_node for r in ranks)
            intra += sum(r // G == src_node and r != src for r in ranks)
        else:
            remote_nodes = {r // G for r in ranks} - {src_node}
            inter += len(remote_nodes)
            intra += sum(r // G == src_node and r != src for r in ranks)  # forwarded at home
            intra += sum(r // G in remote_nodes and r % G != src_local for r in ranks)  # forwarded by the receiver
    return inter / tokens, intra / tokens


@pytest.mark.parametrize("E, K, N, G, scheme, M", [
    (32, 4, 4, 2, "flat", 0), (32, 4, 4, 2, "hierarchical", 0), (32, 4, 4, 2, "node-limited", 2),
    (64, 8, 8, 2, "node-limited", 3), (24, 6, 3, 4, "hierarchical", 0), (16, 2, 2, 4, "flat", 0),
])
def test_closed_form_against_counted_rows(E, K, N, G, scheme, M):
    want = plan_ep.rows_per_token(E, K, N, G, scheme, M)
    inter, intra = counted(E, K, N, G, scheme, M)
    assert want["inter"] == pytest.approx(inter, rel=0.03, abs=0.01)
    assert want["intra"] == pytest.approx(intra, rel=0.03, abs=0.01)


def test_node_limited_bounds_and_table(tmp_path):
    r = plan_ep.rows_per_token(256, 8, 32, 8, "node-limited", 4)
    assert r["inter"] <= 4 * 31 / 32 and r["inter"] < plan_ep.rows_per_token(256, 8, 32, 8, "hierarchical")["inter"]
    out = tmp_path / "plan.json"
    plan_ep.main(["--nodes", "2,4", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["ep"], r["scheme"]) for r in rows] == [(16, "flat"), (16, "hierarchical"), (32, "flat"),
                                                     (32, "hierarchical")]
    assert all(r["ms_per_layer"] > 0 for r in rows)
