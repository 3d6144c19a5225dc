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
//   static void    epi8(const OfzArgs&, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v0, ..., float v7) C[b][m][n..n+7]
//                  (optional: printed where every access of the epilogue fits a 16-byte vector of 8 lanes)
// The epilogue computes and stores every output of the fused region from the accumulator.
//
// Row-wise epilogue (ROW_TPR > 0; Welder's shared-memory connection): one tile spans whole rows (N <= BN),
// so a Softmax or LayerNorm over N runs inside the GEMM kernel. The epilogue then uses instead
//   static float   row_in(const OfzArgs&, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v)   X[b][m][n] from C
//   static void    row_in8(const OfzArgs&, ofz_i64 b, ofz_i64 m, ofz_i64 n, float v0, ..., float v7, float* x)
//                  X[b][m][n..n+7] into x[0..7] (optional, as epi8)
//   static void    row(const OfzArgs&, ofz_i64 b, ofz_i64 m0, ofz_i64 rows, float* ofz_row, float* ofz_scratch)
// row_in's values (X: the tensor the row reductions read) go to an fp32 [BM][BN + 4] buffer that aliases
// the drained pipeline stages (with row_in8: the accumulators first, then X over them 8 columns at a time);
// `row` then reduces rows m0 .. m0+rows-1 of the tile with ROW_TPR threads per row (row_reduce, scratch of
// kThreads / 32 floats) and stores every output.
//
// LayerNorm folded in (Fold = LayerNormFold<EPS>; lower_gemm.py, rewriter/layernorm_fold.py, docs/design.md
// "LayerNorm prologues"): A is X, the LayerNormalization's input, and B the weight scaled offline by its
// gamma along K and centered per column (W''), beta's part having gone into the bias the epilogue adds.
// Each column of W'' sums to zero, so X W'' = (X - mean) W'' and LN(X) W'' = rstd * (X W''): the block
// gathers each row's moments from the A tiles as they pass through shared memory (RowMoments) and scales
// the accumulators by the row's rstd before any epilogue sees them. Not with split-K (a block sees only
// part of each row).
//
// Row split across a cluster (RSPLIT > 1, sm_90 thread-block clusters): a row-wise epilogue over N > BN
// columns. The kernel is launched in clusters of exactly RSPLIT = ceil(N / BN) blocks; the schedule gives a
// cluster's blocks one row tile, block `rank` its columns rank*BN .. (the tile column is the rank). Each of
// the row pass's reductions is a phase: Ops::row_part<p> reduces the block's columns of every row of the
// tile (earlier reductions combined over the cluster) into slot p of the row, then a cluster barrier; last,
// Ops::row combines every slot and stores the block's columns of every output. PHASES + 1 cluster barriers
// per tile whatever BM is (after each phase's barrier the block copies slot p of every block into its own
// shared memory, so the rows combine locally), and the tile may be any GEMM tile (wgmma's too), not one as
// wide as the row.
// Combining in rank order gives every block the same value: the outputs do not depend on the split.
//
// Split-K (SPLIT > 1, sm_90 thread-block clusters): launched with clusters of S <= SPLIT blocks, the S
// blocks of a cluster share one output tile and each runs 1/S of its k tiles. They then reduce through
// distributed shared memory: each stores its fp32 partial tile [BM][BN + 4] in its own shared memory, and
// after a cluster barrier block r sums rows r*BM/S .. (r+1)*BM/S - 1 over the cluster (in rank order, so
// the result does not depend on which block sums) and runs the epilogue on them (the row-wise epilogue
// too: Ops::row over those rows). No workspace, no atomics, one launch. Launched without clusters
// (S = 1) the kernel runs unsplit.
#pragma once
#include "ortfuse_kernel.h"

namespace ofz {
namespace gemm {

template <bool C, class A, class B> struct Pick { using type = A; };
template <class A, class B> struct Pick<false, A, B> { using type = B; };

// Operand access modes.
enum Mode : int {
  kRowMajor = 0,  // A [M][K] (K contiguous) or B [K][N] (N contiguous), copied with cp.async
  kColMajor = 1,  // B stored [N][K] (K contiguous), copied with cp.async
  kGeneric = 2,   // element loads through Ops::a_load / b_load (prologue ops, any layout), staged in registers
  kIm2col = 3,    // B only: the implicit GEMM's gather from an NCHW image (geometry `Geo`), staged in registers
};

// Geometry of a 2-D convolution for kIm2col: B[k][n] of image b is X[b][c][ih][iw] with k = (c, kh, kw),
// n = (oh, ow), ih = oh * SH - PH + kh * DH, iw = ow * SW - PW + kw * DW, zero outside the image. H, W and OW
// are sizes (>= 0) or, on a symbolic image, runtime dims -(k + 1) read from the kernel's arguments. The
// lowering guarantees C * H * W and the pixel count fit in 31 bits (statically, or by the node's
// `dim_limits` checked before the launch), so the gather runs on 32-bit indices.
template <int T>
__device__ __forceinline__ int conv_size(const OfzArgs& a) {
  if constexpr (T >= 0) return T;
  else return (int)a.dim[-T - 1];
}
// TAPS (tap-major K): k = (kh * KW + kw) * C + c instead of (c * KH + kh) * KW + kw, with A the weight
// permuted offline to [OC][KH][KW][C] and BK dividing C, so every k tile lies in one tap: the gather works
// out the tap once per k tile and each element is one load at a fixed channel stride.
template <int C, int H, int W, int KH, int KW, int SH, int SW, int DH, int DW, int PH, int PW, int OW, int TAPS = 0>
struct Conv2d {
  static constexpr int kTaps = KH * KW, kK = C * kTaps;
  static constexpr bool kTapMajor = TAPS != 0;
  static constexpr int kC = C, kKW = KW, kDH = DH, kDW = DW;
  static __device__ __forceinline__ int height(const OfzArgs& a) { return conv_size<H>(a); }
  static __device__ __forceinline__ int width(const OfzArgs& a) { return conv_size<W>(a); }
  // (ih0, iw0) of output pixel n: the image row and column of tap (0, 0)
  static __device__ __forceinline__ void origin(const OfzArgs& a, unsigned n, int& ih0, int& iw0) {
    const unsigned ow_n = (unsigned)conv_size<OW>(a);
    const unsigned oh = n / ow_n, ow = n - oh * ow_n;
    ih0 = (int)oh * SH - PH, iw0 = (int)ow * SW - PW;
  }
  // element offset of tap k for a pixel with origin (ih0, iw0) in the image, or -1 in the padding
  static __device__ __forceinline__ int offset(const OfzArgs& a, unsigned k, int ih0, int iw0) {
    const int h = conv_size<H>(a), w = conv_size<W>(a);
    const unsigned c = k / kTaps, t = k - c * kTaps, kh = t / KW, kw = t - kh * KW;
    const int ih = ih0 + (int)kh * DH, iw = iw0 + (int)kw * DW;
    return (unsigned)ih < (unsigned)h && (unsigned)iw < (unsigned)w ? (int)c * (h * w) + ih * w + iw : -1;
  }
};
struct NoConv {
  static constexpr bool kTapMajor = false;
};

// The LayerNorm fold (see the top of this file); epsilon is EPS_BITS as an IEEE float.
struct NoFold {
  static constexpr bool kOn = false;
};
template <unsigned EPS_BITS>
struct LayerNormFold {
  static constexpr bool kOn = true;
  static __device__ __forceinline__ float eps() { return f32_bits(EPS_BITS); }
};

// Per-row moments of the A operand, gathered k tile by k tile from its shared-memory stage: thread tid
// owns chunks c = tid + i * NT of the BM x (BK / chunk) grid of 16-byte chunks, so the kG threads of a row
// are adjacent lanes of one warp and keep that row for every k tile. Each sums its elements' deviations
// from a shift, the mean of its first chunk (an element of the row's own range, so the sum of squares
// does not cancel as E[x^2] - mean^2 would; in sm_90 SASS about 45 instructions per chunk, half what a
// Chan update per chunk took). `finish` turns each thread's sums into (count, mean, M2), merges the
// row's lanes with Chan's pairwise update and stores 1/sqrt(var + eps) per row of the tile. SWZ: the stage
// is a TMA box in the 128-byte swizzle (128-byte rows, chunk c of row r stored at c ^ r % 8): a row's chunks
// are all in its own line, only their order differs, which matters only for masking a ragged last k tile.
template <class T, int BM, int BK, int ALD, int NT, bool SWZ = false>
struct RowMoments {
  static constexpr int kChunk = 16 / (int)sizeof(T), kG = BK / kChunk, kChunks = BM * kG;
  static_assert(!SWZ || (kG == 8 && ALD == BK), "the 128-byte swizzle: 128-byte rows of 8 chunks");
  static constexpr int kI = (kChunks + NT - 1) / NT;
  static_assert(BK % kChunk == 0 && 32 % kG == 0 && NT % kG == 0, "a row's chunks are adjacent lanes of one warp");
  float cnt[kI], shift[kI], sum[kI], sq[kI];  // elements seen, shift, sum of (x - shift), sum of (x - shift)^2

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int i = 0; i < kI; ++i) cnt[i] = shift[i] = sum[i] = sq[i] = 0.0f;
  }

  // (count, mean, M2) += (nb, mb, m2b), Chan et al.'s pairwise update
  static __device__ __forceinline__ void merge(float& n, float& mu, float& s, float nb, float mb, float m2b) {
    const float nn = n + nb;
    if (nb > 0.0f) {
      const float d = mb - mu, w = nb / nn;
      mu += d * w;
      s += m2b + d * d * n * w;
      n = nn;
    }
  }

  // the stage holding the k tile that starts at k0; K: the row length (chunks past it hold zeros, not data)
  __device__ __forceinline__ void add(const T* stage, ofz_i64 k0, ofz_i64 K) {
    if (k0 + BK <= K) add_tile<false>(stage, 0);  // every k tile but a ragged last one
    else add_tile<true>(stage, K - k0);
  }

  // kMasked: only the first `left` columns of the tile are data
  template <bool kMasked>
  __device__ __forceinline__ void add_tile(const T* stage, ofz_i64 left) {
#pragma unroll
    for (int i = 0; i < kI; ++i) {
      const int c = threadIdx.x + i * NT;
      if (kChunks % NT != 0 && c >= kChunks) continue;
      const int r = c / kG, q = c % kG;
      int valid = kChunk;
      if constexpr (kMasked) {
        const ofz_i64 rest = left - (SWZ ? q ^ (r & 7) : q) * kChunk;  // the chunk's own column
        if (rest <= 0) continue;
        valid = rest < kChunk ? (int)rest : kChunk;
      }
      T e[kChunk];
      load_vec<kChunk>(stage + r * ALD + q * kChunk, e);
      float v[kChunk];
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v[j] = !kMasked || j < valid ? to_f32(e[j]) : 0.0f;
      if (cnt[i] == 0.0f) {  // the first chunk: its mean is the shift
        float s0 = 0.0f;
#pragma unroll
        for (int j = 0; j < kChunk; ++j) s0 += v[j];
        shift[i] = s0 / (float)valid;
      }
      float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const float d = !kMasked || j < valid ? v[j] - shift[i] : 0.0f;
        s1 += d;
        s2 = fmaf(d, d, s2);
      }
      sum[i] += s1, sq[i] += s2, cnt[i] += (float)valid;
    }
  }

  // every thread of the block calls it (warp shuffles); rstd[r]: row r's 1 / sqrt(var + eps)
  __device__ __forceinline__ void finish(float* rstd, float eps) {
#pragma unroll
    for (int i = 0; i < kI; ++i) {
      float n = cnt[i], mu = shift[i], s = 0.0f;
      if (n > 0.0f) {
        mu = shift[i] + sum[i] / n;
        s = fmaxf(sq[i] - sum[i] * sum[i] / n, 0.0f);
      }
#pragma unroll
      for (int off = 1; off < kG; off *= 2) {
        const float nb = __shfl_xor_sync(0xffffffffu, n, off), mb = __shfl_xor_sync(0xffffffffu, mu, off);
        const float sb = __shfl_xor_sync(0xffffffffu, s, off);
        // both lanes merge in the same order (the lower lane's moments first), so they agree on the result
        const bool upper = (threadIdx.x & off) != 0;
        float n1 = upper ? nb : n, m1 = upper ? mb : mu, s1 = upper ? sb : s;
        merge(n1, m1, s1, upper ? n : nb, upper ? mu : mb, upper ? s : sb);
        n = n1, mu = m1, s = s1;
      }
      const int c = threadIdx.x + i * NT;
      // a constant row (no deviation at all) normalizes to 0, whatever rounding left in its accumulators
      // (mean * colsum(W''), scaled by 1/sqrt(eps) it would be large for a tiny eps)
      if ((kChunks % NT == 0 || c < kChunks) && c % kG == 0)
        rstd[c / kG] = s > 0.0f ? 1.0f / sqrtf(s / n + eps) : 0.0f;
    }
  }
};
struct NoMoments {
  __device__ __forceinline__ void clear() {}
  template <class T> __device__ __forceinline__ void add(const T*, ofz_i64, ofz_i64) {}
  __device__ __forceinline__ void finish(float*, float) {}
};

// Math of the warp tile.
// kWgmma*: sm_90a warpgroup MMA with a cp.async pipeline (run_wgmma below); kWsWgmma*: the same MMAs fed by
// TMA in a warp-specialized pipeline (run_wgmma_ws); the others are run_mma's warp-level math.
enum Math : int {
  kMmaF16 = 0, kMmaBF16 = 1, kMmaTF32 = 2, kSimt = 3, kWgmmaF16 = 4, kWgmmaBF16 = 5, kWsWgmmaF16 = 6, kWsWgmmaBF16 = 7
};

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
  static_assert(AMODE != kIm2col, "kIm2col gathers B only");
  static_assert(BM % WM == 0 && BN % WN == 0 && BK % kChunk == 0, "tile shape");
  static_assert(MATH == kSimt || (WM % 16 == 0 && WN % 16 == 0 && BK % 16 == 0), "tensor-core warp tile");
  static_assert(MATH != kSimt || (WM % 4 == 0 && WN % 8 == 0), "SIMT warp tile: 4 x 8 lanes");
};

// Copies of one operand's ROWS x COLS tiles of a row-major global matrix (`ld` elements per row) into
// shared memory (LDS elements per row), one 16-byte cp.async per chunk, NT threads. Each thread's chunks and
// their addresses are worked out once per output tile (`init`); `copy` then issues one k tile and steps to
// the next, so the mainloop adds a stride instead of redoing 64-bit index math. The k axis is the rows
// (KROWS: B [K][N]) or the columns (A [M][K], B stored [N][K]); chunks past the matrix are zero-filled.
template <class T, int ROWS, int COLS, int LDS, int NT, bool KROWS>
struct TileCopy {
  static constexpr int kChunk = 16 / (int)sizeof(T), kPerRow = COLS / kChunk, kChunks = ROWS * kPerRow;
  static constexpr int kIters = (kChunks + NT - 1) / NT;
  const T* base;
  const T* src[kIters];
  int dst[kIters];    // element offset in the stage
  int kpos[kIters];   // chunk's k coordinate within the tile
  bool live[kIters];  // the chunk exists and its other coordinate is inside the matrix
  ofz_i64 step;       // elements from one k tile to the next

  // r0/c0: the tile's first row/column on the fixed axis (the k axis starts at 0)
  __device__ __forceinline__ void init(const T* mat, ofz_i64 r0, ofz_i64 c0, ofz_i64 rows, ofz_i64 cols, ofz_i64 ld) {
    base = mat;
    step = KROWS ? (ofz_i64)ROWS * ld : (ofz_i64)COLS;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = threadIdx.x + i * NT;
      int r, k;
      if constexpr (LDS == COLS + kChunk) chunk_place<ROWS, kPerRow>(c, r, k);  // bank-conflict-free stores
      else r = c / kPerRow, k = c % kPerRow;
      k *= kChunk;
      live[i] = c < kChunks && (KROWS ? c0 + k < cols : r0 + r < rows);
      kpos[i] = KROWS ? r : k;
      dst[i] = r * LDS + k;
      src[i] = mat + (r0 + r) * ld + c0 + k;
    }
  }

  // k tile starting at k0 (the next one in order) into `stage`; `kdim`: the k axis length
  __device__ __forceinline__ void copy(T* stage, ofz_i64 k0, ofz_i64 kdim) {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      if (kChunks % NT != 0 && threadIdx.x + i * NT >= kChunks) continue;
      const bool ok = live[i] && k0 + kpos[i] < kdim;
      cp_async16(stage + dst[i], ok ? src[i] : base, ok ? 16 : 0);
      src[i] += step;
    }
  }
};

// The direct-mode operands' copiers: A [M][K], B [K][N] or B stored [N][K]; unused ones are empty.
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH>
struct DirectCopies {
  using L = Layout<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH>;
  struct None {
    __device__ __forceinline__ void init(const T*, ofz_i64, ofz_i64, ofz_i64, ofz_i64, ofz_i64) {}
    __device__ __forceinline__ void copy(T*, ofz_i64, ofz_i64) {}
  };
  using ACopy = typename Pick<AMODE == kRowMajor, TileCopy<T, BM, BK, L::kALd, L::kThreads, false>, None>::type;
  using BCopy = typename Pick<BMODE == kRowMajor, TileCopy<T, BK, BN, L::kBLd, L::kThreads, true>,
                              typename Pick<BMODE == kColMajor, TileCopy<T, BN, BK, L::kBLd, L::kThreads, false>,
                                            None>::type>::type;
  ACopy a;
  BCopy b;

  // k0: the first k of the block's k range (a split-K block starts mid-K)
  __device__ __forceinline__ void init(const T* A, const T* B, ofz_i64 m0, ofz_i64 n0, ofz_i64 M, ofz_i64 N,
                                       ofz_i64 K, ofz_i64 k0) {
    a.init(A, m0, k0, M, K, K);
    if constexpr (BMODE == kRowMajor) b.init(B, k0, n0, K, N, N);
    else b.init(B, n0, k0, N, K, K);
  }
  __device__ __forceinline__ void copy(T* As, T* Bs, ofz_i64 k0, ofz_i64 K) {
    a.copy(As, k0, K);
    b.copy(Bs, k0, K);
  }
};

// Element i (0 .. ceil(ROWS * COLS / NT) - 1) of thread `tid` in a ROWS x COLS tile walked row by row, NT
// threads side by side: (row, col), or row = -1 past the end. When NT and COLS divide one another the
// split is compile-time arithmetic and a thread keeps one column (NT % COLS == 0) for every i.
template <int ROWS, int COLS, int NT>
__device__ __forceinline__ void tile_element(int tid, int i, int& row, int& col) {
  if constexpr (NT % COLS == 0) {
    row = tid / COLS + i * (NT / COLS), col = tid % COLS;
  } else if constexpr (COLS % NT == 0) {
    row = (i * NT) / COLS, col = (i * NT) % COLS + tid;
  } else {
    const int e = tid + i * NT;
    row = e / COLS, col = e % COLS;
  }
  if ((ROWS * COLS) % NT != 0 && row >= ROWS) row = -1;
}

// Generic-mode operands are software-pipelined through registers: `fetch` issues the element loads (and
// prologue math) of a later k-tile before the current tile's MMAs, `stash` stores them into their shared
// memory stage after, so global latency overlaps the math as the cp.async stages do for direct operands.
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH, class Ops,
          class Geo>
struct Staging {
  using L = Layout<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH>;
  static constexpr int kA = AMODE == kGeneric ? (BM * BK + L::kThreads - 1) / L::kThreads : 0;
  static constexpr int kB = BMODE == kGeneric || BMODE == kIm2col ? (BK * BN + L::kThreads - 1) / L::kThreads : 0;
  T av[kA > 0 ? kA : 1];
  T bv[kB > 0 ? kB : 1];
  // tap-major gather: the thread's pixels (kP of them: its columns of the B tile) as the image row and
  // column of tap (0, 0). A pixel past N still reads inside the image (or zero): its column is never stored.
  static constexpr bool kTaps = BMODE == kIm2col && Geo::kTapMajor;
  static constexpr int kP = !kTaps ? 1 : L::kThreads % BN == 0 ? 1 : BN / L::kThreads;
  int px_h[kP], px_w[kP];

  // once per output tile, before its first fetch
  __device__ __forceinline__ void begin(const OfzArgs& a, ofz_i64 n0) {
    if constexpr (kTaps) {
      static_assert(L::kThreads % BN == 0 || BN % L::kThreads == 0, "tap-major gather: threads and BN nest");
      static_assert(Geo::kC % BK == 0, "tap-major gather: k tiles within one tap");
      const int tid = threadIdx.x;
#pragma unroll
      for (int p = 0; p < kP; ++p)
        Geo::origin(a, (unsigned)n0 + (kP == 1 ? tid % BN : p * L::kThreads + tid), px_h[p], px_w[p]);
    }
  }

  // tap-major: k tile k0 is channels c0 .. c0 + BK - 1 of tap k0 / C
  __device__ __forceinline__ void gather_taps(const OfzArgs& a, const T* B, ofz_i64 k0) {
    const int tid = threadIdx.x;
    const unsigned k = (unsigned)k0, tap = k / Geo::kC, c0 = k - tap * Geo::kC;
    const unsigned kh = tap / Geo::kKW, kw = tap - kh * Geo::kKW;
    const int h = Geo::height(a), w = Geo::width(a), hw = h * w;
    int base[kP];
    bool inside[kP];
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      const int ih = px_h[p] + (int)kh * Geo::kDH, iw = px_w[p] + (int)kw * Geo::kDW;
      inside[p] = (unsigned)ih < (unsigned)h && (unsigned)iw < (unsigned)w;
      base[p] = (int)c0 * hw + ih * w + iw;
    }
#pragma unroll
    for (int i = 0; i < kB; ++i) {
      // the thread's element i: row r of the tile (channel c0 + r) at its pixel p
      const int p = kP == 1 ? 0 : i % kP;
      const int r = kP == 1 ? tid / BN + i * (L::kThreads / BN) : i / kP;
      const bool live = (BK * BN) % L::kThreads == 0 || r < BK;  // compile-time true unless the tile is ragged
      bv[i] = live && inside[p] ? B[base[p] + r * hw] : from_f32<T>(0.0f);
    }
  }

  __device__ __forceinline__ void fetch(const OfzArgs& a, const T* B, ofz_i64 b, ofz_i64 m0, ofz_i64 n0, ofz_i64 k0,
                                        ofz_i64 M, ofz_i64 N, ofz_i64 K) {
    const int tid = threadIdx.x;
    if constexpr (kA > 0) {
#pragma unroll
      for (int i = 0; i < kA; ++i) {
        int r, kc;
        tile_element<BM, BK, L::kThreads>(tid, i, r, kc);
        const ofz_i64 gm = m0 + r, gk = k0 + kc;
        const bool live = (BM * BK) % L::kThreads == 0 || r >= 0;  // compile-time true unless the tile is ragged
        av[i] = from_f32<T>(live && gm < M && gk < K ? Ops::a_load(a, b, gm, gk) : 0.0f);
      }
    }
    if constexpr (kTaps) {
      gather_taps(a, B, k0);
    } else if constexpr (BMODE == kIm2col) {
      // 32-bit gather; B is image b. With NT % BN == 0 the thread's pixel is the same for every i and tile
      // step, so its origin is computed once per tile.
#pragma unroll
      for (int i = 0; i < kB; ++i) {
        int r, nc;
        tile_element<BK, BN, L::kThreads>(tid, i, r, nc);
        const unsigned n = (unsigned)n0 + nc, k = (unsigned)k0 + r;
        int ih0, iw0;
        Geo::origin(a, n, ih0, iw0);
        const bool live = (BK * BN) % L::kThreads == 0 || r >= 0;
        const int off = live && n < (unsigned)N && k < (unsigned)Geo::kK ? Geo::offset(a, k, ih0, iw0) : -1;
        bv[i] = off >= 0 ? B[off] : from_f32<T>(0.0f);
      }
    } else if constexpr (kB > 0) {
#pragma unroll
      for (int i = 0; i < kB; ++i) {
        int r, nc;
        tile_element<BK, BN, L::kThreads>(tid, i, r, nc);
        const ofz_i64 gk = k0 + r, gn = n0 + nc;
        const bool live = (BK * BN) % L::kThreads == 0 || r >= 0;
        bv[i] = from_f32<T>(live && gk < K && gn < N ? Ops::b_load(a, b, gk, gn) : 0.0f);
      }
    }
  }

  __device__ __forceinline__ void stash(T* As, T* Bs) const {
    const int tid = threadIdx.x;
    // r is -1 only past the end of a tile the threads do not divide evenly (decided at compile time)
#pragma unroll
    for (int i = 0; i < kA; ++i) {
      int r, kc;
      tile_element<BM, BK, L::kThreads>(tid, i, r, kc);
      if ((BM * BK) % L::kThreads == 0 || r >= 0) As[r * L::kALd + kc] = av[i];
    }
#pragma unroll
    for (int i = 0; i < kB; ++i) {
      int r, nc;
      tile_element<BK, BN, L::kThreads>(tid, i, r, nc);
      if ((BK * BN) % L::kThreads == 0 || r >= 0) Bs[r * L::kBLd + nc] = bv[i];
    }
  }
};

// Visits the warp's accumulators as runs of adjacent columns: f(row, col, values, count), row and col within
// the block tile; mma fragments give pairs (columns 2t, 2t+1), SIMT lanes single values.
// (Acc and SAcc may be const: f then gets const values.)
template <bool kMma, int kMT, int kNT, class Acc, class SAcc, class F>
__device__ __forceinline__ void for_each_acc(Acc& acc, SAcc& sacc, int wm0, int wn0, F&& f) {
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

// The quad's 4 x 4 exchange behind for_each_acc8: thread t holds m[k] = its pair of column group k (columns
// 8k + 2t, 8k + 2t + 1); afterwards m[s] = thread s's pair of group t (columns 8t + 2s, +1), so m holds
// group t's 8 columns in order. Two xor-shuffle steps, each swapping the pairs whose index differs from t
// in that bit.
__device__ __forceinline__ void quad_transpose(float (&m)[4][2], int t) {
#pragma unroll
  for (int b = 1; b <= 2; b <<= 1) {
    const bool hi = (t & b) != 0;
#pragma unroll
    for (int k0 = 0; k0 < 4; ++k0) {
      if (k0 & b) continue;
      const int k1 = k0 | b;
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float got = __shfl_xor_sync(0xffffffffu, hi ? m[k0][e] : m[k1][e], b);
        if (hi) m[k0][e] = got;
        else m[k1][e] = got;
      }
    }
  }
}

// Visits the warp's mma accumulators as runs of 8 adjacent columns: f(row, col, values, 8). A quad holds each
// 8-column group of a row as four pairs; over four groups it exchanges them (quad_transpose), so each thread
// holds one group whole and the epilogue reads and writes it as one 16-byte vector. With pairs, each warp
// store filled half of every 32-byte sector it touched (H200 Nsight Compute, 2026-11-26: 196,608 excess
// sectors of 417,792 on a 4096 x 768 fp16 output, exactly the output's size).
template <int kMT, int kNT, class Acc, class F>
__device__ __forceinline__ void for_each_acc8(Acc& acc, int wm0, int wn0, F&& f) {
  static_assert(kNT % 4 == 0, "four 8-column groups per exchange");
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j = 0; j < kNT; j += 4)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m[4][2];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          m[k][0] = acc[i][j + k][2 * h];
          m[k][1] = acc[i][j + k][2 * h + 1];
        }
        quad_transpose(m, t);
        f(wm0 + i * 16 + g + 8 * h, wn0 + (j + t) * 8, &m[0][0], 8);
      }
}

// Visits the warp's mma accumulators through its own slice of shared memory, `buf` (8 rows of kStageLd
// floats), for outputs whose rows are not 16-byte aligned (Ops::kStageOut): f(row, col, values), the values
// of rows row .. row + 7 at one column per lane. A fragment gives each thread column pairs of rows 8 apart, and on such rows every pair is two
// scalar stores into sectors that many instructions each fill a little of (our GEMM on GPT-2's LM head,
// H100 2026-11-26: its stores 5.7-9x the output's DRAM time). Here 8 rows x 32 columns of the accumulators
// at a time go into the slice (float2 writes: a half-warp's 16 reach distinct banks), and each of the
// 8 rows comes back with lane l at column l, so one store instruction writes 32 adjacent elements.
constexpr int kStageLd = 40;

template <int kMT, int kNT, class Acc, class F>
__device__ __forceinline__ void for_each_acc_staged(Acc& acc, int wm0, int wn0, float* buf, F&& f) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int i = 0; i < kMT; ++i)
#pragma unroll
    for (int j0 = 0; j0 < kNT; j0 += 4)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        constexpr int kAll = kNT < 4 ? kNT : 4;
        const int groups = kNT - j0 < kAll ? kNT - j0 : kAll;  // 8-column groups in this pass
#pragma unroll
        for (int j = 0; j < kAll; ++j)
          if (j < groups)
            *reinterpret_cast<float2*>(buf + g * kStageLd + j * 8 + 2 * t) =
                make_float2(acc[i][j0 + j][2 * h], acc[i][j0 + j][2 * h + 1]);
        __syncwarp();
        float v[8];
#pragma unroll
        for (int r = 0; r < 8; ++r) v[r] = buf[r * kStageLd + lane];
        if (lane < groups * 8) f(wm0 + i * 16 + 8 * h, wn0 + j0 * 8 + lane, v);
        __syncwarp();  // the slice is rewritten by the next pass
      }
}

// Ops::kStageOut: the warps of the block (each gets a slice of the staging buffer) where the epilogue is
// staged (for_each_acc_staged), else 0.
template <class O, class = void> struct StageOut { static constexpr int value = 0; };
template <class O> struct StageOut<O, decltype((void)O::kStageOut)> { static constexpr int value = O::kStageOut; };

#ifdef OFZ_DIRECT_STORES  // diagnostics only (bench/sweep.py --direct-stores): the fragment stores, as before
constexpr bool kDirectStores = true;
#else
constexpr bool kDirectStores = false;
#endif

// This warp's staging slice: the slices fill the end of the block's dynamic shared memory (tiles.smem_bytes
// adds them there, past the pipeline and any tile buffer, 16-byte aligned), out of the way of the stages a
// TMA producer refills during the epilogue. Not static shared memory: the emulator shares that between a
// cluster's blocks.
template <int kWarps>
__device__ __forceinline__ float* stage_slice() {
  OFZ_DYNAMIC_SMEM(unsigned char, base);
  constexpr unsigned kBytes = kWarps * 8 * kStageLd * 4;
  float* const slices = reinterpret_cast<float*>(base + ((dynamic_smem_size() - kBytes) & ~15u));
  return slices + (threadIdx.x / 32) * 8 * kStageLd;
}

// Whether the printed Ops has rows8 (8 rows at one column: the staged epilogue's whole tiles, where inputs
// along the row, a bias, are loaded once for the 8).
template <class O, class = void> struct HasRows8 { static constexpr bool value = false; };
template <class O> struct HasRows8<O, decltype((void)&O::rows8)> { static constexpr bool value = true; };

// Whether the printed Ops has epi8 (it is printed only where all of the epilogue's accesses fit 8 lanes).
template <class O, class = void> struct HasEpi8 { static constexpr bool value = false; };
template <class O> struct HasEpi8<O, decltype((void)&O::epi8)> { static constexpr bool value = true; };
// Whether it has row_in8 (printed where row_in's accesses fit 8 lanes).
template <class O, class = void> struct HasRowIn8 { static constexpr bool value = false; };
template <class O> struct HasRowIn8<O, decltype((void)&O::row_in8)> { static constexpr bool value = true; };

// for_each_acc bound to one warp's accumulators: visit(f). A functor, not a generic lambda: NVRTC 13.0 takes a
// generic lambda's call operator for a host function.
template <bool kMma, int kMT, int kNT, class Acc, class SAcc>
struct AccVisitor {
  const Acc& acc;
  const SAcc& sacc;
  int wm0, wn0;
  template <class F>
  __device__ __forceinline__ void operator()(F&& f) const { for_each_acc<kMma, kMT, kNT>(acc, sacc, wm0, wn0, f); }
  static constexpr bool kBy8 = kMma && kNT % 4 == 0;  // by8 applies: mma fragments, whole groups of four
  template <class F>
  __device__ __forceinline__ void by8(F&& f) const { for_each_acc8<kMT, kNT>(acc, wm0, wn0, f); }
  template <class F>
  __device__ __forceinline__ void staged(float* buf, F&& f) const {
    static_assert(kMma, "staged stores take mma fragments");
    for_each_acc_staged<kMT, kNT>(acc, wm0, wn0, buf, f);
  }
};

// Row-wise epilogue: X = Ops::row_in(C) into the fp32 row buffer, then Ops::row over the tile's rows. Every
// thread of the block calls it (row reductions synchronise the block). Split across a cluster (RSPLIT > 1),
// the reduction scratch, the slots (kRowSlots x BM floats) and the gathered copy of every block's slots
// (RSPLIT x kRowSlots x BM floats, rank-major) follow the row buffer in dynamic shared memory (the emulation
// shares a kernel's static shared memory between a cluster's blocks).
constexpr int kRowSlots = 4;  // most reductions (phases) of a row pass split across a cluster

// After phase p's cluster barrier: slot p of the tile's rows from every block of the cluster into this block's
// gathered copy, all distributed shared-memory reads in flight together (one round trip per phase). The row
// pass then combines from its own shared memory (row_combine); before (2026-11-26) each row's combine read
// the cluster's blocks itself, a round trip per row, one row after another in each warp.
template <int BM, int kThreads, int RSPLIT>
__device__ __forceinline__ void gather_slots(const float* slots, float* gathered, int p, int rows) {
  constexpr int kN = RSPLIT * BM, kIters = (kN + kThreads - 1) / kThreads;
  const unsigned me = cluster_rank();
  float v[kIters];
#pragma unroll
  for (int u = 0; u < kIters; ++u) {
    const int i = threadIdx.x + u * kThreads, q = i / BM, r = i % BM;  // BM: a compile-time divisor
    v[u] = i < kN && r < rows ? *cluster_peer(slots + p * BM + r, (unsigned)q, me) : 0.0f;
  }
#pragma unroll
  for (int u = 0; u < kIters; ++u) {
    const int i = threadIdx.x + u * kThreads, q = i / BM, r = i % BM;
    if (i < kN && r < rows) gathered[(q * kRowSlots + p) * BM + r] = v[u];
  }
}

// A row's reduction over the cluster: its value in slot `off` (p * BM + row) of every block, combined in rank
// order from the gathered copy (which follows the slots), so every block gets the same value.
template <class Op, ofz_i64 RSPLIT, ofz_i64 BM>
__device__ __forceinline__ float row_combine(const float* slots, ofz_i64 off) {
  const float* const gathered = slots + kRowSlots * BM;
  float r = gathered[off];
#pragma unroll
  for (int q = 1; q < (int)RSPLIT; ++q) r = Op::apply(r, gathered[q * kRowSlots * BM + off]);
  return r;
}

template <int BM, int BN, int kThreads, int kRowLd, int ROW_TPR, int RSPLIT, int PHASES, class Ops, class Visit>
__device__ __forceinline__ void row_epilogue(const OfzArgs& a, float* rowbuf, Visit&& visit, ofz_i64 b, ofz_i64 m0,
                                             ofz_i64 n0, ofz_i64 M, ofz_i64 N) {
  static_assert(ROW_TPR % 32 == 0 && kThreads % ROW_TPR == 0, "rows are reduced by whole warps");
  if constexpr (HasRowIn8<Ops>::value && BN % 8 == 0) {
    // the accumulators into the buffer as they are, then X in groups of 8 adjacent columns (row_in8: one
    // 16-byte access per input), the tile's ragged edge element by element
    visit([&](int r, int c, const float* v, int count) {
      for (int e = 0; e < count; ++e) rowbuf[r * kRowLd + c + e] = v[e];
    });
    __syncthreads();
    constexpr int kGroups = BN / 8;
    for (int g = threadIdx.x; g < BM * kGroups; g += kThreads) {
      const int r = g / kGroups, c = g % kGroups * 8;  // compile-time divisor
      if (m0 + r >= M) break;  // g grows with the row
      float* const p = rowbuf + r * kRowLd + c;  // 32-byte aligned: kRowLd and c are multiples of 4 and 8
      if (n0 + c + 8 <= N) {
        const float4 lo = *reinterpret_cast<const float4*>(p), hi = *reinterpret_cast<const float4*>(p + 4);
        Ops::row_in8(a, b, m0 + r, n0 + c, lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w, p);
      } else {
        for (int e = 0; e < 8 && n0 + c + e < N; ++e) p[e] = Ops::row_in(a, b, m0 + r, n0 + c + e, p[e]);
      }
    }
  } else {
    visit([&](int r, int c, const float* v, int count) {
      for (int e = 0; e < count; ++e)
        if (m0 + r < M && n0 + c + e < N) rowbuf[r * kRowLd + c + e] = Ops::row_in(a, b, m0 + r, n0 + c + e, v[e]);
    });
  }
  __syncthreads();
  const ofz_i64 rows = M - m0 < BM ? M - m0 : (ofz_i64)BM;
  if constexpr (RSPLIT > 1) {
    static_assert(PHASES >= 1 && PHASES <= kRowSlots, "one slot per reduction of the row pass");
    float* const scratch = rowbuf + BM * kRowLd;
    float* const slots = scratch + kThreads / 32;
    float* const gathered = slots + kRowSlots * BM;
    const ofz_i64 n1 = N - n0 < BN ? N : n0 + BN;  // the block's columns: [n0, n1)
    // each phase: the block's partials into slot p; a cluster barrier (slot p complete in every block);
    // slot p gathered from every block; a block barrier (the copy complete before any row combines it)
    auto phase_done = [&](int p) {
      cluster_sync();
      gather_slots<BM, kThreads, RSPLIT>(slots, gathered, p, (int)rows);
      __syncthreads();
    };
    Ops::row_part0(a, b, m0, rows, n0, n1, rowbuf, scratch, slots);
    phase_done(0);
    if constexpr (PHASES > 1) {
      Ops::row_part1(a, b, m0, rows, n0, n1, rowbuf, scratch, slots);
      phase_done(1);
    }
    if constexpr (PHASES > 2) {
      Ops::row_part2(a, b, m0, rows, n0, n1, rowbuf, scratch, slots);
      phase_done(2);
    }
    if constexpr (PHASES > 3) {
      Ops::row_part3(a, b, m0, rows, n0, n1, rowbuf, scratch, slots);
      phase_done(3);
    }
    // this block has read the others' slots for the last time: it arrives now, and waits only before its
    // shared memory is overwritten (next tile) or freed (exit), so the barrier overlaps the last pass
    cluster_arrive();
    Ops::row(a, b, m0, rows, n0, n1, rowbuf, scratch, slots);
    __syncthreads();  // the arrivals came before the pass: the block's own threads finish it first
    cluster_wait();
  } else {
    __shared__ float row_scratch[kThreads / 32];
    Ops::row(a, b, m0, rows, rowbuf, row_scratch);
    __syncthreads();  // the next tile's pipeline overwrites the buffer
  }
}

// Split-K's reduction and epilogue (see the top of this file). `part` is the block's dynamic shared memory:
// the [BM][kRowLd] partial tile, then (row-wise epilogue) kThreads / 32 floats of reduction scratch.
// Each thread takes column groups of its block's rows, kChunk at a time: first every split's partial of every
// group (16-byte distributed shared-memory reads, none summed before all are issued, so they are in flight
// together), then the sums in rank order and their epilogues. Groups are 8 columns where the Ops take 8 at
// once (epi8, row_in8: 16-byte loads and stores of 16-bit elements) and SPLIT <= 4, else 4 (epi2 / row_in).
// Before (2026-11-26, SASS), one column pair at a time waited for its reads, behind a run-time integer
// division for its row: a DSMEM round trip per pair, serialized (BERT-size split-K tiles at M = 1024-2048
// measured 2-4x their unsplit tile on the H200).
template <int BM, int BN, int kThreads, int kRowLd, int ROW_TPR, int SPLIT, class Ops, class Visit>
__device__ __forceinline__ void split_epilogue(const OfzArgs& a, float* part, Visit&& visit, ofz_i64 b, ofz_i64 m0,
                                               ofz_i64 n0, ofz_i64 M, ofz_i64 N, unsigned rank, unsigned splits) {
  static_assert(BN % 4 == 0 && kRowLd % 4 == 0, "rows of whole 16-byte column groups");
  visit([&](int r, int c, const float* v, int count) {
    for (int e = 0; e < count; ++e) part[r * kRowLd + c + e] = v[e];
  });
  cluster_sync();  // every partial tile is complete and visible to the cluster
  const int per = (BM + (int)splits - 1) / (int)splits;  // rows [r0, r1) of the tile are this block's
  const int r0 = (int)rank * per < BM ? (int)rank * per : BM;
  const int r1 = r0 + per < BM ? r0 + per : BM;
  const int rows = (int)(M - m0 < (ofz_i64)r1 ? M - m0 : (ofz_i64)r1) - r0;  // may be <= 0
  const int cols = (int)(N - n0 < (ofz_i64)BN ? N - n0 : (ofz_i64)BN);
  // groups of 8 columns where the Ops take 8 at once (epi8, row_in8: 16-byte accesses) and a group's reads
  // from every split stay 8 (16 made a one-warp split-8 Conv tile spill), else of 4
  constexpr bool kBy8 = BN % 8 == 0 && SPLIT <= 4 && (ROW_TPR > 0 ? HasRowIn8<Ops>::value : HasEpi8<Ops>::value);
  constexpr int kW = kBy8 ? 8 : 4, kV = kW / 4;  // columns, and 16-byte reads of a peer, per group
  constexpr int kGroups = BN / kW;  // a compile-time divisor: the row of a group is a multiply and a shift
  constexpr int kChunk = SPLIT * kV >= 8 ? 1 : 8 / (SPLIT * kV);  // 8 reads of 16 bytes in flight per thread
  const int total = rows > 0 ? rows * kGroups : 0;
  const float4* peer[SPLIT];
#pragma unroll
  for (int q = 0; q < SPLIT; ++q)
    peer[q] = reinterpret_cast<const float4*>(cluster_peer(part, q < (int)splits ? (unsigned)q : rank, rank));
  for (int e0 = threadIdx.x; e0 < total; e0 += kChunk * kThreads) {  // adjacent threads: adjacent groups
    float4 got[kChunk][SPLIT][kV];
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      const int e = e0 + u * kThreads;
      const int off = (r0 + e / kGroups) * (kRowLd / 4) + e % kGroups * kV;
#pragma unroll
      for (int q = 0; q < SPLIT; ++q)
#pragma unroll
        for (int h = 0; h < kV; ++h)
          got[u][q][h] = e < total && q < (int)splits ? peer[q][off + h] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kChunk; ++u) {
      const int e = e0 + u * kThreads;
      if (e >= total) continue;
      float v[kW];
#pragma unroll
      for (int j = 0; j < kW; ++j) v[j] = 0.0f;
#pragma unroll
      for (int q = 0; q < SPLIT; ++q)  // rank order: the result does not depend on which block sums
        if (q < (int)splits)
#pragma unroll
          for (int h = 0; h < kV; ++h)
            v[4 * h] += got[u][q][h].x, v[4 * h + 1] += got[u][q][h].y, v[4 * h + 2] += got[u][q][h].z,
                v[4 * h + 3] += got[u][q][h].w;
      const int r = r0 + e / kGroups, c = kW * (e % kGroups);
      const ofz_i64 m = m0 + r, n = n0 + c;
      if constexpr (kBy8) {
        if (c + 8 <= cols) {
          if constexpr (ROW_TPR > 0)  // X into the block's own rows of its buffer (no other block reads them)
            Ops::row_in8(a, b, m, n, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], part + r * kRowLd + c);
          else
            Ops::epi8(a, b, m, n, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
          continue;
        }
      }
#pragma unroll
      for (int j = 0; j < kW; j += 2) {
        if (c + j >= cols) break;
        if constexpr (ROW_TPR > 0) {
          part[r * kRowLd + c + j] = Ops::row_in(a, b, m, n + j, v[j]);
          if (c + j + 1 < cols) part[r * kRowLd + c + j + 1] = Ops::row_in(a, b, m, n + j + 1, v[j + 1]);
        } else if (c + j + 1 < cols) {
          Ops::epi2(a, b, m, n + j, v[j], v[j + 1]);
        } else {
          Ops::epi1(a, b, m, n + j, v[j]);
        }
      }
    }
  }
  if constexpr (ROW_TPR > 0) {
    static_assert(ROW_TPR % 32 == 0 && kThreads % ROW_TPR == 0, "rows are reduced by whole warps");
    __syncthreads();
    if (rows > 0) Ops::row(a, b, m0 + r0, (ofz_i64)rows, part + r0 * kRowLd, part + BM * kRowLd);
  }
  cluster_sync();  // no block overwrites its partial tile (next tile) or exits while another reads it
}

// The tile's epilogue from the accumulators: split-K's reduction, the row-wise epilogue, or epi2 / epi1 per
// run of columns. `buf`: the block's dynamic shared memory (the drained pipeline stages).
template <int BM, int BN, int kThreads, int kRowLd, int ROW_TPR, int SPLIT, class Ops, int RSPLIT = 1, int PHASES = 0,
          class Visit>
__device__ __forceinline__ void store_tile(const OfzArgs& a, float* buf, const Visit& visit, ofz_i64 b, ofz_i64 m0,
                                           ofz_i64 n0, ofz_i64 M, ofz_i64 N, unsigned rank, unsigned splits) {
#ifdef OFZ_ABLATE_EPILOGUE  // diagnostics only (bench/sweep.py --ablate): no stores (and under split-K no
  // reduction either), so timing it against the real kernel separates the mainloop from the epilogue; one
  // never-true compare per value keeps the MMAs live
  if constexpr (ROW_TPR == 0) {
    visit([&](int r, int c, const float* v, int count) {
      for (int e = 0; e < count; ++e)
        if (v[e] == 1.0e-38f && m0 + r < M && n0 + c + e < N) Ops::epi1(a, b, m0 + r, n0 + c + e, v[e]);
    });
    return;
  } else {  // a row-wise epilogue: no row pass, no cluster barriers, no stores
    visit([&](int r, int c, const float* v, int count) {
      for (int e = 0; e < count; ++e)
        if (v[e] == 1.0e-38f) buf[r * kRowLd + c + e] = v[e];
    });
    return;
  }
#endif
  if constexpr (SPLIT > 1) {
    if (splits > 1) {
      split_epilogue<BM, BN, kThreads, kRowLd, ROW_TPR, SPLIT, Ops>(a, buf, visit, b, m0, n0, M, N, rank, splits);
      return;
    }
  }
  if constexpr (ROW_TPR > 0) {
    row_epilogue<BM, BN, kThreads, kRowLd, ROW_TPR, RSPLIT, PHASES, Ops>(a, buf, visit, b, m0, n0, M, N);
  } else if constexpr (StageOut<Ops>::value > 0 && !kDirectStores) {
    float* const slice = stage_slice<StageOut<Ops>::value>();
    if (m0 + BM <= M && n0 + BN <= N) {  // a whole tile: straight-line code, the input loads issued early
      visit.staged(slice, [&](int r, int c, const float* v) {
        if constexpr (HasRows8<Ops>::value)
          Ops::rows8(a, b, m0 + r, n0 + c, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
        else
          for (int e = 0; e < 8; ++e) Ops::epi1(a, b, m0 + r + e, n0 + c, v[e]);
      });
    } else {
      visit.staged(slice, [&](int r, int c, const float* v) {
        for (int e = 0; e < 8; ++e)
          if (m0 + r + e < M && n0 + c < N) Ops::epi1(a, b, m0 + r + e, n0 + c, v[e]);
      });
    }
  } else {
    if (m0 + BM <= M && n0 + BN <= N) {  // a whole tile: no per-fragment branch, so the epilogue is one
      // block of straight-line code in which the compiler issues the input loads (ld_readonly) ahead of the
      // stores instead of one load after each store
      if constexpr (Visit::kBy8 && HasEpi8<Ops>::value) {  // 16-byte vectors: whole sectors
        visit.by8([&](int r, int c, const float* v, int) {
          Ops::epi8(a, b, m0 + r, n0 + c, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]);
        });
        return;
      }
      visit([&](int r, int c, const float* v, int count) {
        if (count == 2) Ops::epi2(a, b, m0 + r, n0 + c, v[0], v[1]);
        else
          for (int e = 0; e < count; ++e) Ops::epi1(a, b, m0 + r, n0 + c + e, v[e]);
      });
      return;
    }
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

// Which output tiles a block computes, and which of their k tiles: tile u = first, first + step, ... of
// batch x tiles_m x tiles_n. Split-K: the cluster's blocks share tile u and each takes a contiguous share of
// its k tiles, [kt0, kt0 + nk); without it (or in clusters of one) a block owns whole tiles. B multicast (MC
// > 1, run_wgmma_ws): u counts groups of MC tiles stacked along M (tiles_m is in groups), one group per
// cluster, block `mrank` taking the group's tile mrank (past M where tiles_m was odd: computed, not stored).
template <int BM, int BN, int BK, int SPLIT, int MC = 1> struct Schedule {
  static constexpr bool kSplit = SPLIT > 1, kClustered = SPLIT > 1 || MC > 1;
  ofz_i64 tiles_m, tiles_n, tiles, first, step, kt0, nk;
  unsigned splits, rank, mrank;
  __device__ __forceinline__ Schedule(ofz_i64 batch, ofz_i64 M, ofz_i64 N, ofz_i64 K)
      : tiles_m(((M + BM - 1) / BM + MC - 1) / MC), tiles_n((N + BN - 1) / BN), tiles(batch * tiles_m * tiles_n),
        first(kClustered ? (ofz_i64)cluster_id() : (ofz_i64)blockIdx.x),
        step(kClustered ? (ofz_i64)cluster_count() : (ofz_i64)gridDim.x),
        splits(kSplit ? cluster_size() : 1u), rank(kSplit ? cluster_rank() : 0u),
        mrank(MC > 1 ? cluster_rank() : 0u) {
    const ofz_i64 ktiles = (K + BK - 1) / BK;
    kt0 = ktiles * rank / splits;
    nk = ktiles * (rank + 1) / splits - kt0;
  }
  // tile u's batch item and first row and column
  __device__ __forceinline__ void at(ofz_i64 u, ofz_i64& b, ofz_i64& m0, ofz_i64& n0) const {
    const ofz_i64 rest = u % (tiles_m * tiles_n);
    b = u / (tiles_m * tiles_n);
    m0 = ((rest / tiles_n) * MC + mrank) * BM;
    n0 = (rest % tiles_n) * BN;
  }
};

// The LayerNorm fold's rstd per row of the tile: static shared memory, only in kernels that fold.
template <int BM> __device__ __forceinline__ float* fold_rstd() {
  __shared__ float rstd[BM];
  return rstd;
}

// The LayerNorm fold's scaling of the accumulators: row r of the tile by its rstd.
template <bool kMma, int kMT, int kNT, class Acc, class SAcc>
__device__ __forceinline__ void fold_scale(Acc& acc, SAcc& sacc, int wm0, int wn0, const float* rstd) {
  for_each_acc<kMma, kMT, kNT>(acc, sacc, wm0, wn0, [&](int r, int, float* v, int count) {
    for (int e = 0; e < count; ++e) v[e] *= rstd[r];
  });
}

// The warp-level mainloop (mma.sync, tf32 or SIMT): see the top of this file.
template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH, class Ops,
          int ROW_TPR, class Geo, int SPLIT, class Fold, int RSPLIT, int PHASES>
__device__ __forceinline__ void run_mma(const OfzArgs& a, int a_arg, int b_arg, ofz_i64 batch, ofz_i64 M, ofz_i64 N,
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
  const Schedule<BM, BN, BK, SPLIT> sch(batch, M, N, K);
  const ofz_i64 kt0 = sch.kt0, nk = sch.nk;  // the block's k tiles: [kt0, kt0 + nk)
  static_assert(!(Fold::kOn && SPLIT > 1), "the LayerNorm fold needs whole rows of A in one block");
  using Moments = typename Pick<Fold::kOn, RowMoments<T, BM, BK, L::kALd, L::kThreads>, NoMoments>::type;

  for (ofz_i64 u = sch.first; u < sch.tiles; u += sch.step) {
    ofz_i64 b, m0, n0;
    sch.at(u, b, m0, n0);
    Moments moments;
    moments.clear();
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

    // prologue: stages 0 .. STAGES-2 in flight (generic operands stored at once)
    DirectCopies<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH> direct;
    direct.init(A, B, m0, n0, M, N, K, kt0 * BK);
    Staging<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH, Ops, Geo> staged;
    constexpr bool kStaged = AMODE == kGeneric || BMODE == kGeneric || BMODE == kIm2col;
    staged.begin(a, n0);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) {
        T* as = As + s * L::kAStage;
        T* bs = Bs + s * L::kBStage;
        direct.copy(as, bs, (kt0 + s) * BK, K);
        if constexpr (kStaged) {
          staged.fetch(a, B, b, m0, n0, (kt0 + s) * BK, M, N, K);
          staged.stash(as, bs);
        }
      }
      cp_async_commit();
    }
    for (ofz_i64 kt = 0; kt < nk; ++kt) {  // the block's kt-th k tile, kt0 + kt of the whole K
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // tile kt landed for every thread; stage (kt-1) % STAGES is free again
      const ofz_i64 next = kt + STAGES - 1;
      const int ns = (int)(next % STAGES);
      if (next < nk) {
        direct.copy(As + ns * L::kAStage, Bs + ns * L::kBStage, (kt0 + next) * BK, K);
        if constexpr (kStaged) staged.fetch(a, B, b, m0, n0, (kt0 + next) * BK, M, N, K);
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
      moments.add(as, (kt0 + kt) * BK, K);  // the LayerNorm fold's row moments (nothing otherwise)
      // stage ns was drained before this iteration's barrier; it is read after iteration `next`'s
      if constexpr (kStaged)
        if (next < nk) staged.stash(As + ns * L::kAStage, Bs + ns * L::kBStage);
    }
    if constexpr (Fold::kOn) moments.finish(fold_rstd<BM>(), Fold::eps());
    cp_async_wait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages; the row moments are complete
    if constexpr (Fold::kOn) fold_scale<kMma, kMT, kNT>(acc, sacc, wm0, wn0, fold_rstd<BM>());

    const AccVisitor<kMma, kMT, kNT, decltype(acc), decltype(sacc)> visit{acc, sacc, wm0, wn0};
    store_tile<BM, BN, L::kThreads, L::kRowLd, ROW_TPR, SPLIT, Ops, RSPLIT, PHASES>(a, reinterpret_cast<float*>(smem), visit, b, m0, n0,
                                                                    M, N, sch.rank, sch.splits);
  }
}


// ---- sm_90a: the warpgroup-MMA mainloop (MATH kWgmmaF16 / kWgmmaBF16) ----------------------------------------

// One k tile of a warpgroup: the BK / 16 m64nWNk16 MMAs on the stage at shared-window addresses a_at (its A
// rows) and b_at (its B columns), committed as one group; returns once at most this group is in flight
// (the previous k tile's has retired, so its stage may be reused).
template <int WN, int BK, class T, int N>
__device__ __forceinline__ void warpgroup_ktile(float (&d)[N], unsigned a_at, unsigned b_at) {
  wgmma_fence_operand(d);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk) wgmma_m64k16<WN, T>(d, wgmma_desc(a_at + kk * 32u), wgmma_desc(b_at + kk * 32u));
  wgmma_commit();
  wgmma_fence_operand(d);
  wgmma_wait<1>();
}
// The same for a warpgroup whose tile is MT x 64 rows (a ping-pong tile of 128 rows: two m64 halves on one B
// tile), all halves' MMAs in one group.
template <int WN, int BK, class T, int MT, int N>
__device__ __forceinline__ void warpgroup_ktile_rows(float (&d)[MT][N], unsigned a_at, unsigned b_at) {
#pragma unroll
  for (int h = 0; h < MT; ++h) wgmma_fence_operand(d[h]);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
    for (int h = 0; h < MT; ++h)
      wgmma_m64k16<WN, T>(d[h], wgmma_desc(a_at + h * 64u * BK * 2u + kk * 32u), wgmma_desc(b_at + kk * 32u));
  wgmma_commit();
#pragma unroll
  for (int h = 0; h < MT; ++h) wgmma_fence_operand(d[h]);
  wgmma_wait<1>();
}
// A [M][K] and B stored [N][K] (both K-contiguous, copied with cp.async; a MatMul's constant [K][N] weight is
// transposed offline by the lowering), BK = 64: a tile row is one 128-byte swizzle row (ortfuse_kernel.h's
// wgmma section). WM = 16: warp w owns rows 16w' .. 16w'+15 (w' = w mod BM/16) and WN columns, and four
// consecutive warps along M form a warpgroup whose 64 x WN tile is one wgmma.mma_async m64nWNk16 per k16
// step. The accumulators are then laid out as run_mma's with kMT = 1, so AccVisitor and every epilogue are
// shared. Stages start 1024-byte aligned in the shared window (the dynamic bytes carry 1024 of slack).
// Pipeline (STAGES >= 4): while tile kt is multiplied, the wgmma group of tile kt - 1 may still run and
// tiles kt + 1 .. kt + STAGES - 2 are in flight; the stage of tile kt - 2 is refilled after the barrier that
// follows every warpgroup's wait for the group that read it.

// Copies of a ROWS x 64 tile of a K-contiguous matrix (`ld` elements per row) into the 128-byte swizzle, NT
// threads: 8 threads per row (one 16-byte chunk each), NT / 8 rows per pass. A thread's chunk keeps its
// column and its row's position in the 8-row atom across passes, so its destination only steps by whole
// atoms. Rows past the matrix and k past K are zero-filled.
template <class T, int ROWS, int NT>
struct SwizzledCopy {
  static_assert(sizeof(T) == 2 && NT % 64 == 0 && ROWS % 8 == 0, "16-bit K-major tile, whole atoms per pass");
  static constexpr int kPer = NT / 8, kPasses = (ROWS + kPer - 1) / kPer;
  const T* src;      // the thread's first chunk at the block's first k
  ofz_i64 row_step;  // elements from one pass to the next
  ofz_i64 kpos;      // the chunk's k at the block's first k tile
  int live;          // passes whose row lies inside the matrix
  int dst;           // element offset of the first chunk in a stage

  __device__ __forceinline__ void init(const T* mat, ofz_i64 r0, ofz_i64 rows, ofz_i64 ld, ofz_i64 k0) {
    const int tid = threadIdx.x, r = tid / 8, c = tid % 8;
    src = mat + (r0 + r) * ld + k0 + c * 8;
    row_step = (ofz_i64)kPer * ld;
    kpos = k0 + c * 8;
    const ofz_i64 left = rows - r0 - r;  // rows of the matrix from the thread's first one on
    live = left <= 0 ? 0 : (int)((left + kPer - 1) / kPer < kPasses ? (left + kPer - 1) / kPer : kPasses);
    dst = (r / 8) * 512 + (r % 8) * 64 + (c ^ (r % 8)) * 8;
  }

  // k tile `koff` elements past the block's first into `stage`
  __device__ __forceinline__ void copy(T* stage, ofz_i64 koff, ofz_i64 K) const {
    const bool kin = kpos + koff < K;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
      if (ROWS % kPer != 0 && (int)threadIdx.x / 8 + i * kPer >= ROWS) continue;
      const bool ok = kin && i < live;
      cp_async16(stage + dst + i * (kPer / 8) * 512, ok ? src + i * row_step + koff : src, ok ? 16 : 0);
    }
  }
};

template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH, class Ops,
          int ROW_TPR, class Geo, int SPLIT, class Fold, int RSPLIT, int PHASES>
__device__ __forceinline__ void run_wgmma(const OfzArgs& a, int a_arg, int b_arg, ofz_i64 batch, ofz_i64 M, ofz_i64 N,
                                          ofz_i64 K) {
#if !defined(ORTFUSE_EMU) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(BM < 0, "wgmma kernels compile for sm_90a only");
#endif
  static_assert(AMODE == kRowMajor && BMODE == kColMajor, "wgmma: A [M][K] and B [N][K], both copied");
  static_assert(sizeof(T) == 2 && BK == 64 && WM == 16 && BM % 64 == 0 && BN % WN == 0, "wgmma tile shape");
  static_assert(WN == 64 || WN == 128 || WN == 192 || WN == 256, "wgmma N per warpgroup");
  static_assert(STAGES >= 4, "the wgmma pipeline refills a stage two k tiles after it was read");
  static_assert(!Fold::kOn, "the LayerNorm fold runs on the mma.sync mainloop");
  static_assert((MATH == kWgmmaBF16) == SameType<T, __nv_bfloat16>::value, "math and type");
  constexpr int kThreads = (BM / WM) * (BN / WN) * 32;
  constexpr int kNT = WN / 8;
  constexpr int kAStage = BM * BK, kBStage = BN * BK;  // elements
  constexpr int kRowLd = BN + 4;
  OFZ_DYNAMIC_SMEM(T, smem);
  T* const As = smem + ((1024u - (smem_u32(smem) & 1023u)) & 1023u) / sizeof(T);
  T* const Bs = As + STAGES * kAStage;
  const unsigned as_addr = smem_u32(As), bs_addr = smem_u32(Bs);
  const int warp = threadIdx.x / 32;
  const int wm0 = (warp % (BM / WM)) * WM, wn0 = (warp / (BM / WM)) * WN;
  const unsigned a_group = (unsigned)(wm0 & ~63) * BK * 2u, b_group = (unsigned)wn0 * BK * 2u;  // bytes in a stage
  const Schedule<BM, BN, BK, SPLIT> sch(batch, M, N, K);
  const ofz_i64 kt0 = sch.kt0, nk = sch.nk;  // the block's k tiles: [kt0, kt0 + nk)

  for (ofz_i64 u = sch.first; u < sch.tiles; u += sch.step) {
    ofz_i64 b, m0, n0;
    sch.at(u, b, m0, n0);
    const T* A = static_cast<const T*>(a.ptr[a_arg]) + Ops::a_base(a, b);
    const T* B = static_cast<const T*>(a.ptr[b_arg]) + Ops::b_base(a, b);
    float acc[1][kNT][4];
    float (&d)[kNT * 4] = reinterpret_cast<float (&)[kNT * 4]>(acc);
#pragma unroll
    for (int i = 0; i < kNT * 4; ++i) d[i] = 0.0f;
    SwizzledCopy<T, BM, kThreads> ca;
    SwizzledCopy<T, BN, kThreads> cb;
    ca.init(A, m0, M, K, kt0 * BK);
    cb.init(B, n0, N, K, kt0 * BK);
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
      if (s < nk) {
        ca.copy(As + s * kAStage, (ofz_i64)s * BK, K);
        cb.copy(Bs + s * kBStage, (ofz_i64)s * BK, K);
      }
      cp_async_commit();
    }
    for (ofz_i64 kt = 0; kt < nk; ++kt) {
      cp_async_wait<STAGES - 3>();  // this thread's copies of tile kt landed
      fence_proxy_async();          // ... and are visible to the tensor cores' (async) proxy
      __syncthreads();              // everyone's; and every warpgroup finished tile kt - 2's group
      const ofz_i64 next = kt + STAGES - 2;
      if (next < nk) {
        const int ns = (int)(next % STAGES);
        ca.copy(As + ns * kAStage, next * BK, K);
        cb.copy(Bs + ns * kBStage, next * BK, K);
      }
      cp_async_commit();
      const unsigned st = (unsigned)(kt % STAGES);
      const unsigned a_at = as_addr + st * kAStage * 2u + a_group, b_at = bs_addr + st * kBStage * 2u + b_group;
      warpgroup_ktile<WN, BK, T>(d, a_at, b_at);  // tile kt - 1 retired: its stage is refilled after the next barrier
    }
    wgmma_wait<0>();
    wgmma_fence_operand(d);
    cp_async_wait<0>();
    __syncthreads();  // the epilogue buffer and the next tile's copies reuse the stages

    float sacc[1][1];
    const AccVisitor<true, 1, kNT, decltype(acc), decltype(sacc)> visit{acc, sacc, wm0, wn0};
    store_tile<BM, BN, kThreads, kRowLd, ROW_TPR, SPLIT, Ops, RSPLIT, PHASES>(a, reinterpret_cast<float*>(smem), visit, b, m0, n0, M, N,
                                                              sch.rank, sch.splits);
  }
}

// ---- sm_90a: the warp-specialized TMA mainloop (MATH kWsWgmmaF16 / kWsWgmmaBF16) ----------------------------
// The consumer warps are run_wgmma's (warpgroups of 64 x WN, the same accumulator layout and epilogue);
// one more warpgroup, the producer, only feeds them: one of its threads has the tensor memory accelerator
// copy each k tile of A [rows][K] and B [N][K] (tensor maps the library encodes per launch, 64 x BM and 64 x BN
// boxes in the 128-byte swizzle, zero-filled past the matrices) into a ring of STAGES stages. Each stage has
// two mbarriers: `full` completes when its bytes landed (the producer's arrive.expect_tx plus the copies'
// complete_tx), `empty` when every consumer warp released it (one arrival per warp, after the wgmma
// group that read it retired). No block barrier inside the loop: the producer runs up to STAGES k tiles
// ahead, and a consumer warpgroup keeps one wgmma group in flight while it waits for the next stage.
// Persistent: the library caps the grid (the node's blocks_per_sm), each block loops over tiles, and its
// producer fills the ring with the next tile while the consumers store this one. The batch is folded into
// M (wgmma GEMMs have a 2-D weight), so a tile's rows are rows m0.. of A's map. With
// two consumer warpgroups (384 threads, 168 registers each at launch) the producer gives registers back
// (setmaxnreg 40) and the consumers take them (232: 64 x 256 accumulators fit), as CUTLASS's Hopper kernels
// do; the kernel's __launch_bounds__(384, 1) (tiles.GemmTile.moves_registers) makes ptxas allocate exactly
// 168 at launch, without which it may ignore setmaxnreg. Split-K (SPLIT > 1) as run_mma's: a cluster's blocks each run their share of the k tiles, then the consumers meet (a named
// barrier: every warpgroup's last wgmma has read its stages) and reduce through distributed shared memory
// in the drained stages; the barriers sit before the stages, out of that buffer's way. A cluster launch
// gives each cluster one tile, so no producer is still filling the ring then.
// B multicast (MC = 2): a cluster's two blocks take tiles stacked along M with the same columns, so they need
// the same B tile in every k step. Each producer copies its A box and half of the B box, the half landing in
// both blocks (TMA multicast): B crosses from L2 once per pair instead of once per block. A stage is refilled
// only when both blocks' consumers released it (each consumer warp arrives on its stage's `empty` barrier in
// both blocks), and neither block leaves before the other is done with its barriers (a cluster barrier at
// the end). The grid is persistent in pairs: each cluster loops over groups of two tiles.
// A consumer warp hands a stage back: to its own block's producer, or with B multicast to both blocks' (either
// producer's next copy into the stage lands in this block).
template <int MC> __device__ __forceinline__ void release_stage(unsigned long long* empty) {
  if constexpr (MC == 1) {
    mbar_arrive(empty);
  } else {
#pragma unroll
    for (unsigned r = 0; r < (unsigned)MC; ++r) mbar_arrive_cluster(empty, r);
  }
}

template <int CONSUMERS> struct WsRegs {
  static constexpr bool kMove = CONSUMERS == 256;
  static constexpr int kProducer = 40, kConsumer = 232;  // 128 * 40 + 256 * 232 = 384 * 168
};

// Ping-pong consumers (PP): two warpgroups, each computing a whole BM x BN tile (BM = 64 or 128: one or two
// m64 halves; WN = BN), take the block's tiles in turn, warpgroup g the tiles g, g + 2, ... of its sequence.
// The producer fills the ring with the tiles' k tiles in that order, so the warpgroups' mainloops follow each
// other and one warpgroup's epilogue runs while the other's MMAs do (CUTLASS's Hopper "pingpong" kernels; the
// cooperative kernel above stores each tile with both warpgroups while no MMA runs). A warpgroup starts its
// mainloop only after the other has waited on every stage of its own tile (named barrier 2 + g, which the
// other bar.arrives at): without that turn, a warpgroup could wait on a stage's `full` barrier two phases
// ahead of the phase the barrier is in, and take the older parity for its own. `empty` counts one
// warpgroup's warps: each stage is read by one warpgroup. With B multicast (MC = 2) both blocks of the pair run
// the same sequence of tiles, so warpgroup g of each reads the stage and releases it in both blocks.
__device__ __forceinline__ void pingpong_wait_turn(int wg) {
  if (wg == 0) named_barrier_sync<2>(256);
  else named_barrier_sync<3>(256);
}
__device__ __forceinline__ void pingpong_pass_turn(int wg) {
  if (wg == 0) named_barrier_arrive<3>(256);
  else named_barrier_arrive<2>(256);
}

template <class T, int BM, int BN, int BK, int STAGES, class Ops, int MC, class Sch>
__device__ __forceinline__ void pingpong_consumers(const OfzArgs& a, const Sch& sch, unsigned long long* full,
                                                   unsigned long long* empty, T* As, T* Bs, ofz_i64 M, ofz_i64 N) {
  constexpr int kMT = BM / 64, kNT = BN / 8;
  constexpr unsigned kAStageBytes = BM * BK * 2u, kBStageBytes = BN * BK * 2u;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, wg = warp / 4;
  const int wm0 = (warp % 4) * 16;  // the warp's rows in each m64 half
  const unsigned as_addr = smem_u32(As), bs_addr = smem_u32(Bs);
  const ofz_i64 nk = sch.nk;
  ofz_i64 i = 0;  // the tile's place in the block's sequence
  for (ofz_i64 u = sch.first; u < sch.tiles; u += sch.step, ++i) {
    if ((i & 1) != wg) continue;
    ofz_i64 b, m0, n0;
    sch.at(u, b, m0, n0);
    if (i > 0) pingpong_wait_turn(wg);
    float acc[kMT][1][kNT][4];
    float (&d)[kMT][kNT * 4] = reinterpret_cast<float (&)[kMT][kNT * 4]>(acc);
#pragma unroll
    for (int h = 0; h < kMT; ++h)
#pragma unroll
      for (int e = 0; e < kNT * 4; ++e) d[h][e] = 0.0f;
    unsigned it = (unsigned)(i * nk);  // the ring's k tiles before this tile's
    for (ofz_i64 kt = 0; kt < nk; ++kt, ++it) {
      const unsigned s = it % STAGES;
      mbar_wait(&full[s], (it / STAGES) & 1u);
      warpgroup_ktile_rows<BN, BK, T, kMT>(d, as_addr + s * kAStageBytes, bs_addr + s * kBStageBytes);
      if (kt > 0) {
        __syncwarp();
        if (lane == 0) release_stage<MC>(&empty[(it - 1) % STAGES]);
      }
    }
    if (u + sch.step < sch.tiles) pingpong_pass_turn(wg);  // every stage of this tile waited on
    wgmma_wait<0>();
#pragma unroll
    for (int h = 0; h < kMT; ++h) wgmma_fence_operand(d[h]);
    if (nk > 0) {
      __syncwarp();
      if (lane == 0) release_stage<MC>(&empty[(it - 1) % STAGES]);
    }
    float sacc[1][1];
#pragma unroll
    for (int h = 0; h < kMT; ++h) {
      const AccVisitor<true, 1, kNT, float[1][kNT][4], decltype(sacc)> visit{acc[h], sacc, wm0, 0};
      store_tile<64, BN, 128, BN + 4, 0, 1, Ops>(a, reinterpret_cast<float*>(As), visit, b, m0 + 64 * h, n0, M, N, 0u,
                                                 1u);
    }
  }
}

template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int MATH, class Ops, int SPLIT, int MC, int PP,
          class Fold>
__device__ __forceinline__ void run_wgmma_ws(const OfzArgs& a, const OfzTma* tma, ofz_i64 batch, ofz_i64 M, ofz_i64 N,
                                             ofz_i64 K) {
#if !defined(ORTFUSE_EMU) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(BM < 0, "wgmma kernels compile for sm_90a only");
#endif
  static_assert(sizeof(T) == 2 && BK == 64 && (WM == 16 || PP) && BM % 64 == 0 && BN % WN == 0, "wgmma tile shape");
  static_assert(BM <= 256 && BN <= 256, "one TMA box per operand and stage (at most 256 rows)");
  static_assert(WN == 64 || WN == 128 || WN == 192 || WN == 256, "wgmma N per warpgroup");
  static_assert(STAGES >= 2, "a ring of at least two stages");
  static_assert((MATH == kWsWgmmaBF16) == SameType<T, __nv_bfloat16>::value, "math and type");
  static_assert(MC == 1 || (MC == 2 && SPLIT == 1 && (BN / MC) % 8 == 0), "B multicast: pairs along M, no split-K");
  static_assert(!PP || (WN == BN && (BM == 64 || BM == 128) && WM == BM / 4 && SPLIT == 1),
                "ping-pong: a warpgroup per BM x BN tile, no split-K");
  static_assert(!Fold::kOn || (!PP && MC == 1 && SPLIT == 1), "the LayerNorm fold: the cooperative consumers, "
                "whole rows of A in one block");
  constexpr int kConsumers = PP ? 256 : (BM / WM) * (BN / WN) * 32, kConsumerWarps = kConsumers / 32;
  constexpr int kNT = WN / 8;
  constexpr int kAStage = BM * BK, kBStage = BN * BK;  // elements
  constexpr int kBPart = kBStage / MC;  // the part of B's box each block copies (all of it without multicast)
  constexpr unsigned kStageBytes = (unsigned)(kAStage + kBStage) * 2u;
  using Regs = WsRegs<kConsumers>;
  OFZ_DYNAMIC_SMEM(T, smem);
  unsigned long long* const full = reinterpret_cast<unsigned long long*>(smem);
  unsigned long long* const empty = full + STAGES;
  T* const after = reinterpret_cast<T*>(empty + STAGES);
  T* const As = after + ((1024u - (smem_u32(after) & 1023u)) & 1023u) / sizeof(T);
  T* const Bs = As + STAGES * kAStage;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      // every consumer warp of the cluster's MC blocks (ping-pong: of one warpgroup in each)
      mbar_init(&empty[s], (PP ? 4 : kConsumerWarps) * MC);
    }
    mbar_fence_init();
  }
  if constexpr (MC > 1) {
    cluster_sync();  // the barriers exist for the other block's copies and arrivals too
    if (cluster_size() != (unsigned)MC) __trap();  // launched otherwise, B would miss its other half
  } else {
    __syncthreads();  // the only block barrier: the barriers exist for everyone
  }
  const Schedule<BM, BN, BK, SPLIT, MC> sch(batch, M, N, K);
  const ofz_i64 kt0 = sch.kt0, nk = sch.nk;  // the block's k tiles: [kt0, kt0 + nk)
  // split-K reuses the drained stages for the partial tile: only right if no producer refills them for a
  // next tile, i.e. one tile per cluster (what the library launches: ofz_spec_cluster)
  if constexpr (SPLIT > 1)
    if (sch.splits > 1 && sch.step < sch.tiles) __trap();

  if (warp >= kConsumerWarps) {  // the producer warpgroup
    if constexpr (Regs::kMove) setmaxnreg_dec<Regs::kProducer>();
    if (warp == kConsumerWarps && lane == 0) {
      tma_prefetch(&tma->map[0]);
      tma_prefetch(&tma->map[1]);
      unsigned it = 0;  // k tiles issued so far, over every tile of this block
      for (ofz_i64 u = sch.first; u < sch.tiles; u += sch.step) {
        ofz_i64 b, m0, n0;
        sch.at(u, b, m0, n0);
        for (ofz_i64 kt = 0; kt < nk; ++kt, ++it) {
          const unsigned s = it % STAGES, phase = (it / STAGES) & 1u;
          mbar_wait(&empty[s], phase ^ 1u);  // the consumers released this stage's previous use
          mbar_arrive_expect_tx(&full[s], kStageBytes);  // multicast: the other block's half lands here too
          tma_load_2d(As + s * kAStage, &tma->map[0], (int)((kt0 + kt) * BK), (int)(b * M + m0), &full[s]);
          if constexpr (MC > 1)
            tma_load_2d_multicast(Bs + s * kBStage + sch.mrank * kBPart, &tma->map[1], (int)((kt0 + kt) * BK),
                                  (int)(n0 + sch.mrank * (BN / MC)), &full[s], (unsigned short)((1u << MC) - 1u));
          else
            tma_load_2d(Bs + s * kBStage, &tma->map[1], (int)((kt0 + kt) * BK), (int)n0, &full[s]);
        }
      }
    }
    if constexpr (MC > 1) {
      __syncwarp();
      cluster_sync();  // the pair's consumers may still arrive on this block's barriers
    }
    return;
  }

  if constexpr (Regs::kMove) setmaxnreg_inc<Regs::kConsumer>();
  if constexpr (PP) {
    pingpong_consumers<T, BM, BN, BK, STAGES, Ops, MC>(a, sch, full, empty, As, Bs, M, N);
    if constexpr (MC > 1) cluster_sync();  // as below
    return;
  }
  const int wm0 = (warp % (BM / WM)) * WM, wn0 = (warp / (BM / WM)) * WN;
  const unsigned as_addr = smem_u32(As), bs_addr = smem_u32(Bs);
  const unsigned a_group = (unsigned)(wm0 & ~63) * BK * 2u, b_group = (unsigned)wn0 * BK * 2u;  // bytes in a stage
  // the LayerNorm fold: every consumer thread gathers row moments from the A stages while the MMAs run
  using Moments = typename Pick<Fold::kOn, RowMoments<T, BM, BK, BK, kConsumers, true>, NoMoments>::type;
  unsigned it = 0;  // k tiles consumed so far
  for (ofz_i64 u = sch.first; u < sch.tiles; u += sch.step) {
    ofz_i64 b, m0, n0;
    sch.at(u, b, m0, n0);
    float acc[1][kNT][4];
    float (&d)[kNT * 4] = reinterpret_cast<float (&)[kNT * 4]>(acc);
#pragma unroll
    for (int i = 0; i < kNT * 4; ++i) d[i] = 0.0f;
    Moments moments;
    moments.clear();
    for (ofz_i64 kt = 0; kt < nk; ++kt, ++it) {
      const unsigned s = it % STAGES;
      mbar_wait(&full[s], (it / STAGES) & 1u);
      const unsigned a_at = as_addr + s * kAStage * 2u + a_group, b_at = bs_addr + s * kBStage * 2u + b_group;
      warpgroup_ktile<WN, BK, T>(d, a_at, b_at);  // the previous k tile retired: its stage goes back
      // read before this stage goes back (next k tile), while its MMAs run
      moments.add(As + s * kAStage, (kt0 + kt) * BK, K);
      if (kt > 0) {
        __syncwarp();
        if (lane == 0) release_stage<MC>(&empty[(it - 1) % STAGES]);
      }
    }
    wgmma_wait<0>();
    wgmma_fence_operand(d);
    if (nk > 0) {
      __syncwarp();
      if (lane == 0) release_stage<MC>(&empty[(it - 1) % STAGES]);
    }
    float sacc[1][1];
    if constexpr (Fold::kOn) {
      named_barrier_sync<1>(kConsumers);  // every consumer has scaled the previous tile by its rows' rstd
      moments.finish(fold_rstd<BM>(), Fold::eps());
      named_barrier_sync<1>(kConsumers);  // every row's rstd is stored
      fold_scale<true, 1, kNT>(acc, sacc, wm0, wn0, fold_rstd<BM>());
    }
    const AccVisitor<true, 1, kNT, decltype(acc), decltype(sacc)> visit{acc, sacc, wm0, wn0};
    if constexpr (SPLIT > 1)
      if (sch.splits > 1) named_barrier_sync<1>(kConsumers);  // the partial tile overwrites the stages
    store_tile<BM, BN, kConsumers, BN + 4, 0, SPLIT, Ops>(a, reinterpret_cast<float*>(As), visit, b, m0, n0, M, N,
                                                          sch.rank, sch.splits);
  }
  if constexpr (MC > 1) cluster_sync();  // the producers' last wait on the stages this block released
}

template <class T, int BM, int BN, int BK, int WM, int WN, int STAGES, int AMODE, int BMODE, int MATH, class Ops,
          int ROW_TPR = 0, class Geo = NoConv, int SPLIT = 1, class Fold = NoFold, int RSPLIT = 1, int PHASES = 0,
          int MC = 1, int PP = 0>
__device__ __forceinline__ void run(const OfzArgs& a, int a_arg, int b_arg, ofz_i64 batch, ofz_i64 M, ofz_i64 N,
                                    ofz_i64 K, const OfzTma* tma = nullptr) {
  static_assert((MC == 1 && !PP) || MATH == kWsWgmmaF16 || MATH == kWsWgmmaBF16,
                "B multicast and ping-pong: the TMA mainloop only");
  static_assert(RSPLIT == 1 || (ROW_TPR > 0 && SPLIT == 1), "a row split across a cluster: row-wise epilogue, no split-K");
  if constexpr (RSPLIT > 1)  // launched otherwise, a block would reduce only its share of each row
    if (cluster_size() != (unsigned)RSPLIT || (N + BN - 1) / BN != RSPLIT) __trap();
  if constexpr (MATH == kWsWgmmaF16 || MATH == kWsWgmmaBF16) {
    static_assert(AMODE == kRowMajor && BMODE == kColMajor && ROW_TPR == 0 && RSPLIT == 1,
                  "the TMA mainloop: A [M][K] and B [N][K], plain epilogue");
    (void)a_arg, (void)b_arg;
    run_wgmma_ws<T, BM, BN, BK, WM, WN, STAGES, MATH, Ops, SPLIT, MC, PP, Fold>(a, tma, batch, M, N, K);
  } else if constexpr (MATH == kWgmmaF16 || MATH == kWgmmaBF16)
    run_wgmma<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH, Ops, ROW_TPR, Geo, SPLIT, Fold, RSPLIT, PHASES>(
        a, a_arg, b_arg, batch, M, N, K);
  else
    run_mma<T, BM, BN, BK, WM, WN, STAGES, AMODE, BMODE, MATH, Ops, ROW_TPR, Geo, SPLIT, Fold, RSPLIT, PHASES>(
        a, a_arg, b_arg, batch, M, N, K);
}

}  // namespace gemm
}  // namespace ofz
