"""What ptxas says about the generated GEMM kernels at real model shapes (sm_90, no GPU needed): every
kernel fits in registers without spilling to local memory, and the compile records the figures the
report shows. Spills in a mainloop cost more than any tile choice gains, so they are a regression."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as TP

from helpers import const, conv_silu_residual, model, node, vi
from ortfuse.api import compile_model
from ortfuse.customops.compile import Resources

H = TP.FLOAT16

# ResNet-50 at batch 1 (hint): the stem, 3x3 convs of every stage (stride 2 where a stage starts), 1x1s
RESNET = [(3, 64, 7, 2, (3, 3, 3, 3), 1, 224), (64, 64, 3, 1, (1, 1, 1, 1), 1, 56),
          (128, 128, 3, 2, (1, 1, 1, 1), 1, 56), (256, 256, 3, 1, (1, 1, 1, 1), 1, 14),
          (512, 512, 3, 2, (1, 1, 1, 1), 1, 14), (1024, 256, 1, 1, (0, 0, 0, 0), 1, 14),
          (512, 2048, 1, 1, (0, 0, 0, 0), 1, 7)]


def _no_spills(res) -> list[Resources]:
    out = []
    for k in res.kernels:
        by_cc = dict(k.compiled.resources)
        assert 90 in by_cc, k.compiled.entry
        r = by_cc[90]
        assert r.spill_bytes == 0 and r.regs <= 255, (k.compiled.entry, r, k.spec.tiles[:1])
        out.append(r)
    return out


@pytest.mark.parametrize("geom", RESNET)
def test_resnet50_conv_kernels_do_not_spill(geom):
    m, shapes, _ = conv_silu_residual(H, *geom)
    res = compile_model(m, {k: (1,) + v[1:] for k, v in shapes.items()}, "sm_90")
    assert [k.region.kind for k in res.kernels] == ["gemm"]
    _no_spills(res)


@pytest.mark.parametrize("n,k", [(768, 768), (3072, 768), (768, 3072)])
def test_bert_base_gemm_kernels_do_not_spill(n, k):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float16)
    m = model([node("MatMul", ["x", "w"], ["y"]), node("Add", ["y", "b"], ["z"]), node("Gelu", ["z"], ["out"])],
              [vi("x", H, ["batch", 128, k])], [vi("out", H, None)],
              [const("w", w, np.float16), const("b", np.full(n, 0.1), np.float16)], opset=20)
    res = compile_model(m, {"x": (1, 128, k)}, "sm_90")
    assert [k.region.kind for k in res.kernels] == ["gemm"]
    _no_spills(res)


def test_resources_parse_ptxas_log():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "    16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads\n"
           "ptxas info    : Used 64 registers, used 1 barriers, 16 bytes cumulative stack size\n")
    assert Resources.parse(log) == Resources(64, 20, 16)
    assert Resources.parse(log, "k") == Resources(64, 20, 16)
    assert Resources.parse("no ptxas output") is None
    # a non-inlined callee listed first: the kernel's own figures are taken
    callee = ("ptxas info    : Function properties for helper\n"
              "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n")
    assert Resources.parse(callee + log, "k") == Resources(64, 20, 16)
    assert Resources.parse(log, "other") is None
    # ptxas's wgmma serialization notice (its wording in NVRTC 13.5's ptxas) is kept as the reason
    serial = ("ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
              "to insufficient register resources for the wgmma pipeline in the function 'k' in line 12\n")
    assert Resources.parse(log + serial, "k").wgmma_serialized == "insufficient register resources for the wgmma pipeline"
    assert Resources.parse(log, "k").wgmma_serialized == ""


def test_convnext_window_row_kernels_do_not_spill():
    # a later ConvNeXt stage kept channels-last: each block's 7x7 depthwise inside its LayerNorm's row kernel,
    # straight-line (3,000 lines). Read tap by tap, NVRTC 13.5's ptxas put it on 40 registers with a 2.7 KB
    # stack frame of spills (the retry, compile._without_spills, found 140 and none); read a kernel row at a
    # time it builds on 139 without. 768 fp16 channels (three groups a lane) still spill 16 bytes at 255.
    from helpers import convnext_stage
    from ortfuse.api import Options
    res = compile_model(convnext_stage(H, c=384, depth=3, hw=14, tail="ln"), None, "sm_90",
                        options=Options(archs=(90,), layout="blocks"))
    assert any(r.kind == "rowreduce" and any(res.graph.nodes[i].op_type == "Conv" for i in r.nodes)
               for r in res.plan.regions)
    _no_spills(res)


def test_a_spilling_build_is_retried_at_the_launch_bounds_register_cap(monkeypatch, tmp_path):
    from ortfuse.customops import compile as cc
    assert cc.register_cap('__launch_bounds__(384, 1) k(', "k") == 168
    assert cc.register_cap('__launch_bounds__(128) k(', "k") == 255
    assert cc.register_cap('__launch_bounds__(256, 2) k(', "k") == 128
    assert cc.register_cap('__global__ void k(', "k") == 255

    def log(regs: int, spill: int) -> str:
        return (f"ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
                f"    {spill} bytes stack frame, {spill // 2} bytes spill stores, {spill - spill // 2} bytes spill loads\n"
                f"ptxas info    : Used {regs} registers, used 0 barriers\n")
    calls = []

    def fake(source, entry, arch, dump, extra=()):
        calls.append(tuple(extra))
        if arch.startswith("compute"):
            return b"ptx", "", b"ptx"
        return (b"capped" if extra else b"default"), log(140, 0) if extra else log(40, 2704), b"ptx"
    monkeypatch.setattr(cc, "_run_nvrtc", fake)
    monkeypatch.setattr(cc, "check_elf", lambda image: None)
    src = 'extern "C" __global__ void __launch_bounds__(128) k(const OfzArgs a) {}'
    k = cc.compile_kernel(src, "k", (90,), tmp_path)
    assert dict(k.cubins)[90] == b"capped" and dict(k.resources)[90] == Resources(140, 0, 0)
    assert calls[:2] == [(), ("--maxrregcount=255",)]
    # a kernel that does not spill is built once; a retry that spills no less is dropped
    monkeypatch.setattr(cc, "_run_nvrtc", lambda source, entry, arch, dump, extra=():
                        calls.append(tuple(extra)) or (b"dflt", log(96, 0), b"ptx"))
    calls.clear()
    cc.compile_kernel(src + " ", "k", (90,), tmp_path)
    assert ("--maxrregcount=255",) not in calls
    monkeypatch.setattr(cc, "_run_nvrtc", lambda source, entry, arch, dump, extra=():
                        (b"cap" if extra else b"dflt", log(40, 100), b"ptx"))
    k = cc.compile_kernel(src + "  ", "k", (90,), tmp_path)
    assert dict(k.cubins)[90] == b"dflt" and dict(k.resources)[90].spill_bytes == 100

    def refused(source, entry, arch, dump, extra=()):  # a retry NVRTC refuses keeps the first build
        if extra:
            raise cc.CompileError("refused")
        return b"dflt", log(40, 100), b"ptx"
    monkeypatch.setattr(cc, "_run_nvrtc", refused)
    k = cc.compile_kernel(src + "   ", "k", (90,), tmp_path)
    assert dict(k.cubins)[90] == b"dflt"
