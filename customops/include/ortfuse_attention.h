// Fused attention, flash style: O = softmax(score(Q·Kᵀ)) · V with an online softmax, so the [Sq, Sk] score
// matrix never reaches DRAM. fp32 accumulation; Q, K, V and O stored as float, __half or __nv_bfloat16.
// Compiles under NVRTC and, through ortfuse_kernel.h, in the CPU emulation.
//
// Generated code supplies small functors (structs with static __device__ __forceinline__ functions):
//
//   layout (one each for Q, K, V, O; folds every Reshape/Transpose around the pattern into addressing):
//     static ofz_i64 offset(const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s, ofz_i64 d);
//       element offset of row s, column d of head h in batch b (s a query row for Q and O, a key for K, V)
//   rotary embedding (optional, Q and K: a Rope on the path, search/attention.py):
//     static float rope(const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s, ofz_i64 d, float x, float xp);
//     static ofz_i64 rope_half(const OfzArgs& a);
//       the rotated value at column d of row s from x there and xp at the partner column d -+ rope_half()
//       (D / 2, or R / 2 of a rotation of the first R columns); the kernel rotates the rows of Q and K it has
//       loaded, in place (rotate_rows)
//   score epilogue (the element-wise ops between the two MatMuls: scale, mask, Where, Cast):
//     static float score(const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 i, ofz_i64 j, float qk);
//       the Softmax input for query i and key j; -inf (neg_inf()) masks the entry out. It is only called
//       for i < Sq and j < Sk, so it may read masks without bounds checks.
//     static ofz_i64 key_end(const OfzArgs& a, ofz_i64 i, ofz_i64 sq, ofz_i64 sk);   (optional)
//     static ofz_i64 key_begin(const OfzArgs& a, ofz_i64 i, ofz_i64 sq, ofz_i64 sk);   (optional, with key_end)
//       a causal frontier (customops/key_bound.py proves it on the graph): score() masks every key
//       j >= key_end(i) for query row i (and every j < key_begin(i): a sliding window's far side), both never
//       decreasing with i; a unit then visits only the key tiles between its first row's key_begin and its
//       last row's key_end (flash attention's causal tile skipping)
//     static ofz_i64 group(const OfzArgs& a);   (optional, with key_end: grouped-query heads packed)
//       G query heads packed into each unit's rows (below): key_end and key_begin then take a head's own row
//       i and Sq (packed row r is row r % Sq of head r / Sq, sq / G rows a head)
//
// Then a kernel body is one call, e.g. ofz::attn::simt<__half, 64, 64, Q, K, V, O, S>(a, q, k, v, o, dims).
// Launch rule: block = Tile::THREADS threads; one block computes BLOCK_M query rows of one (b, h), and
// grid-strides over all batch * heads * ceil(Sq / BLOCK_M) such units, so `units` = batch * heads * Sq with
// `units_per_block` = BLOCK_M gives enough blocks (never too many). Grouped-query heads packed by the lowering
// (lower_attention): `heads` is then the K/V heads, `sq` G times the query rows, and the callbacks map a
// packed row back to its head and row.
//
// Rows whose scores are all -inf produce 0 (ORT's Softmax gives NaN there); exporters mask with the
// finite lowest float, which behaves exactly like the unfused graph.
#pragma once
#include "ortfuse_kernel.h"

namespace ofz {
namespace attn {

// Runtime sizes: the scores are [batch, heads, sq, sk].
struct Dims {
  ofz_i64 batch, heads, sq, sk;
};

__device__ __forceinline__ float neg_inf() { return f32_bits(0xff800000u); }

// Reduce over the G consecutive lanes that share one query row (all 32 lanes of the warp call it).
template <class Op, int G> __device__ __forceinline__ float group_reduce(float v) {
#pragma unroll
  for (int off = G / 2; off > 0; off >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

constexpr float LOG2E = 1.4426950408889634f;

// One row's online-softmax state. `rescale` folds in a tile whose row max is `tile_max` and returns the
// factor for the old accumulators; `term(s)` is then e^(s - base) as 2^((s - base)·log2e): an FADD, an FMUL
// and one MUFU.EX2 (__expf adds the SFU's denormal fix-up, 3 more). The difference is taken before scaling:
// scores near a finite mask value (-1e30, fp32's lowest) are exact there, where s·log2e - base·log2e would
// lose the exponent to rounding. `base` stays 0 while every score seen is -inf, so a masked tile never
// computes e^(-inf - -inf) = NaN.
// Scores that are only a positive scale c of Q·Kᵀ (no mask: the score functor has `log2_scale`, c·log2e) keep
// the raw qk instead, and their `unit` is c·log2e: m and base are qk maxima, and `term_scaled(qk)` is
// 2^(qk·unit + nbu) with nbu = -base·unit rounded once a tile: one FFMA and the MUFU.EX2 (the scale's FMUL and
// the difference's FADD gone). A tile's terms share nbu's rounding, which cancels in the normalization; the
// rescale's factor is exact, so tiles of different bases differ by their roundings' difference, and the max
// key's term is 2^(its tile's rounding): both near 1 while |qk·unit| is far below 2^24 (attention scores are;
// past about 2^28 a 16-bit P overflows). Taking the factor as 2^(new nbu - old nbu) instead, exact between
// tiles, cost ViT's kernel 9 registers (130: 3 blocks per SM; bounded to 4, it spilled). Masks (fp32's
// lowest value among them) keep `term`: subtracting first.
struct RowState {
  float m, l, base, nbu;
  __device__ __forceinline__ void init() { m = neg_inf(), l = 0.0f, base = 0.0f, nbu = 0.0f; }
  __device__ __forceinline__ float rescale(float tile_max, float unit = LOG2E) {
    const float m_new = fmaxf(m, tile_max);
    const float new_base = m_new == neg_inf() ? 0.0f : m_new;
    const float alpha = exp2_ftz((m - new_base) * unit);  // 0 while m is -inf
    m = m_new, base = new_base, nbu = -new_base * unit, l *= alpha;  // (nbu: read by term_scaled alone)
    return alpha;
  }
  __device__ __forceinline__ float term(float s) const { return exp2_ftz((s - base) * LOG2E); }
  __device__ __forceinline__ float term_scaled(float qk, float unit) const { return exp2_ftz(fmaf(qk, unit, nbu)); }
  __device__ __forceinline__ float inv_sum() const { return l > 0.0f ? 1.0f / l : 0.0f; }
};

// Whether a score functor is a bare scale of Q·Kᵀ (`log2_scale`, see RowState).
template <class S, class = void> struct HasLog2Scale { static constexpr bool value = false; };
template <class S> struct HasLog2Scale<S, decltype((void)&S::log2_scale)> { static constexpr bool value = true; };
template <class S> __device__ __forceinline__ float log2_unit(const OfzArgs& a) {
  if constexpr (HasLog2Scale<S>::value) return (float)S::log2_scale(a);
  else return LOG2E;
}

// Whether a score functor has `key_end` (a causal frontier) and `key_begin` (its far side), and the key tiles
// [lo, hi) of BN keys a unit of query rows i0 .. i1 - 1 visits: every tile, or those from its first row's
// key_begin to its last row's key_end (none where that range is empty: every score of the unit is masked).
template <class S, class = void> struct HasKeyEnd { static constexpr bool value = false; };
template <class S> struct HasKeyEnd<S, decltype((void)&S::key_end)> { static constexpr bool value = true; };
template <class S, class = void> struct HasKeyBegin { static constexpr bool value = false; };
template <class S> struct HasKeyBegin<S, decltype((void)&S::key_begin)> { static constexpr bool value = true; };
template <class S, class = void> struct HasGroup { static constexpr bool value = false; };
template <class S> struct HasGroup<S, decltype((void)&S::group)> { static constexpr bool value = true; };
struct KeyTiles {
  ofz_i64 lo, hi;
};
template <class S, int BN>
__device__ __forceinline__ KeyTiles unit_key_tiles(const OfzArgs& a, ofz_i64 i0, ofz_i64 i1, const Dims& n) {
  const ofz_i64 all = (n.sk + BN - 1) / BN;
  KeyTiles t{0, all};
  if constexpr (HasKeyEnd<S>::value) {
    ofz_i64 first = i0, last = (i1 < n.sq ? i1 : n.sq) - 1, sq = n.sq;
    if constexpr (HasGroup<S>::value) {  // packed heads: the unit's rows within one head, or every row of one
      sq = n.sq / S::group(a);
      if (first / sq == last / sq) first %= sq, last %= sq;
      else first = 0, last = sq - 1;
    }
    const ofz_i64 end = S::key_end(a, last, sq, n.sk);
    t.hi = end <= 0 ? 0 : (end + BN - 1) / BN < all ? (end + BN - 1) / BN : all;
    if constexpr (HasKeyBegin<S>::value) {
      const ofz_i64 begin = S::key_begin(a, first, sq, n.sk);
      t.lo = begin <= 0 ? 0 : begin / BN < t.hi ? begin / BN : t.hi;
    }
  }
  return t;
}

// A unit's query-row tile: in order, or last first under a causal frontier, where the last tiles visit the most
// keys: the blocks launched first take the longest units and the short ones fill the wave's tail.
template <class S> __device__ __forceinline__ ofz_i64 unit_row(ofz_i64 t, ofz_i64 tiles_m) {
  if constexpr (HasKeyEnd<S>::value) return tiles_m - 1 - t;
  else return t;
}

// Whether a layout functor has `rope` (a rotary embedding applied to the rows it loads).
template <class L, class = void> struct HasRope { static constexpr bool value = false; };
template <class L> struct HasRope<L, decltype((void)&L::rope)> { static constexpr bool value = true; };

// Rows s0 .. s0+ROWS-1 of Q or K in shared memory (LD elements apart), rotated in place: columns c and c + H
// (H = L::rope_half(): D / 2, or R / 2 where only the first R columns rotate) are a pair, each rotated from
// both (L::rope). Rows at or past `limit` (zero-filled) are left alone. The block's threads share the pairs;
// the caller synchronizes before and after. Where H divides NT (rotate_half's D / 2 = 32 or 64 of 128
// threads) each thread keeps one column pair and steps over rows: no division, no per-pair bound branch.
template <class E, int ROWS, int D, int LD, int NT, class L>
__device__ __forceinline__ void rotate_rows(E* rows, const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s0,
                                            ofz_i64 limit) {
  const int H = (int)L::rope_half(a);  // a printed constant
  auto pair = [&](int r, int c) {
    E* const row = rows + r * LD;
    const float x0 = to_f32(row[c]), x1 = to_f32(row[c + H]);
    row[c] = from_f32<E>(L::rope(a, b, h, s0 + r, c, x0, x1));
    row[c + H] = from_f32<E>(L::rope(a, b, h, s0 + r, c + H, x1, x0));
  };
  if (NT % H == 0) {
    const int n = (int)(limit - s0 < ROWS ? limit - s0 : ROWS), c = (int)(threadIdx.x % (unsigned)H);
    for (int r = (int)(threadIdx.x / (unsigned)H); r < n; r += NT / H) pair(r, c);
    return;
  }
  for (int e = threadIdx.x; e < ROWS * H; e += NT) {
    const int r = e / H, c = e % H;
    if (s0 + r < limit) pair(r, c);
  }
}

// f(r, c) for each element of a ROWS x W tile, shared by the block's NT threads. Where W divides NT each thread
// keeps one column and steps over rows (no division; a row's address advances by a fixed stride), else the
// elements are dealt out in order.
template <int ROWS, int W, int NT, class F>
__device__ __forceinline__ void for_tile(F&& f) {
  if constexpr (NT % W == 0) {
    const int c = (int)(threadIdx.x % (unsigned)W);
#pragma unroll 4
    for (int r = (int)(threadIdx.x / (unsigned)W); r < ROWS; r += NT / W) f(r, c);
  } else {
    for (int e = threadIdx.x; e < ROWS * W; e += NT) f(e / W, e % W);
  }
}

// ---- SIMT: any head size up to 128, any storage type -------------------------------------------------------
// G = ROW_THREADS threads of one warp share a query row: each computes BLOCK_N / G of its scores per key
// tile and owns DV / G of its output columns (column g + G * c). Q, K, V tiles sit in static shared memory
// as fp32 (under 48 KiB for head sizes up to 128).
template <int D, int DV> struct SimtTile {
  static constexpr int THREADS = 128;
  static constexpr int ROW_THREADS = 4;
  static constexpr int BLOCK_M = THREADS / ROW_THREADS;
  static constexpr int BLOCK_N = (D > 64 || DV > 64) ? 16 : 32;
  static constexpr int KEYS = BLOCK_N / ROW_THREADS;                  // scores per thread per tile
  static constexpr int COLS = (DV + ROW_THREADS - 1) / ROW_THREADS;   // output columns per thread
};

template <class T, int D, int DV, class Q, class K, class V, class O, class Score>
__device__ __forceinline__ void simt(const OfzArgs& a, const T* __restrict__ q, const T* __restrict__ k,
                                     const T* __restrict__ v, T* __restrict__ o, const Dims n) {
  using Tile = SimtTile<D, DV>;
  constexpr int BM = Tile::BLOCK_M, BN = Tile::BLOCK_N, G = Tile::ROW_THREADS, NT = Tile::THREADS;
  static_assert(D >= 1 && D <= 128 && DV >= 1 && DV <= 128, "head sizes 1..128");
  __shared__ float sq[BM][D + 1];  // +1: the rows a warp reads at once fall in different banks
  __shared__ float sk[BN][D + 1];
  __shared__ float sv[BN][DV];
  __shared__ float sp[BM][BN + 1];  // this tile's probabilities, shared by the G threads of a row
  const int tid = threadIdx.x, r = tid / G, g = tid % G;
  const ofz_i64 tiles_m = (n.sq + BM - 1) / BM, units = n.batch * n.heads * tiles_m;
  for (ofz_i64 u = blockIdx.x; u < units; u += gridDim.x) {
    const ofz_i64 bh = u / tiles_m, i0 = unit_row<Score>(u % tiles_m, tiles_m) * BM, b = bh / n.heads, h = bh % n.heads;
    const ofz_i64 i = i0 + r;
    const bool row_ok = i < n.sq;
    __syncthreads();  // the previous unit is done with sq
    for_tile<BM, D, NT>([&](int rr, int c) {
      const ofz_i64 ie = i0 + rr;
      sq[rr][c] = ie < n.sq ? to_f32(q[Q::offset(a, b, h, ie, c)]) : 0.0f;
    });
    if constexpr (HasRope<Q>::value) {  // (the key loop's first barrier follows)
      __syncthreads();
      rotate_rows<float, BM, D, D + 1, NT, Q>(&sq[0][0], a, b, h, i0, n.sq);
    }
    RowState row;
    row.init();
    float acc[Tile::COLS];
#pragma unroll
    for (int c = 0; c < Tile::COLS; ++c) acc[c] = 0.0f;

    const KeyTiles span = unit_key_tiles<Score, BN>(a, i0, i0 + BM, n);
    for (ofz_i64 j0 = span.lo * BN; j0 < span.hi * BN; j0 += BN) {
      __syncthreads();  // sk, sv, sp no longer read by the previous tile
      for_tile<BN, D, NT>([&](int rr, int c) {
        const ofz_i64 je = j0 + rr;
        sk[rr][c] = je < n.sk ? to_f32(k[K::offset(a, b, h, je, c)]) : 0.0f;
      });
      for_tile<BN, DV, NT>([&](int rr, int c) {
        const ofz_i64 je = j0 + rr;
        sv[rr][c] = je < n.sk ? to_f32(v[V::offset(a, b, h, je, c)]) : 0.0f;
      });
      __syncthreads();
      if constexpr (HasRope<K>::value) {
        rotate_rows<float, BN, D, D + 1, NT, K>(&sk[0][0], a, b, h, j0, n.sk);
        __syncthreads();
      }

      float s[Tile::KEYS];
#pragma unroll
      for (int kk = 0; kk < Tile::KEYS; ++kk) s[kk] = 0.0f;
#pragma unroll 8
      for (int d = 0; d < D; ++d) {
        const float x = sq[r][d];
#pragma unroll
        for (int kk = 0; kk < Tile::KEYS; ++kk) s[kk] += x * sk[g + G * kk][d];
      }
      float tile_max = neg_inf();
#pragma unroll
      for (int kk = 0; kk < Tile::KEYS; ++kk) {
        const ofz_i64 j = j0 + g + G * kk;
        s[kk] = row_ok && j < n.sk ? Score::score(a, b, h, i, j, s[kk]) : neg_inf();
        tile_max = fmaxf(tile_max, s[kk]);
      }
      const float alpha = row.rescale(group_reduce<MaxOp, G>(tile_max));
      float psum = 0.0f;
#pragma unroll
      for (int kk = 0; kk < Tile::KEYS; ++kk) {
        const float p = row.term(s[kk]);
        sp[r][g + G * kk] = p;
        psum += p;
      }
      row.l += group_reduce<SumOp, G>(psum);
      __syncwarp();  // the row's probabilities, written by its G lanes, are visible to all of them
#pragma unroll
      for (int c = 0; c < Tile::COLS; ++c) acc[c] *= alpha;
      const int keys = n.sk - j0 < BN ? (int)(n.sk - j0) : BN;
      for (int jj = 0; jj < keys; ++jj) {
        const float p = sp[r][jj];
#pragma unroll
        for (int c = 0; c < Tile::COLS; ++c)
          if (g + G * c < DV) acc[c] += p * sv[jj][g + G * c];
      }
    }
    if (row_ok) {
      const float inv = row.inv_sum();
#pragma unroll
      for (int c = 0; c < Tile::COLS; ++c)
        if (g + G * c < DV) o[O::offset(a, b, h, i, g + G * c)] = from_f32<T>(acc[c] * inv);
    }
  }
}

// ---- tensor cores: fp16 / bf16 storage, head sizes multiples of 16 up to 128 (sm_80+) ------------------------
// Four warps, 16 query rows each (BLOCK_M = 64). Q·Kᵀ and P·V are mma.sync m16n8k16 with fp32 accumulators;
// the score accumulators become P's A fragments in registers (their layouts coincide), so P never touches
// shared memory. K and V tiles are double-buffered with cp.async: tile t+1 loads while tile t computes.
// Preconditions the generated code guarantees: every layout is contiguous in d
// (offset(b, h, s, d) == offset(b, h, s, 0) + d) and each row starts 16-byte aligned (8 elements);
// AFFINE (optional): Q's offsets are affine in s (load_rows steps rows by one stride); AFFINE_KV likewise for K's
// and V's (by default as Q's: packed grouped-query rows make Q's and O's offsets divide by Sq, not K's or V's).
// Each thread keeps two query rows' state and its output accumulators in registers; Q's fragments are
// read from shared memory per key tile (D / 4 registers fewer for the unit: the unrolled copies fit).
// Dynamic shared memory: launch with smem = Tile::SMEM_BYTES (above 48 KiB for head size 128: opt-in).
template <int D, int DV> struct MmaTile {
  static constexpr int THREADS = 128;
  static constexpr int BLOCK_M = 64;
  static constexpr int BLOCK_N = (D > 64 || DV > 64) ? 32 : 64;
  static constexpr int PAD = 8;  // elements added to each shared row: the 8 rows of an ldmatrix hit distinct banks
  static constexpr int SMEM_BYTES = 2 * (BLOCK_M * (D + PAD) + 2 * BLOCK_N * (D + PAD) + 2 * BLOCK_N * (DV + PAD));
  // keys split across a cluster: each thread's (m, l) of two rows and its accumulators, as floats
  static constexpr int SPLIT_STATE_BYTES = (4 + DV / 2) * THREADS * 4;
};

template <class T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
  return (unsigned)__half_as_ushort(__float2half(lo)) | (unsigned)__half_as_ushort(__float2half(hi)) << 16;
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
  return (unsigned)__bfloat16_as_ushort(__float2bfloat16(lo)) | (unsigned)__bfloat16_as_ushort(__float2bfloat16(hi)) << 16;
}
template <class T> __device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]);
template <> __device__ __forceinline__ void mma16816<__half>(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  mma_f16(c, a, b);
}
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  mma_bf16(c, a, b);
}

// Rows s0 .. s0+ROWS-1 of one head, W elements each, global -> shared rows of W + PAD elements, 16 bytes per
// cp.async (placed by chunk_place: a quarter-warp's stores in distinct banks) by the block's NT threads;
// rows at or past `limit` are zero-filled without a global read. The copy is unrolled (a compile-time
// stride). AFFINE: offset(s, d) = offset(0, d) + s * stride (the lowering checks it); then, where NT is a
// multiple of 8 chunk rows, a thread's chunks keep one column and step NT / CHUNKS rows, so its addresses
// are one base plus multiples of one step, with no offset call per chunk.
template <class T, int ROWS, int W, int PAD, int NT, bool AFFINE, class L> __device__ __forceinline__ void load_rows(
    T* dst, const T* src, const OfzArgs& a, ofz_i64 b, ofz_i64 h, ofz_i64 s0, ofz_i64 limit) {
  constexpr int CHUNKS = W / 8, TOTAL = ROWS * CHUNKS, ITERS = (TOTAL + NT - 1) / NT;
  static_assert(PAD == 8, "chunk_place assumes rows padded by one 16-byte chunk");
  const int left = limit - s0 < ROWS ? (int)(limit - s0) : ROWS;  // rows in bounds (none if s0 >= limit)
  if constexpr (AFFINE && NT % (8 * CHUNKS) == 0) {
    constexpr int STEP = NT / CHUNKS;
    int row, col;
    chunk_place<ROWS, CHUNKS>((int)threadIdx.x, row, col);
    col *= 8;
    const ofz_i64 base = L::offset(a, b, h, s0, col), stride = L::offset(a, b, h, s0 + 1, col) - base;
    const T* p = src + base + row * stride;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (TOTAL % NT != 0 && (int)threadIdx.x + it * NT >= TOTAL) break;
      const bool ok = row + it * STEP < left;
      cp_async16(dst + (row + it * STEP) * (W + PAD) + col, ok ? p + it * STEP * stride : src + base, ok ? 16 : 0);
    }
  } else {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int e = (int)threadIdx.x + it * NT;
      if (TOTAL % NT != 0 && e >= TOTAL) break;
      int row, col;
      chunk_place<ROWS, CHUNKS>(e, row, col);
      col *= 8;
      const bool ok = row < left;
      cp_async16(dst + row * (W + PAD) + col, src + L::offset(a, b, h, s0 + (ok ? row : 0), col), ok ? 16 : 0);
    }
  }
}

// K's or V's rows for one unit, a tile at a time. Where their offsets are affine in the key index (AFFINE, the
// lowering checks it) and NT is a multiple of 8 chunk rows, a thread's chunks keep one column and step NT /
// CHUNKS rows, and its address at key s is one base plus s strides, both fixed for the unit: the offset
// callbacks run once a unit instead of twice a tile (ptxas rematerialized their b and h, divisions
// included, inside the key loop), a tile's copy is pointer arithmetic, and a whole tile needs no bounds
// selects. Otherwise each tile is load_rows.
template <class T, int ROWS, int W, int PAD, int NT, bool AFFINE, class L> struct UnitRows {
  static constexpr int CHUNKS = W / 8, TOTAL = ROWS * CHUNKS, ITERS = (TOTAL + NT - 1) / NT, STEP = NT / CHUNKS;
  static constexpr bool FIXED = AFFINE && NT % (8 * CHUNKS) == 0;
  const T* src;
  const OfzArgs* args;
  ofz_i64 b, h;
  const T* base;  // FIXED: this thread's chunk column at key 0
  ofz_i64 stride, jump;  // FIXED: elements from one key to the next, and from one of its chunks to the next
  int shared;  // FIXED: its first chunk's place in a shared tile

  __device__ __forceinline__ UnitRows(const T* src_, const OfzArgs& a, ofz_i64 b_, ofz_i64 h_)
      : src(src_), args(&a), b(b_), h(h_) {
    if constexpr (FIXED) {
      int row, col;
      chunk_place<ROWS, CHUNKS>((int)threadIdx.x, row, col);
      col *= 8;
      const ofz_i64 at0 = L::offset(a, b_, h_, 0, col);
      stride = L::offset(a, b_, h_, 1, col) - at0;
      jump = STEP * stride;
      base = src_ + at0 + row * stride;
      shared = row * (W + PAD) + col;
    }
  }

  // rows s0 .. s0 + ROWS - 1 into `dst`; those at or past `limit` zero-filled without a global read
  __device__ __forceinline__ void load(T* dst, ofz_i64 s0, ofz_i64 limit) const {
    if constexpr (FIXED) {
      const T* p = base + s0 * stride;
      T* d = dst + shared;
      if (s0 + ROWS <= limit) {  // a whole tile
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          if (TOTAL % NT != 0 && (int)threadIdx.x + it * NT >= TOTAL) break;
          cp_async16(d + it * STEP * (W + PAD), p + it * jump, 16);
        }
      } else {
        const int row = shared / (W + PAD);
        const int left = limit - s0 < ROWS ? (int)(limit - s0) : ROWS;
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          if (TOTAL % NT != 0 && (int)threadIdx.x + it * NT >= TOTAL) break;
          const bool ok = row + it * STEP < left;
          cp_async16(d + it * STEP * (W + PAD), ok ? p + it * jump : src, ok ? 16 : 0);
        }
      }
    } else {
      load_rows<T, ROWS, W, PAD, NT, AFFINE, L>(dst, src, *args, b, h, s0, limit);
    }
  }
};

// Keys split across a cluster: each block holds, per row of the unit, the online-softmax state of its share of
// the keys (max m_q, sum l_q and accumulators relative to its base, m_q or 0 while -inf). The blocks put their
// states in shared memory (`state`: the tile buffers, free after the key loop; MmaTile::SPLIT_STATE_BYTES,
// thread-major so every access is conflict-free), and each merges the cluster's over distributed shared
// memory: the row max M over the blocks, then l and the accumulators of the column groups it stores,
// each block's scaled by e^(m_q - M) (0 for a block that saw only -inf). Two cluster barriers: the states
// are written before anyone reads them, and read before any block reuses its buffers.
constexpr unsigned kMaxKeySplit = 4;
template <int DV, int NT> __device__ __forceinline__ void split_merge(float* state, RowState (&st)[2],
                                                                     float (&acc)[DV / 8][4], unsigned splits,
                                                                     unsigned rank, float unit) {
  const int tid = threadIdx.x;
  cp_async_wait<0>();  // a block with no key tile still has its first copies in flight
  __syncthreads();     // the key loop is done with the buffers
  state[0 * NT + tid] = st[0].m, state[1 * NT + tid] = st[1].m;
  state[2 * NT + tid] = st[0].l, state[3 * NT + tid] = st[1].l;
#pragma unroll
  for (int c = 0; c < DV / 8; ++c)
#pragma unroll
    for (int e = 0; e < 4; ++e) state[(4 + c * 4 + e) * NT + tid] = acc[c][e];
  cluster_sync();
  float m[kMaxKeySplit][2], mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (unsigned q = 0; q < kMaxKeySplit; ++q)  // every block's two maxima in flight together
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      m[q][r] = q < splits ? *cluster_peer(state + r * NT + tid, q, rank) : neg_inf();
      mx[r] = fmaxf(mx[r], m[q][r]);
    }
  float f[kMaxKeySplit][2], l[2] = {0.0f, 0.0f};
#pragma unroll
  for (unsigned q = 0; q < kMaxKeySplit; ++q)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      f[q][r] = m[q][r] == neg_inf() ? 0.0f : exp2_ftz((m[q][r] - mx[r]) * unit);
      if (q < splits) l[r] += f[q][r] * *cluster_peer(state + (2 + r) * NT + tid, q, rank);
    }
#pragma unroll
  for (int c = 0; c < DV / 8; ++c) {
    if (c % splits != rank) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float sum = 0.0f;
#pragma unroll
      for (unsigned q = 0; q < kMaxKeySplit; ++q)
        if (q < splits) sum += f[q][e / 2] * *cluster_peer(state + (4 + c * 4 + e) * NT + tid, q, rank);
      acc[c][e] = sum;
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) st[r].m = mx[r], st[r].l = l[r];
  cluster_sync();  // the cluster has read this block's state
}

template <class T, int D, int DV, class Q, class K, class V, class O, class Score, bool AFFINE = false,
          bool AFFINE_KV = AFFINE>
__device__ __forceinline__ void tensor_core(const OfzArgs& a, const T* __restrict__ q, const T* __restrict__ k,
                                            const T* __restrict__ v, T* __restrict__ o, const Dims n) {
  using Tile = MmaTile<D, DV>;
  constexpr int BM = Tile::BLOCK_M, BN = Tile::BLOCK_N, P = Tile::PAD, QS = D + P, VS = DV + P, NT = Tile::THREADS;
  constexpr bool SCALED = HasLog2Scale<Score>::value;
  const float unit = log2_unit<Score>(a);
  static_assert(D % 16 == 0 && DV % 16 == 0 && D <= 128 && DV <= 128, "head sizes: multiples of 16 up to 128");
  OFZ_DYNAMIC_SMEM(T, smem);
  T* const sq = smem;               // [BM][QS]
  T* const sk = sq + BM * QS;       // [2][BN][QS]
  T* const sv = sk + 2 * BN * QS;   // [2][BN][VS]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
  const ofz_i64 tiles_m = (n.sq + BM - 1) / BM, units = n.batch * n.heads * tiles_m;
  // Keys split across a thread-block cluster (the library launches clusters only while the units fit in one
  // wave of SMs, i.e. at small batches; see split_merge): block `rank` of `splits` takes key tiles
  // [tn0, tn1) of the tiles its cluster's unit visits
  const unsigned splits = cluster_size(), rank = cluster_rank();
  const ofz_i64 first = splits > 1 ? (ofz_i64)cluster_id() : (ofz_i64)blockIdx.x;
  const ofz_i64 step = splits > 1 ? (ofz_i64)cluster_count() : (ofz_i64)gridDim.x;
  if (splits > kMaxKeySplit || (splits > 1 && Tile::SPLIT_STATE_BYTES > Tile::SMEM_BYTES)) __trap();  // launched wrong
  for (ofz_i64 u = first; u < units; u += step) {
    const ofz_i64 bh = u / tiles_m, i0 = unit_row<Score>(u % tiles_m, tiles_m) * BM, b = bh / n.heads, h = bh % n.heads;
    const ofz_i64 rows[2] = {i0 + warp * 16 + g, i0 + warp * 16 + g + 8};  // this thread's two query rows
    const bool row_ok[2] = {rows[0] < n.sq, rows[1] < n.sq};
    const KeyTiles span = unit_key_tiles<Score, BN>(a, i0, i0 + BM, n);
    const ofz_i64 tiles_n = span.hi - span.lo;
    const ofz_i64 tn0 = span.lo + tiles_n * rank / splits, tn1 = span.lo + tiles_n * (rank + 1) / splits;
    // rows past Sq are scored as the last row (never stored): the score's reads stay in bounds without a
    // per-score row check, and a mask the same for every row is one load per key for both rows
    const ofz_i64 srow[2] = {row_ok[0] ? rows[0] : n.sq - 1, row_ok[1] ? rows[1] : n.sq - 1};
    __syncthreads();  // the previous unit is done with every buffer
    load_rows<T, BM, D, P, NT, AFFINE, Q>(sq, q, a, b, h, i0, n.sq);
    const UnitRows<T, BN, D, P, NT, AFFINE_KV, K> krows(k, a, b, h);
    const UnitRows<T, BN, DV, P, NT, AFFINE_KV, V> vrows(v, a, b, h);
    krows.load(sk, tn0 * BN, n.sk);
    vrows.load(sv, tn0 * BN, n.sk);
    cp_async_commit();
    RowState st[2];
    st[0].init(), st[1].init();
    float acc[DV / 8][4];
#pragma unroll
    for (int c = 0; c < DV / 8; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;

    for (ofz_i64 tn = tn0; tn < tn1; ++tn) {
      const ofz_i64 j0 = tn * BN;
      const int buf = (int)((tn - tn0) % 2);
      const T* kt = sk + buf * BN * QS;
      const T* vt = sv + buf * BN * VS;
      if (tn + 1 < tn1) {  // prefetch the next tile into the other buffer (freed at the end of tn - 1)
        krows.load(sk + (buf ^ 1) * BN * QS, j0 + BN, n.sk);
        vrows.load(sv + (buf ^ 1) * BN * VS, j0 + BN, n.sk);
        cp_async_commit();
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      if constexpr (HasRope<Q>::value || HasRope<K>::value) {  // rotary embeddings: the rows as they landed
        if constexpr (HasRope<Q>::value)
          if (tn == tn0) rotate_rows<T, BM, D, QS, NT, Q>(sq, a, b, h, i0, n.sq);
        if constexpr (HasRope<K>::value) rotate_rows<T, BN, D, QS, NT, K>(sk + buf * BN * QS, a, b, h, j0, n.sk);
        __syncthreads();
      }
      // S = Q·Kᵀ for this warp's 16 rows: s[nt] is the m16n8 block of keys nt*8 .. nt*8+7.
      float s[BN / 8][4];
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        // Q's A fragment is read again for every key tile: one ldmatrix per 16 columns of d (the warp's
        // rows stay in shared memory), where holding all of them took D / 4 registers for the whole unit
        unsigned qa[4];
        ldmatrix_x4(qa, sq + (warp * 16 + lane % 16) * QS + ks * 16 + lane / 16 * 8);
#pragma unroll
        for (int nt = 0; nt < BN / 8; nt += 2) {  // matrices: (keys nt, d lo), (nt, d hi), (nt+1, lo), (nt+1, hi)
          unsigned kb[4];
          ldmatrix_x4(kb, kt + (nt * 8 + lane / 16 * 8 + lane % 8) * QS + ks * 16 + lane / 8 % 2 * 8);
          const unsigned b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
          mma16816<T>(s[nt], qa, b0);
          mma16816<T>(s[nt + 1], qa, b1);
        }
      }
      // Score epilogue and online softmax; element e of block nt is row g + 8 * (e / 2), key nt*8 + 2t + e % 2.
      // A whole tile scores every element unconditionally, so reads the two rows share (a mask the same for
      // every row) are one load; the last, partial tile checks each key against the keys left (32-bit).
      const int keys = n.sk - j0 < BN ? (int)(n.sk - j0) : BN;
      if constexpr (SCALED) {  // raw qk; only the keys past Sk in the last tile are -inf
        if (keys < BN) {
#pragma unroll
          for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (nt * 8 + 2 * t + e % 2 >= keys) s[nt][e] = neg_inf();
        }
      } else if (keys == BN) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = Score::score(a, b, h, srow[e / 2], j0 + nt * 8 + 2 * t + e % 2, s[nt][e]);
      } else {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int jj = nt * 8 + 2 * t + e % 2;
            s[nt][e] = jj < keys ? Score::score(a, b, h, srow[e / 2], j0 + jj, s[nt][e]) : neg_inf();
          }
      }
      float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
      float alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
      for (int r = 0; r < 2; ++r) alpha[r] = st[r].rescale(group_reduce<MaxOp, 4>(mx[r]), unit);
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = SCALED ? st[e / 2].term_scaled(s[nt][e], unit) : st[e / 2].term(s[nt][e]);
          sum[e / 2] += s[nt][e];
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) st[r].l += group_reduce<SumOp, 4>(sum[r]);
      if (tn > tn0) {  // the first tile's accumulators are still 0: nothing to rescale
#pragma unroll
        for (int c = 0; c < DV / 8; ++c) acc[c][0] *= alpha[0], acc[c][1] *= alpha[0], acc[c][2] *= alpha[1], acc[c][3] *= alpha[1];
      }
      // O += P·V: the accumulators of key blocks 2kk and 2kk+1 are P's A fragment for keys kk*16 .. kk*16+15.
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        const unsigned pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int c = 0; c < DV / 8; c += 2) {  // matrices: (keys lo, cols c), (keys hi, c), (lo, c+1), (hi, c+1)
          unsigned vb[4];
          ldmatrix_x4_trans(vb, vt + (kk * 16 + lane / 8 % 2 * 8 + lane % 8) * VS + (c + lane / 16) * 8);
          const unsigned b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
          mma16816<T>(acc[c], pa, b0);
          mma16816<T>(acc[c + 1], pa, b1);
        }
      }
      __syncthreads();  // this tile's buffers may be refilled
    }
    if (tn0 == tn1) cp_async_wait<0>();  // a unit with no tile: its copies land before the next unit's are issued
    if (splits > 1) split_merge<DV, NT>(reinterpret_cast<float*>(smem), st, acc, splits, rank, unit);
    // O: a thread's two adjacent columns as one 4-byte word (rows contiguous in d and 16-byte aligned); in a
    // cluster, block `rank` stores the column groups c = rank (mod splits)
    const float inv[2] = {st[0].inv_sum(), st[1].inv_sum()};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!row_ok[r]) continue;
      T* const orow = o + O::offset(a, b, h, rows[r], 0);
#pragma unroll
      for (int c = 0; c < DV / 8; ++c)
        if (splits == 1 || c % splits == rank)
          *reinterpret_cast<unsigned*>(orow + c * 8 + 2 * t) =
              pack2<T>(acc[c][2 * r] * inv[r], acc[c][2 * r + 1] * inv[r]);
    }
  }
}

}  // namespace attn
}  // namespace ofz
