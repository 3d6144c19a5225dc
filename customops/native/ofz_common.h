// Helpers shared by the fused op and the probe ops: statuses, attribute readers, the variadic op template.
#pragma once
#include "ofz_ort.h"

#define OFZ_NAME_MAX 128

// Formatted OrtStatus (message truncated to 1 KiB). Never returns NULL.
OrtStatus* ofz_err(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
// Re-wraps `inner` (released here) as "<prefix>: <inner message>"; NULL stays NULL.
OrtStatus* ofz_wrap(OrtStatus* inner, const char* prefix);

// The node name (KernelInfo_GetNodeName), truncated to fit; "" if ORT gives none.
void ofz_node_name(const OrtKernelInfo* info, char* buf, size_t cap);

// Attribute readers. Errors name the node and attribute.
OrtStatus* ofz_attr_int(const OrtKernelInfo* info, const char* node, const char* name, int64_t* out);
OrtStatus* ofz_attr_float(const OrtKernelInfo* info, const char* node, const char* name, float* out);
// Reads up to `cap` values; more than `cap` is an error. `*n` gets the count.
OrtStatus* ofz_attr_ints(const OrtKernelInfo* info, const char* node, const char* name, int64_t* buf,
                         size_t cap, size_t* n);
// An int attribute, or `fallback` when it is missing (or not an int: callers range-check the value).
int64_t ofz_attr_int_or(const OrtKernelInfo* info, const char* name, int64_t fallback);
// Like ofz_attr_ints, but a missing attribute is not an error: *n = 0.
OrtStatus* ofz_attr_ints_opt(const OrtKernelInfo* info, const char* node, const char* name, int64_t* buf,
                             size_t cap, size_t* n);
OrtStatus* ofz_attr_floats(const OrtKernelInfo* info, const char* node, const char* name, float* buf,
                           size_t cap, size_t* n);
// NUL-terminated string attribute; longer than cap-1 is an error.
OrtStatus* ofz_attr_string(const OrtKernelInfo* info, const char* node, const char* name, char* buf, size_t cap);
// Tensor attribute copied to CPU memory (free with ofz_ort.ReleaseValue): its data, element type and count.
OrtStatus* ofz_attr_tensor(const OrtKernelInfo* info, const char* node, const char* name, OrtValue** value,
                           void** data, int* dtype, size_t* count);
// ints attribute in a shape-inference context; a missing attribute gives *n = 0 and no error.
OrtStatus* ofz_infer_ints(const OrtShapeInferContext* ctx, const char* name, int64_t* buf, size_t cap, size_t* n);

// Bytes per element for fixed-size ONNX element types, 0 for strings/sub-byte/unknown types.
size_t ofz_dtype_size(int dtype);

// A custom op with one variadic, heterogeneous input list and output list (min arity 1 each).
// `name` and `ep` must stay valid for as long as ORT may use the op.
typedef struct OfzOp {
  OrtCustomOp base;  // first member: ORT hands back &base
  char name[OFZ_NAME_MAX];
  const char* ep;
} OfzOp;

void ofz_op_init(OfzOp* op, const char* name, const char* ep,
                 OrtStatus* (*create)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**),
                 OrtStatus* (*compute)(void*, OrtKernelContext*), void (*destroy)(void*),
                 OrtStatus* (*infer)(const OrtCustomOp*, OrtShapeInferContext*));
