"""The CUDA driver declarations of customops/native/ofz_cuda.h (the library has no CUDA build dependency)
against cuda.h of the nvidia-cuda-runtime wheel: enum values, and the layout of cuLaunchKernelEx's
configuration, checked by a C compiler with static assertions."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

NATIVE = Path(__file__).resolve().parents[2] / "customops" / "native"
OURS = ["CUresult", "CUdevice", "CUctx_st", "CUcontext", "CUmod_st", "CUmodule", "CUfunc_st", "CUfunction",
        "CUstream_st", "CUstream"]

CHECKS = """
#define SAME_OFFSET(a, fa, b, fb) _Static_assert(offsetof(a, fa) == offsetof(b, fb), #a "." #fa)
_Static_assert(OFZ_CU_ATTR_MAX_SMEM_OPTIN == CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, "smem opt-in");
_Static_assert(OFZ_CU_ATTR_CC_MAJOR == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, "cc major");
_Static_assert(OFZ_CU_ATTR_CC_MINOR == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, "cc minor");
_Static_assert(OFZ_CU_ATTR_SM_COUNT == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, "SM count");
_Static_assert(OFZ_CU_LAUNCH_ATTR_CLUSTER_DIM == CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, "cluster dimension");
_Static_assert(OFZ_CU_LAUNCH_ATTR_PDL == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, "programmatic launch");
_Static_assert(OFZ_CU_FUNC_MAX_THREADS == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, "max threads");
_Static_assert(OFZ_CU_FUNC_MAX_DYN_SMEM == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, "max dynamic smem");
_Static_assert(OFZ_CU_JIT_ERROR_LOG_BUFFER == CU_JIT_ERROR_LOG_BUFFER, "JIT log");
_Static_assert(OFZ_CU_JIT_ERROR_LOG_BUFFER_SIZE == CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES, "JIT log size");
_Static_assert(OFZ_CU_TENSOR_MAP_FLOAT16 == CU_TENSOR_MAP_DATA_TYPE_FLOAT16, "tensor map fp16");
_Static_assert(OFZ_CU_TENSOR_MAP_BFLOAT16 == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, "tensor map bf16");
_Static_assert(OFZ_CU_TENSOR_MAP_INTERLEAVE_NONE == CU_TENSOR_MAP_INTERLEAVE_NONE, "tensor map interleave");
_Static_assert(OFZ_CU_TENSOR_MAP_SWIZZLE_128B == CU_TENSOR_MAP_SWIZZLE_128B, "tensor map swizzle");
_Static_assert(OFZ_CU_TENSOR_MAP_L2_128B == CU_TENSOR_MAP_L2_PROMOTION_L2_128B, "tensor map L2 promotion");
_Static_assert(OFZ_CU_TENSOR_MAP_OOB_ZERO == CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, "tensor map OOB fill");
_Static_assert(sizeof(OfzTensorMap) == sizeof(CUtensorMap) && _Alignof(OfzTensorMap) == _Alignof(CUtensorMap),
               "tensor map size and alignment");
_Static_assert(offsetof(OfzTma, map[1]) == sizeof(CUtensorMap), "two tensor maps back to back");
// the driver entry point's parameter list, argument by argument (ours takes void* for the map and int for enums)
static CUresult (*const encode_check)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                      const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill) =
    cuTensorMapEncodeTiled;
static CUresult (*const occupancy_check)(int*, CUfunction, int, size_t) = cuOccupancyMaxActiveBlocksPerMultiprocessor;
_Static_assert(sizeof(cuuint64_t) == sizeof(unsigned long long) && sizeof(cuuint32_t) == sizeof(unsigned) &&
               sizeof(CUtensorMapDataType) == sizeof(int) && sizeof(CUtensorMapSwizzle) == sizeof(int),
               "encode argument sizes");
_Static_assert(sizeof(OfzLaunchAttr) == sizeof(CUlaunchAttribute), "launch attribute size");
SAME_OFFSET(OfzLaunchAttr, value, CUlaunchAttribute, value);
SAME_OFFSET(OfzLaunchAttr, value.cluster.x, CUlaunchAttribute, value.clusterDim.x);
SAME_OFFSET(OfzLaunchAttr, value.cluster.y, CUlaunchAttribute, value.clusterDim.y);
SAME_OFFSET(OfzLaunchAttr, value.cluster.z, CUlaunchAttribute, value.clusterDim.z);
SAME_OFFSET(OfzLaunchAttr, value.pdl, CUlaunchAttribute, value.programmaticStreamSerializationAllowed);
_Static_assert(sizeof(((OfzLaunchAttr*)0)->value.pdl) == sizeof(int), "programmatic launch flag");
_Static_assert(sizeof(OfzLaunchConfig) == sizeof(CUlaunchConfig), "launch config size");
SAME_OFFSET(OfzLaunchConfig, grid_x, CUlaunchConfig, gridDimX);
SAME_OFFSET(OfzLaunchConfig, block_z, CUlaunchConfig, blockDimZ);
SAME_OFFSET(OfzLaunchConfig, smem, CUlaunchConfig, sharedMemBytes);
SAME_OFFSET(OfzLaunchConfig, stream, CUlaunchConfig, hStream);
SAME_OFFSET(OfzLaunchConfig, attrs, CUlaunchConfig, attrs);
SAME_OFFSET(OfzLaunchConfig, n_attrs, CUlaunchConfig, numAttrs);
int main(void) { return 0; }
"""


def _cuda_include() -> Path:
    nvidia = pytest.importorskip("nvidia.cu13")
    inc = Path(list(nvidia.__path__)[0]) / "include"
    if not (inc / "cuda.h").exists():
        pytest.skip("the nvidia-cuda-runtime wheel has no cuda.h here")
    return inc


def test_driver_declarations_match_cuda_h(tmp_path):
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip("no C compiler")
    # ofz_cuda.h's own handle typedefs would clash with cuda.h's: rename them while it is included
    rename = "".join(f"#define {n} OFZ_{n}\n" for n in OURS)
    undo = "".join(f"#undef {n}\n" for n in OURS)
    src = tmp_path / "abi.c"
    src.write_text(f'#include <stddef.h>\n{rename}#include "ofz_cuda.h"\n#include "../include/ortfuse_args.h"\n'
                   f'{undo}#include <cuda.h>\n{CHECKS}')
    proc = subprocess.run([cc, "-std=c11", "-fsyntax-only", f"-I{NATIVE}", f"-I{_cuda_include()}", str(src)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
