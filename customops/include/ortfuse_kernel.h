// Shared by every generated kernel: the argument struct, dtype conversions, vector access and the
// row reductions. Compiles under NVRTC and, with -DORTFUSE_EMU, on the host through ortfuse_emu.h.
#pragma once
#ifdef ORTFUSE_EMU
#include "ortfuse_emu.h"
#else
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define OFZ_EMU_ENTRY(name)
#define OFZ_DYNAMIC_SMEM(type, name) \
  extern __shared__ __align__(16) unsigned char ofz_dsmem_##name[]; \
  type* const name = reinterpret_cast<type*>(ofz_dsmem_##name)
#endif

#include "ortfuse_args.h"

typedef long long ofz_i64;

namespace ofz {

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

template <int N, class T> __device__ __forceinline__ void store_vec(T* p, const T (&in)[N]) {
  Vec<T, N> w;
#pragma unroll
  for (int i = 0; i < N; ++i) w.v[i] = in[i];
  OFZ_CHECK_VEC(p, sizeof(Vec<T, N>));
  *reinterpret_cast<Vec<T, N>*>(p) = w;
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

struct SumOp { __device__ __forceinline__ static float apply(float a, float b) { return a + b; } };
struct MaxOp { __device__ __forceinline__ static float apply(float a, float b) { return fmaxf(a, b); } };
struct MinOp { __device__ __forceinline__ static float apply(float a, float b) { return fminf(a, b); } };

template <class Op> __device__ __forceinline__ float warp_reduce(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Reduce `v` over the TPR threads that share one row (TPR a multiple of 32, rows laid out as
// consecutive groups of TPR threads). `scratch` holds blockDim.x / 32 floats. Every thread of
// the block must call it (it contains __syncthreads when TPR > 32); all threads of the row get
// the result.
template <class Op, int TPR> __device__ __forceinline__ float row_reduce(float v, float* scratch) {
  v = warp_reduce<Op>(v);
  if (TPR == 32) return v;
  const int warps = TPR / 32;
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
// (through cluster_map, PTX mapa: the same offset in block `rank`'s shared memory).
#ifdef ORTFUSE_EMU
__device__ __forceinline__ unsigned cluster_rank() { return ofz_emu::cluster_rank(); }
__device__ __forceinline__ unsigned cluster_size() { return ofz_emu::cluster_size(); }
__device__ __forceinline__ unsigned cluster_id() { return ofz_emu::cluster_id(); }
__device__ __forceinline__ unsigned cluster_count() { return ofz_emu::cluster_count(); }
__device__ __forceinline__ void cluster_sync() { ofz_emu::sync_cluster(); }
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
template <class T> __device__ __forceinline__ const T* cluster_map(const T* p, unsigned) { return p; }
#endif

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

}  // namespace ofz
