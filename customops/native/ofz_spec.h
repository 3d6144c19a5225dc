// The fused-node format of docs/design.md: parsing and validation, image choice, shape resolution and
// shape inference. No CUDA here, so the CPU probe op `ortfuse.probe::Plan` can test all of it.
#pragma once
#include "ofz_common.h"

#include "../include/ortfuse_args.h"  // the kernel ABI, one definition for kernels and library

#define OFZ_NODE_VERSION 2  // the newest format read: 2 is 1 with sym_products (older libraries refuse it)
#define OFZ_MAX_ARCHS 16
#define OFZ_MAX_TERMS 64
#define OFZ_MAX_OUT_DIMS (OFZ_MAX_TENSORS * OFZ_MAX_DIMS)
#define OFZ_MAX_VARIANTS 4  // kernels of one node, chosen per run by size (variant_rows, variant_from)

typedef struct OfzSpec {
  char node[OFZ_NAME_MAX];
  char sfx[8];  // "" for variant 0, "@v" for variant v: the suffix of the variant's own attributes
  char entry[256];
  size_t n_in, n_out;  // as wired in the graph
  int64_t block, smem, units_per_block;
  int64_t split_k;  // GEMM split-K: most blocks per cluster sharing a tile (1 = no clusters)
  int64_t blocks_per_sm;  // a persistent kernel's grid cap per SM (0 = one block per work unit)
  int64_t row_cluster;  // GEMM row split across a cluster: exactly this many blocks per cluster (1 = none)
  int64_t multicast;  // TMA GEMM sharing B by multicast: clusters of exactly this many blocks, units count clusters
  int64_t pdl;  // 1: a programmatic dependent launch where the device has them (sm_90+), 0: a plain one
  size_t n_archs;
  int64_t archs[OFZ_MAX_ARCHS];
  size_t n_sym;  // pairs (input, axis)
  int64_t sym[2 * OFZ_MAX_DIMS];
  size_t n_derived;  // triples (term, add, div): d[n_sym + j] = floor((term + add) / div) + 1
  int64_t derived[3 * OFZ_MAX_DIMS];
  size_t n_sums;  // pairs (term, term): d[n_sym + n_derived + j] = their sum (a Concat's span along its axis)
  int64_t sums[2 * OFZ_MAX_DIMS];
  unsigned char product[OFZ_MAX_DIMS];  // sym_products: sums rule j multiplies its terms (run-time axes flattened)
  size_t n_units;
  int64_t units[OFZ_MAX_TERMS];
  size_t n_ceil;  // groups (count, term * count, divisor): each multiplies the units by ceil(product / divisor)
  int64_t units_ceil[OFZ_MAX_TERMS];
  size_t n_limits;  // groups (count, term * count, limit): the product of the terms must stay below limit
  int64_t dim_limits[OFZ_MAX_TERMS];
  size_t n_checks;  // triples (input, axis, term): that axis must equal the term (a size, or a runtime dim)
  int64_t dim_checks[3 * OFZ_MAX_TERMS];
  size_t n_align;  // 0, or one per input then output: the byte alignment its address needs (arg_align)
  int64_t align[OFZ_MAX_TENSORS];
  size_t n_tma;  // 0 or OFZ_TMA_MAPS triples (input, box rows, ONNX element type): the kernel's TMA operands
  int64_t tma[3 * OFZ_TMA_MAPS];
  int64_t out_dtypes[OFZ_MAX_TENSORS];
  int64_t out_ranks[OFZ_MAX_TENSORS];
  size_t n_out_dims;
  int64_t out_dims[OFZ_MAX_OUT_DIMS];
  // variant 0 only: how many kernel variants the node carries, and the rule that picks one per run: the
  // product of the variant_rows terms (symbolic dims or sizes) against the rising thresholds variant_from
  int64_t n_variants;
  size_t n_var_rows;
  int64_t var_rows[OFZ_MAX_DIMS];
  int64_t var_from[OFZ_MAX_VARIANTS];
} OfzSpec;

typedef struct OfzLaunch {
  unsigned grid, block, smem;  // grid 0 = nothing to launch; a multiple of cluster
  unsigned cluster;            // blocks per thread-block cluster (1 = launch without clusters)
  long long units;
} OfzLaunch;

#define OFZ_MAX_CLUSTER 8  // the portable cluster size

// Blocks per cluster for `grid` blocks of a kernel with split_k on `sm_count` SMs: the largest power of two
// up to split_k whose split grid stays within one wave (0 SMs: no clusters).
unsigned ofz_spec_cluster(int64_t split_k, long long grid, int sm_count);

// Whether a kernel is launched as a programmatic dependent launch on a device of compute capability `cc`
// (major * 10 + minor) whose driver has cuLaunchKernelEx: it asks for one (pdl) and the device has them (sm_90+).
int ofz_spec_pdl(const OfzSpec* s, int cc, int has_launch_ex);

// Reads and validates every non-image attribute of kernel variant `variant` (0: the node's first kernel;
// v > 0 reads the kernel's own attributes as `name@v`, the shared ones as they are). `n_out` is the number
// of kernel outputs (the probe Plan op has one extra bookkeeping output).
OrtStatus* ofz_spec_parse(const OrtKernelInfo* info, const char* node, size_t n_in, size_t n_out, size_t variant,
                          OfzSpec* s);

// The kernel image for a device of compute capability `cc` (e.g. 90): `cubin_<cc>` if listed, else
// the newest listed cubin of the same major version not newer than the device, else `ptx`
// (*chosen_cc = 0). *image is a malloc'd copy with a terminating NUL (PTX needs one); free() it.
OrtStatus* ofz_spec_image(const OrtKernelInfo* info, const OfzSpec* s, int cc, void** image, size_t* bytes,
                          int* chosen_cc);

// Binds the symbolic dims from the inputs, picks the kernel variant they call for (`*variant`: the last
// whose variant_from[v - 1] the product of variant_rows reaches; 0 for a node of one kernel), allocates
// every output through ORT, fills the kernel arguments and that variant's launch geometry for `sm_count`
// SMs (split-K clusters, a persistent kernel's capped grid; 0 = neither). `specs` holds the node's
// variants, variant 0 first. Extra outputs beyond n_out are left to the caller.
OrtStatus* ofz_spec_resolve(const OfzSpec* const* specs, OrtKernelContext* ctx, int sm_count, OfzArgs* args,
                            OfzLaunch* launch, size_t* variant);

// A TMA operand's 2-D tensor map (the kernel's OfzTma, encoded by the CUDA op): the input's last dim by the
// product of its others, rows `stride1` bytes apart, boxes of box0 x box1 elements of ONNX type `elem`.
// ofz_spec_tma fills one per `tma` triple from the bound inputs.
typedef struct OfzTmaGeom {
  void* base;
  unsigned long long dim0, dim1, stride1;
  unsigned box0, box1;
  int elem;
} OfzTmaGeom;
#define OFZ_TMA_BOX_INNER 64  // elements along K per box: one 128-byte swizzle row of 16-bit elements
OrtStatus* ofz_spec_tma(const OfzSpec* s, OrtKernelContext* ctx, const OfzArgs* args, OfzTmaGeom* geo);

// InferOutputShapeFn body: output k gets out_dtypes[k] and its dims; a symbolic term copies the bound
// input dim (its value or its symbol). `n_extra` int64 outputs of shape [extra_len] follow.
OrtStatus* ofz_spec_infer(OrtShapeInferContext* ctx, size_t n_extra, int64_t extra_len);
