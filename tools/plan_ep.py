"""Expert-parallel traffic past one node, planned: for EP groups of 2-32 nodes of G GPUs and a
model's routing (DeepSeek-V3's by default: hidden 7168, 256 experts, top-8), the rows and bytes
each token puts on inter-node and intra-node links per dispatch + combine, and the time of one
layer's exchange at given link bandwidths, for three schemes:

    flat          the all_to_all backend today: a token goes once to every *rank* hosting one of
                  its experts (its own rank excepted), over whatever link joins the two ranks
    hierarchical  DeepSeek-V3's: once to every *node* hosting one of its experts (to the GPU of
                  the same local rank there), then inside that node to the hosting ranks
    node-limited  hierarchical with each token's experts on at most --max-nodes nodes
                  (dispatch.max_nodes; DeepSeek-V3: 4)

Routing is taken as uniform (every expert equally likely, node-limited: the nodes first, then the
experts among theirs), which is what aux-loss-free balancing aims at. Expected counts are exact
under that assumption (hypergeometric), not sampled:

    P(a group of e of the E experts holds one of a token's K) = 1 - C(E - e, K) / C(E, K)

    python tools/plan_ep.py                                    # the table in docs/multinode.md
    python tools/plan_ep.py --gpus-per-node 8 --inter-gbs 50 --intra-gbs 450 --tokens 4096 --json out.json
"""

import argparse
import json
import math
from pathlib import Path


def p_hit(E: int, e: int, K: int) -> float:
    """Chance that a set of e experts out of E holds at least one of K distinct uniform picks."""
    return 1.0 - math.comb(E - e, K) / math.comb(E, K) if e < E else 1.0


def rows_per_token(E: int, K: int, nodes: int, gpus: int, scheme: str, max_nodes: int = 0) -> dict[str, float]:
    """Expected rows one token sends per dispatch, by link class ("inter", "intra"), in an EP group
    of `nodes` x `gpus` ranks holding E experts evenly (the combine sends the same rows back).
    With M picked nodes (node-limited: max_nodes, else all), Em = M E / nodes experts to pick from,
    a picked node hosting one of the token's experts with pn, a rank with pr:
      flat:         inter M (N-1)/N G pr,  intra M/N (G-1) pr   (the own node is picked with M/N)
      hierarchical: inter M (N-1)/N pn,    intra M (G-1) pr     (forwarded inside every picked node
                                                                  to its hosts but the receiver)"""
    R = nodes * gpus
    if E % R or K > E:
        raise ValueError(f"{E} experts, top-{K}: not an even split over {R} ranks")
    M = max_nodes if scheme == "node-limited" and 0 < max_nodes < nodes else nodes
    Em = M * E // nodes
    pn, pr = p_hit(Em, E // nodes, K), p_hit(Em, E // R, K)
    remote = M * (nodes - 1) / nodes  # picked nodes other than the token's own, in expectation
    if scheme == "flat":
        return {"inter": remote * gpus * pr, "intra": M / nodes * (gpus - 1) * pr}
    return {"inter": remote * pn, "intra": M * (gpus - 1) * pr}


def plan(args) -> list[dict]:
    row = args.hidden + args.hidden // 128 + 8 * args.topk  # FP8 data, UE8M0 scales, routing (int32 id + fp32 weight)
    row = -(-row // 16) * 16
    back = 2 * args.hidden  # the combine: BF16 rows
    out = []
    for nodes in args.nodes:
        for scheme in ("flat", "hierarchical", "node-limited"):
            if scheme == "node-limited" and (not args.max_nodes or args.max_nodes >= nodes):
                continue
            r = rows_per_token(args.experts, args.topk, nodes, args.gpus_per_node, scheme, args.max_nodes)
            inter_b, intra_b = r["inter"] * (row + back), r["intra"] * (row + back)
            ms = max(inter_b * args.tokens / (args.inter_gbs * 1e9), intra_b * args.tokens / (args.intra_gbs * 1e9)) * 1e3
            out.append({"ep": nodes * args.gpus_per_node, "nodes": nodes, "scheme": scheme,
                        "inter_rows": round(r["inter"], 3), "intra_rows": round(r["intra"], 3),
                        "inter_kb_per_token": round(inter_b / 1e3, 2), "intra_kb_per_token": round(intra_b / 1e3, 2),
                        "ms_per_layer": round(ms, 3)})
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16, 32])
    p.add_argument("--max-nodes", type=int, default=4, help="node-limited routing's nodes per token (0: off)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank per exchange")
    p.add_argument("--inter-gbs", type=float, default=50.0, help="inter-node GB/s per GPU (a 400 Gb/s NIC each)")
    p.add_argument("--intra-gbs", type=float, default=450.0, help="intra-node GB/s per GPU (NVLink, one way)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = plan(args)
    cols = ["ep", "nodes", "scheme", "inter_rows", "intra_rows", "inter_kb_per_token", "intra_kb_per_token",
            "ms_per_layer"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    print(f"speed-of-light: inter-node {args.inter_gbs:g} GB/s and intra-node {args.intra_gbs:g} GB/s per GPU, "
          f"{args.tokens} tokens per rank, dispatch (FP8) + combine (BF16); the slower link class sets ms_per_layer")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
