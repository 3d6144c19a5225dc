// Shared by every generated kernel: the argument struct, dtype conversions, vector access and the
// row reductions. Compiles under NVRTC and, with -DORTFUSE_EMU, on the host through ortfuse_emu.h.
#pragma once
#ifdef ORTFUSE_EMU
#include "ortfuse_emu.h"
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define OFZ_EMU_ENTRY(name)
#define OFZ_EMU_ENTRY_TMA(name)
#define OFZ_DYNAMIC_SMEM(type, name) \
  extern __shared__ __align__(16) unsigned char ofz_dsmem_##name[]; \
  type* const name = reinterpret_cast<type*>(ofz_dsmem_##name)
#endif

#include "ortfuse_args.h"

typedef long long ofz_i64;

namespace ofz {

// The launch's dynamic shared memory bytes (PTX %dynamic_smem_size).
__device__ __forceinline__ unsigned dynamic_smem_size() {
#ifdef ORTFUSE_EMU
  return ofz_emu::dynamic_smem_size();
#else
  unsigned r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
#endif
}

// Storage type -> compute type. Half types compute in fp32.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// A float from its IEEE bits (inf and nan literals).
__device__ __forceinline__ float f32_bits(unsigned int b) {
#ifdef ORTFUSE_EMU
  float f; memcpy(&f, &b, sizeof f); return f;
#else
  return __uint_as_float(b);
#endif
}

// Programmatic dependent launch (sm_90+; a kernel launched with it may start while the previous kernel in
// the stream still runs): first wait until that kernel has finished and its writes are visible, then let
// the next kernel start launching. Before the wait the kernel touches no global memory. Without the launch
// attribute both are no-ops, and before sm_90 (and on the host) nothing is emitted.
__device__ __forceinline__ void grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Before grid_dependency_sync: this block's share of a constant input of `bytes` (one no kernel writes)
// prefetched into L2 by one thread, in bulk prefetches of 16-byte aligned chunks, while the previous
// kernel may still run (sm_90+; a hint, so the unaligned ends are skipped).
__device__ __forceinline__ void prefetch_l2_share(const void* p, long long bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x != 0) return;
  const long long blocks = gridDim.x, per = ((bytes + blocks - 1) / blocks + 15) & ~15LL;
  const unsigned long long base = reinterpret_cast<unsigned long long>(p), end = base + bytes;
  unsigned long long lo = (base + blockIdx.x * per + 15) & ~15ULL, hi = base + (blockIdx.x + 1) * per;
  hi = (hi < end ? hi : end) & ~15ULL;
  for (; lo < hi; lo += 1u << 20) {  // at most 1 MiB per instruction
    const unsigned n = static_cast<unsigned>(hi - lo < (1u << 20) ? hi - lo : 1u << 20);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(lo), "r"(n) : "memory");
  }
#else
  (void)p, (void)bytes;
#endif
}

// Rounding through a narrower float type (an ONNX Cast to fp16/bf16 inside a region).
__device__ __forceinline__ float round_f16(float x) { return __half2float(__float2half(x)); }
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// N consecutive elements moved as one aligned access (16 bytes for float4 / 8 halves).
template <class T, int N> struct alignas(sizeof(T) * N) Vec { T v[N]; };

// The emulator checks what the GPU enforces: a vector access on an address that is not a multiple of its
// size faults ("misaligned address").
#ifdef ORTFUSE_EMU
#define OFZ_CHECK_VEC(p, bytes) ofz_emu::check_vector(p, bytes)
#else
#define OFZ_CHECK_VEC(p, bytes)
#endif

template <int N, class T> __device__ __forceinline__ void load_vec(const T* p, T (&out)[N]) {
  OFZ_CHECK_VEC(p, sizeof(Vec<T, N>));
  Vec<T, N> w = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = w.v[i];
}

// N elements as one unsigned word of 2-16 bytes. A Vec of __half copies element by element (its copy is
// user-defined), which ptxas emitted as 2-byte stores (H200 SASS, 2026-11-26); a word moves whole.
template <int B> struct Word;
template <> struct Word<2> { typedef unsigned short type; };
template <> struct Word<4> { typedef unsigned int type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<16> { typedef uint4 type; };

// 16- and 8-byte words go out through PTX: built from 2-byte lanes, NVVM split the uint4 store into four
// 4-byte ones and the uint2 into two (NVRTC 13, sm_90 SASS, 2026-11-26; the 8-byte case is the gated GEMM's
// four fp16 outputs per 8 columns). store_vec writes kernel outputs only: global memory.
template <int N, class T> __device__ __forceinline__ void store_vec(T* p, const T (&in)[N]) {
  typedef typename Word<sizeof(T) * N>::type W;
  W w;
  memcpy(&w, in, sizeof w);
  OFZ_CHECK_VEC(p, sizeof w);
#ifndef ORTFUSE_EMU
  if constexpr (sizeof(W) == 16) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                 : "memory");
    return;
  } else if constexpr (sizeof(W) == 8) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(w.x), "r"(w.y) : "memory");
    return;
  }
#endif
  *reinterpret_cast<W*>(p) = w;
}

// A read of a kernel argument the generated code emits (tensor pointer t<k>). Inputs are `const` there, and
// ORT never hands a fused op an output that aliases an input (no MayInplace), so an input is read-only for
// the whole kernel: it is read through the non-coherent path with an asm that is neither volatile nor a
// memory clobber, which the compiler may move past the kernel's stores. Without that, each of an epilogue's
// bias or residual loads waited for the store before it (a possible alias): the likely cause of a fixed
// ~18 us per 4096 x 768 GEMM output on the H200 (2026-11-26; with it, ~4.5 us: docs/results.md). An
// output read back (non-const pointer) is an ordinary load.
template <class W> __device__ __forceinline__ W ld_readonly(const void* p);
#ifdef ORTFUSE_EMU
template <class W> __device__ __forceinline__ W ld_readonly(const void* p) {
  W w;
  memcpy(&w, p, sizeof w);
  return w;
}
#else
template <> __device__ __forceinline__ unsigned short ld_readonly<unsigned short>(const void* p) {
  unsigned short w;
  asm("ld.global.nc.b16 %0, [%1];" : "=h"(w) : "l"(p));
  return w;
}
template <> __device__ __forceinline__ unsigned int ld_readonly<unsigned int>(const void* p) {
  unsigned int w;
  asm("ld.global.nc.b32 %0, [%1];" : "=r"(w) : "l"(p));
  return w;
}
template <> __device__ __forceinline__ uint2 ld_readonly<uint2>(const void* p) {
  uint2 w;
  asm("ld.global.nc.v2.b32 {%0, %1}, [%2];" : "=r"(w.x), "=r"(w.y) : "l"(p));
  return w;
}
template <> __device__ __forceinline__ uint4 ld_readonly<uint4>(const void* p) {
  uint4 w;
  asm("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(w.x), "=r"(w.y), "=r"(w.z), "=r"(w.w) : "l"(p));
  return w;
}
#endif

template <int N, class T> __device__ __forceinline__ void load_arg(const T* p, T (&out)[N]) {  // an input
  typedef typename Word<sizeof(T) * N>::type W;
  OFZ_CHECK_VEC(p, sizeof(W));
  const W w = ld_readonly<W>(p);
  memcpy(out, &w, sizeof w);
}
template <int N, class T> __device__ __forceinline__ void load_arg(T* p, T (&out)[N]) {  // an output read back
  load_vec<N>(static_cast<const T*>(p), out);
}
// An input vector read only where `ok` holds, zeros elsewhere (a window's tap in the padding, an empty input):
// selected as whole words, so the elements stay in the load's registers (a zero-filled array loaded under a
// branch was merged back half by half)
template <int N, class T> __device__ __forceinline__ void load_arg_if(bool ok, const T* p, T (&out)[N]) {
  typedef typename Word<sizeof(T) * N>::type W;
  W w;
  memset(&w, 0, sizeof w);
  if (ok) {
    OFZ_CHECK_VEC(p, sizeof(W));
    w = ld_readonly<W>(p);
  }
  memcpy(out, &w, sizeof w);
}
template <int N, class T> __device__ __forceinline__ void load_arg_if(bool ok, T* p, T (&out)[N]) {
  for (int i = 0; i < N; ++i) out[i] = T();
  if (ok) load_vec<N>(static_cast<const T*>(p), out);
}

// ONNX QuantizeLinear to 8 bits as ORT's CUDA kernel computes it: x / scale (IEEE) rounded half to even to an
// int32 (__float2int_rn: NaN gives 0, out-of-range values saturate), plus the zero point in int32 arithmetic
// (which wraps, as ORT's does), clamped to [lo, hi]. ORT's CPU kernel clamps before converting: it differs where
// x / scale is NaN (there it gives lo) or past 2^31 with a zero point that wraps the sum.
__device__ __forceinline__ int quantize8(float x, float scale, int zero_point, int lo, int hi) {
  const int v = (int)((unsigned)__float2int_rn(x / scale) + (unsigned)zero_point);
  return max(lo, min(hi, v));
}

// ONNX Max / Min (and Relu, Clip, HardSigmoid built on them) as ORT's CPU and CUDA kernels compute them:
// a NaN operand gives NaN, where fmaxf / fminf return the other operand. sm_80+: one max.NaN / min.NaN.
__device__ __forceinline__ float fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
#endif
}
__device__ __forceinline__ float fmin_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fminf(a, b);
#endif
}

// 2^x as the SFU computes it (ex2.approx.ftz: one MUFU.EX2, about 2 ulp; results below 2^-126 flush to 0,
// -inf gives 0). Plain exp2f / __expf without ftz add a range check and two predicated multiplies per call
// to produce denormal results. For softmax terms relative to the row maximum, where the sum is at least 1.
__device__ __forceinline__ float exp2_ftz(float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#else
  const float r = exp2f(x);
  return r < 1.17549435e-38f ? 0.0f : r;
#endif
}

struct SumOp { __device__ __forceinline__ static float apply(float a, float b) { return a + b; } };
struct MaxOp { __device__ __forceinline__ static float apply(float a, float b) { return fmaxf(a, b); } };
struct MinOp { __device__ __forceinline__ static float apply(float a, float b) { return fminf(a, b); } };

// Reduce `v` over aligned groups of W lanes (W a power of two, at most 32): each lane gets its group's result.
template <class Op, int W = 32> __device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
  for (int off = W / 2; off > 0; off >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Reduce `v` over the TPR threads that share one row (TPR a power of two: a short row's lanes within one
// warp, or a multiple of 32; rows laid out as consecutive groups of TPR threads). `scratch` holds
// blockDim.x / 32 floats. Every thread of the block must call it (it contains __syncthreads when TPR > 32);
// all threads of the row get the result.
template <class Op, int TPR> __device__ __forceinline__ float row_reduce(float v, float* scratch) {
  static_assert(TPR >= 1 && (TPR & (TPR - 1)) == 0, "row threads: a power of two");
  if (TPR <= 32) return warp_reduce<Op, TPR>(v);
  v = warp_reduce<Op>(v);
  const int warps = TPR > 32 ? TPR / 32 : 1;  // (TPR <= 32 returned above)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int first = (warp / warps) * warps;
  __syncthreads();  // scratch may still be read by the previous reduction
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[first];
  for (int w = 1; w < warps; ++w) r = Op::apply(r, scratch[first + w]);
  return r;
}

// ---- thread-block clusters (sm_90) ------------------------------------------------------------------------------
// A launch without a cluster size runs clusters of one block: rank 0 of 1, cluster id = blockIdx.x. Below
// sm_90 there are no clusters and these report exactly that. cluster_sync is barrier.cluster with release /
// acquire semantics: shared-memory writes before it are visible to the cluster's other blocks after it
// (through cluster_map, PTX mapa: the same offset in block `rank`'s shared memory). cluster_arrive and
// cluster_wait are its two halves, with work between them that does not touch the other blocks' memory
// (every thread of the cluster arrives before any wait returns; the emulation fails a kernel that maps another
// block's shared memory between them).
#ifdef ORTFUSE_EMU
__device__ __forceinline__ unsigned cluster_rank() { return ofz_emu::cluster_rank(); }
__device__ __forceinline__ unsigned cluster_size() { return ofz_emu::cluster_size(); }
__device__ __forceinline__ unsigned cluster_id() { return ofz_emu::cluster_id(); }
__device__ __forceinline__ unsigned cluster_count() { return ofz_emu::cluster_count(); }
__device__ __forceinline__ void cluster_sync() { ofz_emu::sync_cluster(); }
__device__ __forceinline__ void cluster_arrive() { ofz_emu::cluster_arrive(); }
__device__ __forceinline__ void cluster_wait() { ofz_emu::cluster_wait(); }
template <class T> __device__ __forceinline__ const T* cluster_map(const T* p, unsigned rank) {
  return static_cast<const T*>(ofz_emu::cluster_map(p, rank));
}
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_special(int which) {
  unsigned r;
  if (which == 0) asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  else if (which == 1) asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  else if (which == 2) asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  else asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_rank() { return cluster_special(0); }
__device__ __forceinline__ unsigned cluster_size() { return cluster_special(1); }
__device__ __forceinline__ unsigned cluster_id() { return cluster_special(2); }
__device__ __forceinline__ unsigned cluster_count() { return cluster_special(3); }
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
template <class T> __device__ __forceinline__ const T* cluster_map(const T* p, unsigned rank) {
  unsigned long long out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
  return reinterpret_cast<const T*>(out);
}
#else
__device__ __forceinline__ unsigned cluster_rank() { return 0; }
__device__ __forceinline__ unsigned cluster_size() { return 1; }
__device__ __forceinline__ unsigned cluster_id() { return blockIdx.x; }
__device__ __forceinline__ unsigned cluster_count() { return gridDim.x; }
__device__ __forceinline__ void cluster_sync() { __syncthreads(); }
__device__ __forceinline__ void cluster_arrive() { __syncthreads(); }
__device__ __forceinline__ void cluster_wait() {}
template <class T> __device__ __forceinline__ const T* cluster_map(const T* p, unsigned) { return p; }
#endif

// `p` (this block's shared memory) in block q of the cluster; this block's own pointer as it is.
template <class T> __device__ __forceinline__ const T* cluster_peer(const T* p, unsigned q, unsigned me) {
  return q == me ? p : cluster_map(p, q);
}

// ---- tensor cores and asynchronous copies (sm_80 and newer) -------------------------------------------------
// Fragment layouts are the PTX ISA's; the emulation header implements the same instructions on the host.
#ifdef ORTFUSE_EMU
__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { ofz_emu::mma_16816(c, a, b, false); }
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { ofz_emu::mma_16816(c, a, b, true); }
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) { ofz_emu::mma_1688_tf32(c, a, b); }
__device__ __forceinline__ unsigned to_tf32(float x) { return ofz_emu::to_tf32(x); }
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) { ofz_emu::ldmatrix(r, row, 4, false); }
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) { ofz_emu::ldmatrix(r, row, 4, true); }
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) { ofz_emu::ldmatrix(r, row, 2, false); }
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) { ofz_emu::ldmatrix(r, row, 2, true); }
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) { ofz_emu::async_copy(smem, gmem, src_bytes); }
__device__ __forceinline__ void cp_async_commit() { ofz_emu::async_commit(); }
template <int N> __device__ __forceinline__ void cp_async_wait() { ofz_emu::async_wait(N); }
#else
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// D = A * B + D: m16n8k16, A row-major 16x16 (4 regs of 2 halves), B column-major 16x8 (2 regs), fp32 D.
__device__ __forceinline__ void mma_f16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// m16n8k8 on tf32 operands (fp32 bit patterns, see to_tf32).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(smem_u32(row)));
}
// 16 bytes global -> shared, bypassing L1; bytes past src_bytes are zero-filled (src_bytes 0: no read).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
#endif

// Where copy chunk c goes in a shared tile of ROWS rows x PER_ROW 16-byte chunks, each row padded by one
// chunk: its row and chunk column. Chunk (r, j) then lands in bank group (r * (PER_ROW + 1) + j) % 8 of the
// 8 groups of 4 banks, and the eight 16-byte stores of a quarter-warp (consecutive c) are one wavefront only
// when their groups differ. Consecutive chunks of one row do when a row holds a multiple of 8 chunks; rows of
// 2 or 4 chunks would wrap onto the next row's groups (two wavefronts), so a quarter-warp takes its chunks
// from rows PER_ROW apart instead: rows r and r + 4 (4 chunks) or r, r + 2, r + 4, r + 6 (2 chunks) of each
// group of 8 rows, whose bank groups are disjoint. (The 1-chunk padding keeps ldmatrix's 8 rows in 8 groups.)
template <int ROWS, int PER_ROW>
__device__ __forceinline__ void chunk_place(int c, int& row, int& col) {
  if constexpr ((PER_ROW == 2 || PER_ROW == 4) && ROWS % 8 == 0) {
    const int e = c % 8;
    row = c / (8 * PER_ROW) * 8 + c / 8 % PER_ROW + PER_ROW * (e / PER_ROW);
    col = e % PER_ROW;
  } else {
    row = c / PER_ROW, col = c % PER_ROW;
  }
}


// ---- Hopper warpgroup MMA (sm_90a): wgmma.mma_async with both operands in shared memory -------------------
// Operands are K-major tiles in the 128-byte swizzle: rows of 64 16-bit elements (128 bytes), 8-row atoms of
// 1024 bytes aligned to 1024 in the shared window, chunk c (16 bytes) of row r stored at chunk c ^ (r % 8).
// A descriptor names the atom column's first row plus the k offset (32 bytes per k16 step); the stride
// byte offset is the 1024 bytes between 8-row groups; the leading byte offset is unused for this layout (1).
// D is m64nN in fp32, the PTX ISA's layout (the mma.m16n8 accumulator layout per warp, repeated over N/8).
// The order the PTX ISA asks for: cp.async writes land (cp.async.wait_group), fence.proxy.async (they were
// made by the generic proxy; wgmma reads through the async proxy), a block barrier, wgmma.fence, the
// wgmma.mma_async group, commit, wait_group before the accumulators or the read stages are touched.
__device__ __forceinline__ unsigned long long wgmma_desc(unsigned window_addr) {
  return (unsigned long long)((window_addr & 0x3ffffu) >> 4) | 1ull << 16 | (1024ull >> 4) << 32 | 1ull << 62;
}
template <int N, class T> __device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], unsigned long long da, unsigned long long db);
template <class A, class B> struct SameType { static constexpr bool value = false; };
template <class A> struct SameType<A, A> { static constexpr bool value = true; };
#ifdef ORTFUSE_EMU
__device__ __forceinline__ unsigned smem_u32(const void* p) { return ofz_emu::smem_addr(p); }
__device__ __forceinline__ void wgmma_fence() { ofz_emu::wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { ofz_emu::wgmma_commit(); }
template <int N> __device__ __forceinline__ void wgmma_wait() { ofz_emu::wgmma_wait(N); }
__device__ __forceinline__ void fence_proxy_async() { ofz_emu::fence_proxy_async(); }
template <int N> __device__ __forceinline__ void wgmma_fence_operand(float (&)[N]) {}
template <int N, class T> __device__ __forceinline__ void wgmma_m64k16(float (&d)[N / 2], unsigned long long da, unsigned long long db) {
  ofz_emu::wgmma(d, N, da, db, SameType<T, __nv_bfloat16>::value);
}
#elif defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pins the accumulators at this point of the instruction stream: the compiler may not move their reads or
// writes across it (the registers change asynchronously between wgmma.mma_async and wait_group).
template <int N> __device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// One m64nNk16 wgmma per specialization: the accumulator operands "+f"(d[i]) and their PTX names %i,
// then the descriptors and the scale-d predicate (1: accumulate).
#define OFZ_ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                    "+f"(d[i + 6]), "+f"(d[i + 7])
#define OFZ_ACC32(i) OFZ_ACC8(i), OFZ_ACC8(i + 8), OFZ_ACC8(i + 16), OFZ_ACC8(i + 24)
#define OFZ_ACC64 OFZ_ACC32(0), OFZ_ACC32(32)
#define OFZ_ACC128 OFZ_ACC64, OFZ_ACC32(64), OFZ_ACC32(96)
#define OFZ_REGS32 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define OFZ_REGS64 OFZ_REGS32 \
  ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define OFZ_REGS128 OFZ_REGS64 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, " \
  "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, " \
  "%115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define OFZ_ACC96 OFZ_ACC64, OFZ_ACC32(64)
#define OFZ_REGS96 OFZ_REGS64 \
  ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, " \
  "%82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define OFZ_WGMMA_M64K16(N, T, PTX_T, ACC, REGS, DA, DB, SCALE)                                                 \
  template <>                                                                                                   \
  __device__ __forceinline__ void wgmma_m64k16<N, T>(float(&d)[N / 2], unsigned long long da,                   \
                                                     unsigned long long db) {                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #SCALE ", 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " {" REGS "}, %" #DA ", %" #DB \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                         \
                 : ACC                                                                                          \
                 : "l"(da), "l"(db), "r"(1));                                                                   \
  }
OFZ_WGMMA_M64K16(64, __half, "f16", OFZ_ACC32(0), OFZ_REGS32, 32, 33, 34)
OFZ_WGMMA_M64K16(64, __nv_bfloat16, "bf16", OFZ_ACC32(0), OFZ_REGS32, 32, 33, 34)
OFZ_WGMMA_M64K16(128, __half, "f16", OFZ_ACC64, OFZ_REGS64, 64, 65, 66)
OFZ_WGMMA_M64K16(128, __nv_bfloat16, "bf16", OFZ_ACC64, OFZ_REGS64, 64, 65, 66)
OFZ_WGMMA_M64K16(192, __half, "f16", OFZ_ACC96, OFZ_REGS96, 96, 97, 98)
OFZ_WGMMA_M64K16(192, __nv_bfloat16, "bf16", OFZ_ACC96, OFZ_REGS96, 96, 97, 98)
OFZ_WGMMA_M64K16(256, __half, "f16", OFZ_ACC128, OFZ_REGS128, 128, 129, 130)
OFZ_WGMMA_M64K16(256, __nv_bfloat16, "bf16", OFZ_ACC128, OFZ_REGS128, 128, 129, 130)
#else  // declared only: a wgmma kernel compiles for sm_90a (ortfuse_gemm.h says so at compile time)
__device__ void wgmma_fence();
__device__ void wgmma_commit();
template <int N> __device__ void wgmma_wait();
__device__ void fence_proxy_async();
template <int N> __device__ void wgmma_fence_operand(float (&d)[N]);
#endif

// ---- Hopper transaction barriers and the tensor memory accelerator (sm_90a kernels) ------------------------
// mbarrier: a 64-bit shared-memory object counting arrivals (and bytes: expect_tx / complete_tx) per phase;
// a phase completes when every expected arrival came and every expected byte landed, and the barrier
// moves on to the next phase. mbar_wait(bar, parity) returns once the phase of that parity has completed:
// on a fresh barrier (phase 0 running) parity 1 counts as completed, so a producer's first pass over an
// `empty` ring does not block. tma_load_2d copies one box of a 2-D tensor map (a K-major tile: 64 16-bit
// elements per row, 128-byte swizzle) into shared memory and completes its bytes on the barrier;
// elements outside the tensor are zero-filled; tma_load_2d_multicast lands the same box in several blocks of a
// cluster (each block's barrier at the same offset counts its bytes), and mbar_arrive_cluster arrives on
// another block's barrier. setmaxnreg moves registers between warpgroups; a named
// barrier lets some warps of the block meet without the others (bar.arrive: count toward it without waiting).
#ifdef ORTFUSE_EMU
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) { ofz_emu::mbar_init(bar, count); }
__device__ __forceinline__ void mbar_fence_init() {}
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) { ofz_emu::mbar_arrive(bar, 0); }
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  ofz_emu::mbar_arrive(bar, bytes);
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) { ofz_emu::mbar_wait(bar, parity); }
__device__ __forceinline__ void tma_prefetch(const OfzTensorMap*) {}
__device__ __forceinline__ void tma_load_2d(void* dst, const OfzTensorMap* map, int c0, int c1, unsigned long long* bar) {
  ofz_emu::tma_load_2d(dst, map, c0, c1, bar);
}
__device__ __forceinline__ void mbar_arrive_cluster(unsigned long long* bar, unsigned rank) {
  ofz_emu::mbar_arrive_remote(bar, rank);
}
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const OfzTensorMap* map, int c0, int c1,
                                                      unsigned long long* bar, unsigned short mask) {
  ofz_emu::tma_load_2d_multicast(dst, map, c0, c1, bar, mask);
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {}
template <int ID> __device__ __forceinline__ void named_barrier_sync(int count) { ofz_emu::sync_named(ID, count); }
template <int ID> __device__ __forceinline__ void named_barrier_arrive(int count) { ofz_emu::arrive_named(ID, count); }
#elif defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// makes the initialized barriers visible to the async proxy (the TMA unit) and, with the block barrier
// that follows, to the other threads
__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  const unsigned addr = smem_u32(bar);
  unsigned done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(addr), "r"(parity) : "memory");
  } while (!done);
}
__device__ __forceinline__ void tma_prefetch(const OfzTensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
// c0: the element along the contiguous axis (K), c1: the row
__device__ __forceinline__ void tma_load_2d(void* dst, const OfzTensorMap* map, int c0, int c1, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar))
      : "memory");
}
// mbarrier.arrive on the barrier at `bar`'s offset in block `rank` of the cluster (this block's own included)
__device__ __forceinline__ void mbar_arrive_cluster(unsigned long long* bar, unsigned rank) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n"
               ::"r"(smem_u32(bar)), "r"(rank) : "memory");
}
// tma_load_2d into every block of the cluster in `mask`: the box lands at `dst`'s offset in each of them and
// completes its bytes on the barrier at `bar`'s offset there
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const OfzTensorMap* map, int c0, int c1,
                                                      unsigned long long* bar, unsigned short mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(smem_u32(bar)),
      "h"(mask) : "memory");
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// bar.sync ID, count: `count` threads (whole warps) of the block meet; ID 1..15 (0 is __syncthreads)
template <int ID> __device__ __forceinline__ void named_barrier_sync(int count) {
  asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "r"(count) : "memory");
}
// bar.arrive ID, count: counts the calling warp's threads toward the barrier and goes on (a producer's signal
// to the warps that bar.sync there)
template <int ID> __device__ __forceinline__ void named_barrier_arrive(int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(ID), "r"(count) : "memory");
}
#else  // declared only, as the wgmma instructions above
__device__ void mbar_init(unsigned long long* bar, unsigned count);
__device__ void mbar_fence_init();
__device__ void mbar_arrive(unsigned long long* bar);
__device__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes);
__device__ void mbar_wait(unsigned long long* bar, unsigned parity);
__device__ void tma_prefetch(const OfzTensorMap* map);
__device__ void tma_load_2d(void* dst, const OfzTensorMap* map, int c0, int c1, unsigned long long* bar);
__device__ void mbar_arrive_cluster(unsigned long long* bar, unsigned rank);
__device__ void tma_load_2d_multicast(void* dst, const OfzTensorMap* map, int c0, int c1, unsigned long long* bar,
                                      unsigned short mask);
template <int N> __device__ void setmaxnreg_inc();
template <int N> __device__ void setmaxnreg_dec();
template <int ID> __device__ void named_barrier_sync(int count);
template <int ID> __device__ void named_barrier_arrive(int count);
#endif

}  // namespace ofz
