"""The emulated tensor-core and async-copy intrinsics (ofz::mma_*, ldmatrix, cp.async) against numpy:
one warp loads A [16x16] and B [16x8] with cp.async, takes fragments with ldmatrix (or plain shared-memory
reads in the PTX fragment layout) and multiplies with mma.sync. The same sources compile with NVRTC."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import bf16

from ortfuse.customops.compile import compile_kernel
from ortfuse.customops.emulate import compile_emulated

# t0 = A [16][16] row-major, t1 = B: [16 k][8 n] (B_NK 0) or [8 n][16 k] (B_NK 1), t2 = D [16][8] fp32.
# dim[0] = number of valid bytes in each row chunk of A (16: all; less exercises the zero fill).
MMA16 = r"""
#include "ortfuse_kernel.h"
extern "C" __global__ void tc16(const OfzArgs a) {
  __shared__ __align__(16) ELEM As[16][16];
  __shared__ __align__(16) ELEM Bs[128];
  const ELEM* A = (const ELEM*)a.ptr[0];
  const ELEM* B = (const ELEM*)a.ptr[1];
  float* D = (float*)a.ptr[2];
  const int l = threadIdx.x;
  // A: 16 rows x 2 chunks of 8 elements; B: 8 chunks of 16 bytes.
  ofz::cp_async16(&As[l / 2][(l % 2) * 8], A + (l / 2) * 16 + (l % 2) * 8, (int)a.dim[0]);
  if (l < 16) ofz::cp_async16(&Bs[l * 8], B + l * 8, 16);
  ofz::cp_async_commit();
  ofz::cp_async_wait<0>();
  __syncthreads();
  unsigned fa[4], fb[2];
  // matrix i = l/8: rows (i&1)*8 + l%8, columns (i>>1)*8
  ofz::ldmatrix_x4(fa, &As[((l / 8) & 1) * 8 + l % 8][(l / 8 >> 1) * 8]);
#if B_NK
  ofz::ldmatrix_x2(fb, &Bs[(l % 8) * 16 + ((l / 8) & 1) * 8]);   // rows n, columns k
#else
  ofz::ldmatrix_x2_trans(fb, &Bs[(l % 16) * 8]);                 // rows k
#endif
  float c[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  MMA(c, fa, fb);
  const int g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + (i % 2)] = c[i];
}
OFZ_EMU_ENTRY(tc16)
"""

TF32 = r"""
#include "ortfuse_kernel.h"
extern "C" __global__ void tc32(const OfzArgs a) {
  const float* A = (const float*)a.ptr[0];  // [16][8]
  const float* B = (const float*)a.ptr[1];  // [8][8] (k, n)
  float* D = (float*)a.ptr[2];
  const int l = threadIdx.x, g = l / 4, t = l % 4;
  unsigned fa[4] = {ofz::to_tf32(A[g * 8 + t]), ofz::to_tf32(A[(g + 8) * 8 + t]),
                    ofz::to_tf32(A[g * 8 + t + 4]), ofz::to_tf32(A[(g + 8) * 8 + t + 4])};
  unsigned fb[2] = {ofz::to_tf32(B[t * 8 + g]), ofz::to_tf32(B[(t + 4) * 8 + g])};
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  ofz::mma_tf32(c, fa, fb);
  for (int i = 0; i < 4; ++i) D[(g + 8 * (i / 2)) * 8 + 2 * t + (i % 2)] = c[i];
}
OFZ_EMU_ENTRY(tc32)
"""

EARLY_READ = r"""
#include "ortfuse_kernel.h"
extern "C" __global__ void early(const OfzArgs a) {
  OFZ_DYNAMIC_SMEM(float, buf);  // uninitialized (0xff bytes) in the emulator
  const float* X = (const float*)a.ptr[0];
  float* Y = (float*)a.ptr[1];
  if (threadIdx.x == 0) ofz::cp_async16(buf, X, 16);
  ofz::cp_async_commit();
  if (threadIdx.x == 0) Y[0] = buf[0];   // before the wait: not there yet
  ofz::cp_async_wait<0>();
  if (threadIdx.x == 0) Y[1] = buf[1];
}
OFZ_EMU_ENTRY(early)
"""


@pytest.mark.parametrize("elem", ["__half", "__nv_bfloat16"])
@pytest.mark.parametrize("b_nk", [0, 1])
@pytest.mark.parametrize("valid", [8, 3])
def test_mma_m16n8k16(elem, b_nk, valid):
    rng = np.random.default_rng(3)
    a32, b32 = rng.standard_normal((16, 16)).astype(np.float32), rng.standard_normal((16, 8)).astype(np.float32)
    if elem == "__half":
        a, b = a32.astype(np.float16), b32.astype(np.float16)
        av, bv = a.astype(np.float32), b.astype(np.float32)
    else:
        (a, av), (b, bv) = bf16(a32), bf16(b32)
    bmem = np.ascontiguousarray(b.T) if b_nk else b
    mma = "ofz::mma_f16" if elem == "__half" else "ofz::mma_bf16"
    src = f"#define ELEM {elem}\n#define MMA {mma}\n#define B_NK {b_nk}\n" + MMA16
    d = np.zeros((16, 8), np.float32)
    compile_emulated(src).launch("tc16", 1, 32, [a, bmem, d], [valid * 2])
    av = av.copy()
    av[:, 0:8][:, valid:] = 0  # each 8-element chunk of A keeps its first `valid` elements
    av[:, 8:16][:, valid:] = 0
    np.testing.assert_allclose(d, av @ bv + 1.0, rtol=1e-5, atol=1e-5)


def test_mma_tf32_rounds_operands():
    rng = np.random.default_rng(4)
    a, b = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((8, 8)).astype(np.float32)
    d = np.zeros((16, 8), np.float32)
    compile_emulated(TF32).launch("tc32", 1, 32, [a, b, d])

    def tf32(x):  # round half away from zero to 10 mantissa bits
        return ((x.view(np.uint32) + 0x1000) & 0xFFFFE000).view(np.float32)
    np.testing.assert_allclose(d, tf32(a) @ tf32(b), rtol=1e-5, atol=1e-5)
    assert np.abs(d - a @ b).max() > 1e-6  # tf32 is visibly not fp32


def test_cp_async_lands_at_wait():
    x = np.arange(1, 5, dtype=np.float32)
    y = np.zeros(2, np.float32)
    compile_emulated(EARLY_READ).launch("early", 1, 32, [x, y], smem=16)
    assert np.isnan(y[0]) and y[1] == 2.0


@pytest.mark.parametrize("src,entry,defs", [(MMA16, "tc16", "#define ELEM __half\n#define MMA ofz::mma_f16\n#define B_NK 0\n"),
                                            (MMA16, "tc16", "#define ELEM __nv_bfloat16\n#define MMA ofz::mma_bf16\n#define B_NK 1\n"),
                                            (TF32, "tc32", ""), (EARLY_READ, "early", "")])
def test_intrinsics_compile_with_nvrtc(src, entry, defs, tmp_path):
    ck = compile_kernel(defs + src, entry, (80, 90), tmp_path)
    assert [cc for cc, _ in ck.cubins] == [80, 90]
