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

template <int N, class T> __device__ __forceinline__ void load_vec(const T* p, T (&out)[N]) {
  Vec<T, N> w = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = w.v[i];
}

template <int N, class T> __device__ __forceinline__ void store_vec(T* p, const T (&in)[N]) {
  Vec<T, N> w;
#pragma unroll
  for (int i = 0; i < N; ++i) w.v[i] = in[i];
  *reinterpret_cast<Vec<T, N>*>(p) = w;
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

}  // namespace ofz
