from __future__ import annotations

import pytest

from ortfuse.bench import roofline


def test_matmul_work_is_counted_by_hand():
  b, m, k, n = 4, 8, 16, 32
  work = roofline.count_work(roofline.matmul_model(b, m, k, n), {"x": [b, m, k]})
  assert work.flops == 2 * b * m * n * k
  assert work.weight_bytes == 4 * k * n
  assert work.io_bytes == 4 * (b * m * k + b * m * n)
  assert work.dtype == "fp32"


def test_ideal_time_takes_the_larger_term():
  work = roofline.Work(flops=2_000, weight_bytes=600, io_bytes=400, dtype="fp32")
  dev = roofline.Device("fake", bandwidth=1_000.0, flops={"fp32": 1_000.0}, method="test")
  ideal = roofline.ideal_time(work, dev)
  assert ideal.memory_s == pytest.approx(1.0) and ideal.compute_s == pytest.approx(2.0)
  assert ideal.seconds == pytest.approx(2.0) and ideal.bound == "compute"
  assert dev.peak("fp16") == 1_000.0                    # falls back to fp32 when fp16 was not measured


def test_cpu_device_is_measured_positive():
  dev = roofline.measure_device("cpu")
  assert dev.bandwidth > 1e8 and dev.flops["fp32"] > 1e8


def test_tiny_bert_flops_match_the_architecture():
  from ortfuse.bench import zoo
  pytest.importorskip("transformers")
  path = zoo.build("bert", tiny=True)
  b, s, h, heads, inter, layers = 2, 16, 64, 4, 256, 2
  per_layer = 2 * b * s * h * (3 * h + h + 2 * inter) + 2 * 2 * b * heads * s * s * (h // heads)
  pooler = 2 * b * h * h
  work = roofline.count_work(path, {n: [b, s] for n in ("input_ids", "attention_mask", "token_type_ids")})
  assert work.flops == layers * per_layer + pooler
