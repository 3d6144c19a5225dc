// The CUDA driver API subset ortfuse uses, resolved lazily from libcuda.so.1 with dlopen so that the
// library builds and loads on machines without CUDA.
#pragma once
#include <stddef.h>

typedef int CUresult;  // 0 = CUDA_SUCCESS
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;

enum {
  OFZ_CU_ATTR_MAX_SMEM_OPTIN = 97,        // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
  OFZ_CU_ATTR_CC_MAJOR = 75,              // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
  OFZ_CU_ATTR_CC_MINOR = 76,              // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR
  OFZ_CU_ATTR_SM_COUNT = 16,              // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  OFZ_CU_LAUNCH_ATTR_CLUSTER_DIM = 4,     // CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
  OFZ_CU_LAUNCH_ATTR_PDL = 6,             // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
  OFZ_CU_FUNC_MAX_THREADS = 0,            // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
  OFZ_CU_FUNC_MAX_DYN_SMEM = 8,           // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
  OFZ_CU_JIT_ERROR_LOG_BUFFER = 5,        // CU_JIT_ERROR_LOG_BUFFER
  OFZ_CU_JIT_ERROR_LOG_BUFFER_SIZE = 6,   // CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
  // cuTensorMapEncodeTiled's enums (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill)
  OFZ_CU_TENSOR_MAP_FLOAT16 = 6,          // CU_TENSOR_MAP_DATA_TYPE_FLOAT16
  OFZ_CU_TENSOR_MAP_BFLOAT16 = 9,         // CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
  OFZ_CU_TENSOR_MAP_INTERLEAVE_NONE = 0,  // CU_TENSOR_MAP_INTERLEAVE_NONE
  OFZ_CU_TENSOR_MAP_SWIZZLE_128B = 3,     // CU_TENSOR_MAP_SWIZZLE_128B
  OFZ_CU_TENSOR_MAP_L2_128B = 2,          // CU_TENSOR_MAP_L2_PROMOTION_L2_128B
  OFZ_CU_TENSOR_MAP_OOB_ZERO = 0,         // CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE: zeros outside the tensor
};

// cuLaunchKernelEx's configuration (CUDA 12.0+ cuda.h: CUlaunchAttribute is an id padded to 8 bytes and a
// 64-byte value union, of which a cluster dimension uses the first three unsigned ints and the programmatic
// stream serialization flag the first int).
typedef struct OfzLaunchAttr {
  int id;
  char pad[4];
  union {
    char bytes[64];
    struct {
      unsigned x, y, z;
    } cluster;
    int pdl;
  } value;
} OfzLaunchAttr;
typedef struct OfzLaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, smem;
  CUstream stream;
  OfzLaunchAttr* attrs;
  unsigned n_attrs;
} OfzLaunchConfig;

typedef struct OfzCuda {
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*DevicePrimaryCtxRelease)(CUdevice);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*ModuleLoadDataEx)(CUmodule*, const void*, unsigned, int*, void**);
  CUresult (*ModuleUnload)(CUmodule);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*FuncGetAttribute)(int*, int, CUfunction);
  CUresult (*FuncSetAttribute)(CUfunction, int, int);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**);
  CUresult (*GetErrorString)(CUresult, const char**);
  // optional (NULL on drivers before CUDA 12.0): cluster launches for split-K GEMMs
  CUresult (*LaunchKernelEx)(const OfzLaunchConfig*, CUfunction, void**, void**);
  // optional (NULL on drivers before CUDA 12.0): tensor maps for TMA GEMMs (map: 128 bytes, 64-byte aligned;
  // type, rank, address, dims, byte strides of dims 1.., box, element strides, interleave, swizzle, L2
  // promotion, out-of-bounds fill)
  CUresult (*TensorMapEncodeTiled)(void*, int, unsigned, void*, const unsigned long long*, const unsigned long long*,
                                   const unsigned*, const unsigned*, int, int, int, int);
  // optional: resident blocks per SM of a kernel at a block size and dynamic shared memory (persistent grids)
  CUresult (*OccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
} OfzCuda;

// The driver table, or NULL with a reason in `why` (libcuda.so.1 missing, a symbol missing, cuInit
// failed). Thread-safe; the first call does the loading.
const OfzCuda* ofz_cuda(const char** why);
// "CUDA_ERROR_xxx"-style text for an error code (never NULL).
const char* ofz_cuda_error(CUresult r);
