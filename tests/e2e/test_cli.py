"""The command line end to end: optimize + check on the demo encoder, and every kind of bad input
giving one line, exit code 2, and no output file."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path


import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP

import helpers
from helpers import model, node, vi, wrong_gelu
from ortfuse.cli import main
from ortfuse.demo import encoder


def _save(m: onnx.ModelProto, path: Path) -> Path:
    onnx.save(m, str(path))
    return path


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("demo")
    src = _save(encoder(layers=1, hidden=64, heads=2, ffn=128), d / "in.onnx")
    return src, d / "out.onnx"


def test_optimize_then_check_emulate(demo, capsys):
    src, dst = demo
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    assert main(["optimize", str(src), str(dst), "--arch", "sm_80,sm_90", "--report", str(dst) + ".md",
                 "--explain"]) == 0
    out = capsys.readouterr().out
    assert "regions fused:" in out and "kernels compiled:" in out and "est. DRAM saved:" in out
    assert hashlib.sha256(src.read_bytes()).hexdigest() == before  # the input is never modified
    m = onnx.load(str(dst))
    onnx.checker.check_model(m)
    assert m.ir_version <= 13 and any(o.domain == "ortfuse" for o in m.opset_import)
    fused = [n for n in m.graph.node if n.domain == "ortfuse"]
    assert fused and {f.name for f in m.functions} == {n.op_type for n in fused}
    assert main(["check", str(src), str(dst), "--emulate", "--input-shape", "hidden_states:2x9x64",
                 "--input-shape", "attention_mask:2x9"]) == 0
    assert "parity PASS" in capsys.readouterr().out
    report = Path(str(dst) + ".md").read_text()
    assert "## Fused regions" in report
    # each fused node's estimate as our kernel and as ORT's ops, at the hints and at batch 32 (what a GPU
    # timeline of the same nodes is compared with): ours the faster, or the search would not have fused it
    rows = [ln for ln in report.splitlines() if ln.startswith("| ortfuse_region_")]
    assert rows and "est. us, ours vs ORT's ops (hints / at batch 32)" in report
    for ln in rows:
        cells = ln.rstrip(" |").rsplit("| ", 1)[1].split(" / ")
        pairs = [tuple(float(v) for v in c.split(" vs ")) for c in cells]
        assert len(pairs) == 2 and all(0 < o for o, _ in pairs) and any(o < a for o, a in pairs), ln


def test_check_detects_a_wrong_kernel(demo, tmp_path, capsys):
    """A fused node whose function body differs from its kernel must fail `check --emulate`."""
    src, dst = demo
    bad = tmp_path / "bad.onnx"
    wrong_gelu(src, dst, bad)
    # whole-model parity runs the (now wrong) functions: it must fail too
    assert main(["check", str(src), str(bad), "--emulate"]) == 1
    assert "FAIL" in capsys.readouterr().out


def _bad_cases(tmp: Path):
    good = _save(encoder(layers=1, hidden=32, heads=2, ffn=64), tmp / "good.onnx")
    (tmp / "text.onnx").write_text("this is not a model")
    data = good.read_bytes()
    (tmp / "trunc.onnx").write_bytes(data[: len(data) // 3])
    unknown = model([node("Relu", ["x"], ["a"]), onnx.helper.make_node("NoSuchOp", ["a"], ["y"], name="mystery")],
                    [vi("x", TP.FLOAT, [2, 4])], [vi("y", TP.FLOAT, [2, 4])])
    _save(unknown, tmp / "unknown.onnx")
    return [
        (["optimize", str(tmp / "text.onnx")], "text.onnx"),
        (["optimize", str(tmp / "trunc.onnx")], "trunc.onnx"),
        (["optimize", str(tmp / "missing.onnx")], "missing.onnx"),
        (["optimize", str(tmp / "unknown.onnx")], "NoSuchOp"),
        (["optimize", str(good), "--input-shape", "hidden_states:1x8x99"], "hidden_states"),
        (["optimize", str(good), "--input-shape", "nope:1x8"], "nope"),
        (["optimize", str(good), "--input-shape", "hidden_states=1x8"], "hidden_states=1x8"),
        (["optimize", str(good), "--wgmma", "--arch", "sm_80,sm_90"], "--arch sm_90"),
        (["optimize", str(good), "--dim-hint", "sequence"], "NAME=VALUE"),
        (["optimize", str(good), "--dim-hint", "seq=\u00b2"], "NAME=VALUE"),
        (["optimize", str(good), "--dim-hint", "seq=99999999999999999999"], "NAME=VALUE"),
        (["optimize", str(good), "--dim-hint", "seq=3000000000"], "NAME=VALUE"),
        (["optimize", str(good), "--dim-hint", "seq=2000000"], "an integer from 1 to"),
        (["optimize", str(good), "--dim-hint", "nope=3"], "'nope' is not a symbolic dim"),
        (["optimize", str(good), "--dim-hint", "batch=2", "--dim-hint", "batch=3"], "'batch' given twice"),
    ]


def test_bad_input_one_line_exit_2_nothing_written(tmp_path, capsys):
    for argv, needle in _bad_cases(tmp_path):
        out = tmp_path / "out.onnx"
        rc = main(argv[:2] + [str(out)] + argv[2:])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, argv
        assert err and err[-1].startswith("ortfuse: error:") and needle in err[-1], (argv, err)
        assert not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_unsupported_dtype_is_left_to_ort(tmp_path):
    """Ops on element types ortfuse does not fuse (double) stay with ORT; the model still runs."""
    m = model([node("Relu", ["x"], ["a"]), node("Exp", ["a"], ["y"])], [vi("x", TP.DOUBLE, [2, 4])],
              [vi("y", TP.DOUBLE, [2, 4])])
    src = _save(m, tmp_path / "d.onnx")
    assert main(["optimize", str(src), str(tmp_path / "o.onnx"), "--explain"]) == 0
    out = onnx.load(str(tmp_path / "o.onnx"))
    assert not [n for n in out.graph.node if n.domain == "ortfuse"]


def test_convs_on_symbolic_images_fuse_and_explain_lists_refused_anchors(tmp_path, capsys):
    """A Conv on a symbolic image size fuses (its output size is computed at run time); a Conv refused as an
    anchor (grouped) is listed with its reason."""
    from helpers import const

    rng = np.random.default_rng(0)
    m = model([node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], strides=[2, 2]), node("Sigmoid", ["y"], ["z"]),
               node("Conv", ["z", "g"], ["u"], group=2), node("Tanh", ["u"], ["v"])],
              [vi("x", TP.FLOAT16, ["n", 8, "h", "w"])], [vi("v", TP.FLOAT16, None)],
              [const("w", rng.standard_normal((16, 8, 3, 3)) * 0.1, np.float16),
               const("g", rng.standard_normal((16, 8, 1, 1)) * 0.1, np.float16)])
    src = _save(m, tmp_path / "c.onnx")
    assert main(["optimize", str(src), str(tmp_path / "o.onnx"), "--explain"]) == 0
    out = capsys.readouterr().out
    assert "not fused: Conv" in out and "grouped convolution (group=2" in out, out
    assert "symbolic image sizes: 1 fused Convs index images of run-time size" in out, out
    out_nodes = onnx.load(str(tmp_path / "o.onnx")).graph.node
    assert len([n for n in out_nodes if n.domain == "ortfuse"]) == 1
    kept = [(n.op_type, list(n.input)) for n in out_nodes if n.domain != "ortfuse"]
    assert kept == [("Conv", ["z", "g"]), ("Tanh", ["u"])], kept  # the grouped Conv, and a Tanh alone


def test_summary_counts_conv_chains(tmp_path, capsys):
    from helpers import conv_chain

    src = _save(conv_chain(TP.FLOAT16, 16, 32, 1, hw=(8, 8)), tmp_path / "c.onnx")
    assert main(["optimize", str(src), str(tmp_path / "o.onnx")]) == 0
    out = capsys.readouterr().out
    assert "conv chains:          1 Convs compute their input image in their gather" in out, out
    assert "regions fused:        1 (1 gemm)" in out, out


def test_summary_counts_gated_gemms_and_rotations_in_attention(tmp_path, capsys):
    from helpers import gated_mlp, rope_attention

    src = _save(gated_mlp(TP.FLOAT16, 64, 96, ("n", 7))[0], tmp_path / "g.onnx")
    assert main(["optimize", str(src), str(tmp_path / "o.onnx")]) == 0
    out = capsys.readouterr().out
    assert "gated GEMMs:          1 GEMMs compute a gated activation's two halves" in out, out
    src = _save(rope_attention(TP.FLOAT16), tmp_path / "r.onnx")
    assert main(["optimize", str(src), str(tmp_path / "o2.onnx")]) == 0
    out = capsys.readouterr().out
    assert "rotary embeddings:    2 applied by the attention kernels" in out, out


def test_console_script_and_module_entry(tmp_path):
    r = subprocess.run([sys.executable, "-m", "ortfuse", "optimize", str(tmp_path / "none.onnx"),
                        str(tmp_path / "o.onnx")], capture_output=True, text=True)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_python_api_returns_a_new_model():
    m = encoder(layers=1, hidden=32, heads=2, ffn=64)
    before = m.SerializeToString()
    import ortfuse
    out = ortfuse.optimize(m)
    assert m.SerializeToString() == before
    assert any(n.domain == "ortfuse" for n in out.graph.node)



def _strided(tmp: Path) -> Path:
    """x[n, 4] -> Reshape to [n/2, 8]: runs only for even n, so DEFAULT_DIMS' 8 works and 5 does not."""
    shape = onnx.numpy_helper.from_array(np.array([-1, 8], dtype=np.int64), "s")
    m = model([node("Reshape", ["x", "s"], ["r"]), node("Sigmoid", ["r"], ["y"])],
              [vi("x", TP.FLOAT, ["n", 4])], [vi("y", TP.FLOAT, None)], [shape])
    return _save(m, tmp / "strided.onnx")


def test_check_feeds_the_shapes_the_optimized_model_was_compiled_for(tmp_path, capsys):
    src = _strided(tmp_path)
    dst = tmp_path / "o.onnx"
    assert main(["optimize", str(src), str(dst), "--input-shape", "x:6x4"]) == 0
    capsys.readouterr()
    assert main(["check", str(src), str(dst), "--emulate"]) == 0  # 6x4 from the pins, not the default 8
    assert "parity PASS" in capsys.readouterr().out
    # a shape the optimized model was not compiled for: one line, exit 2
    assert main(["check", str(src), str(dst), "--input-shape", "x:8x4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("ortfuse: error: --input-shape x:8x4 contradicts") and "x:6x4" in err[-1]
    assert main(["check", str(src), str(dst), "--input-shape", "x:6"]) == 2
    assert "x:6x4" in capsys.readouterr().err


def test_check_reports_shapes_the_original_cannot_run(tmp_path, capsys):
    src = _strided(tmp_path)
    dst = tmp_path / "o.onnx"
    assert main(["optimize", str(src), str(dst)]) == 0  # n stays symbolic
    capsys.readouterr()
    assert main(["check", str(src), str(dst), "--input-shape", "x:5x4"]) == 2  # 20 elements are not k*8
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ortfuse: error: ORT could not run") and "x:5x4" in err[0]
    assert "--input-shape" in err[0] and "Traceback" not in err[0]
    assert main(["check", str(src), str(dst), "--input-shape", "x:4x4", "--emulate"]) == 0


def test_check_reports_a_model_ort_cannot_load(tmp_path, capsys):
    # ORT 1.31 has no RandomUniformLike at opset 22 (torch.export's ViT-MAE at opset 23): there is no reference
    # to compare with, which check says in one line about the input, not as a parity failure
    m = model([node("RandomUniformLike", ["x"], ["r"], seed=1.0), node("Add", ["x", "r"], ["y"])],
              [vi("x", TP.FLOAT, [2, 4])], [vi("y", TP.FLOAT, None)], opset=22)
    src, dst = _save(m, tmp_path / "r.onnx"), tmp_path / "o.onnx"
    assert main(["optimize", str(src), str(dst)]) == 0
    capsys.readouterr()
    assert main(["check", str(src), str(dst)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ortfuse: error: ORT cannot load {src}")
    assert "RandomUniformLike" in err[0]


def test_ln_fold_switch(tmp_path, monkeypatch, capsys):
    # a pre-LN fp16 block: --ln-fold on folds gamma into the weight (a new initializer), off leaves it;
    # a bad ORTFUSE_LN_FOLD is one line and exit 2
    k, n = 64, 96
    rng = np.random.default_rng(0)
    inits = [onnx.numpy_helper.from_array((rng.standard_normal(s) * 0.2 + o).astype(np.float16), name)
             for name, s, o in (("w", (k, n), 0.0), ("b", (n,), 0.0), ("g", (k,), 1.0), ("e", (k,), 0.0))]
    m = model([node("LayerNormalization", ["x", "g", "e"], ["y"], axis=-1), node("MatMul", ["y", "w"], ["p"]),
               node("Add", ["p", "b"], ["z"]), node("Relu", ["z"], ["out"])],
              [vi("x", TP.FLOAT16, ["n", k])], [vi("out", TP.FLOAT16, None)], inits)
    src = _save(m, tmp_path / "ln.onnx")
    for mode, folded in (("on", True), ("off", False)):
        dst = tmp_path / f"{mode}.onnx"
        capsys.readouterr()
        assert main(["optimize", str(src), str(dst), "--ln-fold", mode]) == 0
        names = {t.name for t in onnx.load(str(dst)).graph.initializer}
        assert ("w__ortfuse_ln" in names) == folded, names
        assert ("1 LayerNorms folded into the GEMMs" in capsys.readouterr().out) == folded
    monkeypatch.setenv("ORTFUSE_LN_FOLD", "sometimes")
    capsys.readouterr()
    assert main(["optimize", str(src), str(tmp_path / "bad.onnx")]) == 2
    assert "LayerNorm fold mode 'sometimes'" in capsys.readouterr().err


def test_dim_hints_reach_the_cost_model_and_leave_shapes_symbolic(tmp_path, capsys):
    from ortfuse.demo import encoder

    src = _save(encoder(layers=1, hidden=32, heads=2, ffn=64), tmp_path / "e.onnx")
    out = tmp_path / "o.onnx"
    assert main(["optimize", str(src), str(out), "--dim-hint", "seq=16", "--dim-hint", "batch=4"]) == 0
    assert "batch=4, seq=16" in capsys.readouterr().out
    dims = [d.dim_param for d in onnx.load(str(out)).graph.input[0].type.tensor_type.shape.dim[:2]]
    assert dims == ["batch", "seq"]


def test_layout_switch(tmp_path, monkeypatch, capsys):
    # a ConvNeXt stage: --layout blocks keeps its residual stream channels-last (the second block's depthwise
    # Conv then joins its LayerNorm's kernel: no Conv left to ORT but the first block's) and the report says
    # so; model leaves both Convs to ORT; a bad ORTFUSE_LAYOUT is one line and exit 2
    from helpers import convnext_stage
    src = _save(convnext_stage(TP.FLOAT16, c=16, depth=2, tail="ln"), tmp_path / "stage.onnx")
    for mode, convs in (("blocks", 1), ("model", 2)):
        dst, rep = tmp_path / f"{mode}.onnx", tmp_path / f"{mode}.md"
        capsys.readouterr()
        assert main(["optimize", str(src), str(dst), "--layout", mode, "--report", str(rep)]) == 0
        assert sum(n.op_type == "Conv" for n in onnx.load(str(dst)).graph.node) == convs
        assert ("## Residual-stream layout" in rep.read_text()) == (mode == "blocks")
        assert ("2 residual ops kept in their blocks' layout" in capsys.readouterr().err) == (mode == "blocks")
    _bad_setting(monkeypatch, capsys, src, tmp_path, "ORTFUSE_LAYOUT", "sideways", "layout mode 'sideways'")


def test_ort_attention_switch(tmp_path, monkeypatch, capsys):
    # --ort-attention on hands the attention pattern to ORT's MultiHeadAttention and the report says so; off
    # keeps our kernel; a bad ORTFUSE_ORT_ATTENTION is one line and exit 2
    from helpers import plain_attention
    src = _save(plain_attention(TP.FLOAT16, heads=2, head=16), tmp_path / "attn.onnx")
    for mode in ("on", "off"):
        dst, rep = tmp_path / f"{mode}.onnx", tmp_path / f"{mode}.md"
        capsys.readouterr()
        assert main(["optimize", str(src), str(dst), "--ort-attention", mode, "--report", str(rep)]) == 0
        ops = [n.op_type for n in onnx.load(str(dst)).graph.node]
        assert ("MultiHeadAttention" in ops) == (mode == "on") and ("Softmax" not in ops)
        assert ("## ORT's fused attention" in rep.read_text()) == (mode == "on")
        assert ("-> ORT's MultiHeadAttention" in capsys.readouterr().err) == (mode == "on")
    _bad_setting(monkeypatch, capsys, src, tmp_path, "ORTFUSE_ORT_ATTENTION", "maybe", "ORT attention mode 'maybe'")


def test_k_rope_switch(tmp_path, monkeypatch, capsys):
    # --k-rope once gives K's rotation a kernel of its own (the summary says so), kernel keeps it in the
    # attention kernel; a bad ORTFUSE_K_ROPE is one line and exit 2
    from helpers import rope_attention
    src = _save(rope_attention(TP.FLOAT16), tmp_path / "rope.onnx")
    for mode, fused in (("once", 2), ("kernel", 1)):
        dst = tmp_path / f"{mode}.onnx"
        capsys.readouterr()
        assert main(["optimize", str(src), str(dst), "--k-rope", mode, "--ort-attention", "off"]) == 0
        assert sum(n.domain == "ortfuse" for n in onnx.load(str(dst)).graph.node) == fused
        assert ("attention kernels read K rotated once" in capsys.readouterr().out) == (mode == "once")
    _bad_setting(monkeypatch, capsys, src, tmp_path, "ORTFUSE_K_ROPE", "twice", "K rotation mode 'twice'")


def _bad_setting(monkeypatch, capsys, src, tmp_path, env: str, value: str, says: str) -> None:
    """A bad setting in the environment: one line naming it, exit status 2."""
    monkeypatch.setenv(env, value)
    capsys.readouterr()
    assert main(["optimize", str(src), str(tmp_path / "bad.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]


def test_a_dim_merged_into_a_size_says_how_to_fuse_what_it_left(tmp_path, capsys):
    """Symbolic inference merges 's' into the constant's 16 where they broadcast (at run time 's' may be 1), so
    every region reading a tensor of that size stays with ORT; the summary names the merge and the inputs whose
    shapes --input-shape would fix, and with them the chain fuses."""
    from onnx import numpy_helper
    c = numpy_helper.from_array(np.random.default_rng(0).random((1, 16, 8), np.float32), "c")
    m = model([node("Add", ["x", "c"], ["a"]), node("Relu", ["a"], ["b"]), node("Mul", ["b", "x"], ["d"]),
               node("Tanh", ["d"], ["out"])], [vi("x", TP.FLOAT, ["n", "s", 8])], [vi("out", TP.FLOAT, None)], [c],
              opset=17)
    src = _save(m, tmp_path / "in.onnx")
    assert main(["optimize", str(src), str(tmp_path / "out.onnx")]) == 0
    out = capsys.readouterr().out
    assert "regions fused:        0" in out
    assert ("merged dims:          shape inference merged 's' into 16: the regions reading 4 tensors of a merged "
            "size") in out
    assert "give the shapes of x with --input-shape" in out
    assert main(["optimize", str(src), str(tmp_path / "out.onnx"), "--input-shape", "x:2x16x8"]) == 0
    out = capsys.readouterr().out
    assert "merged dims" not in out and "regions fused:        1" in out


def test_check_seeds_random_draws_so_outputs_compare(tmp_path, capsys):
    # ViT-MAE's masking: noise drawn per call, its argsort choosing which rows go on; fused work after it.
    # Unseeded, two sessions draw differently and no output compares; the check seeds both models alike
    # (the input model is left as it was)
    nodes = [node("RandomUniformLike", ["x"], ["noise"], dtype=TP.FLOAT),
             node("ReduceSum", ["noise", "ax"], ["score"], keepdims=0),
             node("TopK", ["score", "k"], ["v", "keep"], axis=1), node("Unsqueeze", ["keep", "ax"], ["idx"]),
             node("Expand", ["idx", "shp"], ["idx2"]), node("GatherElements", ["x", "idx2"], ["g"], axis=1),
             node("Mul", ["g", "g"], ["sq"]), node("Add", ["sq", "g"], ["h"]), node("Tanh", ["h"], ["y"])]
    m = model(nodes, [vi("x", TP.FLOAT, [2, 6, 8])], [vi("y", TP.FLOAT, [2, 3, 8])],
              [helpers.const("ax", [2], np.int64), helpers.const("k", [3], np.int64),
               helpers.const("shp", [2, 3, 8], np.int64)])
    src = _save(m, tmp_path / "mae.onnx")
    before = src.read_bytes()
    dst = tmp_path / "o.onnx"
    assert main(["optimize", str(src), str(dst)]) == 0
    capsys.readouterr()
    assert main(["check", str(src), str(dst), "--emulate"]) == 0
    out = capsys.readouterr().out
    assert "parity PASS" in out and "random draws (1 RandomUniformLike) given fixed seeds" in out
    assert src.read_bytes() == before
    from ortfuse.check import _seeded
    seeded, drawn = _seeded(m)
    assert drawn == "1 RandomUniformLike" and not any(a.name == "seed" for a in m.graph.node[0].attribute)
    assert _seeded(seeded) == (seeded, "")  # a seeded draw is left as it is
