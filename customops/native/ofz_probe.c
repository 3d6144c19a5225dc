// CPU-EP probe ops in domain `ortfuse.probe`. They exist so that every ORT ABI slot the library uses is
// observable from Python on a machine without a GPU (tests/runtime/test_probe.py):
//   Probe: attributes of each kind, inputs/outputs/shapes/dtypes, node name, allocator info, errors,
//          shape inference. Outputs: Y = X*alpha + beta, FACTS (int64[PROBE_FACTS]), SUMS (float[4]).
//   Plan:  a fused node (docs/design.md format) run through the same parse/resolve/infer code as the
//          CUDA op, minus CUDA: outputs are zero-filled and one extra int64[PLAN_LEN] output reports
//          the launch [grid, block, smem, chosen cubin cc (0 = PTX), image bytes, units, d0..d15, cluster,
//          then per TMA map (zeros if none) dim0, dim1, stride1, box0, box1, element type] for a device of
//          compute capability `probe_cc` with `probe_sm_count` SMs (optional, 0), then the kernel variant
//          run (0 for a node of one kernel), then 1 if it is a programmatic dependent launch.
#include <stdlib.h>
#include <string.h>

#include "ofz_probe.h"
#include "ofz_spec.h"

#define TRY(expr)            \
  do {                       \
    OrtStatus* st_ = (expr); \
    if (st_) return st_;     \
  } while (0)

enum { PROBE_FACTS = 18, PROBE_SUMS = 4, PLAN_TMA = 6, PLAN_LEN = 6 + OFZ_MAX_DIMS + 1 + PLAN_TMA * OFZ_TMA_MAPS + 2 };

// Index of each fact in Probe's FACTS output; the Python test mirrors this list.
enum {
  F_TAG_LEN, F_INTS_SUM, F_INTS_COUNT, F_CTX_INPUTS, F_CTX_OUTPUTS, F_INFO_INPUTS, F_INFO_OUTPUTS,
  F_NODE_NAME_LEN, F_DEVICE_ID, F_MEM_IS_CPU, F_LAST_DTYPE, F_LAST_RANK, F_LAST_DIM_SUM, F_LAST_COUNT,
  F_LAST_VALUE_TYPE, F_LAST_INT64_SUM, F_STREAM_IS_NULL, F_TABLE_DTYPE
};

typedef struct ProbeKernel {
  char node[OFZ_NAME_MAX];
  float alpha;
  int64_t beta, fail;
  int64_t facts[PROBE_FACTS];
  float sums[PROBE_SUMS];
} ProbeKernel;

static OrtStatus* probe_info(const OrtKernelInfo* info, ProbeKernel* k) {
  const char* n = k->node;
  TRY(ofz_attr_float(info, n, "alpha", &k->alpha));
  TRY(ofz_attr_int(info, n, "beta", &k->beta));
  int64_t ints[64];
  float floats[64];
  size_t n_ints = 0, n_floats = 0;
  TRY(ofz_attr_ints(info, n, "ints", ints, 64, &n_ints));
  TRY(ofz_attr_floats(info, n, "floats", floats, 64, &n_floats));
  for (size_t i = 0; i < n_ints; ++i) k->facts[F_INTS_SUM] += ints[i];
  k->facts[F_INTS_COUNT] = (int64_t)n_ints;
  for (size_t i = 0; i < n_floats; ++i) k->sums[0] += floats[i];
  k->sums[2] = (float)n_floats;
  k->sums[3] = k->alpha;
  char tag[256];
  TRY(ofz_attr_string(info, n, "tag", tag, sizeof tag));
  k->facts[F_TAG_LEN] = (int64_t)strlen(tag);

  OrtValue* table = NULL;
  void* data = NULL;
  int dtype = 0;
  size_t count = 0;
  TRY(ofz_attr_tensor(info, n, "table", &table, &data, &dtype, &count));
  k->facts[F_TABLE_DTYPE] = dtype;
  for (size_t i = 0; i < count; ++i) {
    if (dtype == OFZ_DT_FLOAT) k->sums[1] += ((const float*)data)[i];
    if (dtype == OFZ_DT_INT64) k->sums[1] += (float)((const int64_t*)data)[i];
  }
  ofz_ort.ReleaseValue(table);

  size_t ins = 0, outs = 0;
  TRY(ofz_ort.KernelInfo_GetInputCount(info, &ins));
  TRY(ofz_ort.KernelInfo_GetOutputCount(info, &outs));
  k->facts[F_INFO_INPUTS] = (int64_t)ins;
  k->facts[F_INFO_OUTPUTS] = (int64_t)outs;
  k->facts[F_NODE_NAME_LEN] = (int64_t)strlen(k->node);

  OrtAllocator* alloc = NULL;  // the same route the CUDA op takes to find its device
  const OrtMemoryInfo* mem = NULL;
  const char* mem_name = NULL;
  int id = -1;
  TRY(ofz_ort.KernelInfoGetAllocator(info, ORT_MEM_DEFAULT, &alloc));
  OrtStatus* s = ofz_ort.AllocatorGetInfo(alloc, &mem);
  if (!s) s = ofz_ort.MemoryInfoGetId(mem, &id);
  if (!s) s = ofz_ort.MemoryInfoGetName(mem, &mem_name);
  ofz_ort.ReleaseAllocator(alloc);
  if (s) return s;
  k->facts[F_DEVICE_ID] = id;
  k->facts[F_MEM_IS_CPU] = mem_name && strcmp(mem_name, "Cpu") == 0;
  return NULL;
}

static OrtStatus* probe_create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  ProbeKernel* k = calloc(1, sizeof *k);
  if (!k) return ofz_err(ORT_FAIL, "probe: out of memory");
  ofz_node_name(info, k->node, sizeof k->node);
  OrtStatus* s = NULL;
  if (ofz_attr_int_or(info, "fail_create", 0))
    s = ofz_err(ORT_INVALID_ARGUMENT, "probe: node '%s' refused creation (fail_create=1)", k->node);
  if (!s) s = probe_info(info, k);
  if (s) {
    free(k);
    return s;
  }
  k->fail = ofz_attr_int_or(info, "fail", 0);
  *out = k;
  return NULL;
}

// Facts about the last input: dtype, rank, dims, element count, value type, int64 sum.
static OrtStatus* last_input_facts(OrtKernelContext* ctx, size_t idx, int64_t* f) {
  const OrtValue* v = NULL;
  TRY(ofz_ort.KernelContext_GetInput(ctx, idx, &v));
  int vtype = 0, dtype = 0;
  TRY(ofz_ort.GetValueType(v, &vtype));
  OrtTSI* tsi = NULL;
  TRY(ofz_ort.GetTensorTypeAndShape(v, &tsi));
  size_t rank = 0, count = 0;
  int64_t dims[64];
  OrtStatus* s = ofz_ort.GetTensorElementType(tsi, &dtype);
  if (!s) s = ofz_ort.GetDimensionsCount(tsi, &rank);
  if (!s && rank <= 64) s = ofz_ort.GetDimensions(tsi, dims, rank);
  if (!s) s = ofz_ort.GetTensorShapeElementCount(tsi, &count);
  ofz_ort.ReleaseTSI(tsi);
  if (s) return s;
  f[F_LAST_VALUE_TYPE] = vtype;
  f[F_LAST_DTYPE] = dtype;
  f[F_LAST_RANK] = (int64_t)rank;
  f[F_LAST_COUNT] = (int64_t)count;
  for (size_t i = 0; i < rank && i < 64; ++i) f[F_LAST_DIM_SUM] += dims[i];
  if (dtype == OFZ_DT_INT64) {
    void* p = NULL;
    TRY(ofz_ort.GetTensorMutableData((OrtValue*)v, &p));
    for (size_t i = 0; i < count; ++i) f[F_LAST_INT64_SUM] += ((const int64_t*)p)[i];
  }
  return NULL;
}

static OrtStatus* new_output(OrtKernelContext* ctx, size_t i, const int64_t* dims, size_t rank, void** data) {
  OrtValue* v = NULL;
  TRY(ofz_ort.KernelContext_GetOutput(ctx, i, dims, rank, &v));
  return ofz_ort.GetTensorMutableData(v, data);
}

static OrtStatus* probe_compute(void* kernel, OrtKernelContext* ctx) {
  ProbeKernel* k = kernel;
  if (k->fail) return ofz_err(ORT_FAIL, "probe: node '%s' failed on request (fail=1)", k->node);
  int64_t facts[PROBE_FACTS];
  memcpy(facts, k->facts, sizeof facts);
  size_t ins = 0, outs = 0;
  TRY(ofz_ort.KernelContext_GetInputCount(ctx, &ins));
  TRY(ofz_ort.KernelContext_GetOutputCount(ctx, &outs));
  facts[F_CTX_INPUTS] = (int64_t)ins;
  facts[F_CTX_OUTPUTS] = (int64_t)outs;
  if (outs != 3) return ofz_err(ORT_INVALID_ARGUMENT, "probe: node '%s' needs 3 outputs, has %zu", k->node, outs);
  void* stream = (void*)1;
  TRY(ofz_ort.KernelContext_GetGPUComputeStream(ctx, &stream));
  facts[F_STREAM_IS_NULL] = stream == NULL;
  TRY(last_input_facts(ctx, ins - 1, facts));

  const OrtValue* x = NULL;  // Y = X * alpha + beta over input 0 (float)
  TRY(ofz_ort.KernelContext_GetInput(ctx, 0, &x));
  OrtTSI* tsi = NULL;
  TRY(ofz_ort.GetTensorTypeAndShape(x, &tsi));
  int dtype = 0;
  size_t rank = 0, count = 0;
  int64_t dims[64];
  OrtStatus* s = ofz_ort.GetTensorElementType(tsi, &dtype);
  if (!s) s = ofz_ort.GetDimensionsCount(tsi, &rank);
  if (!s && rank <= 64) s = ofz_ort.GetDimensions(tsi, dims, rank);
  if (!s) s = ofz_ort.GetTensorShapeElementCount(tsi, &count);
  ofz_ort.ReleaseTSI(tsi);
  if (s) return s;
  if (dtype != OFZ_DT_FLOAT || rank > 64)
    return ofz_err(ORT_INVALID_ARGUMENT, "probe: node '%s': input 0 must be float of rank <= 64", k->node);
  void *xp = NULL, *yp = NULL, *fp = NULL, *sp = NULL;
  TRY(ofz_ort.GetTensorMutableData((OrtValue*)x, &xp));
  TRY(new_output(ctx, 0, dims, rank, &yp));
  for (size_t i = 0; i < count; ++i) ((float*)yp)[i] = ((const float*)xp)[i] * k->alpha + (float)k->beta;
  const int64_t nf = PROBE_FACTS, ns = PROBE_SUMS;
  TRY(new_output(ctx, 1, &nf, 1, &fp));
  memcpy(fp, facts, sizeof facts);
  TRY(new_output(ctx, 2, &ns, 1, &sp));
  memcpy(sp, k->sums, sizeof k->sums);
  return NULL;
}

static OrtStatus* probe_infer(const OrtCustomOp* op, OrtShapeInferContext* ctx) {
  (void)op;
  const OrtOpAttr* attr = NULL;
  int64_t fail = 0;
  size_t got = 0;
  OrtStatus* s = ofz_ort.ShapeInferContext_GetAttribute(ctx, "fail_infer", &attr);
  if (s) ofz_ort.ReleaseStatus(s);
  else if (attr) TRY(ofz_ort.ReadOpAttr(attr, ORT_ATTR_INT, &fail, sizeof fail, &got));
  if (fail) return ofz_err(ORT_INVALID_GRAPH, "probe: shape inference failed on request (fail_infer=1)");

  size_t n_in = 0, rank = 0;
  TRY(ofz_ort.ShapeInferContext_GetInputCount(ctx, &n_in));
  OrtTSI* in = NULL;  // owned by the context
  TRY(ofz_ort.ShapeInferContext_GetInputTypeShape(ctx, 0, &in));
  TRY(ofz_ort.GetDimensionsCount(in, &rank));
  if (rank > 64) return ofz_err(ORT_INVALID_ARGUMENT, "probe: input rank %zu > 64", rank);
  int64_t dims[64];
  const char* names[64];
  TRY(ofz_ort.GetDimensions(in, dims, rank));
  TRY(ofz_ort.GetSymbolicDimensions(in, names, rank));
  // Output 0 copies input 0 (values and symbols); outputs 1 and 2 are fixed-size vectors.
  const int64_t nf = PROBE_FACTS, ns = PROBE_SUMS;
  for (size_t o = 0; o < 3; ++o) {
    OrtTSI* t = NULL;
    TRY(ofz_ort.CreateTSI(&t));
    s = ofz_ort.SetTensorElementType(t, o == 1 ? OFZ_DT_INT64 : OFZ_DT_FLOAT);
    if (!s) s = o == 0 ? ofz_ort.SetDimensions(t, dims, rank) : ofz_ort.SetDimensions(t, o == 1 ? &nf : &ns, 1);
    if (!s && o == 0) s = ofz_ort.SetSymbolicDimensions(t, names, rank);
    if (!s) s = ofz_ort.ShapeInferContext_SetOutputTypeShape(ctx, o, t);
    ofz_ort.ReleaseTSI(t);
    if (s) return s;
  }
  return NULL;
}

// ---- Plan ----

typedef struct PlanKernel {
  size_t n_var;
  OfzSpec spec[OFZ_MAX_VARIANTS];
  int64_t chosen_cc[OFZ_MAX_VARIANTS], image_bytes[OFZ_MAX_VARIANTS], sm_count, cc;
} PlanKernel;

static OrtStatus* plan_create(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** out) {
  (void)op;
  (void)api;
  char node[OFZ_NAME_MAX];
  ofz_node_name(info, node, sizeof node);
  size_t ins = 0, outs = 0;
  TRY(ofz_ort.KernelInfo_GetInputCount(info, &ins));
  TRY(ofz_ort.KernelInfo_GetOutputCount(info, &outs));
  if (outs < 2) return ofz_err(ORT_INVALID_ARGUMENT, "probe: Plan node '%s' needs the kernel outputs plus one", node);
  PlanKernel* k = calloc(1, sizeof *k);
  if (!k) return ofz_err(ORT_FAIL, "probe: out of memory");
  int64_t cc = 0;
  void* image = NULL;
  size_t bytes = 0;
  int chosen = 0;
  OrtStatus* s = ofz_spec_parse(info, node, ins, outs - 1, 0, &k->spec[0]);
  k->n_var = s ? 0 : (size_t)k->spec[0].n_variants;
  for (size_t v = 1; v < k->n_var && !s; ++v) s = ofz_spec_parse(info, node, ins, outs - 1, v, &k->spec[v]);
  if (!s) s = ofz_attr_int(info, node, "probe_cc", &cc);
  k->cc = cc;
  if (!s) k->sm_count = ofz_attr_int_or(info, "probe_sm_count", 0);
  for (size_t v = 0; v < k->n_var && !s; ++v) {
    s = ofz_spec_image(info, &k->spec[v], (int)cc, &image, &bytes, &chosen);
    free(image);
    image = NULL;
    k->chosen_cc[v] = chosen;
    k->image_bytes[v] = (int64_t)bytes;
  }
  if (s) {
    free(k);
    return s;
  }
  *out = k;
  return NULL;
}

static OrtStatus* plan_compute(void* kernel, OrtKernelContext* ctx) {
  PlanKernel* k = kernel;
  const OfzSpec* specs[OFZ_MAX_VARIANTS];
  for (size_t i = 0; i < k->n_var; ++i) specs[i] = &k->spec[i];
  size_t v = 0;
  OfzArgs args;
  OfzLaunch launch;
  TRY(ofz_spec_resolve(specs, ctx, (int)k->sm_count, &args, &launch, &v));
  const OfzSpec* s = specs[v];
  const int64_t* od = s->out_dims;  // zero-fill the kernel outputs
  for (size_t o = 0; o < s->n_out; ++o) {
    size_t count = 1;
    for (int64_t j = 0; j < s->out_ranks[o]; ++j, ++od) count *= (size_t)(*od >= 0 ? *od : args.dim[-(*od + 1)]);
    if (count) memset(args.ptr[s->n_in + o], 0, count * ofz_dtype_size((int)s->out_dtypes[o]));
  }
  const int64_t n = PLAN_LEN;
  int64_t* rep = NULL;
  TRY(new_output(ctx, s->n_out, &n, 1, (void**)&rep));
  int64_t head[6] = {launch.grid, launch.block, launch.smem, k->chosen_cc[v], k->image_bytes[v], launch.units};
  memcpy(rep, head, sizeof head);
  for (int d = 0; d < OFZ_MAX_DIMS; ++d) rep[6 + d] = args.dim[d];
  rep[6 + OFZ_MAX_DIMS] = launch.cluster;
  int64_t* tma = rep + 7 + OFZ_MAX_DIMS;
  memset(tma, 0, sizeof(int64_t) * PLAN_TMA * OFZ_TMA_MAPS);
  rep[PLAN_LEN - 2] = (int64_t)v;
  rep[PLAN_LEN - 1] = ofz_spec_pdl(s, (int)k->cc, 1);  // as a CUDA 12+ driver would launch it
  if (s->n_tma && launch.grid) {
    OfzTmaGeom geo[OFZ_TMA_MAPS];
    TRY(ofz_spec_tma(s, ctx, &args, geo));
    for (size_t j = 0; j < s->n_tma; ++j) {
      const int64_t g[PLAN_TMA] = {(int64_t)geo[j].dim0, (int64_t)geo[j].dim1, (int64_t)geo[j].stride1, geo[j].box0,
                                   geo[j].box1, geo[j].elem};
      memcpy(tma + PLAN_TMA * j, g, sizeof g);
    }
  }
  return NULL;
}

static OrtStatus* plan_infer(const OrtCustomOp* op, OrtShapeInferContext* ctx) {
  (void)op;
  return ofz_spec_infer(ctx, 1, PLAN_LEN);
}

static OfzOp g_probe, g_plan;

void ofz_probe_ops(const OrtCustomOp** probe, const OrtCustomOp** plan) {
  ofz_op_init(&g_probe, "Probe", "CPUExecutionProvider", probe_create, probe_compute, free, probe_infer);
  ofz_op_init(&g_plan, "Plan", "CPUExecutionProvider", plan_create, plan_compute, free, plan_infer);
  *probe = &g_probe.base;
  *plan = &g_plan.base;
}
