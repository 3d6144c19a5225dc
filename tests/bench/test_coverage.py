"""The architecture coverage sweep (bench/coverage.py) end to end on one model: export, optimize, emulated
parity, a table row; and a failing export is a row, not a crash."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from ortfuse.bench import coverage  # noqa: E402


def _swept(tmp_path, *args: str):
    """The table file of a sweep with these arguments (the sweep passing)."""
    out = tmp_path / "coverage.md"
    assert coverage.main([*args, "--out", str(out)]) == 0
    return out


def _cells(out, name: str) -> list[str]:
    """The cells of model `name`'s first row in the sweep's table at `out`."""
    row = next(line for line in out.read_text().splitlines() if line.startswith(f"| {name} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_one_architecture_end_to_end(tmp_path, capsys):
    out = _swept(tmp_path, "--models", "distilbert", "--dtypes", "fp16", "bf16")
    rows = [line for line in out.read_text().splitlines() if line.startswith("| distilbert")]
    assert len(rows) == 2
    half, bf16 = ([c.strip() for c in row.strip("|").split("|")] for row in rows)
    assert half[1] == "fp16" and half[4] == "2 / 2" and half[5] == "ok", half  # every layer's attention
    assert bf16[1] == "bf16" and bf16[2:6] == half[2:6], bf16  # the same plan in bf16


def test_a_failed_export_is_a_row(monkeypatch, tmp_path):
    def broken():
        raise AttributeError("module 'transformers' has no attribute 'NoSuchConfig'")
    monkeypatch.setitem(coverage.MODELS, "distilbert", broken)
    out = _swept(tmp_path, "--models", "distilbert")
    assert "export failed: AttributeError" in out.read_text()


def test_a_decoder_with_a_kv_cache(tmp_path):
    # past keys and values in, present ones out, the mask over "past_sequence + sequence": checked after a past
    # of 8 at 8 new tokens and at one (a generation step)
    out = _swept(tmp_path, "--models", "gpt2_past", "--dtypes", "fp16")
    cells = _cells(out, "gpt2_past")
    assert cells[4] == "2 / 2" and cells[5] == "ok", cells


def test_a_plain_pytorch_architecture(tmp_path):
    # bench/torch_nets.py: a YOLOv8-style detector (C2f Split/Concat, SPPF MaxPools, an FPN Upsample + Concat,
    # the DFL head's Softmax over bins), its Conv + BatchNorm + SiLU layers our GEMM kernels
    out = _swept(tmp_path, "--models", "yolo", "--dtypes", "fp16")
    cells = _cells(out, "yolo")
    assert cells[5] == "ok" and "gemm" in cells[2], cells


def test_a_model_orts_optimizer_fused_first(tmp_path):
    # distilbert through onnxruntime.transformers' optimizer: BiasGelu and SkipLayerNormalization in the input,
    # written as standard ops and fused as in the raw export's row
    out = _swept(tmp_path, "--models", "distilbert_ortopt", "--dtypes", "fp16")
    cells = _cells(out, "distilbert_ortopt")
    assert cells[5] == "ok" and "4 gemm" in cells[2] and cells[4] == "2 / 2", cells


def test_a_model_orts_quantizer_wrote(tmp_path):
    # Mistral through quantize_static (QDQ, int8): the element-wise ops between the Q/DQ pairs fuse, the RMS
    # norms the Qs read stay ORT's (a kernel's row sums would move a quantized element a step), and the output
    # matches with ORT running each model as written (ORT requantizes one chain of the optimized model only:
    # rewriter.qdq); the bf16 row is not built, and says why
    out = _swept(tmp_path, "--models", "mistral_qdq", "--dtypes", "fp32", "bf16")
    cells = _cells(out, "mistral_qdq")
    assert cells[5] == "ok" and "pointwise" in cells[2] and "rowreduce" not in cells[2], cells
    assert "| mistral_qdq | bf16 |  |  |  | not built (qdq rows are fp32 models) |" in out.read_text()


def test_only_the_asked_dtypes_are_built(tmp_path):
    paths = coverage.export("distilbert", tmp_path, ["fp32", "bf16"])
    assert set(paths) == {"fp32", "bf16"} and sorted(p.name for p in tmp_path.iterdir()) == \
        ["distilbert-bf16.onnx", "distilbert-fp32.onnx"]


def test_an_export_converted_to_opset_22_computes_its_convs_in_bf16(tmp_path):
    import onnx

    from ortfuse.bench.bf16 import opset
    from ortfuse.check import _dtypes
    m = onnx.load(str(coverage.export("resnet", tmp_path, ["bf16"], opset=22)["bf16"]))
    types = _dtypes(m)
    assert opset(m) == 22 and {types[n.output[0]] for n in m.graph.node if n.op_type == "Conv"} == \
        {onnx.TensorProto.BFLOAT16}


@pytest.mark.parametrize("opset", [None, 23])
def test_torch_export_of_sdpa_attention_fuses_whole(tmp_path, opset):
    # torch.onnx.export(dynamo=True), torch's default exporter: scaled_dot_product_attention decomposed with
    # Kᵀ as Reshape [B*H, S, D] -> Transpose -> Reshape [B, H, D, S] (targets from Shape on the host), the
    # sequence length as Squeeze(Shape(ids, start=1, end=2)) feeding the mask's and the positions' Ranges:
    # nothing but our kernels and the MatMuls ORT keeps is left. At opset 23 torch writes ONNX's Attention
    # (rewriter.onnx_attention), with the same mask: the same is left
    pytest.importorskip("onnxscript")
    from ortfuse.api import compile_model
    from ortfuse.check import check_models

    path = coverage.export("distilbert", tmp_path, ["fp16"], opset, "dynamo")["fp16"]
    res = compile_model(str(path), None, "sm_90")
    assert [r.kind for r in res.plan.regions].count("attention") == 2
    left = {n.op_type for n in res.model.graph.node if n.domain != "ortfuse"}
    assert left == {"MatMul"}, left
    copies = [ops for ops in ([res.graph.nodes[i].op_type for i in r.nodes] for r in res.plan.regions)
              if set(ops) <= {"Reshape", "Transpose", "Slice", "Split", "Squeeze", "Unsqueeze"}]
    assert not copies, copies  # Kᵀ is read by the attention kernels where the QKV projection wrote K
    rep = check_models(str(path), res.model, emulate=True)
    assert rep.ok, "\n".join(rep.lines())


def test_torch_export_of_a_decoder_with_a_kv_cache(tmp_path):
    # the mask's dim, named "total_sequence" for torch.export, is renamed "past_sequence + sequence" so the
    # check feeds it past + new tokens
    pytest.importorskip("onnxscript")
    out = _swept(tmp_path, "--models", "llama_past", "--exporter", "dynamo", "--dtypes", "fp32")
    cells = _cells(out, "llama_past")
    assert cells[4] == "2 / 2" and cells[5] == "ok", cells


@pytest.mark.parametrize("exporter,opset", [("torchscript", None), ("dynamo", None), ("dynamo", 23)])
def test_causal_attention_without_a_mask_tensor(tmp_path, exporter, opset):
    # nanoGPT's scaled_dot_product_attention(is_causal=True) over a dynamic sequence: exported as a Trilu of
    # ones sized through Shape (TorchScript, torch.export before opset 23, with TorchScript's scale computed from
    # q.size(-1)) or ONNX's Attention with is_causal: the causal rule becomes iotas the attention kernel computes,
    # so the kernels and the two MatMuls ORT keeps (the MLP's down projection, the tied LM head) are all that is
    # left, and the attention kernels read Q, K and V where the packed projection wrote them
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")
    from ortfuse.api import compile_model
    from ortfuse.check import check_models

    path = coverage.export("nanogpt", tmp_path, ["fp16"], opset if opset else coverage.EXPORT_OPSET
                           if exporter == "torchscript" else None, exporter)["fp16"]
    res = compile_model(str(path), None, "sm_90")
    assert [n.op_type for n in res.model.graph.node if n.domain != "ortfuse"] == ["MatMul", "MatMul"]
    attention = [r for r in res.plan.regions if r.kind == "attention"]
    assert len(attention) == 2 and all(len(r.inputs) == 1 for r in attention), [r.inputs for r in attention]
    rep = check_models(str(path), res.model, emulate=True)
    assert rep.ok, "\n".join(rep.lines())


def test_gpt2_as_it_was_exported_before_its_masking_utilities(tmp_path):
    # bench/torch_nets.py LegacyGpt2 (transformers 4.2x-4.3x GPT-2 with a cache): the bias buffer sliced at run
    # time from Sk - Sq and the (1 - mask) * lowest padding still give each attention kernel its bottom-right
    # frontier (customops/key_bound.py); the row checks parity at a prompt after a past and at a step
    from ortfuse.api import compile_model
    out = _swept(tmp_path, "--models", "gpt2_legacy_past", "--dtypes", "fp16")
    cells = _cells(out, "gpt2_legacy_past")
    assert cells[4] == "2 / 2" and cells[5] == "ok", cells
    res = compile_model(coverage.export("gpt2_legacy_past", tmp_path, ("fp16",))["fp16"], None, "sm_90")
    srcs = [k.compiled.source for k in res.kernels if k.region.kind == "attention"]
    assert len(srcs) == 2 and all("key_end(" in s and "(ask - asq)" in s for s in srcs)


def test_sam_windows_over_merged_expressions(tmp_path):
    # SAM's window un-partition slices padded windows back to the image: shape inference merges Min(8, minted)
    # into 8, which once made every tensor suspect and left both attentions (and all shape arithmetic) to ORT
    out = _swept(tmp_path, "--models", "sam_vision", "--dtypes", "fp16")
    cells = _cells(out, "sam_vision")
    assert cells[4] == "2 / 2" and cells[5] == "ok", cells
    assert int(cells[3].split("->")[1]) < 80, cells


def test_a_model_that_draws_and_one_with_cones_ort_folds(tmp_path):
    # ViT-MAE draws its masking noise on every call (the check seeds both models alike); BEiT's relative-position
    # index and bias come from constants alone, which ORT folds when a session starts: no kernel of ours
    # computes them (no pointwise region), and parity holds
    out = _swept(tmp_path, "--models", "vit_mae", "beit", "--dtypes", "fp32")
    mae, beit = _cells(out, "vit_mae"), _cells(out, "beit")
    assert mae[4] == "2 / 2" and mae[5] == "ok", mae
    assert beit[4] == "2 / 2" and beit[5] == "ok" and "pointwise" not in beit[2], beit


def test_torch_multihead_attention(tmp_path):
    # torchvision's ViT: nn.MultiheadAttention unflattens its packed projection to a target whose Slice bounds
    # come from a Mod of constants; shape inference leaves the heads without a size until the folds make those
    # constant and it runs again. Its fp16 model also made ORT's CPU EP crash at ORT_ENABLE_ALL (check's sessions)
    out = _swept(tmp_path, "--models", "torchvision_vit", "--dtypes", "fp16")
    cells = _cells(out, "torchvision_vit")
    assert cells[4] == "2 / 2" and cells[5] == "ok", cells


def test_sequence_first_multihead_attention(tmp_path):
    # WavLM runs torch's multi_head_attention_forward (sequence first, a gated relative position bias): its output
    # is flattened to [79 * batch, embed] for the out-projection, a product of run-time dims the node computes
    out = _swept(tmp_path, "--models", "wavlm", "--dtypes", "fp32")
    cells = _cells(out, "wavlm")
    assert cells[4] == "2 / 2" and cells[5] == "ok", cells


def test_repeated_nodes_of_the_fp16_converter_are_dropped():
    # onnxruntime's float16 converter can write one Cast several times under one name (DPT's torch.export)
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper

    cast = helper.make_node("Cast", ["x"], ["xc"], name="c", to=TP.FLOAT)
    m = helper.make_model(helper.make_graph([cast, cast, helper.make_node("Relu", ["xc"], ["y"]), cast], "g",
                                            [helper.make_tensor_value_info("x", TP.FLOAT16, [2])],
                                            [helper.make_tensor_value_info("y", TP.FLOAT, [2])]))
    coverage._drop_repeated_nodes(m)
    assert [n.op_type for n in m.graph.node] == ["Cast", "Relu"]
    onnx.checker.check_model(m)
