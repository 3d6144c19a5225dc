// The kernel ABI (docs/design.md): every generated kernel takes one OfzArgs by value. Plain C, shared by
// the kernels (through ortfuse_kernel.h) and the native op library that fills it.
#pragma once
#define OFZ_MAX_TENSORS 32
#define OFZ_MAX_DIMS 16
typedef struct {
  void* ptr[OFZ_MAX_TENSORS];
  long long dim[OFZ_MAX_DIMS];
} OfzArgs;

// A kernel whose GEMM operands the tensor memory accelerator copies (sm_90, the fused node's `tma`
// attribute) takes a second parameter: one tensor map per such operand, A then B. On a GPU each is a
// CUtensorMap (128 opaque bytes; CUDA 13's cuda.h aligns it to 128) the library encodes per launch; under
// emulation the same bytes hold the emulator's own description (ortfuse_emu.h, EmuTensorMap).
#define OFZ_TMA_MAPS 2
#if defined(__cplusplus)
#define OFZ_ALIGN128 alignas(128)
#else
#define OFZ_ALIGN128 _Alignas(128)
#endif
typedef struct {
  OFZ_ALIGN128 unsigned long long opaque[16];
} OfzTensorMap;
typedef struct {
  OfzTensorMap map[OFZ_TMA_MAPS];
} OfzTma;
