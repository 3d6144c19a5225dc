// The GEMM mainloop every generated GEMM kernel instantiates: C[b] = A[b] (M x K) * B[b] (K x N), fp32
// accumulation, a multi-stage cp.async pipeline through shared memory, and per-warp tiles computed with
// mma.sync (fp16/bf16, or tf32 when the user opts in) or fp32 FMAs. The generated part is `Ops`, a struct
// printed from the kernel IR (customops/lower_gemm.py):
//   static ofz_i64 a_base(const OfzArgs&, ofz_i64 b)              element offset of batch b's A (direct modes)
//   static ofz_i64 b_base(const OfzArgs&, ofz_i64 b)              same for B
//   static float   a_load(const OfzArgs&, ofz_i64 b, ofz_i64 m, ofz_i64 k)   generic mode: A[b][m][k] with its prologue
//   static float   b_load(const OfzArgs&, ofz_i64 b, ofz_i64 k, ofz_i64 n)   generic mode: B[b][k][n]
//   static void    epi2(const OfzArgs&, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v0, float v1)  C[b][m][n..n+1]
//   static void    epi1(const OfzArgs&, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v)              C[b][m][n]
// The epilogue computes and stores every output of the fused region from the accumulator.
//
// Row-wise epilogue (ROW_TPR > 0; Welder's shared-memory connection): one tile spans whole rows (N <= BN),
// so a Softmax or LayerNorm over N runs inside the GEMM kernel. The epilogue then uses instead
//   static float   row_in(const OfzArgs&, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v)   X[b][m][n] from C
//   static void    row(const OfzArgs&, ofz_i64 b, ofz_i64 m0, ofz_i64 rows, float* ofz_row, float* ofz_scratch)
// row_in's values (X: the tensor the row reductions read) go to an fp32 [BM][BN + 4] buffer that aliases
// the drained pipeline stages; `row` then reduces rows m0 .. m0+rows-1 of the tile with ROW_TPR threads per
// row (row_reduce, scratch of kThreads / 32 floats) and stores every output.
#pragma once
#include "ortfuse_kernel.h"

namespace ofz {
namespace gemm {

// Operand access modes.
enum Mode : int {
  kRowMajor = 0,  // A [M][K] (K contiguous) or B [K][N] (N contiguous), copied with cp.async
  kColMajor = 1,  // B stored [N][K] (K contiguous), copied with cp.async
  kGeneric = 2,   // element loads through Ops::a_load / b_load (prologue ops, any layout), staged in registers
};
// Math of the warp tile.
enum Math : int { kMmaF16 = 0, kMmaBF16 = 1, kMmaTF32 = 2, kSimt = 3 };

template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH>
struct Layout {
  static constexpr int kThreads = (BM / WM) * (BN / WN) * 32;
  static constexpr int kPad = 16 / (int)sizeof(T);            // row skew: conflict-free ldmatrix / fragment reads
  static constexpr int kChunk = 16 / (int)sizeof(T);          // elements per 16-byte copy
  static constexpr bool kBNK = BMODE == kColMajor;             // B tile stored [BN][BK]
  static constexpr int kALd = BK + kPad;
  static constexpr int kBLd = kBNK ? BK + kPad : BN + kPad;
  static constexpr int kAStage = BM * kALd;
  static constexpr int kBStage = kBNK ? BN * kBLd : BK * kBLd;
  static constexpr int kSmemBytes = STAGES * (kAStage + kBStage) * (int)sizeof(T);
  static constexpr int kRowLd = BN + 4;  // row-wise epilogue buffer: fp32, skewed by 4 banks per row
  static_assert(STAGES >= 2, "the pipeline needs two stages");
  static_assert(BM % WM == 0 && BN % WN == 0 && BK % kChunk == 0, "tile shape");
  static_assert(MATH == kSimt || (WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0), "tensor-core warp tile");
  static_assert(MATH != kSimt || (WM % 4 == 0 && WN % 8 == 0), "SIMT warp tile: 4 x 8 lanes");
};

// Rows r0 .. r0+ROWS-1, columns c0 .. c0+COLS-1 of a row-major global matrix (`ld` elements per row) into
// shared memory with LDS elements per row, 16 bytes per cp.async; chunks outside rows x cols are zeroed.
template <class T, int ROWS, int COLS, int LDS, int NT>
__device__ __forceinline__ void copy_tile(T* dst, const T* src, ofz_i64 r0, ofz_i64 c0, ofz_i64 rows, ofz_i64 cols,
                                          ofz_i64 ld) {
  constexpr int chunk = 16 / (int)sizeof(T), per_row = COLS / chunk;
  for (int c = threadIdx.x; c < ROWS * per_row; c += NT) {
    const int r = c / per_row, k = (c % per_row) * chunk;
    const ofz_i64 gr = r0 + r, gc = c0 + k;
    const bool ok = gr < rows && gc < cols;
    cp_async16(dst + r * LDS + k, ok ? src + gr * ld + gc : src, ok ? 16 : 0);
  }
}

// Copies (or, in generic mode, loads and converts) k-tile `kt` of A and B into pipeline stage `stage`.
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH, class Ops>
__device__ __forceinline__ void load_tile(const OfzArgs& a, T* As, T* Bs, const T* A, const T* B, ofz_i64 b,
                                          ofz_i64 m0, ofz_i64 n0, ofz_i64 k0, ofz_i64 M, ofz_i64 N, ofz_i64 K) {
  using L = Layout<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH>;
  const int tid = threadIdx.x;
  if constexpr (AMODE == kRowMajor) {
    copy_tile<T, BM, BK, L::kALd, L::kThreads>(As, A, m0, k0, M, K, K);
  } else {
    for (int e = tid; e < BM * BK; e += L::kThreads) {
      const int r = e / BK, kc = e % BK;
      const ofz_i64 gm = m0 + r, gk = k0 + kc;
      As[r * L::kALd + kc] = from_f32<T>(gm < M && gk < K ? Ops::a_load(a, b, gm, gk) : 0.0f);
    }
  }
  if constexpr (BMODE == kRowMajor) {
    copy_tile<T, BK, BN, L::kBLd, L::kThreads>(Bs, B, k0, n0, K, N, N);
  } else if constexpr (BMODE == kColMajor) {
    copy_tile<T, BN, BK, L::kBLd, L::kThreads>(Bs, B, n0, k0, N, K, K);
  } else {
    for (int e = tid; e < BK * BN; e += L::kThreads) {
      const int r = e / BN, nc = e % BN;
      const ofz_i64 gk = k0 + r, gn = n0 + nc;
      Bs[r * L::kBLd + nc] = from_f32<T>(gk < K && gn < N ? Ops::b_load(a, b, gk, gn) : 0.0f);
    }
  }
}

// Visits the warp's accumulators as runs of adjacent columns: f(row, col, values, count), row and col within
// the block tile; mma fragments give pairs (columns 2t, 2t+1), SIMT lanes single values.
template <bool kMma, int kMT, int kNT, class Acc, class SAcc, class F>
__device__ __forceinline__ void for_each_acc(const Acc& acc, const SAcc& sacc, int wm0, int wn0, F&& f) {
  const int lane = threadIdx.x % 32;
  if constexpr (kMma) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int j = 0; j < kNT; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) f(wm0 + i * 16 + g + 8 * h, wn0 + j * 8 + 2 * t, &acc[i][j][2 * h], 2);
  } else {
    const int lr = lane / 8, lc = lane % 8;
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int j = 0; j < kNT; ++j) f(wm0 + lr + 4 * i, wn0 + lc + 8 * j, &sacc[i][j], 1);
  }
}

// Row-wise epilogue: X = Ops::row_in(C) into the fp32 row buffer, then Ops::row over the tile's rows. Every
// thread of the block calls it (row reductions synchronise the block).
template <int BM, int kThreads, int kRowLd, int ROW_TPR, class Ops, class Visit>
__device__ __forceinline__ void row_epilogue(const OfzArgs& a, float* rowbuf, Visit&& visit, ofz_i64 b, ofz_i64 m0,
                                             ofz_i64 n0, ofz_i64 M, ofz_i64 N) {
  static_assert(ROW_TPR % 32 == 0 && kThreads % ROW_TPR == 0, "rows are reduced by whole warps");
  __shared__ float row_scratch[kThreads / 32];
  visit([&](int r, int c, const float* v, int count) {
    for (int e = 0; e < count; ++e)
      if (m0 + r < M && n0 + c + e < N) rowbuf[r * kRowLd + c + e] = Ops::row_in(a, b, m0 + r, n0 + c + e, v[e]);
  });
  __syncthreads();
  Ops::row(a, b, m0, M - m0 < BM ? M - m0 : (ofz_i64)BM, rowbuf, row_scratch);
  __syncthreads();  // the next tile's pipeline overwrites the buffer
}

template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH, class Ops,
          int ROW_TPR = 0>
__device__ __forceinline__ void run(const OfzArgs& a, int a_arg, int b_arg, ofz_i64 batch, ofz_i64 M, ofz_i64 N,
                                    ofz_i64 K) {
  using L = Layout<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH>;
  constexpr bool kMma = MATH != kSimt;
  constexpr int kMT = kMma ? WM / 16 : WM / 4;   // per warp: mma tiles (16 rows) or SIMT rows per lane
  constexpr int kNT = WN / 8;                     // mma tiles (8 columns) or SIMT columns per lane
  OFZ_DYNAMIC_SMEM(T, smem);
  T* const As = smem;
  T* const Bs = smem + STAGES * L::kAStage;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int wm0 = (warp % (BM / WM)) * WM, wn0 = (warp / (BM / WM)) * WN;
  const int g = lane / 4, t = lane % 4;
  const ofz_i64 tiles_m = (M + BM - 1) / BM, tiles_n = (N + BN - 1) / BN;
  const ofz_i64 tiles = batch * tiles_m * tiles_n;
  const ofz_i64 ktiles = (K + BK - 1) / BK;

  for (ofz_i64 u = blockIdx.x; u < tiles; u += gridDim.x) {
    const ofz_i64 b = u / (tiles_m * tiles_n), rest = u % (tiles_m * tiles_n);
    const ofz_i64 m0 = (rest / tiles_n) * BM, n0 = (rest % tiles_n) * BN;
    const T* A = nullptr;
    const T* B = nullptr;
    if constexpr (AMODE != kGeneric) A = static_cast<const T*>(a.ptr[a_arg]) + Ops::a_base(a, b);
    if constexpr (BMODE != kGeneric) B = static_cast<const T*>(a.ptr[b_arg]) + Ops::b_base(a, b);

    float acc[kMma ? kMT : 1][kMma ? kNT : 1][4];  // mma accumulator fragments
    float sacc[kMma ? 1 : kMT][kMma ? 1 : kNT];     // SIMT: one value per (row, column) of the lane
#pragma unroll
    for (int i = 0; i < kMT; ++i)
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        if constexpr (kMma) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
        else sacc[i][j] = 0.0f;
      }

    // prologue: stages 0 .. STAGES-2 in flight
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ktiles)
        load_tile<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH, Ops>(
            a, As + s * L::kAStage, Bs + s * L::kBStage, A, B, b, m0, n0, (ofz_i64)s * BK, M, N, K);
      cp_async_commit();
    }
    for (ofz_i64 kt = 0; kt < ktiles; ++kt) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile kt landed for every thread; stage (kt-1) % STAGES is free again
      const ofz_i64 next = kt + STAGES - 1;
      if (next < ktiles) {
        const int ns = (int)(next % STAGES);
        load_tile<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH, Ops>(
            a, As + ns * L::kAStage, Bs + ns * L::kBStage, A, B, b, m0, n0, next * BK, M, N, K);
      }
      cp_async_commit();
      const int st = (int)(kt % STAGES);
      const T* as = As + st * L::kAStage;
      const T* bs = Bs + st * L::kBStage;
      if constexpr (MATH == kMmaF16 || MATH == kMmaBF16) {
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
          unsigned fa[kMT][4], fb[kNT][2];
          const int mat = lane / 8, r8 = lane % 8;
#pragma unroll
          for (int i = 0; i < kMT; ++i)
            ldmatrix_x4(fa[i], as + (wm0 + i * 16 + (mat & 1) * 8 + r8) * L::kALd + kk + (mat >> 1) * 8);
#pragma unroll
          for (int j = 0; j < kNT; j += 2) {
            unsigned r[4];
            if constexpr (L::kBNK)
              ldmatrix_x4(r, bs + (wn0 + j * 8 + (mat >> 1) * 8 + r8) * L::kBLd + kk + (mat & 1) * 8);
            else
              ldmatrix_x4_trans(r, bs + (kk + (mat & 1) * 8 + r8) * L::kBLd + wn0 + j * 8 + (mat >> 1) * 8);
            fb[j][0] = r[0], fb[j][1] = r[1], fb[j + 1][0] = r[2], fb[j + 1][1] = r[3];
          }
#pragma unroll
          for (int i = 0; i < kMT; ++i)
#pragma unroll
            for (int j = 0; j < kNT; ++j) {
              if constexpr (MATH == kMmaF16) mma_f16(acc[i][j], fa[i], fb[j]);
              else mma_bf16(acc[i][j], fa[i], fb[j]);
            }
        }
      } else if constexpr (MATH == kMmaTF32) {
        auto bat = [&](int k, int n) -> float { return L::kBNK ? to_f32(bs[n * L::kBLd + k]) : to_f32(bs[k * L::kBLd + n]); };
#pragma unroll
        for (int kk = 0; kk < BK; kk += 8) {
          unsigned fa[kMT][4], fb[kNT][2];
#pragma unroll
          for (int i = 0; i < kMT; ++i) {
            const T* r0 = as + (wm0 + i * 16 + g) * L::kALd + kk + t;
            fa[i][0] = to_tf32(to_f32(r0[0]));
            fa[i][1] = to_tf32(to_f32(r0[8 * L::kALd]));
            fa[i][2] = to_tf32(to_f32(r0[4]));
            fa[i][3] = to_tf32(to_f32(r0[8 * L::kALd + 4]));
          }
#pragma unroll
          for (int j = 0; j < kNT; ++j) {
            fb[j][0] = to_tf32(bat(kk + t, wn0 + j * 8 + g));
            fb[j][1] = to_tf32(bat(kk + t + 4, wn0 + j * 8 + g));
          }
#pragma unroll
          for (int i = 0; i < kMT; ++i)
#pragma unroll
            for (int j = 0; j < kNT; ++j) mma_tf32(acc[i][j], fa[i], fb[j]);
        }
      } else {
        const int lr = lane / 8, lc = lane % 8;
#pragma unroll 4
        for (int kk = 0; kk < BK; ++kk) {
          float av[kMT], bv[kNT];
#pragma unroll
          for (int i = 0; i < kMT; ++i) av[i] = to_f32(as[(wm0 + lr + 4 * i) * L::kALd + kk]);
#pragma unroll
          for (int j = 0; j < kNT; ++j) {
            const int n = wn0 + lc + 8 * j;
            bv[j] = L::kBNK ? to_f32(bs[n * L::kBLd + kk]) : to_f32(bs[kk * L::kBLd + n]);
          }
#pragma unroll
          for (int i = 0; i < kMT; ++i)
#pragma unroll
            for (int j = 0; j < kNT; ++j) sacc[i][j] = fmaf(av[i], bv[j], sacc[i][j]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages

    auto visit = [&](auto&& f) { for_each_acc<kMma, kMT, kNT>(acc, sacc, wm0, wn0, f); };
    if constexpr (ROW_TPR > 0) {
      row_epilogue<BM, L::kThreads, L::kRowLd, ROW_TPR, Ops>(a, reinterpret_cast<float*>(smem), visit, b, m0, n0, M, N);
    } else {
      visit([&](int r, int c, const float* v, int count) {
        const ofz_i64 m = m0 + r, n = n0 + c;
        if (m >= M) return;
        if (count == 2 && n + 1 < N) Ops::epi2(a, b, m, n, v[0], v[1]);
        else
          for (int e = 0; e < count; ++e)
            if (n + e < N) Ops::epi1(a, b, m, n + e, v[e]);
      });
    }
  }
}

}  // namespace gemm
}  // namespace ofz
