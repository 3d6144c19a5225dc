#include "ofz_spec.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define BAD(...) ofz_err(ORT_INVALID_ARGUMENT, __VA_ARGS__)
#define TRY(expr)                    \
  do {                               \
    OrtStatus* st_ = (expr);         \
    if (st_) return st_;             \
  } while (0)

// A term is a constant (t >= 0) or the runtime dim d[-t-1]: bound (sym_dims), derived (sym_derived) or a sum
// (sym_sums), in that order.
static OrtStatus* check_terms_below(const OfzSpec* s, const char* what, const int64_t* t, size_t n, size_t dims) {
  for (size_t i = 0; i < n; ++i)
    if (t[i] < 0 && (size_t)(-(t[i] + 1)) >= dims)
      return BAD("ortfuse: node '%s': %s[%zu] = %lld names runtime dim %lld but only %zu are defined before it",
                 s->node, what, i, (long long)t[i], (long long)(-(t[i] + 1)), dims);
  return NULL;
}

static OrtStatus* check_terms(const OfzSpec* s, const char* what, const int64_t* t, size_t n) {
  return check_terms_below(s, what, t, n, s->n_sym + s->n_derived + s->n_sums);
}

// Groups (count, terms..., value) with count >= 1 terms and a value >= 1 (units_ceil, dim_limits).
static OrtStatus* check_groups(const OfzSpec* s, const char* what, const char* value, const int64_t* g, size_t n) {
  for (size_t k = 0; k < n;) {
    const int64_t count = g[k];
    if (count < 1 || k + (size_t)count + 2 > n)
      return BAD("ortfuse: node '%s': %s group at %zu has count %lld but %zu values follow", s->node, what, k,
                 (long long)count, n - k - 1);
    TRY(check_terms(s, what, &g[k + 1], (size_t)count));
    if (g[k + 1 + count] < 1)
      return BAD("ortfuse: node '%s': %s %s at %zu = %lld, expected >= 1", s->node, what, value,
                 k + 1 + (size_t)count, (long long)g[k + 1 + count]);
    k += (size_t)count + 2;
  }
  return NULL;
}

// A variant's own attribute: `name` for variant 0, `name@v` for variant v.
static const char* vname(const OfzSpec* s, const char* name, char* buf, size_t cap) {
  snprintf(buf, cap, "%s%s", name, s->sfx);
  return buf;
}
#define V(name) vname(s, name, nb, sizeof nb)

OrtStatus* ofz_spec_parse(const OrtKernelInfo* info, const char* node, size_t n_in, size_t n_out, size_t variant,
                          OfzSpec* s) {
  memset(s, 0, sizeof *s);
  snprintf(s->node, sizeof s->node, "%s", node);
  if (variant >= OFZ_MAX_VARIANTS) return BAD("ortfuse: node '%s': kernel variant %zu of at most %d", node, variant,
                                              OFZ_MAX_VARIANTS);
  if (variant) s->sfx[0] = '@', s->sfx[1] = (char)('0' + variant);  // OFZ_MAX_VARIANTS < 10
  char nb[64];
  s->n_in = n_in;
  s->n_out = n_out;
  if (n_in + n_out > OFZ_MAX_TENSORS)
    return BAD("ortfuse: node '%s' has %zu inputs and %zu outputs; the kernel ABI allows at most %d tensors", node,
               n_in, n_out, OFZ_MAX_TENSORS);
  int64_t version = 0;
  TRY(ofz_attr_int(info, node, "ortfuse_version", &version));
  if (version < 1 || version > OFZ_NODE_VERSION)
    return BAD("ortfuse: node '%s' has ortfuse_version %lld; this library reads versions 1 to %d (rebuild the "
               "model or the library)", node, (long long)version, OFZ_NODE_VERSION);
  TRY(ofz_attr_string(info, node, V("entry"), s->entry, sizeof s->entry));
  if (!s->entry[0]) return BAD("ortfuse: node '%s': attribute '%s' is empty", node, V("entry"));
  TRY(ofz_attr_ints(info, node, V("cubin_archs"), s->archs, OFZ_MAX_ARCHS, &s->n_archs));
  for (size_t i = 0; i < s->n_archs; ++i)
    if (s->archs[i] < 10 || s->archs[i] > 999)
      return BAD("ortfuse: node '%s': cubin_archs[%zu] = %lld is not a compute capability", node, i,
                 (long long)s->archs[i]);
  TRY(ofz_attr_int(info, node, V("block"), &s->block));
  TRY(ofz_attr_int(info, node, V("smem"), &s->smem));
  TRY(ofz_attr_int(info, node, V("units_per_block"), &s->units_per_block));
  if (s->block < 1 || s->block > 1024) return BAD("ortfuse: node '%s': block = %lld, expected 1..1024",
                                                  node, (long long)s->block);
  if (s->smem < 0 || s->smem > (1 << 30)) return BAD("ortfuse: node '%s': smem = %lld bytes is out of range",
                                                     node, (long long)s->smem);
  if (s->units_per_block < 1) return BAD("ortfuse: node '%s': units_per_block = %lld, expected >= 1",
                                         node, (long long)s->units_per_block);
  s->split_k = ofz_attr_int_or(info, V("split_k"), 1);
  if (s->split_k < 1 || s->split_k > OFZ_MAX_CLUSTER)
    return BAD("ortfuse: node '%s': split_k = %lld, expected 1..%d", node, (long long)s->split_k, OFZ_MAX_CLUSTER);
  s->row_cluster = ofz_attr_int_or(info, V("row_cluster"), 1);
  if (s->row_cluster < 1 || s->row_cluster > OFZ_MAX_CLUSTER || (s->row_cluster > 1 && s->split_k > 1))
    return BAD("ortfuse: node '%s': row_cluster = %lld, expected 1..%d (and no split_k)", node,
               (long long)s->row_cluster, OFZ_MAX_CLUSTER);
  s->multicast = ofz_attr_int_or(info, V("multicast"), 1);
  if (s->multicast < 1 || s->multicast > OFZ_MAX_CLUSTER || (s->multicast > 1 && (s->split_k > 1 || s->row_cluster > 1)))
    return BAD("ortfuse: node '%s': multicast = %lld, expected 1..%d (and neither split_k nor row_cluster)", node,
               (long long)s->multicast, OFZ_MAX_CLUSTER);
  s->pdl = ofz_attr_int_or(info, V("pdl"), 0);
  if (s->pdl != 0 && s->pdl != 1)
    return BAD("ortfuse: node '%s': pdl = %lld, expected 0 or 1", node, (long long)s->pdl);
  s->blocks_per_sm = ofz_attr_int_or(info, V("blocks_per_sm"), 0);
  if (s->blocks_per_sm < 0 || s->blocks_per_sm > 32)
    return BAD("ortfuse: node '%s': blocks_per_sm = %lld, expected 0..32", node, (long long)s->blocks_per_sm);

  size_t n_sym2 = 0;
  TRY(ofz_attr_ints(info, node, "sym_dims", s->sym, 2 * OFZ_MAX_DIMS, &n_sym2));
  if (n_sym2 % 2) return BAD("ortfuse: node '%s': sym_dims has odd length %zu (expected (input, axis) pairs)",
                             node, n_sym2);
  s->n_sym = n_sym2 / 2;
  for (size_t k = 0; k < s->n_sym; ++k)
    if (s->sym[2 * k] < 0 || (size_t)s->sym[2 * k] >= n_in || s->sym[2 * k + 1] < 0)
      return BAD("ortfuse: node '%s': sym_dims pair %zu = (%lld, %lld) does not name an input axis (%zu inputs)", node,
                 k, (long long)s->sym[2 * k], (long long)s->sym[2 * k + 1], n_in);
  size_t n_der3 = 0;
  TRY(ofz_attr_ints_opt(info, node, "sym_derived", s->derived, 3 * OFZ_MAX_DIMS, &n_der3));
  if (n_der3 % 3)
    return BAD("ortfuse: node '%s': sym_derived has length %zu (expected (term, add, div) triples)", node, n_der3);
  s->n_derived = n_der3 / 3;
  if (s->n_sym + s->n_derived > OFZ_MAX_DIMS)
    return BAD("ortfuse: node '%s': %zu runtime dims; the kernel ABI allows at most %d", node,
               s->n_sym + s->n_derived, OFZ_MAX_DIMS);
  for (size_t j = 0; j < s->n_derived; ++j) {  // each reads a dim defined before it
    TRY(check_terms_below(s, "sym_derived", &s->derived[3 * j], 1, s->n_sym + j));
    if (s->derived[3 * j + 2] < 1)
      return BAD("ortfuse: node '%s': sym_derived rule %zu has divisor %lld, expected >= 1", node, j,
                 (long long)s->derived[3 * j + 2]);
  }
  size_t n_sum2 = 0;
  TRY(ofz_attr_ints_opt(info, node, "sym_sums", s->sums, 2 * OFZ_MAX_DIMS, &n_sum2));
  if (n_sum2 % 2) return BAD("ortfuse: node '%s': sym_sums has odd length %zu (expected (term, term) pairs)", node,
                             n_sum2);
  s->n_sums = n_sum2 / 2;
  if (s->n_sym + s->n_derived + s->n_sums > OFZ_MAX_DIMS)
    return BAD("ortfuse: node '%s': %zu runtime dims; the kernel ABI allows at most %d", node,
               s->n_sym + s->n_derived + s->n_sums, OFZ_MAX_DIMS);
  for (size_t j = 0; j < s->n_sums; ++j)  // each reads dims defined before it
    TRY(check_terms_below(s, "sym_sums", &s->sums[2 * j], 2, s->n_sym + s->n_derived + j));
  int64_t prods[OFZ_MAX_DIMS];
  size_t n_prods = 0;
  TRY(ofz_attr_ints_opt(info, node, "sym_products", prods, OFZ_MAX_DIMS, &n_prods));
  if (n_prods && version < 2)
    return BAD("ortfuse: node '%s': sym_products needs ortfuse_version 2, the node has %lld", node, (long long)version);
  for (size_t k = 0; k < n_prods; ++k) {
    if (prods[k] < 0 || (size_t)prods[k] >= s->n_sums)
      return BAD("ortfuse: node '%s': sym_products[%zu] = %lld names no sym_sums rule (%zu rules)", node, k,
                 (long long)prods[k], s->n_sums);
    s->product[prods[k]] = 1;
  }
  TRY(ofz_attr_ints(info, node, V("units"), s->units, OFZ_MAX_TERMS, &s->n_units));
  TRY(check_terms(s, "units", s->units, s->n_units));
  TRY(ofz_attr_ints_opt(info, node, V("units_ceil"), s->units_ceil, OFZ_MAX_TERMS, &s->n_ceil));
  TRY(check_groups(s, "units_ceil", "divisor", s->units_ceil, s->n_ceil));
  TRY(ofz_attr_ints_opt(info, node, V("dim_limits"), s->dim_limits, OFZ_MAX_TERMS, &s->n_limits));
  TRY(check_groups(s, "dim_limits", "limit", s->dim_limits, s->n_limits));

  size_t n_chk3 = 0;
  TRY(ofz_attr_ints_opt(info, node, "dim_checks", s->dim_checks, 3 * OFZ_MAX_TERMS, &n_chk3));
  if (n_chk3 % 3)
    return BAD("ortfuse: node '%s': dim_checks has length %zu (expected (input, axis, dim) triples)", node, n_chk3);
  s->n_checks = n_chk3 / 3;
  for (size_t j = 0; j < s->n_checks; ++j) {
    const int64_t* c = &s->dim_checks[3 * j];
    if (c[0] < 0 || (size_t)c[0] >= n_in || c[1] < 0 || c[1] >= 64 ||
        (c[2] < 0 && (size_t)(-(c[2] + 1)) >= s->n_sym + s->n_derived + s->n_sums))
      return BAD("ortfuse: node '%s': dim_checks triple %zu = (%lld, %lld, %lld) does not name an input axis and a "
                 "size or runtime dim", node, j, (long long)c[0], (long long)c[1], (long long)c[2]);
  }

  TRY(ofz_attr_ints_opt(info, node, V("arg_align"), s->align, OFZ_MAX_TENSORS, &s->n_align));
  if (s->n_align && s->n_align != n_in + n_out)
    return BAD("ortfuse: node '%s': arg_align has %zu entries, expected one per input and output (%zu)", node,
               s->n_align, n_in + n_out);
  for (size_t i = 0; i < s->n_align; ++i)
    if (s->align[i] < 1 || s->align[i] > 256 || (s->align[i] & (s->align[i] - 1)))
      return BAD("ortfuse: node '%s': arg_align[%zu] = %lld, expected a power of two in 1..256", node, i,
                 (long long)s->align[i]);

  size_t n_tma3 = 0;
  TRY(ofz_attr_ints_opt(info, node, V("tma"), s->tma, 3 * OFZ_TMA_MAPS, &n_tma3));
  if (n_tma3 != 0 && n_tma3 != 3 * OFZ_TMA_MAPS)
    return BAD("ortfuse: node '%s': tma has %zu entries, expected %d (input, box rows, element type) triples", node,
               n_tma3, OFZ_TMA_MAPS);
  s->n_tma = n_tma3 / 3;
  for (size_t j = 0; j < s->n_tma; ++j) {
    const int64_t* t = &s->tma[3 * j];
    if (t[0] < 0 || (size_t)t[0] >= n_in || t[1] < 1 || t[1] > 256 || (t[2] != OFZ_DT_FLOAT16 && t[2] != OFZ_DT_BFLOAT16))
      return BAD("ortfuse: node '%s': tma triple %zu = (%lld, %lld, %lld) is not (an input, 1..256 box rows, fp16 or "
                 "bf16)", node, j, (long long)t[0], (long long)t[1], (long long)t[2]);
  }

  size_t n_dt = 0, n_rk = 0;
  TRY(ofz_attr_ints(info, node, "out_dtypes", s->out_dtypes, OFZ_MAX_TENSORS, &n_dt));
  TRY(ofz_attr_ints(info, node, "out_ranks", s->out_ranks, OFZ_MAX_TENSORS, &n_rk));
  TRY(ofz_attr_ints(info, node, "out_dims", s->out_dims, OFZ_MAX_OUT_DIMS, &s->n_out_dims));
  if (n_dt != n_out || n_rk != n_out)
    return BAD("ortfuse: node '%s' has %zu outputs but out_dtypes has %zu and out_ranks %zu entries", node, n_out,
               n_dt, n_rk);
  size_t total = 0;
  for (size_t k = 0; k < n_out; ++k) {
    if (ofz_dtype_size((int)s->out_dtypes[k]) == 0)
      return BAD("ortfuse: node '%s': out_dtypes[%zu] = %lld is not a supported tensor type",
                 node, k, (long long)s->out_dtypes[k]);
    if (s->out_ranks[k] < 0 || s->out_ranks[k] > OFZ_MAX_DIMS)
      return BAD("ortfuse: node '%s': out_ranks[%zu] = %lld, expected 0..%d",
                 node, k, (long long)s->out_ranks[k], OFZ_MAX_DIMS);
    total += (size_t)s->out_ranks[k];
  }
  if (total != s->n_out_dims)
    return BAD("ortfuse: node '%s': out_dims has %zu entries but out_ranks sum to %zu", node, s->n_out_dims, total);
  TRY(check_terms(s, "out_dims", s->out_dims, s->n_out_dims));
  if (variant) return NULL;
  // kernel variants by size: variant v runs where the product of variant_rows reaches variant_from[v - 1]
  s->n_variants = ofz_attr_int_or(info, "variants", 1);
  if (s->n_variants < 1 || s->n_variants > OFZ_MAX_VARIANTS)
    return BAD("ortfuse: node '%s': variants = %lld, expected 1..%d", node, (long long)s->n_variants, OFZ_MAX_VARIANTS);
  if (s->n_variants == 1) return NULL;
  size_t n_from = 0;
  TRY(ofz_attr_ints(info, node, "variant_rows", s->var_rows, OFZ_MAX_DIMS, &s->n_var_rows));
  TRY(check_terms_below(s, "variant_rows", s->var_rows, s->n_var_rows, s->n_sym));  // bound before any kernel runs
  TRY(ofz_attr_ints(info, node, "variant_from", s->var_from, OFZ_MAX_VARIANTS, &n_from));
  if (n_from != (size_t)s->n_variants - 1)
    return BAD("ortfuse: node '%s': variant_from has %zu entries, expected %lld (one per variant after the first)",
               node, n_from, (long long)s->n_variants - 1);
  for (size_t v = 0; v < n_from; ++v)
    if (s->var_from[v] < 1 || (v && s->var_from[v] <= s->var_from[v - 1]))
      return BAD("ortfuse: node '%s': variant_from must rise from 1 (entry %zu is %lld)", node, v,
                 (long long)s->var_from[v]);
  return NULL;
}
#undef V

OrtStatus* ofz_spec_image(const OrtKernelInfo* info, const OfzSpec* s, int cc, void** image, size_t* bytes,
                          int* chosen_cc) {
  int best = 0;
  for (size_t i = 0; i < s->n_archs; ++i) {
    int a = (int)s->archs[i];
    if (a == cc || (a / 10 == cc / 10 && a < cc && a > best)) best = a;
    if (a == cc) break;
  }
  char name[48];
  if (best) snprintf(name, sizeof name, "cubin_%d%s", best, s->sfx);
  else snprintf(name, sizeof name, "ptx%s", s->sfx);
  OrtValue* value = NULL;
  void* data = NULL;
  int dtype = 0;
  size_t count = 0;
  TRY(ofz_attr_tensor(info, s->node, name, &value, &data, &dtype, &count));
  OrtStatus* st = NULL;
  if (dtype != OFZ_DT_UINT8 || count == 0)
    st = BAD("ortfuse: node '%s': attribute '%s' must be a non-empty uint8 tensor (got type %d, %zu elements)",
             s->node, name, dtype, count);
  else if (!(*image = malloc(count + 1)))
    st = ofz_err(ORT_FAIL, "ortfuse: node '%s': out of host memory for '%s'", s->node, name);
  else {
    memcpy(*image, data, count);
    ((char*)*image)[count] = '\0';
    *bytes = count;
    *chosen_cc = best;
  }
  ofz_ort.ReleaseValue(value);
  return st;
}

static int64_t term(int64_t t, const OfzArgs* a) { return t >= 0 ? t : (int64_t)a->dim[-(t + 1)]; }

// The kernel reads or writes argument i in vectors: a misaligned address (a buffer a user bound through
// IOBinding at an offset) would fault on the GPU, so it is refused here.
static OrtStatus* check_aligned(const OfzSpec* s, size_t i, const void* p) {
  if (i >= s->n_align || ((uintptr_t)p & (uintptr_t)(s->align[i] - 1)) == 0) return NULL;
  const int out = i >= s->n_in;
  return BAD("ortfuse: node '%s': %s %zu is at address %p, which is not %lld-byte aligned; this kernel accesses it "
             "in %lld-byte vectors (bind buffers at aligned addresses)", s->node, out ? "output" : "input",
             out ? i - s->n_in : i, p, (long long)s->align[i], (long long)s->align[i]);
}

unsigned ofz_spec_cluster(int64_t split_k, long long grid, int sm_count) {
  unsigned c = 1;
  while (grid > 0 && 2 * (int64_t)c <= split_k && grid * 2 * (long long)c <= (long long)sm_count) c *= 2;
  return c;
}

int ofz_spec_pdl(const OfzSpec* s, int cc, int has_launch_ex) { return s->pdl && cc >= 90 && has_launch_ex; }

// Input i's dims (at most 64).
static OrtStatus* input_dims(OrtKernelContext* ctx, size_t i, int64_t* dims, size_t* rank) {
  const OrtValue* v = NULL;
  TRY(ofz_ort.KernelContext_GetInput(ctx, i, &v));
  OrtTSI* tsi = NULL;
  TRY(ofz_ort.GetTensorTypeAndShape(v, &tsi));
  OrtStatus* st = ofz_ort.GetDimensionsCount(tsi, rank);
  if (!st && *rank <= 64) st = ofz_ort.GetDimensions(tsi, dims, *rank);
  ofz_ort.ReleaseTSI(tsi);
  if (!st && *rank > 64) return BAD("ortfuse: input %zu has rank %zu; at most 64 is supported", i, *rank);
  return st;
}

// Binds the symbolic dims from the input shapes into args->dim; `dims`/`rank` keep the last input queried
// (`have`), so a caller reading the same input's shape again need not ask ORT twice.
static OrtStatus* bind_dims(const OfzSpec* s, OrtKernelContext* ctx, OfzArgs* args, int64_t* dims, size_t* rank_out,
                            size_t* have_out) {
  size_t rank = 0, have = SIZE_MAX;
  for (size_t k = 0; k < s->n_sym; ++k) {  // bind symbolic dims from input shapes
    if ((size_t)s->sym[2 * k] != have) {  // one shape query per input: its dims are listed together
      have = (size_t)s->sym[2 * k];
      TRY(input_dims(ctx, have, dims, &rank));
    }
    size_t axis = (size_t)s->sym[2 * k + 1];
    if (axis >= rank || rank > 64)
      return BAD("ortfuse: node '%s': symbolic dim %zu reads axis %zu of input %lld, which has rank %zu", s->node, k,
                 axis, (long long)s->sym[2 * k], rank);
    if (dims[axis] < 0)
      return BAD("ortfuse: node '%s': input %lld has negative dim %lld",
                 s->node, (long long)s->sym[2 * k], (long long)dims[axis]);
    args->dim[k] = dims[axis];
  }
  *rank_out = rank;
  *have_out = have;
  return NULL;
}

// The kernel variant to run from the bound dims (variant 0's spec holds the rule): the last v whose
// variant_from[v - 1] the product of variant_rows reaches; 0 for a node of one kernel.
static size_t pick(const OfzSpec* s, const OfzArgs* args) {
  size_t v = 0;
  if (s->n_variants <= 1) return v;
  long long rows = 1;
  for (size_t i = 0; i < s->n_var_rows; ++i) {
    const int64_t t = term(s->var_rows[i], args);
    rows = t != 0 && rows > (1LL << 62) / t ? (1LL << 62) : rows * t;
  }
  while (v + 1 < (size_t)s->n_variants && rows >= s->var_from[v]) ++v;
  return v;
}

OrtStatus* ofz_spec_resolve(const OfzSpec* const* specs, OrtKernelContext* ctx, int sm_count, OfzArgs* args,
                            OfzLaunch* launch, size_t* variant) {
  const OfzSpec* s = specs[0];  // the node's shapes and rule, shared by its variants
  size_t n_in = 0, n_out = 0;
  TRY(ofz_ort.KernelContext_GetInputCount(ctx, &n_in));
  TRY(ofz_ort.KernelContext_GetOutputCount(ctx, &n_out));
  if (n_in != s->n_in || n_out < s->n_out)
    return BAD("ortfuse: node '%s': got %zu inputs and %zu outputs at run time, expected %zu and %zu", s->node, n_in,
               n_out, s->n_in, s->n_out);
  memset(args, 0, sizeof *args);
  for (size_t i = 0; i < n_in; ++i) {
    const OrtValue* v = NULL;
    TRY(ofz_ort.KernelContext_GetInput(ctx, i, &v));
    if (!v) return BAD("ortfuse: node '%s': input %zu is missing", s->node, i);
    TRY(ofz_ort.GetTensorMutableData((OrtValue*)v, &args->ptr[i]));
  }
  size_t rank = 0;
  int64_t dims[64];
  size_t have = SIZE_MAX;  // the input whose dims are in `dims`
  TRY(bind_dims(s, ctx, args, dims, &rank, &have));
  *variant = pick(s, args);
  s = specs[*variant];  // from here on the chosen kernel's own rules (alignment, limits, grid)
  for (size_t i = 0; i < n_in; ++i) TRY(check_aligned(s, i, args->ptr[i]));
  for (size_t j = 0; j < s->n_derived; ++j) {  // a Conv's output size from its input's
    const int64_t* r = &s->derived[3 * j];
    const int64_t size = term(r[0], args);
    if (size + r[1] < 0)
      return BAD("ortfuse: node '%s': an image size of %lld is smaller than a Conv's kernel with its padding (%lld)",
                 s->node, (long long)size, (long long)-r[1]);
    args->dim[s->n_sym + j] = (size + r[1]) / r[2] + 1;
  }
  for (size_t j = 0; j < s->n_sums; ++j) {  // a Concat's span (the sum of its inputs'), or run-time axes flattened
    const int64_t a = term(s->sums[2 * j], args), b = term(s->sums[2 * j + 1], args);
    args->dim[s->n_sym + s->n_derived + j] = s->product[j] ? a * b : a + b;
  }
  for (size_t j = 0; j < s->n_checks; ++j) {  // other inputs with the same symbolic dims, or their sums
    const int64_t* c = &s->dim_checks[3 * j];
    if ((size_t)c[0] != have) {  // triples are grouped by input: one shape query each
      have = (size_t)c[0];
      TRY(input_dims(ctx, have, dims, &rank));
    }
    const int64_t want = term(c[2], args);
    if ((size_t)c[1] >= rank || dims[c[1]] != want) {
      char got[64], from[96];
      if ((size_t)c[1] >= rank) snprintf(got, sizeof got, "rank %zu, no axis %lld", rank, (long long)c[1]);
      else snprintf(got, sizeof got, "size %lld at axis %lld", (long long)dims[c[1]], (long long)c[1]);
      const size_t k = c[2] < 0 ? (size_t)(-(c[2] + 1)) : 0;
      if (c[2] < 0 && k < s->n_sym)
        snprintf(from, sizeof from, "axis %lld of input %lld, which shape inference took for it",
                 (long long)s->sym[2 * k + 1], (long long)s->sym[2 * k]);
      else if (c[2] < 0) snprintf(from, sizeof from, "the spans a Concat joins along it, summed");
      else snprintf(from, sizeof from, "a size shape inference took for it");
      return BAD("ortfuse: node '%s': input %lld has %s, but the kernel was built for %lld there (%s); run the "
                 "original model, or optimize with the input shapes fixed (--input-shape)", s->node,
                 (long long)c[0], got, (long long)want, from);
    }
  }
  for (size_t i = 0; i < s->n_limits;) {  // sizes the kernel was built for: 32-bit index math, sliced tables
    const size_t count = (size_t)s->dim_limits[i];
    const long long limit = s->dim_limits[i + 1 + count];
    long long p = 1;
    for (size_t j = 0; j < count && p < limit; ++j) {  // stops at the limit: no overflow
      const int64_t t = term(s->dim_limits[i + 1 + j], args);
      p = t != 0 && p > limit / t ? limit : p * t;
    }
    if (p >= limit)
      return BAD("ortfuse: node '%s': a size of %lld (or more) exceeds what this kernel was built for (< %lld: an "
                 "image's elements or pixels for its 32-bit gather, or a sequence for a table it slices); fix the "
                 "size when optimizing (--input-shape), or give a shorter input", s->node, p, limit);
    i += count + 2;
  }
  const int64_t* od = s->out_dims;
  for (size_t k = 0; k < s->n_out; ++k) {  // allocate outputs through ORT
    int64_t dims[OFZ_MAX_DIMS];
    size_t rank = (size_t)s->out_ranks[k];
    for (size_t j = 0; j < rank; ++j) dims[j] = term(*od++, args);
    OrtValue* out = NULL;
    TRY(ofz_ort.KernelContext_GetOutput(ctx, k, dims, rank, &out));
    TRY(ofz_ort.GetTensorMutableData(out, &args->ptr[n_in + k]));
    TRY(check_aligned(s, n_in + k, args->ptr[n_in + k]));
  }
  long long units = 1;
  for (size_t i = 0; i < s->n_units; ++i) {
    int64_t t = term(s->units[i], args);
    if (t != 0 && units > (1LL << 62) / t)
      return BAD("ortfuse: node '%s': work size overflows 2^62 units", s->node);
    units *= t;
  }
  for (size_t i = 0; i < s->n_ceil;) {  // tiles: ceil(product of the group's terms / divisor)
    const size_t count = (size_t)s->units_ceil[i];
    long long p = 1;
    for (size_t j = 0; j < count; ++j) {
      int64_t t = term(s->units_ceil[i + 1 + j], args);
      if (t != 0 && p > (1LL << 62) / t) return BAD("ortfuse: node '%s': work size overflows 2^62 units", s->node);
      p *= t;
    }
    const long long tiles = (p + s->units_ceil[i + 1 + count] - 1) / s->units_ceil[i + 1 + count];
    if (tiles != 0 && units > (1LL << 62) / tiles)
      return BAD("ortfuse: node '%s': work size overflows 2^62 units", s->node);
    units *= tiles;
    i += count + 2;
  }
  long long grid = (units + s->units_per_block - 1) / s->units_per_block;
  if (grid > 0x7fffffffLL) grid = 0x7fffffffLL;  // kernels use grid-stride loops
  launch->units = units;
  if (s->row_cluster > 1) {  // a row split across a cluster: the tiles of a row are one cluster's blocks
    if (grid % s->row_cluster)
      return BAD("ortfuse: node '%s': %lld blocks do not form clusters of %lld", s->node, grid,
                 (long long)s->row_cluster);
    launch->cluster = (unsigned)s->row_cluster;
    launch->grid = (unsigned)grid;
  } else {
    // a unit is one cluster's work: a split-K tile (clusters only within one wave of SMs) or a B-multicast
    // group of tiles (always clusters of `multicast`); a persistent kernel caps the grid at blocks_per_sm per
    // SM in whole clusters, each looping over units (grid-stride)
    launch->cluster = s->multicast > 1 ? (unsigned)s->multicast : ofz_spec_cluster(s->split_k, grid, sm_count);
    if (s->blocks_per_sm > 0 && sm_count > 0 && (launch->cluster == 1 || s->multicast > 1)) {
      long long cap = s->blocks_per_sm * (long long)sm_count / launch->cluster;
      if (cap < 1) cap = 1;
      if (grid > cap) grid = cap;
    }
    if (grid > 0x7fffffffLL / launch->cluster) grid = 0x7fffffffLL / launch->cluster;
    launch->grid = (unsigned)(grid * launch->cluster);
  }
  launch->block = (unsigned)s->block;
  launch->smem = (unsigned)s->smem;
  return NULL;
}

OrtStatus* ofz_spec_tma(const OfzSpec* s, OrtKernelContext* ctx, const OfzArgs* args, OfzTmaGeom* geo) {
  for (size_t j = 0; j < s->n_tma; ++j) {
    const int64_t* t = &s->tma[3 * j];
    const size_t i = (size_t)t[0];
    int64_t dims[64];
    size_t rank = 0;
    TRY(input_dims(ctx, i, dims, &rank));
    unsigned long long rows = 1;
    for (size_t k = 0; k + 1 < rank; ++k) rows *= (unsigned long long)dims[k];
    const unsigned long long k = rank ? (unsigned long long)dims[rank - 1] : 1;
    // what cuTensorMapEncodeTiled requires: dims in 1..2^31 and a 16-byte row stride (the address's 16 bytes
    // are the node's arg_align, checked by ofz_spec_resolve)
    if (k < 1 || rows < 1 || k > (1ULL << 31) || rows > (1ULL << 31) || (k * 2) % 16)
      return BAD("ortfuse: node '%s': input %zu (%llu rows of %llu elements) cannot be copied by TMA: rows of a "
                 "multiple of 8 elements, 1 to 2^31 of them each way, are needed", s->node, i, rows, k);
    geo[j].base = args->ptr[i];
    geo[j].dim0 = k, geo[j].dim1 = rows, geo[j].stride1 = k * 2;
    geo[j].box0 = OFZ_TMA_BOX_INNER, geo[j].box1 = (unsigned)t[1];
    geo[j].elem = (int)t[2];
  }
  return NULL;
}

typedef struct InferDims {
  int64_t sym[2 * OFZ_MAX_DIMS], derived[3 * OFZ_MAX_DIMS], sums[2 * OFZ_MAX_DIMS];
  unsigned char product[OFZ_MAX_DIMS];  // sums rule j multiplies (sym_products)
  size_t n_sym, n_derived, n_sums, n_in;
  unsigned long long unk[OFZ_MAX_DIMS];  // the name of a bound dim that has none at the input, once given
} InferDims;

// ORT turns an output dim without a name into dim_value, -1 included, and ONNX shape inference downstream
// then aborts the process on it (std::clamp in Slice's, 2026-11-27 on an H100; reproduced on the CPU EP).
// So a dim shape inference cannot size is always named: by its formula over the names it is made of
// ("h+2", "(h-1)/2+1"), which states equality where ONNX semantics give it (one name, one value in a graph),
// or, where nothing names it, by a name of its own that equals nothing else.
enum { INFER_NAME_MAX = 128 };

static void unique_name(char* name, unsigned long long* id) {
  static unsigned long long next;
  unsigned long long own = 0;
  if (!id) id = &own;
  if (!*id) *id = __atomic_add_fetch(&next, 1, __ATOMIC_RELAXED);
  snprintf(name, INFER_NAME_MAX, "ortfuse_unk_%ld_%llu", (long)getpid(), *id);  // a saved graph's names too
}

// `fmt` over the two parts where the result fits; else a name of its own (a cut name could equal another).
static void compose_name(char* name, const char* fmt, const char* a, const char* b) {
  if (snprintf(name, INFER_NAME_MAX, fmt, a, b) >= INFER_NAME_MAX) unique_name(name, NULL);
}

static OrtStatus* infer_dim(OrtShapeInferContext* ctx, InferDims* d, size_t p, int64_t* value, char* name);

// A term at shape inference: a constant, or a runtime dim before dim p: its value, or -1 and its name.
static OrtStatus* infer_term(OrtShapeInferContext* ctx, InferDims* d, int64_t t, size_t p, int64_t* value,
                             char* name) {
  *value = t;
  name[0] = '\0';
  if (t < 0 && (size_t)(-(t + 1)) < p) return infer_dim(ctx, d, (size_t)(-(t + 1)), value, name);
  if (t < 0) *value = -1, unique_name(name, NULL);  // malformed: kernel creation says so
  return NULL;
}

// Runtime dim p at shape inference: an input's dim, a derived one computed from its source, or a sum or product
// of two terms; its value where known, else -1 and a non-empty name (see above).
static OrtStatus* infer_dim(OrtShapeInferContext* ctx, InferDims* d, size_t p, int64_t* value, char* name) {
  *value = -1;
  name[0] = '\0';
  if (p >= d->n_sym + d->n_derived) {  // a sum or product of two terms
    const size_t j = p - d->n_sym - d->n_derived;
    if (j >= d->n_sums) return unique_name(name, NULL), NULL;
    int64_t a = -1, b = -1;
    char na[INFER_NAME_MAX], nb[INFER_NAME_MAX];
    TRY(infer_term(ctx, d, d->sums[2 * j], p, &a, na));
    TRY(infer_term(ctx, d, d->sums[2 * j + 1], p, &b, nb));
    if (a >= 0 && b >= 0) *value = d->product[j] ? a * b : a + b;
    else {
      if (a >= 0) snprintf(na, sizeof na, "%lld", (long long)a);
      if (b >= 0) snprintf(nb, sizeof nb, "%lld", (long long)b);
      if (!d->product[j]) compose_name(name, "%s+%s", na, nb);
      else {  // a factor with another operator is parenthesized: "(p+s)*4", "(w - 1)*3"
        char pa[INFER_NAME_MAX + 2], pb[INFER_NAME_MAX + 2];
        snprintf(pa, sizeof pa, strpbrk(na, "+-/ ") ? "(%s)" : "%s", na);
        snprintf(pb, sizeof pb, strpbrk(nb, "+-/ ") ? "(%s)" : "%s", nb);
        compose_name(name, "%s*%s", pa, pb);
      }
    }
    return NULL;
  }
  if (p >= d->n_sym) {  // a Conv's output size: (size + add) / div + 1
    const size_t j = p - d->n_sym;
    const int64_t add = d->derived[3 * j + 1], div = d->derived[3 * j + 2];
    int64_t size = -1;
    char src[INFER_NAME_MAX], tail[48];
    TRY(infer_term(ctx, d, d->derived[3 * j], p, &size, src));
    if (size >= 0 && div >= 1 && size + add >= 0) *value = (size + add) / div + 1;
    else if (size >= 0 || div < 1) unique_name(name, NULL);  // too small or malformed: Compute says so
    else {
      snprintf(tail, sizeof tail, "%+lld)/%lld+1", (long long)add, (long long)div);
      compose_name(name, "(%s%s", src, add ? tail : tail + 2);  // "(h-1)/2+1", or "(h)/2+1" for add 0
    }
    return NULL;
  }
  if (d->sym[2 * p] < 0 || (size_t)d->sym[2 * p] >= d->n_in) return unique_name(name, NULL), NULL;
  OrtTSI* in = NULL;  // owned by the context
  size_t in_rank = 0, axis = (size_t)d->sym[2 * p + 1];
  if (ofz_ort.ShapeInferContext_GetInputTypeShape(ctx, (size_t)d->sym[2 * p], &in) ||
      ofz_ort.GetDimensionsCount(in, &in_rank) || axis >= in_rank || in_rank > 64)
    return BAD("ortfuse: shape inference: symbolic dim %zu reads axis %zu of input %lld, which has no such axis",
               p, axis, (long long)d->sym[2 * p]);
  int64_t in_dims[64];
  const char* in_names[64];
  TRY(ofz_ort.GetDimensions(in, in_dims, in_rank));
  TRY(ofz_ort.GetSymbolicDimensions(in, in_names, in_rank));
  *value = in_dims[axis];
  if (in_dims[axis] >= 0) return NULL;
  *value = -1;
  if (in_names[axis] && in_names[axis][0]) compose_name(name, "%s%s", in_names[axis], "");
  else unique_name(name, &d->unk[p]);  // one name for the dim in all outputs of the node
  return NULL;
}

OrtStatus* ofz_spec_infer(OrtShapeInferContext* ctx, size_t n_extra, int64_t extra_len) {
  int64_t dtypes[OFZ_MAX_TENSORS], ranks[OFZ_MAX_TENSORS];
  static __thread int64_t odims[OFZ_MAX_OUT_DIMS];  // 4 KiB: keep it off the stack
  static __thread char name_buf[OFZ_MAX_DIMS][INFER_NAME_MAX];
  size_t n_dt = 0, n_rk = 0, n_od = 0, n_sym2 = 0, n_der3 = 0, n_sum2 = 0;
  InferDims d;
  memset(d.unk, 0, sizeof d.unk);
  TRY(ofz_infer_ints(ctx, "out_dtypes", dtypes, OFZ_MAX_TENSORS, &n_dt));
  TRY(ofz_infer_ints(ctx, "out_ranks", ranks, OFZ_MAX_TENSORS, &n_rk));
  TRY(ofz_infer_ints(ctx, "out_dims", odims, OFZ_MAX_OUT_DIMS, &n_od));
  TRY(ofz_infer_ints(ctx, "sym_dims", d.sym, 2 * OFZ_MAX_DIMS, &n_sym2));
  TRY(ofz_infer_ints(ctx, "sym_derived", d.derived, 3 * OFZ_MAX_DIMS, &n_der3));
  TRY(ofz_infer_ints(ctx, "sym_sums", d.sums, 2 * OFZ_MAX_DIMS, &n_sum2));
  int64_t prods[OFZ_MAX_DIMS];
  size_t n_prods = 0;
  TRY(ofz_infer_ints(ctx, "sym_products", prods, OFZ_MAX_DIMS, &n_prods));
  memset(d.product, 0, sizeof d.product);
  for (size_t k = 0; k < n_prods; ++k)  // (out of range: kernel creation says so)
    if (prods[k] >= 0 && prods[k] < OFZ_MAX_DIMS) d.product[prods[k]] = 1;
  TRY(ofz_ort.ShapeInferContext_GetInputCount(ctx, &d.n_in));
  d.n_sym = n_sym2 / 2;
  d.n_derived = n_der3 / 3;
  d.n_sums = n_sum2 / 2;
  if (n_dt != n_rk) return BAD("ortfuse: shape inference: out_dtypes has %zu entries, out_ranks %zu", n_dt, n_rk);
  size_t used = 0;
  for (size_t k = 0; k < n_dt + n_extra; ++k) {
    int extra = k >= n_dt;
    size_t rank = extra ? 1 : (size_t)ranks[k];
    if (rank > OFZ_MAX_DIMS || used + (extra ? 0 : rank) > n_od)
      return BAD("ortfuse: shape inference: out_ranks and out_dims disagree at output %zu", k);
    int64_t dims[OFZ_MAX_DIMS];
    const char* names[OFZ_MAX_DIMS];
    int named = 0;
    for (size_t j = 0; j < rank; ++j) {
      int64_t t = extra ? extra_len : odims[used++];
      dims[j] = t;
      names[j] = "";
      if (t >= 0) continue;
      TRY(infer_dim(ctx, &d, (size_t)(-(t + 1)), &dims[j], name_buf[j]));
      names[j] = name_buf[j];
      named = 1;  // infer_dim names every dim it cannot size
    }
    OrtTSI* out = NULL;
    TRY(ofz_ort.CreateTSI(&out));
    OrtStatus* st = ofz_ort.SetTensorElementType(out, extra ? OFZ_DT_INT64 : (int)dtypes[k]);
    if (!st) st = ofz_ort.SetDimensions(out, dims, rank);
    if (!st && named) st = ofz_ort.SetSymbolicDimensions(out, names, rank);
    if (!st) st = ofz_ort.ShapeInferContext_SetOutputTypeShape(ctx, k, out);
    ofz_ort.ReleaseTSI(out);
    if (st) return st;
  }
  return NULL;
}
