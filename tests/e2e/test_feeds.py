"""Random model inputs (ortfuse/feeds.py): one value per symbolic dim name across the inputs, dims that are
expressions of others (a decoder's mask over past + new tokens, as optimum names it) evaluated from theirs,
and the bench harness's feeds on the same binding."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from ortfuse.feeds import bind_dims, random_feeds
from ortfuse.rewriter.shapes import eval_dim, is_dim_expression

TOTAL = "past_sequence_length + sequence_length"


def _decoder_inputs() -> onnx.ModelProto:
    """The inputs of a decoder step with a KV cache, named as optimum exports them (no nodes needed)."""
    ins = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
           helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", TOTAL]),
           helper.make_tensor_value_info("past_key_values.0.key", TensorProto.FLOAT,
                                         ["batch_size", 2, "past_sequence_length", 16])]
    g = helper.make_graph([], "decoder", ins, [])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_an_expression_dim_is_evaluated_from_its_names():
    m = _decoder_inputs()
    assert bind_dims(m) == {"batch_size": 2, "sequence_length": 8, "past_sequence_length": 8, TOTAL: 16}
    feeds = random_feeds(m)
    assert feeds["attention_mask"].shape == (2, 16) and feeds["past_key_values.0.key"].shape == (2, 2, 8, 16)


def test_a_given_shape_binds_its_names_for_every_input():
    # one new token at batch 4: the mask and the cache follow the ids' batch, the mask spans past + 1
    feeds = random_feeds(_decoder_inputs(), {"input_ids": [4, 1]})
    assert {k: v.shape for k, v in feeds.items()} == {
        "input_ids": (4, 1), "attention_mask": (4, 9), "past_key_values.0.key": (4, 2, 8, 16)}


def test_a_value_given_for_an_expression_solves_for_its_one_open_name():
    bound = bind_dims(_decoder_inputs(), {"input_ids": [1, 1], "attention_mask": [1, 20]})
    assert bound["past_sequence_length"] == 19
    # two open names: nothing to solve, both at their defaults (and the given shape used as given)
    feeds = random_feeds(_decoder_inputs(), {"attention_mask": [2, 20]})
    assert feeds["attention_mask"].shape == (2, 20) and feeds["input_ids"].shape == (2, 8)


def test_dim_names_with_punctuation_are_names():
    assert is_dim_expression("past + seq") and is_dim_expression("2*sequence") and is_dim_expression("floor(s/2)")
    assert not any(map(is_dim_expression, ("p2o.DynamicDimension.0", "seq-len", "batch_size", "unk__3")))
    assert eval_dim("2*floor(seq/3) + 1", {"seq": 10}, lambda n: 0) == 7
    assert eval_dim("p2o.DynamicDimension.0 + 1", {"p2o.DynamicDimension.0": 4}, lambda n: 0) == 5
    assert eval_dim("past + new", {"past": 3}, lambda n: 100) == 103  # a name not known: its default
    assert eval_dim("__import__('os')", {}, lambda n: 1) is None  # arithmetic only
    assert eval_dim("seq**99999999", {"seq": 2}, lambda n: 1) is None


def test_harness_feeds_evaluate_the_decoder_mask():
    from ortfuse.bench.harness import make_feeds
    feeds = make_feeds(_decoder_inputs(), batch=3, dims={"sequence_length": 1, "past_sequence_length": 31})
    assert feeds["attention_mask"].shape == (3, 32) and feeds["past_key_values.0.key"].shape == (3, 2, 31, 16)
    assert feeds["input_ids"].shape == (3, 1)
    assert np.all(feeds["attention_mask"][0] == 1) and feeds["attention_mask"].min() == 0  # padding on later rows


def test_an_empty_past_binds_zero():
    # the cache given empty: the other cache input and the mask follow; a mask as long as the new tokens solves
    # for an empty past
    feeds = random_feeds(_decoder_inputs(), {"past_key_values.0.key": [2, 2, 0, 16], "input_ids": [2, 4]})
    assert feeds["attention_mask"].shape == (2, 4)
    bound = bind_dims(_decoder_inputs(), {"input_ids": [2, 4], "attention_mask": [2, 4]})
    assert bound["past_sequence_length"] == 0 and bound[TOTAL] == 4


def test_8_bit_data_a_dequantizer_reads_spans_its_range():
    """An int8 or uint8 input that a DequantizeLinear reads is quantized data, not an index: its whole range
    (values in {0, 1} would dequantize to two values); other integer inputs keep theirs."""
    from onnx import numpy_helper
    TP = TensorProto
    nodes = [helper.make_node("DequantizeLinear", ["q", "s"], ["d"]),
             helper.make_node("DequantizeLinear", ["u", "s"], ["e"]),
             helper.make_node("Cast", ["i"], ["f"], to=TP.FLOAT)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("q", TP.INT8, [64, 64]),
                                       helper.make_tensor_value_info("u", TP.UINT8, [64, 64]),
                                       helper.make_tensor_value_info("i", TP.INT8, [8])],
                          [helper.make_tensor_value_info(t, TP.FLOAT, None) for t in "def"],
                          [numpy_helper.from_array(np.array(0.1, np.float32), "s")])
    feeds = random_feeds(helper.make_model(g))
    assert feeds["q"].min() == -128 and feeds["q"].max() == 127
    assert feeds["u"].min() == 0 and feeds["u"].max() == 255
    assert set(np.unique(feeds["i"])) <= {0, 1}
