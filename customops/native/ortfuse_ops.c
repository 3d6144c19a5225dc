// libortfuse_ops.so: registers ortfuse's ops with ONNX Runtime (no ORT headers, never links ORT).
//   * domain `ortfuse`, EP "CUDAExecutionProvider": one generic fused op per name in the session config
//     entry `ortfuse.op_types`. CreateKernelV2 parses the node, loads the cubin/PTX into the primary
//     context of ORT's device; KernelComputeV2 binds shapes, allocates outputs and launches on ORT's stream.
//   * domain `ortfuse.probe`, CPU EP: the probe ops of ofz_probe.c, always registered.
// Domains and ops live in static storage for the life of the process (ORT keeps pointers to them).
#include <ctype.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ofz_cuda.h"
#include "ofz_probe.h"
#include "ofz_spec.h"

#define OFZ_CONFIG_KEY "ortfuse.op_types"
#ifndef OFZ_FUSED_EP  // tests build a CPU-EP copy to check, without a GPU, that ORT accepts an optimized graph
#define OFZ_FUSED_EP "CUDAExecutionProvider"
#endif
#define OFZ_DOMAIN "ortfuse"
#define OFZ_SMEM_DEFAULT_LIMIT (48 * 1024)

// ---- the fused CUDA op ----

// One compiled kernel of the node (a node may carry several, picked per run by size in ofz_spec_resolve).
typedef struct Variant {
  OfzSpec spec;
  CUmodule mod;
  CUfunction fn;
  // TMA GEMMs: the last tensor maps encoded, by geometry (a weight's never changes; ORT's arena mostly
  // hands an activation the same buffer run after run), under the kernel's lock: ORT may run a kernel
  // from threads
  OfzTmaGeom tma_geo[OFZ_TMA_MAPS];
  OfzTensorMap tma_map[OFZ_TMA_MAPS];
  int tma_cached[OFZ_TMA_MAPS];
  int pdl;  // launched as a programmatic dependent launch: the kernel asks for it and the device has them
} Variant;

typedef struct FusedKernel {
  CUdevice dev;
  CUcontext ctx;  // the device's primary context (retained), which ORT's CUDA EP also uses
  pthread_mutex_t tma_lock;
  int sm_count;  // for split-K cluster launches and persistent grids; 0 = neither
  size_t n_var;
  const OfzSpec* specs[OFZ_MAX_VARIANTS];  // &var[v].spec, for ofz_spec_resolve
  Variant var[OFZ_MAX_VARIANTS];
} FusedKernel;

static OrtStatus* cu_fail(const Variant* k, const char* what, CUresult r) {
  return ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': %s failed: %s (CUDA error %d)", k->spec.node, what,
                 ofz_cuda_error(r), r);
}

// Device of ORT's default allocator for this node (the CUDA EP's device_id).
static OrtStatus* node_device(const OrtKernelInfo* info, int* id) {
  OrtAllocator* alloc = NULL;
  const OrtMemoryInfo* mem = NULL;
  OrtStatus* s = ofz_ort.KernelInfoGetAllocator(info, ORT_MEM_DEFAULT, &alloc);
  if (s) return s;
  s = ofz_ort.AllocatorGetInfo(alloc, &mem);
  if (!s) s = ofz_ort.MemoryInfoGetId(mem, id);
  ofz_ort.ReleaseAllocator(alloc);
  return s;
}

// Loads a variant's module and checks its launch limits; sets *sm_count where it launches clusters or a
// persistent grid. Runs with the node's context current.
static OrtStatus* load_module(const OfzCuda* cu, const OrtKernelInfo* info, CUdevice dev, Variant* k, int* sm_count) {
  int major = 0, minor = 0, smem_optin = 0, max_threads = 0;
  CUresult r = cu->DeviceGetAttribute(&major, OFZ_CU_ATTR_CC_MAJOR, dev);
  if (!r) r = cu->DeviceGetAttribute(&minor, OFZ_CU_ATTR_CC_MINOR, dev);
  if (!r) r = cu->DeviceGetAttribute(&smem_optin, OFZ_CU_ATTR_MAX_SMEM_OPTIN, dev);
  if (r) return cu_fail(k, "cuDeviceGetAttribute", r);
  void* image = NULL;
  size_t bytes = 0;
  int chosen = 0;
  OrtStatus* s = ofz_spec_image(info, &k->spec, major * 10 + minor, &image, &bytes, &chosen);
  if (s) return s;
  char log[2048] = "";
  int opts[2] = {OFZ_CU_JIT_ERROR_LOG_BUFFER, OFZ_CU_JIT_ERROR_LOG_BUFFER_SIZE};
  void* vals[2] = {log, (void*)(size_t)sizeof log};
  r = cu->ModuleLoadDataEx(&k->mod, image, 2, opts, vals);
  free(image);
  if (r) {
    k->mod = NULL;
    return ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': loading the %s for sm_%d%d failed: %s%s%.1500s", k->spec.node,
                   chosen ? "cubin" : "PTX", major, minor, ofz_cuda_error(r), log[0] ? "; JIT log: " : "", log);
  }
  r = cu->ModuleGetFunction(&k->fn, k->mod, k->spec.entry);
  if (r) return cu_fail(k, "cuModuleGetFunction (entry not in the image?)", r);
  r = cu->FuncGetAttribute(&max_threads, OFZ_CU_FUNC_MAX_THREADS, k->fn);
  if (r) return cu_fail(k, "cuFuncGetAttribute", r);
  if (k->spec.block > max_threads)
    return ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': block of %lld threads exceeds this kernel's limit of %d "
                   "on sm_%d%d", k->spec.node, (long long)k->spec.block, max_threads, major, minor);
  if (k->spec.smem > smem_optin)
    return ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': needs %lld bytes of shared memory, sm_%d%d allows %d",
                   k->spec.node, (long long)k->spec.smem, major, minor, smem_optin);
  if (k->spec.smem > OFZ_SMEM_DEFAULT_LIMIT) {
    r = cu->FuncSetAttribute(k->fn, OFZ_CU_FUNC_MAX_DYN_SMEM, (int)k->spec.smem);
    if (r) return cu_fail(k, "cuFuncSetAttribute(max dynamic shared memory)", r);
  }
  // a row split across a cluster cannot run without one (each block would reduce only its part of a row)
  if (k->spec.row_cluster > 1 && (major < 9 || !cu->LaunchKernelEx))
    return ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': this GEMM splits its rows across thread-block clusters of %lld, "
                   "which need sm_90 or newer and a CUDA 12 driver (this is sm_%d%d%s); optimize the model for "
                   "this GPU", k->spec.node, (long long)k->spec.row_cluster, major, minor,
                   cu->LaunchKernelEx ? "" : ", no cuLaunchKernelEx");
  // nor can a GEMM that shares B between a cluster's blocks (each copies only its part of B's tile)
  if (k->spec.multicast > 1 && (major < 9 || !cu->LaunchKernelEx))
    return ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': this GEMM shares its B tiles across thread-block clusters of "
                   "%lld, which need sm_90 or newer and a CUDA 12 driver (this is sm_%d%d%s); optimize the model "
                   "for this GPU", k->spec.node, (long long)k->spec.multicast, major, minor,
                   cu->LaunchKernelEx ? "" : ", no cuLaunchKernelEx");
  // split-K kernels run in clusters where the device has them (sm_90+) and the driver can launch them;
  // otherwise in clusters of one, which the kernel handles as no split. Persistent kernels (sm_90a TMA
  // GEMMs) cap their grid at the SM count times their blocks per SM.
  if ((k->spec.split_k > 1 || k->spec.blocks_per_sm > 0) && major >= 9 && cu->LaunchKernelEx) {
    r = cu->DeviceGetAttribute(sm_count, OFZ_CU_ATTR_SM_COUNT, dev);
    if (r) return cu_fail(k, "cuDeviceGetAttribute(multiprocessor count)", r);
  }
  // a kernel built for programmatic dependent launches (it waits for its predecessor itself) gets one
  // where the device and driver have them; elsewhere its wait is a no-op and the launch a plain one
  k->pdl = ofz_spec_pdl(&k->spec, major * 10 + minor, cu->LaunchKernelEx != NULL);
  // a persistent grid holds no more blocks per SM than the device keeps resident (the compiler's tile model
  // estimated them); any more would run as a second wave
  int resident = 0;
  if (k->spec.blocks_per_sm > 0 && cu->OccupancyMaxActiveBlocksPerMultiprocessor &&
      cu->OccupancyMaxActiveBlocksPerMultiprocessor(&resident, k->fn, (int)k->spec.block, (size_t)k->spec.smem) == 0 &&
      resident >= 1 && resident < k->spec.blocks_per_sm)
    k->spec.blocks_per_sm = resident;
  return NULL;
}

static void fused_destroy(void* kernel) {
  FusedKernel* k = kernel;
  if (!k) return;
  pthread_mutex_destroy(&k->tma_lock);
  const OfzCuda* cu = k->ctx ? ofz_cuda(NULL) : NULL;  // no context: the driver was never needed
  if (cu) {
    CUcontext prev = NULL;
    if (cu->CtxPushCurrent(k->ctx) == 0) {
      for (size_t v = 0; v < k->n_var; ++v)
        if (k->var[v].mod) cu->ModuleUnload(k->var[v].mod);
      cu->CtxPopCurrent(&prev);
    }
    cu->DevicePrimaryCtxRelease(k->dev);
  }
  free(k);
}

static OrtStatus* fused_create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  char node[OFZ_NAME_MAX];
  ofz_node_name(info, node, sizeof node);
  size_t ins = 0, outs = 0;
  OrtStatus* s = ofz_ort.KernelInfo_GetInputCount(info, &ins);
  if (!s) s = ofz_ort.KernelInfo_GetOutputCount(info, &outs);
  if (s) return s;
  // its cached tensor maps are 128-byte aligned (CUtensorMap): so is the kernel record
  const size_t bytes = (sizeof(FusedKernel) + 127) / 128 * 128;
  FusedKernel* k = aligned_alloc(128, bytes);
  if (!k) return ofz_err(ORT_FAIL, "ortfuse: node '%s': out of host memory", node);
  memset(k, 0, bytes);
  pthread_mutex_init(&k->tma_lock, NULL);
  s = ofz_spec_parse(info, node, ins, outs, 0, &k->var[0].spec);
  k->n_var = s ? 0 : (size_t)k->var[0].spec.n_variants;
  for (size_t v = 1; v < k->n_var && !s; ++v) s = ofz_spec_parse(info, node, ins, outs, v, &k->var[v].spec);
  for (size_t v = 0; v < k->n_var; ++v) k->specs[v] = &k->var[v].spec;
  const char* why = NULL;
  const OfzCuda* cu = s ? NULL : ofz_cuda(&why);
  if (!s && !cu) s = ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': CUDA driver unavailable: %s", node, why);
  int device = 0;
  if (!s) s = node_device(info, &device);
  if (!s) {
    CUresult r = cu->DeviceGet(&k->dev, device);
    if (!r) r = cu->DevicePrimaryCtxRetain(&k->ctx, k->dev);
    if (r) {
      k->ctx = NULL;
      s = cu_fail(&k->var[0], "retaining the device's primary context", r);
    }
  }
  if (!s) {
    CUresult r = cu->CtxPushCurrent(k->ctx);
    if (r) s = cu_fail(&k->var[0], "cuCtxPushCurrent", r);
    else {
      CUcontext prev = NULL;
      for (size_t v = 0; v < k->n_var && !s; ++v) s = load_module(cu, info, k->dev, &k->var[v], &k->sm_count);
      cu->CtxPopCurrent(&prev);
    }
  }
  if (s) {
    fused_destroy(k);
    return s;
  }
  *out = k;
  return NULL;
}

static int same_geometry(const OfzTmaGeom* a, const OfzTmaGeom* b) {
  return a->base == b->base && a->dim0 == b->dim0 && a->dim1 == b->dim1 && a->stride1 == b->stride1 &&
         a->box0 == b->box0 && a->box1 == b->box1 && a->elem == b->elem;
}

// The tensor maps of a TMA GEMM's operands (host-side encoding, no device work): 2-D, the 128-byte swizzle,
// zeros outside the tensor. A map whose geometry matches the last one encoded for that operand is reused.
static OrtStatus* encode_maps(const OfzCuda* cu, FusedKernel* fk, Variant* k, OrtKernelContext* ctx,
                              const OfzArgs* args, OfzTma* maps) {
  OfzTmaGeom geo[OFZ_TMA_MAPS];
  OrtStatus* s = ofz_spec_tma(&k->spec, ctx, args, geo);
  if (s) return s;
  if (!cu->TensorMapEncodeTiled)
    return ofz_err(ORT_EP_FAIL, "ortfuse: node '%s': the CUDA driver has no cuTensorMapEncodeTiled (CUDA 12.0+ is "
                   "needed for this TMA kernel; optimize with --no-wgmma)", k->spec.node);
  int hit[OFZ_TMA_MAPS] = {0};
  pthread_mutex_lock(&fk->tma_lock);  // once per launch: every map hits after the first runs
  for (size_t j = 0; j < k->spec.n_tma; ++j)
    if ((hit[j] = k->tma_cached[j] && same_geometry(&k->tma_geo[j], &geo[j]))) maps->map[j] = k->tma_map[j];
  pthread_mutex_unlock(&fk->tma_lock);
  for (size_t j = 0; j < k->spec.n_tma; ++j) {
    if (hit[j]) continue;
    const unsigned long long dims[2] = {geo[j].dim0, geo[j].dim1}, strides[1] = {geo[j].stride1};
    const unsigned box[2] = {geo[j].box0, geo[j].box1}, unit[2] = {1, 1};
    const int type = geo[j].elem == OFZ_DT_FLOAT16 ? OFZ_CU_TENSOR_MAP_FLOAT16 : OFZ_CU_TENSOR_MAP_BFLOAT16;
    CUresult r = cu->TensorMapEncodeTiled(&maps->map[j], type, 2, geo[j].base, dims, strides, box, unit,
                                          OFZ_CU_TENSOR_MAP_INTERLEAVE_NONE, OFZ_CU_TENSOR_MAP_SWIZZLE_128B,
                                          OFZ_CU_TENSOR_MAP_L2_128B, OFZ_CU_TENSOR_MAP_OOB_ZERO);
    if (r) return cu_fail(k, "cuTensorMapEncodeTiled", r);
    pthread_mutex_lock(&fk->tma_lock);
    k->tma_geo[j] = geo[j], k->tma_map[j] = maps->map[j], k->tma_cached[j] = 1;
    pthread_mutex_unlock(&fk->tma_lock);
  }
  return NULL;
}

// No allocation outside ORT, no sync, no module loading: safe under CUDA graph capture.
static OrtStatus* fused_compute(void* kernel, OrtKernelContext* ctx) {
  FusedKernel* fk = kernel;
  size_t v = 0;
  OfzArgs args;
  OfzLaunch launch;
  OrtStatus* s = ofz_spec_resolve(fk->specs, ctx, fk->sm_count, &args, &launch, &v);
  if (s || launch.grid == 0) return s;
  Variant* k = &fk->var[v];
  void* stream = NULL;
  s = ofz_ort.KernelContext_GetGPUComputeStream(ctx, &stream);
  if (s) return s;
  const OfzCuda* cu = ofz_cuda(NULL);
  CUcontext prev = NULL;
  CUresult r = cu->CtxPushCurrent(fk->ctx);
  if (r) return cu_fail(k, "cuCtxPushCurrent", r);
  OfzTma maps;  // a TMA GEMM's tensor maps: its second parameter
  void* params[2] = {&args, &maps};
  if (k->spec.n_tma) {
    s = encode_maps(cu, fk, k, ctx, &args, &maps);
    if (s) {
      cu->CtxPopCurrent(&prev);
      return s;
    }
  }
  OfzLaunchAttr attrs[2];
  unsigned n_attrs = 0;
  if (launch.cluster > 1) {  // split-K or a row split: clusters of launch.cluster blocks share each tile (row)
    attrs[n_attrs] = (OfzLaunchAttr){.id = OFZ_CU_LAUNCH_ATTR_CLUSTER_DIM};
    attrs[n_attrs].value.cluster.x = launch.cluster, attrs[n_attrs].value.cluster.y = 1;
    attrs[n_attrs++].value.cluster.z = 1;
  }
  if (k->pdl) {  // may start while the previous kernel in the stream finishes (it waits for it itself)
    attrs[n_attrs] = (OfzLaunchAttr){.id = OFZ_CU_LAUNCH_ATTR_PDL};
    attrs[n_attrs++].value.pdl = 1;
  }
  if (n_attrs) {
    OfzLaunchConfig cfg = {launch.grid, 1, 1, launch.block, 1, 1, launch.smem, (CUstream)stream, attrs, n_attrs};
    r = cu->LaunchKernelEx(&cfg, k->fn, params, NULL);
  } else {
    r = cu->LaunchKernel(k->fn, launch.grid, 1, 1, launch.block, 1, 1, launch.smem, (CUstream)stream, params, NULL);
  }
  cu->CtxPopCurrent(&prev);
  return r ? cu_fail(k, launch.cluster > 1 ? "cuLaunchKernelEx (cluster launch)"
                       : n_attrs ? "cuLaunchKernelEx (programmatic dependent launch)" : "cuLaunchKernel", r) : NULL;
}

static OrtStatus* fused_infer(const OrtCustomOp* op, OrtShapeInferContext* ctx) {
  (void)op;
  return ofz_spec_infer(ctx, 0, 0);
}

// ---- registration ----

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static OrtCustomOpDomain* g_probe_domain;  // shared by every session options object
static OfzOp** g_ops;                      // fused ops by name, never freed
static size_t g_n_ops, g_cap_ops;
static OrtCustomOpDomain** g_domains;      // one fused domain per registration, never freed
static size_t g_n_domains, g_cap_domains;

static int grow(void** arr, size_t* cap, size_t need, size_t elem) {
  if (need <= *cap) return 1;
  size_t n = *cap ? 2 * *cap : 16;
  void* p = realloc(*arr, n * elem);
  if (!p) return 0;
  *arr = p;
  *cap = n;
  return 1;
}

static OfzOp* fused_op(const char* name) {
  for (size_t i = 0; i < g_n_ops; ++i)
    if (strcmp(g_ops[i]->name, name) == 0) return g_ops[i];
  if (!grow((void**)&g_ops, &g_cap_ops, g_n_ops + 1, sizeof *g_ops)) return NULL;
  OfzOp* op = malloc(sizeof *op);
  if (!op) return NULL;
  ofz_op_init(op, name, OFZ_FUSED_EP, fused_create, fused_compute, fused_destroy, fused_infer);
  g_ops[g_n_ops++] = op;
  return op;
}

static OrtStatus* probe_domain(OrtSessionOptions* options) {
  if (!g_probe_domain) {
    const OrtCustomOp *probe = NULL, *plan = NULL;
    ofz_probe_ops(&probe, &plan);
    OrtCustomOpDomain* d = NULL;
    OrtStatus* s = ofz_ort.CreateCustomOpDomain(OFZ_PROBE_DOMAIN, &d);
    if (!s) s = ofz_ort.CustomOpDomain_Add(d, probe);
    if (!s) s = ofz_ort.CustomOpDomain_Add(d, plan);
    if (s) {
      if (d) ofz_ort.ReleaseCustomOpDomain(d);
      return s;
    }
    g_probe_domain = d;
  }
  return ofz_ort.AddCustomOpDomain(options, g_probe_domain);
}

static int valid_op_name(const char* s) {
  if (!*s || strlen(s) >= OFZ_NAME_MAX) return 0;
  for (; *s; ++s)
    if (!isalnum((unsigned char)*s) && *s != '_') return 0;
  return 1;
}

// Builds the `ortfuse` domain from the comma-separated `list` (modified in place).
static OrtStatus* fused_domain(OrtSessionOptions* options, char* list) {
  OrtCustomOpDomain* d = NULL;
  OrtStatus* s = ofz_ort.CreateCustomOpDomain(OFZ_DOMAIN, &d);
  if (s) return s;
  const OfzOp* added[1024];
  size_t n_added = 0;
  for (char* tok = strtok(list, ","); tok && !s; tok = strtok(NULL, ",")) {
    while (isspace((unsigned char)*tok)) ++tok;
    char* end = tok + strlen(tok);
    while (end > tok && isspace((unsigned char)end[-1])) *--end = '\0';
    if (!*tok) continue;
    if (!valid_op_name(tok)) {
      s = ofz_err(ORT_INVALID_ARGUMENT, "ortfuse: session config '%s': bad op type '%.100s'", OFZ_CONFIG_KEY, tok);
      break;
    }
    OfzOp* op = fused_op(tok);
    if (!op) {
      s = ofz_err(ORT_FAIL, "ortfuse: out of memory registering '%s'", tok);
      break;
    }
    int dup = 0;
    for (size_t i = 0; i < n_added; ++i) dup |= added[i] == op;
    if (dup) continue;
    if (n_added == sizeof added / sizeof *added) {
      s = ofz_err(ORT_INVALID_ARGUMENT, "ortfuse: more than %zu fused op types in one session", n_added);
      break;
    }
    added[n_added++] = op;
    s = ofz_ort.CustomOpDomain_Add(d, &op->base);
  }
  if (!s && n_added == 0) {  // nothing listed: no fused domain
    ofz_ort.ReleaseCustomOpDomain(d);
    return NULL;
  }
  if (!s && !grow((void**)&g_domains, &g_cap_domains, g_n_domains + 1, sizeof *g_domains))
    s = ofz_err(ORT_FAIL, "ortfuse: out of memory");
  if (!s) s = ofz_ort.AddCustomOpDomain(options, d);
  if (s) {  // not handed to ORT: safe to release
    ofz_ort.ReleaseCustomOpDomain(d);
    return s;
  }
  g_domains[g_n_domains++] = d;
  return NULL;
}

static OrtStatus* read_config(OrtSessionOptions* options, char** out) {
  int has = 0;
  *out = NULL;
  OrtStatus* s = ofz_ort.HasSessionConfigEntry(options, OFZ_CONFIG_KEY, &has);
  if (s || !has) return s;
  size_t size = 0;
  s = ofz_ort.GetSessionConfigEntry(options, OFZ_CONFIG_KEY, NULL, &size);
  if (s) return s;
  char* buf = calloc(size + 1, 1);
  if (!buf) return ofz_err(ORT_FAIL, "ortfuse: out of memory");
  s = ofz_ort.GetSessionConfigEntry(options, OFZ_CONFIG_KEY, buf, &size);
  if (s) {
    free(buf);
    return s;
  }
  *out = buf;
  return NULL;
}

__attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                    const OrtApiBase* base) {
  const OrtApi* api = base->GetApi(OFZ_ORT_API_VERSION);
  if (!api) {  // API 1 still has CreateStatus (slot 0): say why instead of failing silently
    const OrtApi* v1 = base->GetApi(1);
    if (!v1) return NULL;
    OrtStatus* (*create)(int, const char*) = (OrtStatus * (*)(int, const char*))((void (*const*)(void))v1)[0];
    char msg[200];
    snprintf(msg, sizeof msg, "ortfuse: ONNX Runtime %s is too old; libortfuse_ops needs ORT >= 1.20 (C API %d)",
             base->GetVersionString(), OFZ_ORT_API_VERSION);
    return create(ORT_FAIL, msg);
  }
  pthread_mutex_lock(&g_lock);
  if (!ofz_ort.CreateStatus) ofz_ort_bind(api);  // one table per process; running kernels read it
  char* list = NULL;
  OrtStatus* s = probe_domain(options);
  if (!s) s = read_config(options, &list);
  if (!s && list) s = fused_domain(options, list);
  free(list);
  pthread_mutex_unlock(&g_lock);
  return s;
}
