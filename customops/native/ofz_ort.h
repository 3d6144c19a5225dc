// The subset of the ONNX Runtime C ABI that ortfuse uses, declared from the slot table in
// shared/notes/ort-custom-op-abi.md (no ORT headers). Slots are zero-based indices into the
// function table that OrtApiBase::GetApi(20) returns; they never move between releases.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;  // opaque: only ever read as a table of function pointers
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtValue OrtValue;
typedef struct OrtTensorTypeAndShapeInfo OrtTSI;
typedef struct OrtAllocator OrtAllocator;
typedef struct OrtMemoryInfo OrtMemoryInfo;
typedef struct OrtShapeInferContext OrtShapeInferContext;
typedef struct OrtOpAttr OrtOpAttr;

typedef struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)(void);
} OrtApiBase;

#define OFZ_ORT_API_VERSION 20

enum { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2, ORT_NOT_IMPLEMENTED = 9, ORT_INVALID_GRAPH = 10,
       ORT_EP_FAIL = 11 };
enum { OFZ_DT_UNDEFINED = 0, OFZ_DT_FLOAT = 1, OFZ_DT_UINT8 = 2, OFZ_DT_INT64 = 7, OFZ_DT_STRING = 8,
       OFZ_DT_FLOAT16 = 10, OFZ_DT_DOUBLE = 11, OFZ_DT_BFLOAT16 = 16, OFZ_DT_MAX = 26 };
enum { ORT_MEM_DEFAULT = 0 };
enum { ORT_ATTR_INT = 1, ORT_ATTR_INTS = 2, ORT_ATTR_FLOAT = 3, ORT_ATTR_FLOATS = 4, ORT_ATTR_STRING = 5 };
enum { ORT_IO_REQUIRED = 0, ORT_IO_OPTIONAL = 1, ORT_IO_VARIADIC = 2 };
enum { ORT_ONNX_TYPE_TENSOR = 1 };

// OrtCustomOp, field for field (208 bytes on x86-64). ORT reads a field only if `version` is at least
// the field's gate; ortfuse sets version 20 and fills every field it needs.
typedef struct OrtCustomOp OrtCustomOp;
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);
  const char* (*GetName)(const OrtCustomOp*);
  const char* (*GetExecutionProviderType)(const OrtCustomOp*);
  int (*GetInputType)(const OrtCustomOp*, size_t);
  size_t (*GetInputTypeCount)(const OrtCustomOp*);
  int (*GetOutputType)(const OrtCustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const OrtCustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetOutputCharacteristic)(const OrtCustomOp*, size_t);
  int (*GetInputMemoryType)(const OrtCustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const OrtCustomOp*);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp*);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp*);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp*);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*, void**);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp*, OrtShapeInferContext*);
  int (*GetStartVersion)(const OrtCustomOp*);
  int (*GetEndVersion)(const OrtCustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

typedef const OrtKernelInfo* Info;
typedef OrtStatus* St;

// Typed views of the slots used, filled once by ofz_ort_bind. The comment is the slot index.
typedef struct OfzOrt {
  St (*CreateStatus)(int code, const char* msg);                                            // 0
  int (*GetErrorCode)(const OrtStatus*);                                                    // 1
  const char* (*GetErrorMessage)(const OrtStatus*);                                         // 2
  St (*CreateCustomOpDomain)(const char*, OrtCustomOpDomain**);                             // 26
  St (*CustomOpDomain_Add)(OrtCustomOpDomain*, const OrtCustomOp*);                         // 27
  St (*AddCustomOpDomain)(OrtSessionOptions*, OrtCustomOpDomain*);                          // 28
  St (*GetTensorMutableData)(OrtValue*, void**);                                            // 51
  St (*CreateTSI)(OrtTSI**);                                                                // 57
  St (*SetTensorElementType)(OrtTSI*, int);                                                 // 58
  St (*SetDimensions)(OrtTSI*, const int64_t*, size_t);                                     // 59
  St (*GetTensorElementType)(const OrtTSI*, int*);                                          // 60
  St (*GetDimensionsCount)(const OrtTSI*, size_t*);                                         // 61
  St (*GetDimensions)(const OrtTSI*, int64_t*, size_t);                                     // 62
  St (*GetSymbolicDimensions)(const OrtTSI*, const char**, size_t);                         // 63
  St (*GetTensorShapeElementCount)(const OrtTSI*, size_t*);                                 // 64
  St (*GetTensorTypeAndShape)(const OrtValue*, OrtTSI**);                                   // 65
  St (*GetValueType)(const OrtValue*, int*);                                                // 67
  St (*MemoryInfoGetName)(const OrtMemoryInfo*, const char**);                              // 71
  St (*MemoryInfoGetId)(const OrtMemoryInfo*, int*);                                        // 72
  St (*AllocatorGetInfo)(const OrtAllocator*, const OrtMemoryInfo**);                       // 77
  St (*GetAllocatorWithDefaultOptions)(OrtAllocator**);                                     // 78
  St (*KernelInfoGetAttribute_float)(Info, const char*, float*);                            // 85
  St (*KernelInfoGetAttribute_int64)(Info, const char*, int64_t*);                          // 86
  St (*KernelInfoGetAttribute_string)(Info, const char*, char*, size_t*);                   // 87
  St (*KernelContext_GetInputCount)(const OrtKernelContext*, size_t*);                      // 88
  St (*KernelContext_GetOutputCount)(const OrtKernelContext*, size_t*);                     // 89
  St (*KernelContext_GetInput)(const OrtKernelContext*, size_t, const OrtValue**);          // 90
  St (*KernelContext_GetOutput)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);  // 91
  void (*ReleaseStatus)(OrtStatus*);                                                        // 93
  void (*ReleaseValue)(OrtValue*);                                                          // 96
  void (*ReleaseTSI)(OrtTSI*);                                                              // 99
  void (*ReleaseCustomOpDomain)(OrtCustomOpDomain*);                                        // 101
  void (*ReleaseAllocator)(OrtAllocator*);                                                  // 132
  St (*KernelInfoGetAttributeArray_float)(Info, const char*, float*, size_t*);              // 162
  St (*KernelInfoGetAttributeArray_int64)(Info, const char*, int64_t*, size_t*);            // 163
  St (*KernelContext_GetGPUComputeStream)(const OrtKernelContext*, void**);                 // 193
  St (*KernelInfo_GetInputCount)(Info, size_t*);                                            // 230
  St (*KernelInfo_GetOutputCount)(Info, size_t*);                                           // 231
  St (*KernelInfoGetAttribute_tensor)(Info, const char*, OrtAllocator*, OrtValue**);        // 236
  St (*HasSessionConfigEntry)(const OrtSessionOptions*, const char*, int*);                 // 237
  St (*GetSessionConfigEntry)(const OrtSessionOptions*, const char*, char*, size_t*);       // 238
  St (*KernelInfo_GetNodeName)(Info, char*, size_t*);                                       // 244
  St (*ShapeInferContext_GetInputCount)(const OrtShapeInferContext*, size_t*);              // 267
  St (*ShapeInferContext_GetInputTypeShape)(const OrtShapeInferContext*, size_t, OrtTSI**);  // 268
  St (*ShapeInferContext_GetAttribute)(const OrtShapeInferContext*, const char*, const OrtOpAttr**);  // 269
  St (*ShapeInferContext_SetOutputTypeShape)(const OrtShapeInferContext*, size_t, const OrtTSI*);  // 270
  St (*SetSymbolicDimensions)(OrtTSI*, const char**, size_t);                               // 271
  St (*ReadOpAttr)(const OrtOpAttr*, int, void*, size_t, size_t*);                          // 272
  St (*KernelInfoGetAllocator)(Info, int, OrtAllocator**);                                  // 278
} OfzOrt;

// The bound table (valid after the first successful ofz_ort_bind; the table is process-global in ORT).
extern OfzOrt ofz_ort;
void ofz_ort_bind(const OrtApi* api);
