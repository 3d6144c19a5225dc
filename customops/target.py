"""The one hardware table, keyed by compute capability. Every tuning constant the search and the
code generator use lives here, with where it comes from."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    cc: int  # compute capability * 10, e.g. 90
    name: str
    sm_count: int
    max_threads_per_block: int  # CUDA limit, all listed archs
    smem_per_block: int  # bytes usable by one block with opt-in (CUDA programming guide, table 21)
    # shared memory the blocks of one SM may hold together (CUDA C++ Programming Guide, compute capabilities
    # table: 164 KB on sm_80, 100 KB on sm_86/sm_89, 228 KB on sm_90)
    smem_per_sm: int
    l2_bytes: int
    dram_gbps: float  # peak DRAM bandwidth of the reference board
    launch_us: float  # ORT per-kernel launch+dispatch cost on the CUDA EP, measured order of magnitude
    mma_f16_tflops: float  # dense fp16/bf16 tensor-core peak with fp32 accumulation
    mma_tf32_tflops: float  # dense tf32 tensor-core peak
    fp32_tflops: float  # SIMT fp32 FMA peak
    clock_ghz: float  # boost clock: instruction issue rate is 4 warp-instructions per SM per clock
    # DRAM round trip of one load: ~600 core clocks at the boost clock on these parts (public
    # microbenchmarks, e.g. Chips and Cheese's H100/A100 latency tests); assumed, not measured by us
    mem_latency_ns: float
    regs_per_sm: int = 65536
    smem_reserved_per_block: int = 1024  # shared memory the system takes per resident block (same table)
    max_threads_per_sm: int = 2048
    l2_over_dram: float = 2.5  # L2 bandwidth / DRAM bandwidth, rough ratio for re-read tile traffic
    # Share of the dense tensor-core peak that warp-level mma.sync (what our kernels issue) can reach. On
    # sm_90 the peak needs Hopper's warpgroup wgmma, which cuBLAS uses and we do not; public
    # microbenchmarks put mma.sync at about 50-65% of it there. Measured (H100, 2026-11-25, fp16 M=4096
    # tile sweep, docs/gpu/2026-11-25-h100-gemm-sweep.txt): our mma.sync tiles reach 0.11-0.18 of the peak,
    # cuBLAS 0.38-0.57. The cost model prices cuBLAS at the full peak, so this share is kept as a ratio (ours
    # vs cuBLAS, with `gemm_vs_cublas`) until both sides are calibrated together (bench/README.md).
    mma_sync_share: float = 1.0
    # Hopper's warpgroup MMA (wgmma.mma_async, sm_90a cubins): the device has it. Our wgmma kernels are used
    # only when every target arch has it and the user opts in (`--wgmma`: parity verified on an H100,
    # 2026-11-25); api.target_for folds both into this flag.
    wgmma: bool = False
    # Programmatic dependent launch (sm_90+): each kernel may start launching while the previous kernel in the
    # stream finishes, and waits for it before touching memory (ortfuse_kernel.h grid_dependency_sync): the
    # launch gap and the next kernel's start overlap the last blocks of the one before. Used where every target
    # arch has it and the user opts in (`--pdl`: not measured yet); api.target_for folds both into this flag.
    pdl: bool = False
    # attention kernels skip the key tiles past a proven causal frontier (customops.key_bound; Options.key_frontier)
    key_frontier: bool = True
    # Share of the dense peak our wgmma kernel (cp.async pipeline, no TMA or warp specialization) reaches:
    # measured 0.12-0.23 (H100, 2026-11-25, same sweep; about 1.3x our mma.sync tiles), kept as a ratio as
    # mma_sync_share is (CUTLASS's TMA + warp-specialized kernels reach ~75-80%).
    wgmma_share: float = 0.7
    # The same wgmma fed by TMA in a warp-specialized pipeline (ortfuse_gemm.h run_wgmma_ws: a producer
    # warpgroup, mbarriers instead of block barriers, no copy instructions among the MMAs), the structure of
    # CUTLASS's Hopper kernels. Assumed above wgmma_share, not measured (no GPU since it was written):
    # `--profile` times both families, and the GPU suite's tile sweep measures every TMA tile.
    wgmma_ws_share: float = 0.8
    # Our GEMM's speed relative to cuBLAS on the same instructions (issue 5's target: within 15%). Measured on
    # an H100 (2026-11-25): our best tile over bare cuBLAS 2.2-2.5x (wgmma) and 2.8-3.2x (mma.sync) at M=4096,
    # 1.4-2.4x at batch 1. What the cost model uses it for is the ratio ours / ORT per region: at batch 32 the
    # measured ratio of 10 fp16 MatMul regions (BERT, GPT-2, ViT with --wgmma) was a median 1.5x the model's
    # with 0.85; 0.55 on sm_90 was tried and not kept (it contradicted the measured batch-1 verdicts:
    # bench/README.md, "Cost model against --profile"). Assumed; `ortfuse optimize --profile` measures.
    gemm_vs_cublas: float = 0.85
    # A Conv whose operands our kernel copies as they are (a 16-byte aligned 1x1 convolution), relative to
    # cuDNN: assumed; on the H100 (2026-11-25) the model's ours / ORT ratio for ResNet-50's and MobileNetV2's
    # Conv regions matched the measured one within a median 1.1x with it.
    direct_conv_vs_cudnn: float = 0.85
    # A Conv whose im2col operand our kernel gathers element by element (no cp.async), relative to cuDNN:
    # assumed, not measured; `--profile` measures it per region.
    implicit_gemm_vs_cudnn: float = 0.6
    # Our GEMM with a row-wise epilogue (LayerNorm/Softmax over the row inside the kernel: a whole-row tile,
    # or a row split across a cluster) against our plain GEMM of the same shape: at least this factor. The
    # tile model puts it at 1.0-1.3x; measured on an H200 (2026-11-26, docs/results.md), the best row tile of
    # each of BERT's four residual + LayerNorm GEMM shapes took 2.9-3.2x our best plain tile (e.g. 4096x768x768:
    # 55.8 us against 17.3), and in every measured placement of BERT, GPT-2 and ViT fp16 cuBLAS + our row
    # kernel beat it. Measured on sm_90; assumed elsewhere. `--profile` still times both.
    row_epilogue_floor: float = 3.0
    # Our GEMM kernel with a LayerNorm folded into its A operand (the row moments gathered in the mainloop, no
    # split-K) against the plain kernel of the same shape, launch and fixed costs included: at least this
    # factor (CostModel.ours_us). The tile model puts the mainloop alone at 1.0-1.1x. Measured on an H100 (2026-11-26, docs/results.md, session 21) only through whole models: the
    # default build with GPT-2's and ViT's 24 folds each against `--ln-fold off`, where the LayerNorms run as
    # our row kernel, was 3.39 against 3.13 ms (GPT-2, batch 32), 0.76 / 0.67 (batch 1), ViT 4.71 / 3.88 and
    # 1.17 / 1.03: 4-35 us lost per fold. With cuBLAS's times for those GEMMs (27-52 us at batch 32) and a row
    # kernel of ~5 us that is 1.5-2.2x per folded GEMM; the smaller is kept. Assumed 1.0 elsewhere.
    ln_fold_floor: float = 1.0
    # A node ORT's CUDA EP hands to its CPU EP (search.ops.CPU_EP_ONLY) costs the CPU kernel, the copy of its
    # result to the device (ORT's MemcpyFromHost from pageable memory, which waits for the host) and the
    # dispatch of both, in us, besides a kernel of ours: assumed, not measured. Such a node also keeps the
    # session from capturing CUDA graphs, which no figure here prices.
    host_node_us: float = 15.0
    vector_bytes: int = 16  # widest global load per thread (LDG.128)
    # Shared memory serves one 128-byte wavefront per clock per SM: 32 banks of 4 bytes each (CUDA C++
    # Programming Guide, "Shared Memory"; 128 B/clk/SM on sm_80 through sm_90, e.g. H100's 32.3 TB/s at 144
    # SMs x 1.755 GHz). ldmatrix.x4 and a warp's 16-byte cp.async are 4 wavefronts each.
    smem_bytes_per_clk: int = 128
    # Thread-block clusters (sm_90): the most blocks of one cluster that split a GEMM tile's K (8 is the
    # portable cluster size; 1 = no clusters). The cost of their reduction through distributed shared memory
    # is assumed, not measured: a cluster barrier (~400 core clocks) and remote shared-memory reads at about
    # L2's per-SM rate (64 bytes per clock).
    max_cluster: int = 1
    cluster_sync_ns: float = 200.0
    dsmem_gbps_per_sm: float = 120.0
    # Clocks per output element, per computing thread, of a GEMM epilogue for each per-element branch in its
    # code (FN_BRANCHES: IEEE division's and sqrt's slow-path check, ...). Each branch is a convergence region
    # (BSSY/BSYNC) ptxas does not schedule across, so the tile's elements run one after another at full
    # latency. Measured on an H200 (2026-11-26, docs/gpu/2026-11-26-h200-s14-*), 4096x3072x768 on the
    # 128x192x64/16x192/5 TMA tile (8 computing warps, one block and 4 tiles per SM): with BERT's bias + erf
    # GELU, whose x / sqrt(2) was then an IEEE division (208 such regions in the epilogue's SASS), 83.6 us;
    # with GPT-2's bias + tanh GELU (24 instructions per element, no branch), 50.3; with the bias alone, 49.7.
    # The 33.9 us over 384 elements per thread: 175 clocks each. Branch-free epilogue math costs ~nothing
    # there (the producer keeps loading the next tile meanwhile), so it is not charged.
    epilogue_branch_clocks: float = 175.0
    # Our attention kernel (ortfuse_attention.h), in core clocks per key tile (the tensor-core tile: 64 query
    # rows x 64 keys, the SIMT one 32 x 32; head sizes 64): `*_tile_clocks` is one block's time per tile
    # alone on its SM (small batches: the chain of one block's tiles), `*_sm_clocks` an SM's time per tile
    # when every SM is busy (large batches: co-resident blocks overlap), `attn_fixed_clocks` a block's start
    # and finish outside its tiles (the launch included), `attn_split_clocks` what splitting a unit's keys
    # across a cluster adds (the cluster launch, two cluster barriers, the merge over distributed shared
    # memory). Fitted on an H100 to --profile's and the timeline's times (warm L2; docs/gpu, 2026-11-26/27):
    # BERT fp16 at batch 1 (12 heads x 128, 2 key tiles a unit) 8.3 us with its keys in one block, 11.9 split
    # across clusters of 2, 24.6 at batch 32; SmolLM's decode step (3 units x 9 tiles, clusters of 4) 18.0;
    # SIMT fp32 ViT-B (197 keys: 7 tiles) 69.7 / 393.7 us at batch 1 / 32. ViT fp16's tiles took 4.2 us on a
    # flushed L2 (the kernel table) against 3.05 here. The same clocks are assumed on other archs.
    attn_mma_tile_clocks: float = 6040.0
    attn_mma_sm_clocks: float = 4000.0
    attn_simt_tile_clocks: float = 19100.0
    attn_simt_sm_clocks: float = 6200.0
    attn_fixed_clocks: float = 4360.0
    attn_split_clocks: float = 13170.0
    # A K row's rotary embedding applied by the kernel (rotate_rows, on every K tile each unit loads), in issue
    # clocks per rotated pair and thread: sm_90 SASS of SmolLM's fp16 prompt kernel (2026-11-29, not timed),
    # 97 instructions an iteration of 4 pairs (16 LDG of cos and sin, 8 LDS and STS, 24 conversions, 16 FMUL /
    # FFMA; 231 before each thread kept one column pair). Each of a block's 4 warps issues its pairs on its
    # own scheduler, so a tile's pairs over THREADS add about that many clocks to a block's chain and to an
    # SM's time alike (16 a thread: ~390 beside a tile's 6040 / 4000). An estimate from instruction counts,
    # never measured on a GPU.
    attn_rope_pair_clocks: float = 24.0
    # ORT's MultiHeadAttention (com.microsoft; `rewriter.mha`), in us: fixed + per 64-key tile of a query
    # row's keys + FLOPs (2 B N Sq Sk (D + Dv)) at a rate, for each path ORT takes. Fitted through bench/kernels'
    # device times (L2 flushed; docs/gpu 2026-11-26 H100 s20 and H200 s14, 2026-11-27 H100 s31), each class
    # through its own points and so not yet checked on any other shape: 16-bit without a bias (flash
    # attention) BERT-base 128 keys 7.6 / 16.8 us at batch 1 / 32, ViT-B 197 keys 9.3 / 27.7; 16-bit with an
    # attention_bias BERT 9.2 / 23.0, ViT 16.9 / 77.1 (query rows not a multiple of 8, which ORT's
    # memory-efficient kernel wants with a bias, run at about half the rate);
    # fp32 ViT 35.4 / 294.0 without a bias, 36.0 / 311.7 with one (no tile term: one shape only).
    mha_flash_us: tuple[float, float, float] = (5.9, 0.7, 185.0)  # (fixed us, us a key tile, TFLOP/s)
    mha_bias_us: tuple[float, float, float] = (2.55, 3.1, 113.0)
    mha_bias_unaligned_tflops: float = 61.0
    mha_fp32_us: tuple[float, float, float] = (27.1, 0.0, 14.3)
    mha_fp32_bias_tflops: float = 13.4
    # cuBLAS on a GEMM whose weight or output rows are not 16-byte aligned (N = 50,257 fp16 logits), over the
    # roofline estimate of the aligned GEMM (`CostModel.gemm_us`). 1.0 (never pad) where nothing was observed.
    # sm_90: measured on an H100 (2026-11-26, docs/gpu/2026-11-26-h100-s21-sweep-unaligned.md), GPT-2's LM head
    # as ORT runs it: 7.8x at 4096x50257x768 (2485 us), 4.2x at 128 rows (112 us); padded to 50,264 columns
    # plus the Slice, 826 and 52 us (3.0x and 2.1x faster). The smaller factor is kept: padding pays from ~2x.
    unaligned_gemm_slowdown: float = 1.0
    # Our GEMM storing an output whose rows are not 16-byte aligned directly (no vector stores: each thread
    # writes its elements one by one, rows apart): that output's DRAM time at least this many times over.
    # Measured on mma fragments before they were staged (below); SIMT lanes still store this way.
    # sm_90: measured on an H100 (2026-11-26, ...-s21-sweep-unaligned.md), our best TMA tile for GPT-2's LM
    # head + bias (4096 / 128 x 50257 x 768, the weight read transposed) took 1644 / 69 us where the aligned
    # GEMM would take ~540 / ~49 (1.05 / 1.16x padded cuBLAS, as on aligned shapes): the extra is 9x / 5.7x the
    # output's aligned DRAM time (412 / 12.9 MB). The smaller is kept. 1.0 (no charge) where not measured.
    unaligned_store_factor: float = 1.0
    # The same outputs stored through shared memory a row at a time (ortfuse_gemm.h for_each_acc_staged, what
    # mma-fragment kernels have done since 2026-11-26; SIMT lanes still store directly): assumed, not yet
    # measured. A warp's store writes 32 adjacent elements (64 bytes of 16-bit ones), so L2 gets whole
    # sectors and DRAM about the aligned bytes, where a fragment's scalar stores touched 8 rows' sectors 8
    # bytes each. What it adds is the round trip through shared memory, 8 bytes per element (an fp32 write
    # and read) at `smem_bytes_per_clk` per SM, which nothing overlaps (the consumers' MMAs wait for their
    # epilogue): on sm_90 half the output's aligned DRAM time for 16-bit outputs (GPT-2's LM head: ~56 us
    # against ~123). Issue is no more than on the aligned path: the whole-tile staged epilogue of the LM head
    # + bias (128x256 TMA tile, sm_90 SASS, NVRTC 13) is 5.1 instructions per element (the bias loaded once
    # per 8 rows) against 7.1 for the aligned 16-byte path (its quad exchange: SHFL and SEL). Measure with
    # `bench/device_call.sh sweep-unaligned` (its "misaligned" lines) and replace.
    staged_store_factor: float = 1.0

    @property
    def arch(self) -> str:
        return f"sm_{self.cc}"


# Reference boards: A100-SXM4-80GB (sm_80), RTX A6000 (sm_86), L40S (sm_89), H100-SXM5 (sm_90).
# Figures from NVIDIA's data sheets (dense, no sparsity); launch_us is the typical ORT CUDA EP per-node
# overhead: on sm_90 the one measured on the H100 machine (bench/overhead.py: 5.5-6.3 us per node,
# 2026-11-24/25), elsewhere assumed. sm_86/sm_89 have 1536 threads per SM.
TABLE: dict[int, Target] = {
    80: Target(80, "A100", 108, 1024, 163 * 1024, 164 * 1024, 40 * 2**20, 2039.0, 4.0, 312.0, 156.0, 19.5, 1.41,
               425.0),
    86: Target(86, "RTX A6000", 84, 1024, 99 * 1024, 100 * 1024, 6 * 2**20, 768.0, 4.0, 154.8, 77.4, 38.7, 1.80,
               333.0, max_threads_per_sm=1536),
    89: Target(89, "L40S", 142, 1024, 99 * 1024, 100 * 1024, 96 * 2**20, 864.0, 4.0, 362.0, 181.0, 91.6, 2.52,
               238.0, max_threads_per_sm=1536),
    90: Target(90, "H100", 132, 1024, 227 * 1024, 228 * 1024, 50 * 2**20, 3350.0, 6.0, 989.0, 494.0, 67.0, 1.98,
               303.0, max_cluster=8, mma_sync_share=0.6, wgmma=True, pdl=True,
               unaligned_gemm_slowdown=4.2, unaligned_store_factor=5.7, staged_store_factor=1.5,
               ln_fold_floor=1.5),
}

# SASS instructions per element of each fp32 function the printer emits (customops/printer.py FN), sm_90,
# NVRTC 13.5, eight independent elements per thread, the main line up to the kernel's EXIT (IEEE division's
# slow path is a subroutine after it; sin's and cos's large-argument reduction is inline, so theirs is an
# upper bound): `python -m ortfuse.bench.sass --functions`, 2026-11-26. Functions not listed count one
# (add, mul, compares, selects, min/max, casts).
FN_INSTRUCTIONS: dict[str, float] = {
    "exp": 8.25, "log": 25.4, "sqrt": 14.0, "rsqrt": 4.0, "erf": 21.1, "tanh": 15.25, "sin": 113.5,
    "cos": 114.5, "log1p": 29.25, "div": 12.75, "pow": 91.5, "fmod": 72.25, "recip_fast": 5.1,
}
# SASS instructions per output element and tap of a depthwise window in a memory-bound kernel (the image's and
# weight's vector loads and their conversions, the padding guard, the FMA): ConvNeXt-T's 7x7 walked
# channels-last inside its LayerNorm kernel, the row loop's instructions over its window FMAs, 3.7 (fp16) and
# about 3.3 (fp32), sm_90, NVRTC 13.5 (`python -m ortfuse.bench.sass`, 2026-11-27). Pools count the same.
WINDOW_TAP_INSTRUCTIONS = 3.5
# a depthwise window of at most this many taps is straight-line (customops.lower): each tap's offsets are
# constants, its image read a guarded load, a kernel row's reads issued together (ConvNeXt's 7x7: 49); larger
# windows loop tap by tap
WINDOW_UNROLL = 64
# of which at most this many taps of a kernel row are read ahead of their math at a time (ConvNeXt's 7: all;
# a 1x63 row read at once took 255 registers and spilled 384 bytes)
WINDOW_READ_AHEAD = 8
# a long row's hand-unrolled trip (ROW_LONG_UNROLL columns) moves at most this many reads ahead of its math:
# every vector of its columns (GroupNorm: 4 image vectors and the per-channel affine), not a window's taps
ROW_READ_AHEAD = 16
# Per-element branches (BSSY convergence regions on the main line) of the same functions, same count; exp,
# log, rsqrt, erf, tanh and recip_fast (Sigmoid's) have none.
FN_BRANCHES: dict[str, float] = {"sqrt": 1, "div": 1, "log1p": 1, "pow": 1, "sin": 2, "cos": 2, "fmod": 3}

# Row-reduction geometry: each thread of a row handles about this many vectors per pass, so a
# row of C elements gets C / (VEC * ROW_VECTORS_PER_THREAD) threads, rounded up to a power of two
# and clamped to [32, ROW_MAX_THREADS]. Small rows share a block so it has >= ROW_MIN_BLOCK threads.
ROW_VECTORS_PER_THREAD = 2
ROW_MAX_THREADS = 512
ROW_MIN_BLOCK = 128
# a row kernel's rows of at most this many 16-byte vectors per lane are a warp's, straight-line: BERT-base's
# residual + LayerNorm (768 fp16) holds 24 elements and each per-column input's 24 in registers (118 of them;
# 4 groups, 1024 columns, took 168); longer rows keep the loop over several warps (2026-11-26, unmeasured)
ROW_KERNEL_GROUPS = 3
POINTWISE_BLOCK = 256


def short_row_threads(vectors: int) -> int:
    """Threads of a row of at most ROW_KERNEL_GROUPS vectors a lane (a warp's row): one vector a lane, in
    the smallest power of two of lanes that holds them, at most a warp; rows of fewer vectors share a warp
    (ConvNeXt's 96 fp16 channels, 12 vectors: 16 lanes a row, 75% of them busy, where a warp a row had 37%)."""
    return min(32, 1 << max(vectors - 1, 0).bit_length())


def long_row_threads(vectors: int, cap: int = ROW_MAX_THREADS) -> int:
    """Threads of a longer row: about ROW_VECTORS_PER_THREAD vectors each, a power of two in [32, cap]."""
    per_row = max(1, -(-vectors // ROW_VECTORS_PER_THREAD))
    return min(cap, max(32, 1 << (per_row - 1).bit_length()))


def vector_lanes(inner: int, itemsize: int, vector_bytes: int) -> int:
    """Elements a memory-bound kernel moves per vector access along an innermost axis of `inner` elements: the
    widest access holds, halved until it divides the axis."""
    vec = max(1, vector_bytes // itemsize)
    while vec > 1 and inner % vec:
        vec //= 2
    return vec


def for_cc(cc: int) -> Target:
    if cc not in TABLE:
        raise KeyError(f"no hardware entry for compute capability {cc}; known: {sorted(TABLE)}")
    return TABLE[cc]


def parse_arch(arch: str) -> Target:
    """'sm_90' / '90' / 'compute_90' -> Target."""
    digits = arch.lower().replace("sm_", "").replace("compute_", "")
    if not digits.isdigit():
        raise ValueError(f"bad --arch '{arch}': expected e.g. sm_90")
    return for_cc(int(digits))
