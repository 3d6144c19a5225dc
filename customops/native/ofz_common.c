#include "ofz_common.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

OfzOrt ofz_ort;

typedef void (*OfzFn)(void);

// Copies slot `idx` of ORT's table into a typed field. Function-pointer casts keep this ISO C.
#define BIND(field, idx) ofz_ort.field = (__typeof__(ofz_ort.field))tbl[idx]

void ofz_ort_bind(const OrtApi* api) {
  const OfzFn* tbl = (const OfzFn*)(const void*)api;
  BIND(CreateStatus, 0);
  BIND(GetErrorCode, 1);
  BIND(GetErrorMessage, 2);
  BIND(CreateCustomOpDomain, 26);
  BIND(CustomOpDomain_Add, 27);
  BIND(AddCustomOpDomain, 28);
  BIND(GetTensorMutableData, 51);
  BIND(CreateTSI, 57);
  BIND(SetTensorElementType, 58);
  BIND(SetDimensions, 59);
  BIND(GetTensorElementType, 60);
  BIND(GetDimensionsCount, 61);
  BIND(GetDimensions, 62);
  BIND(GetSymbolicDimensions, 63);
  BIND(GetTensorShapeElementCount, 64);
  BIND(GetTensorTypeAndShape, 65);
  BIND(GetValueType, 67);
  BIND(MemoryInfoGetName, 71);
  BIND(MemoryInfoGetId, 72);
  BIND(AllocatorGetInfo, 77);
  BIND(GetAllocatorWithDefaultOptions, 78);
  BIND(KernelInfoGetAttribute_float, 85);
  BIND(KernelInfoGetAttribute_int64, 86);
  BIND(KernelInfoGetAttribute_string, 87);
  BIND(KernelContext_GetInputCount, 88);
  BIND(KernelContext_GetOutputCount, 89);
  BIND(KernelContext_GetInput, 90);
  BIND(KernelContext_GetOutput, 91);
  BIND(ReleaseStatus, 93);
  BIND(ReleaseValue, 96);
  BIND(ReleaseTSI, 99);
  BIND(ReleaseCustomOpDomain, 101);
  BIND(ReleaseAllocator, 132);
  BIND(KernelInfoGetAttributeArray_float, 162);
  BIND(KernelInfoGetAttributeArray_int64, 163);
  BIND(KernelContext_GetGPUComputeStream, 193);
  BIND(KernelInfo_GetInputCount, 230);
  BIND(KernelInfo_GetOutputCount, 231);
  BIND(KernelInfoGetAttribute_tensor, 236);
  BIND(HasSessionConfigEntry, 237);
  BIND(GetSessionConfigEntry, 238);
  BIND(KernelInfo_GetNodeName, 244);
  BIND(ShapeInferContext_GetInputCount, 267);
  BIND(ShapeInferContext_GetInputTypeShape, 268);
  BIND(ShapeInferContext_GetAttribute, 269);
  BIND(ShapeInferContext_SetOutputTypeShape, 270);
  BIND(SetSymbolicDimensions, 271);
  BIND(ReadOpAttr, 272);
  BIND(KernelInfoGetAllocator, 278);
}

OrtStatus* ofz_err(int code, const char* fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return ofz_ort.CreateStatus(code, msg);
}

OrtStatus* ofz_wrap(OrtStatus* inner, const char* prefix) {
  if (!inner) return NULL;
  OrtStatus* s = ofz_err(ofz_ort.GetErrorCode(inner), "%s: %s", prefix, ofz_ort.GetErrorMessage(inner));
  ofz_ort.ReleaseStatus(inner);
  return s;
}

void ofz_node_name(const OrtKernelInfo* info, char* buf, size_t cap) {
  size_t size = 0;
  buf[0] = '\0';
  OrtStatus* s = ofz_ort.KernelInfo_GetNodeName(info, NULL, &size);
  if (s) {
    ofz_ort.ReleaseStatus(s);
    return;
  }
  char tmp[1024];
  if (size == 0 || size > sizeof tmp) return;
  s = ofz_ort.KernelInfo_GetNodeName(info, tmp, &size);
  if (s) {
    ofz_ort.ReleaseStatus(s);
    return;
  }
  snprintf(buf, cap, "%s", tmp);
}

static OrtStatus* attr_error(OrtStatus* s, const char* node, const char* name) {
  char prefix[320];
  snprintf(prefix, sizeof prefix, "ortfuse: node '%s': attribute '%s'", node, name);
  return ofz_wrap(s, prefix);
}

OrtStatus* ofz_attr_int(const OrtKernelInfo* info, const char* node, const char* name, int64_t* out) {
  return attr_error(ofz_ort.KernelInfoGetAttribute_int64(info, name, out), node, name);
}

OrtStatus* ofz_attr_float(const OrtKernelInfo* info, const char* node, const char* name, float* out) {
  return attr_error(ofz_ort.KernelInfoGetAttribute_float(info, name, out), node, name);
}

OrtStatus* ofz_attr_ints(const OrtKernelInfo* info, const char* node, const char* name, int64_t* buf,
                         size_t cap, size_t* n) {
  size_t size = 0;
  OrtStatus* s = ofz_ort.KernelInfoGetAttributeArray_int64(info, name, NULL, &size);
  if (s) return attr_error(s, node, name);
  if (size > cap) return ofz_err(ORT_INVALID_ARGUMENT,
                                 "ortfuse: node '%s': attribute '%s' has %zu values, at most %zu allowed",
                                 node, name, size, cap);
  *n = size;
  if (size == 0) return NULL;
  return attr_error(ofz_ort.KernelInfoGetAttributeArray_int64(info, name, buf, &size), node, name);
}

int64_t ofz_attr_int_or(const OrtKernelInfo* info, const char* name, int64_t fallback) {
  int64_t v = fallback;
  OrtStatus* s = ofz_ort.KernelInfoGetAttribute_int64(info, name, &v);
  if (s) {
    ofz_ort.ReleaseStatus(s);
    v = fallback;
  }
  return v;
}

OrtStatus* ofz_attr_ints_opt(const OrtKernelInfo* info, const char* node, const char* name, int64_t* buf,
                             size_t cap, size_t* n) {
  size_t size = 0;
  OrtStatus* s = ofz_ort.KernelInfoGetAttributeArray_int64(info, name, NULL, &size);
  if (s) {  // absent (ORT has no cheaper presence test)
    ofz_ort.ReleaseStatus(s);
    *n = 0;
    return NULL;
  }
  return ofz_attr_ints(info, node, name, buf, cap, n);
}

OrtStatus* ofz_attr_floats(const OrtKernelInfo* info, const char* node, const char* name, float* buf,
                           size_t cap, size_t* n) {
  size_t size = 0;
  OrtStatus* s = ofz_ort.KernelInfoGetAttributeArray_float(info, name, NULL, &size);
  if (s) return attr_error(s, node, name);
  if (size > cap) return ofz_err(ORT_INVALID_ARGUMENT,
                                 "ortfuse: node '%s': attribute '%s' has %zu values, at most %zu allowed",
                                 node, name, size, cap);
  *n = size;
  if (size == 0) return NULL;
  return attr_error(ofz_ort.KernelInfoGetAttributeArray_float(info, name, buf, &size), node, name);
}

OrtStatus* ofz_attr_string(const OrtKernelInfo* info, const char* node, const char* name, char* buf, size_t cap) {
  size_t size = 0;  // includes the NUL
  OrtStatus* s = ofz_ort.KernelInfoGetAttribute_string(info, name, NULL, &size);
  if (s) return attr_error(s, node, name);
  if (size == 0 || size > cap) return ofz_err(ORT_INVALID_ARGUMENT,
                                              "ortfuse: node '%s': attribute '%s' is longer than %zu bytes",
                                              node, name, cap - 1);
  return attr_error(ofz_ort.KernelInfoGetAttribute_string(info, name, buf, &size), node, name);
}

OrtStatus* ofz_attr_tensor(const OrtKernelInfo* info, const char* node, const char* name, OrtValue** value,
                           void** data, int* dtype, size_t* count) {
  OrtAllocator* cpu = NULL;  // ORT's default CPU allocator: static, never released
  OrtStatus* s = ofz_ort.GetAllocatorWithDefaultOptions(&cpu);
  if (s) return attr_error(s, node, name);
  *value = NULL;
  s = ofz_ort.KernelInfoGetAttribute_tensor(info, name, cpu, value);
  if (s) return attr_error(s, node, name);
  OrtTSI* tsi = NULL;
  s = ofz_ort.GetTensorTypeAndShape(*value, &tsi);
  if (!s) s = ofz_ort.GetTensorElementType(tsi, dtype);
  if (!s) s = ofz_ort.GetTensorShapeElementCount(tsi, count);
  if (tsi) ofz_ort.ReleaseTSI(tsi);
  if (!s) s = ofz_ort.GetTensorMutableData(*value, data);
  if (s) {
    ofz_ort.ReleaseValue(*value);
    *value = NULL;
    return attr_error(s, node, name);
  }
  return NULL;
}

OrtStatus* ofz_infer_ints(const OrtShapeInferContext* ctx, const char* name, int64_t* buf, size_t cap, size_t* n) {
  const OrtOpAttr* attr = NULL;
  *n = 0;
  OrtStatus* s = ofz_ort.ShapeInferContext_GetAttribute(ctx, name, &attr);
  if (s) {  // absent: ORT reports it as an error; treat as empty
    ofz_ort.ReleaseStatus(s);
    return NULL;
  }
  if (!attr) return NULL;
  size_t bytes = 0;
  s = ofz_ort.ReadOpAttr(attr, ORT_ATTR_INTS, buf, cap * sizeof(int64_t), &bytes);
  if (s) {
    char prefix[200];
    snprintf(prefix, sizeof prefix, "ortfuse: shape inference: attribute '%s'", name);
    return ofz_wrap(s, prefix);
  }
  *n = bytes / sizeof(int64_t);
  return NULL;
}

size_t ofz_dtype_size(int dtype) {
  // Indexed by ONNXTensorElementDataType; 0 = not a fixed byte size.
  static const unsigned char sizes[OFZ_DT_MAX + 1] = {0, 4, 1, 1, 2, 2, 4, 8, 0, 1, 2, 8, 4, 8, 8, 16,
                                                      2, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1};
  return (dtype >= 0 && dtype <= OFZ_DT_MAX) ? sizes[dtype] : 0;
}

// ---- the variadic op template ----

static const char* op_name(const OrtCustomOp* op) { return ((const OfzOp*)op)->name; }
static const char* op_ep(const OrtCustomOp* op) { return ((const OfzOp*)op)->ep; }
static int any_type(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return OFZ_DT_UNDEFINED; }
static size_t one(const OrtCustomOp* op) { (void)op; return 1; }
static int variadic(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_IO_VARIADIC; }
static int mem_default(const OrtCustomOp* op, size_t i) { (void)op; (void)i; return ORT_MEM_DEFAULT; }
static int min_arity(const OrtCustomOp* op) { (void)op; return 1; }
static int heterogeneous(const OrtCustomOp* op) { (void)op; return 0; }

void ofz_op_init(OfzOp* op, const char* name, const char* ep,
                 OrtStatus* (*create)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**),
                 OrtStatus* (*compute)(void*, OrtKernelContext*), void (*destroy)(void*),
                 OrtStatus* (*infer)(const OrtCustomOp*, OrtShapeInferContext*)) {
  memset(op, 0, sizeof *op);
  snprintf(op->name, sizeof op->name, "%s", name);
  op->ep = ep;
  OrtCustomOp* b = &op->base;
  b->version = OFZ_ORT_API_VERSION;
  b->GetName = op_name;
  b->GetExecutionProviderType = op_ep;
  b->GetInputType = any_type;
  b->GetInputTypeCount = one;
  b->GetOutputType = any_type;
  b->GetOutputTypeCount = one;
  b->KernelDestroy = destroy;
  b->GetInputCharacteristic = variadic;
  b->GetOutputCharacteristic = variadic;
  b->GetInputMemoryType = mem_default;
  b->GetVariadicInputMinArity = min_arity;
  b->GetVariadicInputHomogeneity = heterogeneous;
  b->GetVariadicOutputMinArity = min_arity;
  b->GetVariadicOutputHomogeneity = heterogeneous;
  b->CreateKernelV2 = create;
  b->KernelComputeV2 = compute;
  b->InferOutputShapeFn = infer;
}
