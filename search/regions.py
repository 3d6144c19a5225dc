"""Region growth: greedy merging along producer->consumer edges in topological order. A merge is
kept only if `legal` allows it and the merged group still lowers to one kernel; the cost model then
keeps the regions that pay."""
from __future__ import annotations

from typing import Callable, Optional

from ortfuse.customops.target import Target
from ortfuse.rewriter.graph import Graph
from ortfuse.search import legal, ops
from ortfuse.search.cost import CostModel, traffic
from ortfuse.search.plan import Plan, Region, Reject

# Lowering check: raises with a reason when a candidate region is not one kernel.
Check = Callable[[Graph, Region], Optional[str]]


def _lowering_check(tgt: Target) -> Check:
    from ortfuse.customops.lower import LoweringError, lower

    def check(g: Graph, region: Region) -> Optional[str]:
        try:
            lower(g, region, tgt)
        except LoweringError as e:
            return str(e)
        return None
    return check


def _candidate(g: Graph, nodes: set[int], check: Check) -> Region | Reject:
    r = legal.classify(g, nodes)
    if isinstance(r, Reject):
        return r
    why = check(g, r)
    return Reject(f"region at {g.node_label(min(nodes))}", why) if why else r


def plan(g: Graph, tgt: Target, cost: Optional[CostModel] = None, check: Optional[Check] = None) -> Plan:
    cost = cost or CostModel(tgt)
    check = check or _lowering_check(tgt)
    rejects: list[Reject] = []
    refusals: list[Reject] = []
    group_of: dict[int, frozenset[int]] = {}
    for i in range(len(g.nodes)):
        why = legal.node_verdict(g, i)
        if why is None:
            group_of[i] = frozenset((i,))
        else:
            rejects.append(why)

    for i in sorted(group_of):
        for _, t in ops.data_inputs(g.nodes[i]):
            p = g.producer.get(t)
            if p is None or p not in group_of or group_of[p] == group_of[i]:
                continue
            merged = set(group_of[p] | group_of[i])
            if legal.creates_cycle(g, merged, group_of):
                refusals.append(Reject(f"{g.node_label(p)} + {g.node_label(i)}", "merging would create a cycle"))
                continue
            cand = _candidate(g, merged, check)
            if isinstance(cand, Reject):
                refusals.append(Reject(f"{g.node_label(p)} + {g.node_label(i)}", cand.reason))
                continue
            frozen = frozenset(merged)
            for n in frozen:
                group_of[n] = frozen

    regions: list[Region] = []
    for group in sorted(set(group_of.values()), key=min):
        cand = _candidate(g, set(group), check)
        if isinstance(cand, Reject):
            refusals.append(cand)
            continue
        cand = Region(len(regions), cand.kind, cand.nodes, cand.inputs, cand.outputs, cand.space, traffic(g, cand))
        why = cost.verdict(g, cand)
        if why:
            refusals.append(why)
            continue
        regions.append(cand)
    result = Plan(tuple(regions), tuple(rejects), tuple(refusals))
    result.validate(len(g.nodes))
    return result
