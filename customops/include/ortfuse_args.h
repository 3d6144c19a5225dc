// The kernel ABI (docs/design.md): every generated kernel takes one OfzArgs by value. Plain C, shared by
// the kernels (through ortfuse_kernel.h) and the native op library that fills it.
#pragma once
#define OFZ_MAX_TENSORS 32
#define OFZ_MAX_DIMS 16
typedef struct {
  void* ptr[OFZ_MAX_TENSORS];
  long long dim[OFZ_MAX_DIMS];
} OfzArgs;
