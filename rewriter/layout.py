"""Residual streams kept in the layout their blocks compute in (transpose sinking, as ORT's transpose
optimizer does for NHWC execution providers).

ConvNeXt's block computes channels-last and keeps its residual stream NCHW:
`s' = s + Transpose(mlp(LN(Transpose(dwconv(s)))), (0,3,1,2))`. So every block writes the stream transposed,
and its depthwise Conv reads an NCHW image, which a row kernel computing channels-last cannot walk (one
memory transaction per tap and channel), so the Conv stays a cuDNN kernel writing its output and the
LayerNorm's kernel reading it back.

`sink_transposes` rewrites a chain of such element-wise ops `y_k = op(y_{k-1}, Transpose(m_k, P))` as
`y'_k = op(y'_{k-1}, m_k)` with `y_k = Transpose(y'_k, P)`: the stream lives in the blocks' own layout.
The value of every tensor the graph had is unchanged (the same ops on the same values, in the same
operand order). Then each block's depthwise Conv reads `Transpose(y'_{k-1}, P)`, a channels-last image in
memory, which the LayerNorm's row kernel computes in place (as it does SegFormer's Mix-FFN); each block's
residual Add is a plain epilogue of its last GEMM; and a `Transpose(y_k, P⁻¹)` after the chain (the next
stage's downsampling LayerNorm) reads `y'_k` itself.

A chain is rewritten only where that saves transposed copies: every interior `y_k` must be read only by
the next op of the chain, by Transposes that undo P, and by depthwise Convs whose output goes to such
Transposes (computed channels-last); and what the chain gains must outweigh the Transposes it leaves to be
run where some other reader needs `y_k` itself (`_worth`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import onnx

from ortfuse.customops import scalar
from ortfuse.rewriter import _proto
from ortfuse.rewriter.attrs import inverse_perm
from ortfuse.rewriter.canonical import remove_dead
from ortfuse.rewriter.graph import Graph, TensorInfo
from ortfuse.rewriter.shapes import assemble

_BINARY = ("Add", "Sub", "Mul", "Div")


@dataclass(frozen=True)
class _Link:
    """One op of a chain: node `op` reads the stream at input `stream` and `Transpose(m, perm)` at the other."""
    op: int
    stream: int  # 0 or 1
    transpose: int  # the Transpose node feeding the other input
    perm: tuple[int, ...]


def _perm(g: Graph, i: int) -> Optional[tuple[int, ...]]:
    n = g.nodes[i]
    if n.op_type != "Transpose" or n.domain not in ("", "ai.onnx"):
        return None
    shape = g.tensors[n.input[0]].shape if n.input[0] in g.tensors else None
    if shape is None:
        return None
    perm = tuple(scalar.transpose_perm(n, len(shape)))
    return perm if sorted(perm) == list(range(len(shape))) else None


def _link(g: Graph, i: int) -> Optional[_Link]:
    """Node i as a chain op: a binary element-wise op of the default domain whose two inputs and output
    have one shape (no broadcast), one input a Transpose's output."""
    n = g.nodes[i]
    if n.op_type not in _BINARY or n.domain not in ("", "ai.onnx") or len(n.input) != 2 or n.input[0] == n.input[1]:
        return None
    infos = [g.tensors.get(t) for t in (*n.input, n.output[0])]
    if any(t is None or t.shape is None for t in infos) or len({t.shape for t in infos}) != 1 \
            or len({t.dtype for t in infos}) != 1 or any(t in g.constants for t in n.input):
        return None
    for side in (1, 0):
        p = g.producer.get(n.input[side])
        perm = _perm(g, p) if p is not None else None
        if perm is not None and perm != tuple(range(len(perm))):
            return _Link(i, 1 - side, p, perm)
    return None


def _undoes(g: Graph, i: int, perm: tuple[int, ...]) -> bool:
    return _perm(g, i) == inverse_perm(perm)


def _depthwise_channels_last(g: Graph, i: int, perm: tuple[int, ...]) -> bool:
    """Node i is a depthwise Conv whose output only Transposes undoing `perm` read: fused, its kernel walks
    it channels-last, which reads well from a channels-last image."""
    n = g.nodes[i]
    if n.op_type != "Conv" or n.domain not in ("", "ai.onnx") or n.input[1] not in g.tensors:
        return False
    w = g.tensors[n.input[1]].shape
    readers = g.consumers.get(n.output[0], ())
    return w is not None and len(w) == 4 and w[1] == 1 and scalar.attr(n, "group", 1) == w[0] \
        and bool(readers) and n.output[0] not in g.graph_outputs \
        and all(_undoes(g, c, perm) for c in readers)


def _reads_directly(g: Graph, t: str, c: int) -> bool:
    return t in g.nodes[c].input  # not (only) inside a subgraph


def _chains(g: Graph) -> list[list[_Link]]:
    """Maximal chains: each op's stream input is the previous op's output, with the same perm."""
    links = {i: l for i in range(len(g.nodes)) if (l := _link(g, i)) is not None}
    nxt: dict[int, int] = {}
    for i, l in links.items():
        p = g.producer.get(g.nodes[i].input[l.stream])
        if p in links and links[p].perm == l.perm and p not in nxt:
            nxt[p] = i
    starts = [i for i in links if i not in nxt.values()]
    chains = []
    for i in sorted(starts):
        chain = [links[i]]
        while chain[-1].op in nxt:
            chain.append(links[nxt[chain[-1].op]])
        chains.append(chain)
    return chains


def _gains(g: Graph, chain: list[_Link], k: int) -> Optional[tuple[int, bool]]:
    """(copies saved, whether `y_k` itself must still be computed) for op k of a chain; None where an
    interior op's output has a reader the chain cannot serve."""
    link = chain[k]
    y = g.nodes[link.op].output[0]
    users = g.consumers.get(y, ())
    following = chain[k + 1].op if k + 1 < len(chain) else None
    gained, kept = 0, y in g.graph_outputs
    for c in users:
        if not _reads_directly(g, y, c):
            kept = True
        elif c == following:
            continue
        elif (_undoes(g, c, link.perm) and g.nodes[c].output[0] not in g.graph_outputs) \
                or _depthwise_channels_last(g, c, link.perm):  # (a graph output keeps its name: read y)
            gained += 1
        else:
            kept = True
    if kept and following is not None:
        return None
    return gained, kept


def _worth(g: Graph, chain: list[_Link]) -> bool:
    """The chain is rewritten: every interior output serves only readers the chain serves, and more
    transposed copies are saved than left to run (one for each output some other reader needs as it was)."""
    out = [_gains(g, chain, k) for k in range(len(chain))]
    return all(o is not None for o in out) and sum(o[0] for o in out) > sum(o[1] for o in out)


def chain_heads(g: Graph) -> list[str]:
    """The output of each rewritable chain's first op (what `sink_transposes` may be told to take)."""
    return [g.nodes[chain[0].op].output[0] for chain in _chains(g) if _worth(g, chain)]


def sink_transposes(g: Graph, take: Callable[[str], bool] = lambda head: True) -> tuple[Graph, int]:
    """(new graph, number of element-wise ops now computed in their chain's layout), for the chains whose head
    (`chain_heads`) `take` accepts. `g` is untouched."""
    plans = [chain for chain in _chains(g) if _worth(g, chain) and take(g.nodes[chain[0].op].output[0])]
    if not plans:
        return g, 0
    m = onnx.ModelProto()
    m.CopyFrom(g.model)
    tensors = dict(g.tensors)
    before: dict[int, list[onnx.NodeProto]] = {}  # node index -> nodes that take its place
    alias: dict[str, str] = {}  # outputs of Transposes undoing a chain's perm -> the chain's own tensor
    for chain in plans:
        prev_new: Optional[str] = None
        for link in chain:
            n = g.nodes[link.op]
            inv = inverse_perm(link.perm)
            y, stream = n.output[0], n.input[link.stream]
            y_new = f"{y}__ortfuse_sunk"
            shape = g.tensors[y].shape
            tensors[y_new] = TensorInfo(y_new, g.tensors[y].dtype, tuple(shape[p] for p in inv))
            new: list[onnx.NodeProto] = []
            if prev_new is None:  # the chain's first op reads its stream through the inverse Transpose
                p = g.producer.get(stream)
                if p is not None and _perm(g, p) == link.perm:
                    prev = g.nodes[p].input[0]  # ... which undoes the stream's own
                else:
                    prev = f"{stream}__ortfuse_t{''.join(map(str, inv))}"
                    if prev not in tensors:
                        tensors[prev] = TensorInfo(prev, g.tensors[stream].dtype, tensors[y_new].shape)
                        new.append(onnx.helper.make_node("Transpose", [stream], [prev], name=f"{prev}/transpose",
                                                         perm=list(inv)))
            else:
                prev = prev_new
            ins = [g.nodes[link.transpose].input[0]] * 2
            ins[link.stream] = prev
            new.append(onnx.helper.make_node(n.op_type, ins, [y_new], name=f"{n.name or y}/sunk"))
            # y itself, for its other readers (a depthwise Conv reads it as a view); dropped if none is left
            new.append(onnx.helper.make_node("Transpose", [y_new], [y], name=f"{n.name or y}/transpose",
                                             perm=list(link.perm)))
            for c in g.consumers.get(y, ()):
                if _reads_directly(g, y, c) and _undoes(g, c, link.perm) \
                        and g.nodes[c].output[0] not in g.graph_outputs:
                    alias[g.nodes[c].output[0]] = y_new
            before[link.op] = new
            prev_new = y_new
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(m.graph.node):
        nodes.extend(before.get(i, [node]))
    _proto.read_instead(nodes, alias)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    remove_dead(m)
    return assemble(m, tensors, g.opset, g.hint_overrides), sum(map(len, plans))
