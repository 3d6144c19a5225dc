// Lazy libcuda.so.1 loading. Nothing here runs until a fused kernel is created on the CUDA EP.
#include "ofz_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>

static OfzCuda g_cuda;
static const char* g_why = "not loaded";
static char g_why_buf[256];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

// Newer versioned symbol first (`cuCtxPushCurrent_v2`), then the plain name.
static void* sym(void* lib, const char* name, const char* v2) {
  void* p = v2 ? dlsym(lib, v2) : NULL;
  return p ? p : dlsym(lib, name);
}

#define LOAD(field, name, v2)                                                   \
  do {                                                                          \
    void* p_ = sym(lib, name, v2);                                              \
    if (!p_) {                                                                  \
      snprintf(g_why_buf, sizeof g_why_buf, "libcuda.so.1 lacks %s", name);     \
      g_why = g_why_buf;                                                        \
      return;                                                                   \
    }                                                                           \
    *(void**)&g_cuda.field = p_;                                                \
  } while (0)

static void load(void) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(g_why_buf, sizeof g_why_buf, "cannot load libcuda.so.1 (%s)", dlerror());
    g_why = g_why_buf;
    return;
  }
  OfzCuda* c = &g_cuda;
  LOAD(Init, "cuInit", NULL);
  LOAD(DeviceGet, "cuDeviceGet", NULL);
  LOAD(DeviceGetAttribute, "cuDeviceGetAttribute", NULL);
  LOAD(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", NULL);
  LOAD(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2");
  LOAD(CtxPushCurrent, "cuCtxPushCurrent", "cuCtxPushCurrent_v2");
  LOAD(CtxPopCurrent, "cuCtxPopCurrent", "cuCtxPopCurrent_v2");
  LOAD(ModuleLoadDataEx, "cuModuleLoadDataEx", NULL);
  LOAD(ModuleUnload, "cuModuleUnload", NULL);
  LOAD(ModuleGetFunction, "cuModuleGetFunction", NULL);
  LOAD(FuncGetAttribute, "cuFuncGetAttribute", NULL);
  LOAD(FuncSetAttribute, "cuFuncSetAttribute", NULL);
  LOAD(LaunchKernel, "cuLaunchKernel", NULL);
  LOAD(GetErrorString, "cuGetErrorString", NULL);
  *(void**)&c->LaunchKernelEx = dlsym(lib, "cuLaunchKernelEx");  // optional: CUDA 12.0+
  *(void**)&c->TensorMapEncodeTiled = dlsym(lib, "cuTensorMapEncodeTiled");  // optional: CUDA 12.0+
  *(void**)&c->OccupancyMaxActiveBlocksPerMultiprocessor = dlsym(lib, "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  CUresult r = c->Init(0);
  if (r != 0) {
    snprintf(g_why_buf, sizeof g_why_buf, "cuInit failed (%s)", ofz_cuda_error(r));
    g_why = g_why_buf;
    return;
  }
  g_why = NULL;  // success; the handle stays open for the life of the process
}

const OfzCuda* ofz_cuda(const char** why) {
  pthread_once(&g_once, load);
  if (why) *why = g_why;
  return g_why ? NULL : &g_cuda;
}

const char* ofz_cuda_error(CUresult r) {
  const char* s = NULL;
  if (g_cuda.GetErrorString && g_cuda.GetErrorString(r, &s) == 0 && s) return s;
  return "unknown CUDA error";
}
