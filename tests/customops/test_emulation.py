"""CPU emulation of kernels (customops/include/ortfuse_emu.h + customops/emulate.py): hand-written kernels on
ortfuse_kernel.h run through g++ and are checked against numpy / ORT; every source is also compiled by
NVRTC for sm_90 to prove it is valid CUDA as written."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ortfuse.customops import emulate
from ortfuse.customops.emulate import EmulationError, compile_emulated
from ortfuse.errors import CompileError

INCLUDE = Path(emulate.__file__).resolve().parent / "include"

ELEMENTWISE = r"""
#include "ortfuse_kernel.h"
// y = x * 1.5 + 0.25, N-wide vector accesses plus a scalar tail, grid-stride.
template <class T, int N> __device__ __forceinline__ void affine(const OfzArgs& a) {
  const T* __restrict__ x = (const T*)a.ptr[0];
  T* __restrict__ y = (T*)a.ptr[1];
  const ofz_i64 n = a.dim[0], nvec = n / N, stride = (ofz_i64)gridDim.x * blockDim.x;
  const ofz_i64 first = (ofz_i64)blockIdx.x * blockDim.x + threadIdx.x;
  for (ofz_i64 i = first; i < nvec; i += stride) {
    T v[N], o[N];
    ofz::load_vec<N>(x + i * N, v);
#pragma unroll
    for (int k = 0; k < N; ++k) o[k] = ofz::from_f32<T>(ofz::to_f32(v[k]) * 1.5f + 0.25f);
    ofz::store_vec<N>(y + i * N, o);
  }
  for (ofz_i64 i = nvec * N + first; i < n; i += stride) y[i] = ofz::from_f32<T>(ofz::to_f32(x[i]) * 1.5f + 0.25f);
}
extern "C" __global__ void __launch_bounds__(128) ew_f32(const OfzArgs a) { affine<float, 4>(a); }
extern "C" __global__ void __launch_bounds__(128) ew_f16(const OfzArgs a) { affine<__half, 8>(a); }
extern "C" __global__ void __launch_bounds__(128) ew_bf16(const OfzArgs a) { affine<__nv_bfloat16, 8>(a); }

// Reverse each block's slice through dynamic shared memory.
extern "C" __global__ void rev_dyn(const OfzArgs a) {
  OFZ_DYNAMIC_SMEM(float, buf);
  const float* x = (const float*)a.ptr[0];
  float* y = (float*)a.ptr[1];
  const ofz_i64 base = (ofz_i64)blockIdx.x * blockDim.x;
  buf[threadIdx.x] = x[base + threadIdx.x];
  __syncthreads();
  y[base + threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}
OFZ_EMU_ENTRY(ew_f32)
OFZ_EMU_ENTRY(ew_f16)
OFZ_EMU_ENTRY(ew_bf16)
OFZ_EMU_ENTRY(rev_dyn)
"""

REDUCE = r"""
#include "ortfuse_kernel.h"
// Row sums and maxima of a (rows, cols) fp32 matrix, BLOCK / TPR rows per block. Every thread runs the
// same number of iterations because row_reduce contains __syncthreads.
template <int TPR, int BLOCK> __device__ __forceinline__ void rowstats(const OfzArgs& a) {
  __shared__ float scratch[BLOCK / 32];
  const float* x = (const float*)a.ptr[0];
  float* sum = (float*)a.ptr[1];
  float* mx = (float*)a.ptr[2];
  const ofz_i64 rows = a.dim[0], cols = a.dim[1];
  constexpr int RPB = BLOCK / TPR;
  const int t = threadIdx.x % TPR;
  for (ofz_i64 base = (ofz_i64)blockIdx.x * RPB; base < rows; base += (ofz_i64)gridDim.x * RPB) {
    const ofz_i64 row = base + threadIdx.x / TPR;
    float s = 0.f, m = -__int_as_float(0x7f800000);
    if (row < rows)
      for (ofz_i64 c = t; c < cols; c += TPR) { const float v = x[row * cols + c]; s += v; m = fmaxf(m, v); }
    s = ofz::row_reduce<ofz::SumOp, TPR>(s, scratch);
    m = ofz::row_reduce<ofz::MaxOp, TPR>(m, scratch);
    if (row < rows && t == 0) { sum[row] = s; mx[row] = m; }
  }
}
extern "C" __global__ void rows32(const OfzArgs a) { rowstats<32, 256>(a); }
extern "C" __global__ void rows64(const OfzArgs a) { rowstats<64, 256>(a); }
extern "C" __global__ void rows256(const OfzArgs a) { rowstats<256, 512>(a); }

// Block sum: warp partials in shared memory, then only warp 0 reduces them (divergent warp reduce).
extern "C" __global__ void block_sum(const OfzArgs a) {
  __shared__ float partial[32];
  const float* x = (const float*)a.ptr[0];
  float* y = (float*)a.ptr[1];
  const ofz_i64 n = a.dim[0];
  float s = 0.f;
  for (ofz_i64 i = (ofz_i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (ofz_i64)gridDim.x * blockDim.x)
    s += x[i];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  s = ofz::warp_reduce<ofz::SumOp>(s);
  if (lane == 0) partial[warp] = s;
  __syncthreads();
  if (warp == 0) {
    float v = lane < (int)(blockDim.x / 32) ? partial[lane] : 0.f;
    v = ofz::warp_reduce<ofz::SumOp>(v);
    if (lane == 0) y[blockIdx.x] = v;
  }
}

// Threads outside [lo, hi) return before the barrier; the rest reverse their slice through shared memory.
extern "C" __global__ void early_exit(const OfzArgs a) {
  __shared__ float buf[1024];
  const float* x = (const float*)a.ptr[0];
  float* y = (float*)a.ptr[1];
  const int lo = (int)a.dim[0], hi = (int)a.dim[1], t = threadIdx.x;
  if (t < lo || t >= hi) return;
  const ofz_i64 base = (ofz_i64)blockIdx.x * blockDim.x;
  buf[t] = x[base + t];
  __syncthreads();
  y[base + t] = buf[lo + hi - 1 - t];
  __syncthreads();
  y[base + t] += 1.0f;
}

// Every shuffle flavour, width and a few types; 6 results per thread.
extern "C" __global__ void shuffles(const OfzArgs a) {
  long long* out = (long long*)a.ptr[0];
  const int t = blockIdx.x * blockDim.x + threadIdx.x, lane = threadIdx.x % 32;
  long long* o = out + 6 * (ofz_i64)t;
  o[0] = __shfl_down_sync(0xffffffffu, (1LL << 40) + t, 3);
  o[1] = __shfl_up_sync(0xffffffffu, t, 5, 16);
  o[2] = (long long)__shfl_sync(0xffffffffu, (float)t, 7 + 8 * (lane & 1), 8);
  o[3] = (long long)__shfl_xor_sync(0xffffffffu, (double)t, 9, 16);
  o[4] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  o[5] = __shfl_xor_sync(lane < 16 ? 0x0000ffffu : 0xffff0000u, t, 1);  // two disjoint groups
}
OFZ_EMU_ENTRY(rows32)
OFZ_EMU_ENTRY(rows64)
OFZ_EMU_ENTRY(rows256)
OFZ_EMU_ENTRY(block_sum)
OFZ_EMU_ENTRY(early_exit)
OFZ_EMU_ENTRY(shuffles)
"""

CONVERT = r"""
#include "ortfuse_kernel.h"
#define GRID_STRIDE(i, n) \
  for (ofz_i64 i = (ofz_i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (ofz_i64)gridDim.x * blockDim.x)
extern "C" __global__ void h2f(const OfzArgs a) {
  GRID_STRIDE(i, a.dim[0]) ((float*)a.ptr[1])[i] = __half2float(((const __half*)a.ptr[0])[i]);
}
extern "C" __global__ void f2h(const OfzArgs a) {
  GRID_STRIDE(i, a.dim[0]) ((__half*)a.ptr[1])[i] = __float2half(((const float*)a.ptr[0])[i]);
}
extern "C" __global__ void b2f(const OfzArgs a) {
  GRID_STRIDE(i, a.dim[0]) ((float*)a.ptr[1])[i] = ofz::to_f32(((const __nv_bfloat16*)a.ptr[0])[i]);
}
extern "C" __global__ void f2b(const OfzArgs a) {
  GRID_STRIDE(i, a.dim[0]) ((__nv_bfloat16*)a.ptr[1])[i] = ofz::from_f32<__nv_bfloat16>(((const float*)a.ptr[0])[i]);
}
OFZ_EMU_ENTRY(h2f)
OFZ_EMU_ENTRY(f2h)
OFZ_EMU_ENTRY(b2f)
OFZ_EMU_ENTRY(f2b)
"""

BROKEN = r"""
#include "ortfuse_kernel.h"
// Upper half-warps leave while the lower half waits for them at a full-warp shuffle.
extern "C" __global__ void partner_exit(const OfzArgs a) {
  if (threadIdx.x % 32 >= 16) return;
  ((float*)a.ptr[0])[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
// Lane 0 waits at __syncthreads while its warp waits for it at a shuffle.
extern "C" __global__ void barrier_vs_shuffle(const OfzArgs a) {
  if (threadIdx.x == 0) __syncthreads();
  ((float*)a.ptr[0])[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
// A mask that leaves out the calling lane.
extern "C" __global__ void bad_mask(const OfzArgs a) {
  ((float*)a.ptr[0])[threadIdx.x] = __shfl_sync(0x1u, 1.0f, 0);
}
extern "C" __global__ void fill(const OfzArgs a) { ((float*)a.ptr[0])[threadIdx.x] = 3.0f; }
OFZ_EMU_ENTRY(partner_exit)
OFZ_EMU_ENTRY(barrier_vs_shuffle)
OFZ_EMU_ENTRY(bad_mask)
OFZ_EMU_ENTRY(fill)
"""

SOURCES = {"elementwise": ELEMENTWISE, "reduce": REDUCE, "convert": CONVERT, "broken": BROKEN}


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ORTFUSE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def mods() -> dict[str, emulate.EmulatedModule]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # g++ runs outside the GIL
        return dict(zip(SOURCES, pool.map(compile_emulated, SOURCES.values())))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_same_source_compiles_with_nvrtc(name: str) -> None:
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    import nvidia.cu13
    cuda_inc = os.path.join(list(nvidia.cu13.__path__)[0], "include")
    prog = nvrtc.createProgram(SOURCES[name], f"{name}.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, ["--gpu-architecture=sm_90", f"-I{cuda_inc}", f"-I{INCLUDE}", "-std=c++17"])
        except Exception:
            pytest.fail(nvrtc.getProgramLog(prog))
        assert len(nvrtc.getCUBIN(prog)) > 0
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("n", [1, 7, 4096 + 13])
def test_elementwise_vectorized(mods, n: int) -> None:
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    for entry, dt in [("ew_f32", np.float32), ("ew_f16", np.float16), ("ew_bf16", ml_dtypes.bfloat16)]:
        xs = x.astype(dt)
        y = np.full(n, np.nan, dt)
        mods["elementwise"].launch(entry, 3, 128, [xs, y], [n])
        want = (xs.astype(np.float32) * np.float32(1.5) + np.float32(0.25)).astype(dt)
        np.testing.assert_array_equal(y.view(np.uint16 if dt != np.float32 else np.uint32),
                                      want.view(np.uint16 if dt != np.float32 else np.uint32), err_msg=entry)


def test_vector_access_on_a_misaligned_address_fails_as_on_a_gpu(mods) -> None:
    # ew_f32 reads and writes float4: 16-byte placement runs, 8-byte placement faults on a GPU and fails here
    x, y = np.ones(64, np.float32), np.zeros(64, np.float32)
    mods["elementwise"].launch("ew_f32", 1, 128, [x, y], [64], align=[16, 16])
    assert (y == 1.75).all()
    with pytest.raises(EmulationError, match="16-byte vector access at 0x[0-9a-f]+ is misaligned"):
        mods["elementwise"].launch("ew_f32", 1, 128, [x, y], [64], align=[8, 16])
    with pytest.raises(ValueError, match="1 alignments for 2 arguments"):
        mods["elementwise"].launch("ew_f32", 1, 128, [x, y], [64], align=[16])


def test_dynamic_shared_memory(mods) -> None:
    x = np.arange(4 * 96, dtype=np.float32)
    y = np.zeros_like(x)
    mods["elementwise"].launch("rev_dyn", 4, 96, [x, y], [], smem=96 * 4)
    np.testing.assert_array_equal(y, x.reshape(4, 96)[:, ::-1].ravel())


@pytest.mark.parametrize("entry,tpr", [("rows32", 32), ("rows64", 64), ("rows256", 256)])
@pytest.mark.parametrize("cols", [1, 31, 33, 257, 1001])
def test_row_reduce(mods, entry: str, tpr: int, cols: int) -> None:
    rows = 37  # not a multiple of rows-per-block; grid 3 also exercises the grid-stride loop
    x = np.random.default_rng(cols).standard_normal((rows, cols)).astype(np.float32)
    s, m = np.full(rows, np.nan, np.float32), np.full(rows, np.nan, np.float32)
    mods["reduce"].launch(entry, 3, 512 if tpr == 256 else 256, [x, s, m], [rows, cols])
    np.testing.assert_allclose(s, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(m, x.max(1))


def test_row_reduce_matches_ort(mods) -> None:
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper
    rows, cols = 19, 300
    g = helper.make_graph([helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, cols])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows])],
                          [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    x = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    (want,) = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    s, mx = np.empty(rows, np.float32), np.empty(rows, np.float32)
    mods["reduce"].launch("rows64", 2, 256, [x, s, mx], [rows, cols])
    np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [96, 1024])
def test_divergent_warp_reduce(mods, block: int) -> None:
    n, grid = 50_000, 5
    x = np.random.default_rng(block).standard_normal(n).astype(np.float32)
    y = np.full(grid, np.nan, np.float32)
    mods["reduce"].launch("block_sum", grid, block, [x, y], [n])
    np.testing.assert_allclose(y.astype(np.float64).sum(), x.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("lo,hi", [(0, 100), (150, 256), (40, 41), (33, 200)])
def test_early_exit_then_syncthreads(mods, lo: int, hi: int) -> None:
    block, grid = 256, 3
    x = np.random.default_rng(lo).standard_normal(grid * block).astype(np.float32)
    y = np.full(grid * block, -7.0, np.float32)
    mods["reduce"].launch("early_exit", grid, block, [x, y], [lo, hi])
    want = np.full((grid, block), -7.0, np.float32)
    want[:, lo:hi] = x.reshape(grid, block)[:, lo:hi][:, ::-1] + 1.0
    np.testing.assert_array_equal(y.reshape(grid, block), want)


def _shuffle_reference(nthreads: int) -> np.ndarray:
    t = np.arange(nthreads)
    lane, warp0 = t % 32, t - t % 32
    seg = lambda w: warp0 + (lane & ~(w - 1))  # noqa: E731 - first lane of each width-w segment
    out = np.zeros((nthreads, 6), np.int64)
    src = lane + 3
    out[:, 0] = np.where(src < 32, (1 << 40) + warp0 + src, (1 << 40) + t)
    src = lane - 5
    out[:, 1] = np.where(src >= (lane & ~15), warp0 + src, t)
    out[:, 2] = seg(8) + (7 + 8 * (lane & 1)) % 8
    src = lane ^ 9
    out[:, 3] = np.where(src <= (lane & ~15) + 15, warp0 + src, t)
    out[:, 4] = sum(1 << k for k in range(0, 32, 3))
    out[:, 5] = t ^ 1
    return out


def test_shuffle_semantics(mods) -> None:
    grid, block = 2, 64
    out = np.zeros((grid * block, 6), np.int64)
    mods["reduce"].launch("shuffles", grid, block, [out], [])
    np.testing.assert_array_equal(out, _shuffle_reference(grid * block))


def test_half_to_float_all_patterns(mods) -> None:
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    for entry, dt in [("h2f", np.float16), ("b2f", ml_dtypes.bfloat16)]:
        y = np.zeros(bits.size, np.float32)
        mods["convert"].launch(entry, 64, 256, [bits, y], [bits.size])
        want = bits.view(dt).astype(np.float32)
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(y), nan, err_msg=entry)
        np.testing.assert_array_equal(y[~nan].view(np.uint32), want[~nan].view(np.uint32), err_msg=entry)


@np.errstate(invalid="ignore", over="ignore")
def _float_cases() -> np.ndarray:
    rng = np.random.default_rng(1)
    finite16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite16 = np.unique(finite16[np.isfinite(finite16)].astype(np.float64))
    b16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    b16 = np.unique(b16[np.isfinite(b16)])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504, 65519.996, 65520, 65536, 2.0**-24,
                         2.0**-25, 2.0**-25 * (1 + 2**-23), 2.0**-25 * (1 - 2**-24), 2.0**-24 * 1.5, 2.0**-14,
                         2.0**-14 * (1 - 2**-11), 1e-45, 1e-40, 3.4e38, -3.4e38, 1 + 2**-11, 1 + 3 * 2**-11])
    return np.concatenate([
        (finite16[:-1] + finite16[1:]) / 2,  # every fp16 tie (exact in fp32)
        (b16[:-1] + b16[1:]) / 2,            # every bf16 tie
        finite16, specials, -specials,
        rng.integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # any bits
        rng.uniform(-70000, 70000, 20_000), rng.uniform(-1e-4, 1e-4, 20_000),
    ]).astype(np.float32)


def test_float_to_half_bit_exact(mods) -> None:
    x = _float_cases()
    for entry, dt in [("f2h", np.float16), ("f2b", ml_dtypes.bfloat16)]:
        y = np.zeros(x.size, np.uint16)
        mods["convert"].launch(entry, 64, 256, [x, y], [x.size])
        with np.errstate(invalid="ignore", over="ignore"):
            want = x.astype(dt).view(np.uint16)
        nan = np.isnan(x)
        assert (y[nan] == 0x7FFF).all(), entry  # the GPU's canonical NaN
        np.testing.assert_array_equal(y[~nan], want[~nan], err_msg=entry)


@pytest.mark.parametrize("entry,needle", [("partner_exit", "exited while lane"), ("barrier_vs_shuffle", "deadlock"),
                                          ("bad_mask", "excludes its own lane")])
def test_misuse_is_an_error_not_a_hang(mods, entry: str, needle: str) -> None:
    y = np.zeros(64, np.float32)
    with pytest.raises(EmulationError, match=needle):
        mods["broken"].launch(entry, 2, 64, [y], [])
    mods["broken"].launch("fill", 1, 64, [y], [])  # the module stays usable after an aborted launch
    assert (y == 3.0).all()


def test_launch_argument_checks(mods) -> None:
    y = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="invalid launch"):
        mods["broken"].launch("fill", 1, 2048, [y], [])
    with pytest.raises(ValueError, match="C-contiguous"):
        mods["broken"].launch("fill", 1, 32, [np.zeros((8, 8), np.float32)[:, ::2]], [])
    with pytest.raises(ValueError, match="no OFZ_EMU_ENTRY"):
        mods["broken"].launch("nope", 1, 32, [y], [])


def test_compile_error_names_dumped_source() -> None:
    src = '#include "ortfuse_kernel.h"\nextern "C" __global__ void k(const OfzArgs a) { this is not C++; }\n'
    with pytest.raises(CompileError) as e:
        compile_emulated(src)
    dumped = next(w for w in str(e.value).split() if w.endswith("kernel.cu"))
    assert Path(dumped).read_text() == src


def test_concurrent_builds_of_one_source() -> None:
    src = ELEMENTWISE + "\n// concurrency\n"
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # bypass the in-process cache: 3 real builds
        paths = list(pool.map(lambda _: emulate._load.__wrapped__("concurrent", src).path, range(3)))
    assert len(set(paths)) == 1 and paths[0].exists()


def test_kernel_headers_come_precompiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORTFUSE_CACHE_DIR", str(tmp_path))
    flags = emulate._pch_flags()
    assert flags[0] == "-include" and Path(flags[1] + ".gch").stat().st_size > 1_000_000
    src = tmp_path / "k.cu"
    src.write_text(ELEMENTWISE)
    # g++ falls back to parsing the headers without a word when a PCH does not fit: -H says which it took
    proc = subprocess.run([emulate.CXX, *emulate.cxx_flags(), f"-I{INCLUDE}", *flags, "-Winvalid-pch", "-H",
                           "-x", "c++", str(src), "-o", str(tmp_path / "k.so")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"! {flags[1]}.gch" in proc.stderr.splitlines()[0] and "invalid" not in proc.stderr


def test_kernels_build_without_a_precompiled_header(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORTFUSE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(emulate, "PCH_HEADERS", ("ortfuse_kernel.h", "no_such_header.h"))
    assert emulate._pch_flags() == () and len(list(tmp_path.glob("emu/pch-*/failed"))) == 1
    mod = compile_emulated(ELEMENTWISE + "\n// built without a precompiled header\n")
    x = np.linspace(-3, 3, 1000, dtype=np.float32)
    y = np.zeros_like(x)
    mod.launch("ew_f32", 2, 128, [x, y], [x.size])
    np.testing.assert_allclose(y, x * 1.5 + 0.25, rtol=1e-6)


def test_missing_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    emulate._compiler_version.cache_clear()
    monkeypatch.setattr(emulate, "CXX", "no-such-gxx-ortfuse")
    try:
        with pytest.raises(CompileError, match="not found on PATH"):
            compile_emulated("int x;")
    finally:
        emulate._compiler_version.cache_clear()


def test_big_launch_is_fast(mods) -> None:
    grid, block = 2048, 256
    x = np.ones(grid * block, np.float32)
    y = np.zeros(grid, np.float32)
    t0 = time.perf_counter()
    mods["reduce"].launch("block_sum", grid, block, [x, y], [x.size])
    elapsed = time.perf_counter() - t0
    assert (y == block).all()
    assert elapsed < 10, f"{grid}x{block} block reduction took {elapsed:.2f} s"


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_launch_releases_fiber_stacks(mods) -> None:
    """A launch unmaps its fiber stacks: every loaded module has its own emulator state, and a session that
    loads hundreds (the fuzz test, the whole suite) would otherwise keep 2 mappings per thread per module
    and exhaust vm.max_map_count (65530 by default)."""
    x = np.ones(1024, np.float32)
    y = np.zeros(1, np.float32)
    mods["reduce"].launch("block_sum", 1, 1024, [x, y], [x.size])  # warm: lazy loader mappings settle
    before = _mappings()
    mods["reduce"].launch("block_sum", 1, 1024, [x, y], [x.size])
    mods["elementwise"].launch("rev_dyn", 4, 96, [x[:384], np.zeros(384, np.float32)], [], smem=96 * 4)
    assert _mappings() - before < 64, "fiber stacks stay mapped after the launch"
    assert y[0] == 1024


CLUSTER = r"""
#include "ortfuse_kernel.h"
// Each block writes its rank into its shared memory; after cluster_sync every thread reads every other
// block's value through cluster_map and stores the cluster's sum, rank, size and id.
extern "C" __global__ void gather(const OfzArgs a) {
  OFZ_DYNAMIC_SMEM(float, s);
  const unsigned rank = ofz::cluster_rank(), size = ofz::cluster_size();
  if (threadIdx.x == 0) s[0] = (float)(rank + 1) * 10.0f + (float)ofz::cluster_id();
  ofz::cluster_sync();
  float sum = 0.0f;
  for (unsigned q = 0; q < size; ++q) sum += *ofz::cluster_map(s, q);
  float* out = (float*)a.ptr[0] + ((ofz_i64)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  out[0] = sum, out[1] = (float)rank, out[2] = (float)size, out[3] = (float)ofz::cluster_count();
  ofz::cluster_sync();  // keep s alive until every block has read it
}
// Half of block 1 waits at __syncthreads while everyone else waits at the cluster barrier: a deadlock.
extern "C" __global__ void skip(const OfzArgs a) {
  if (ofz::cluster_rank() == 1 && threadIdx.x < 16) __syncthreads();
  ofz::cluster_sync();
}
// cluster_map of a pointer outside dynamic shared memory.
extern "C" __global__ void bad_map(const OfzArgs a) {
  __shared__ float st[4];
  st[threadIdx.x % 4] = 0.0f;
  const float* p = ofz::cluster_map(st, 0);
  ((float*)a.ptr[0])[threadIdx.x] = *p;
}
// The barrier in halves, as the row-wise GEMM epilogue ends a tile: read the other blocks, arrive, local work
// (out[1]: this block's own value, read after the arrival), wait; then each block overwrites its value.
// With `late` the other blocks are read after the arrival: a race on hardware, an error here.
extern "C" __global__ void halves(const OfzArgs a) {
  OFZ_DYNAMIC_SMEM(float, s);
  const unsigned rank = ofz::cluster_rank(), size = ofz::cluster_size();
  const bool late = a.dim[0] != 0;
  if (threadIdx.x == 0) s[0] = (float)(rank + 1);
  ofz::cluster_sync();
  float sum = 0.0f;
  if (!late)
    for (unsigned q = 0; q < size; ++q) sum += *ofz::cluster_peer(s, q, rank);
  ofz::cluster_arrive();
  if (late)
    for (unsigned q = 0; q < size; ++q) sum += *ofz::cluster_peer(s, q, rank);
  float* out = (float*)a.ptr[0] + ((ofz_i64)blockIdx.x * blockDim.x + threadIdx.x) * 2;
  out[0] = sum, out[1] = s[0];
  __syncthreads();
  ofz::cluster_wait();
  if (threadIdx.x == 0) s[0] = -1.0f;  // the next tile's write
}
// cluster_wait without its arrival.
extern "C" __global__ void wait_alone(const OfzArgs a) { ofz::cluster_wait(); }
OFZ_EMU_ENTRY(gather)
OFZ_EMU_ENTRY(skip)
OFZ_EMU_ENTRY(bad_map)
OFZ_EMU_ENTRY(halves)
OFZ_EMU_ENTRY(wait_alone)
"""


# the last: the most a cluster holds on sm_90, 8 blocks of 1024 threads (a TMA split-K GEMM of 640 threads in
# clusters of 8 in ViT-B's default build exceeded the emulator's former 4096 threads per cluster)
@pytest.mark.parametrize("cluster,grid,block", [(1, 3, 64), (2, 6, 64), (4, 4, 64), (8, 16, 64), (8, 8, 1024)])
def test_cluster_blocks_share_distributed_shared_memory(cluster: int, grid: int, block: int) -> None:
    mod = compile_emulated(CLUSTER)
    out = np.full((grid, block, 4), np.nan, np.float32)
    mod.launch("gather", grid, block, [out], [], smem=16, cluster=cluster)
    for b in range(grid):
        cid, rank = b // cluster, b % cluster
        want = sum((q + 1) * 10.0 + cid for q in range(cluster))
        assert (out[b, :, 0] == want).all() and (out[b, :, 1] == rank).all(), (b, out[b, 0])
        assert (out[b, :, 2] == cluster).all() and (out[b, :, 3] == grid // cluster).all()


def test_cluster_misuse_is_an_error_not_a_hang() -> None:
    mod = compile_emulated(CLUSTER)
    y = np.zeros(64, np.float32)
    with pytest.raises(EmulationError, match="deadlock: .* at cluster_sync"):
        mod.launch("skip", 4, 32, [y], [], smem=16, cluster=2)
    with pytest.raises(EmulationError, match="not in its block's dynamic shared memory"):
        mod.launch("bad_map", 2, 32, [y], [], smem=16, cluster=2)
    with pytest.raises(ValueError, match="invalid launch"):
        mod.launch("gather", 6, 32, [np.zeros(6 * 32 * 4, np.float32)], [], smem=16, cluster=4)  # 6 % 4
    out = np.zeros((2, 32, 4), np.float32)
    mod.launch("gather", 2, 32, [out], [], smem=16, cluster=2)  # the module stays usable
    assert (out[:, :, 0] == 30.0).all()


def test_cluster_barrier_in_halves() -> None:
    # cluster_arrive / cluster_wait: work between them runs, the reads before them see every block's value;
    # a read of another block between them, a wait without an arrival, are errors naming the thread
    mod = compile_emulated(CLUSTER)
    out = np.full((4, 64, 2), np.nan, np.float32)
    mod.launch("halves", 4, 64, [out], [0], smem=16, cluster=2)
    assert (out[:, :, 0] == 3.0).all() and (out[:, :, 1] == np.repeat([1.0, 2.0, 1.0, 2.0], 64).reshape(4, 64)).all()
    with pytest.raises(EmulationError, match="cluster_map to block . between cluster_arrive and cluster_wait"):
        mod.launch("halves", 2, 32, [np.zeros((2, 32, 2), np.float32)], [1], smem=16, cluster=2)
    with pytest.raises(EmulationError, match="cluster_wait without cluster_arrive"):
        mod.launch("wait_alone", 2, 32, [np.zeros(64, np.float32)], [], smem=16, cluster=2)


def test_cluster_source_compiles_for_sm_90(tmp_path) -> None:
    from ortfuse.customops.compile import compile_kernel
    ck = compile_kernel(CLUSTER, "gather", (90,), tmp_path)
    assert b"barrier.cluster" in ck.ptx and b"mapa" in ck.ptx


def test_an_empty_tensor_is_memory_no_read_can_touch():
    # emulation gives an empty argument an address whose 64 GiB fault on any access (a KV cache's empty past:
    # a kernel reading it unguarded crashes the run, at whatever offset it computes, not only near 0 as with
    # ORT's null); a subprocess, since the read kills the process
    import subprocess
    import sys

    from ortfuse.customops.emulate import no_memory
    if no_memory() is None:
        pytest.skip("no reserved address space off Linux")
    code = ("import ctypes; from ortfuse.customops.emulate import no_memory; "
            "print(ctypes.string_at(no_memory() + (5 << 30), 1))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode < 0, (r.returncode, r.stdout, r.stderr[-500:])


def test_the_build_level_is_configurable_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests build at -O1 (tests/conftest.py); users at -O2 unless they set ORTFUSE_EMU_OPT."""
    from ortfuse.errors import InputError

    monkeypatch.setenv("ORTFUSE_EMU_OPT", "1")
    assert emulate.cxx_flags()[-1] == "-O1"
    monkeypatch.delenv("ORTFUSE_EMU_OPT")
    assert emulate.cxx_flags()[-1] == "-O2"
    monkeypatch.setenv("ORTFUSE_EMU_OPT", "fast")
    with pytest.raises(InputError, match="ORTFUSE_EMU_OPT='fast'"):
        emulate.cxx_flags()


def test_the_users_build_level_runs_fibers_clusters_and_tensor_cores(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    """The suite builds at -O1; users at -O2. The emulator's fiber switches, cluster barriers and tensor-core
    fragments are where an optimization level could matter: they run at -O2 here too."""
    import test_tensorcore_emu as tc

    monkeypatch.setenv("ORTFUSE_EMU_OPT", "2")
    monkeypatch.setenv("ORTFUSE_CACHE_DIR", str(tmp_path))
    assert emulate.cxx_flags()[-1] == "-O2"
    test_cluster_blocks_share_distributed_shared_memory(8, 8, 1024)
    test_cluster_misuse_is_an_error_not_a_hang()
    tc.test_mma_m16n8k16("__half", 1, 3)
    tc.test_cp_async_lands_at_wait()
    assert any(p.name.startswith("pch-") for p in (tmp_path / "emu").iterdir())
