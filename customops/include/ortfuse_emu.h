// Host emulation of the CUDA subset generated kernels use. ortfuse_kernel.h includes this header when
// compiled with g++ -DORTFUSE_EMU (C++17), so the very source given to NVRTC also runs on the CPU.
//
// Execution model: blocks run one after another, or a cluster's blocks together (launches with a cluster
// size, sm_90 thread-block clusters). The threads are cooperative fibers (one small stack each) scheduled
// round-robin; __syncthreads, cluster_sync, __syncwarp, shuffles and votes are the only switch points.
// __shared__ expands to `static`: with one block at a time, a static is exactly block-shared storage.
// Blocks of one cluster would share it, so cluster kernels keep their shared data in dynamic shared
// memory, which is per block (and reachable from the cluster's other blocks through cluster_map).
// Errors (deadlock, misuse) abort the launch and are reported through ofz_emu_last_error(). Launches of
// one module are serialized by a mutex.
// Only 1-D grids and blocks are emulated (.y and .z are always 0 / 1).
#pragma once

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

// ---- qualifiers -----------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static  // block-shared because blocks never overlap; do not write `static __shared__`
#define __constant__ static
#define __grid_constant__
// __restrict__ is a g++ keyword already.

// Dynamic shared memory (the `smem` bytes of a launch), 16-byte aligned. Use as a declaration statement
// inside a kernel: OFZ_DYNAMIC_SMEM(float, buf); buf[i] = ...
#define OFZ_DYNAMIC_SMEM(type, name) type* const name = reinterpret_cast<type*>(::ofz_emu::dynamic_smem())

#ifndef OFZ_EMU_STACK_BYTES
#define OFZ_EMU_STACK_BYTES (64 * 1024)
#endif

namespace ofz_emu {
struct Dim3 {
  unsigned int x, y, z;
};
}  // namespace ofz_emu

// Set by the scheduler before it switches into a fiber.
static ofz_emu::Dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim{1, 1, 1}, gridDim{1, 1, 1};
constexpr int warpSize = 32;

// ---- fiber scheduler ------------------------------------------------------------------------------------
namespace ofz_emu {

constexpr int kMaxThreads = 1024;          // per block
constexpr int kMaxCluster = 8;             // blocks per cluster (the portable limit)
constexpr int kMaxFibers = kMaxCluster * kMaxThreads;  // threads of one cluster, all live at once
enum : unsigned char { kRun, kAtBlock, kAtWarp, kDone, kAtCluster, kAtMbar, kAtNamed };  // thread states
enum : unsigned char { kSync, kShfl, kBallot, kAny, kAll };          // warp operations
static const char* const kOpName[] = {"__syncwarp", "a shuffle", "__ballot_sync", "__any_sync", "__all_sync"};

struct Thread {
  unsigned char state, op;
  unsigned mask;     // lanes named by the pending warp op
  int src;           // lane a shuffle reads, -1 for its own value
  uint64_t val, out; // value posted to / result of the pending warp op
  bool arrived;      // between cluster_arrive and cluster_wait
  unsigned gen;      // the cluster barrier's phase it arrived in
};

// Context switching. x86-64 uses a small hand-written switch (callee-saved registers, MXCSR and the x87
// control word) because glibc's swapcontext makes a sigprocmask system call on every switch, which is
// ~10x slower; elsewhere, or with -DOFZ_EMU_UCONTEXT, makecontext/swapcontext.
#if defined(__x86_64__) && !defined(OFZ_EMU_UCONTEXT)
extern "C" void ofz_emu_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl ofz_emu_ctx_switch
  .hidden ofz_emu_ctx_switch
  .type ofz_emu_ctx_switch, @function
ofz_emu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ofz_emu_ctx_switch, .-ofz_emu_ctx_switch
)");
using Context = void*;  // the saved stack pointer
inline void ctx_swap(Context* save, Context* load) { ofz_emu_ctx_switch(save, *load); }
inline void ctx_make(Context* c, char* stack, size_t size, void (*fn)()) {
  uint64_t* top = reinterpret_cast<uint64_t*>(stack + size);  // 16-byte aligned (page aligned)
  top[-1] = 0;                                                 // fake return address of fn: it never returns
  top[-2] = reinterpret_cast<uint64_t>(fn);                    // popped by `ret`
  for (int r = 3; r <= 8; ++r) top[-r] = 0;                    // rbp rbx r12..r15
  top[-9] = 0x1f80u | (uint64_t)0x037fu << 32;                 // default MXCSR, x87 control word
  *c = top - 9;
}
#else
using Context = ucontext_t;
inline void ctx_swap(Context* save, Context* load) { swapcontext(save, load); }
inline void ctx_make(Context* c, char* stack, size_t size, void (*fn)()) {
  getcontext(c);
  c->uc_stack.ss_sp = stack;
  c->uc_stack.ss_size = size;
  c->uc_link = nullptr;
  makecontext(c, fn, 0);
}
#endif

struct State {
  Context main, dead;  // the launcher; where an aborted fiber saves itself (never resumed)
  Context ctx[kMaxFibers];
  char* stack[kMaxFibers] = {};   // guard page + OFZ_EMU_STACK_BYTES, mapped for one launch
  Thread th[kMaxFibers];
  unsigned waiting[kMaxFibers / 32];  // per warp: lanes parked at a warp op
  unsigned exited[kMaxFibers / 32];   // per warp: lanes that returned
  // n fibers = cluster blocks of `block` threads; fiber i is thread i % block of the cluster's block i / block
  int n = 0, block = 0, cluster = 1, live = 0, runnable = 0, at_cluster = 0, cur = 0;  // at_cluster: arrivals
  unsigned cluster_gen = 0;  // phases of the cluster barrier completed
  int live_in[kMaxCluster], at_block[kMaxCluster];  // per block of the cluster
  unsigned first_block = 0;                          // blockIdx.x of the cluster's block 0
  void (*body)(const void*) = nullptr;
  const void* args = nullptr;
  bool aborted = false;
  std::string error;
  unsigned char* smem = nullptr;
  size_t smem_cap = 0, smem_bytes = 0, smem_stride = 0;  // dynamic shared memory: one stride per block
  // Proxy fences (wgmma reads shared memory through the async proxy): a thread whose cp.async writes
  // landed is `unfenced` until it runs fence.proxy.async; a block barrier passed by such a thread leaves
  // the block's shared memory unfenced for the async proxy until the next barrier.
  bool unfenced[kMaxFibers];
  int unfenced_arrivals[kMaxCluster];
  bool block_unfenced[kMaxCluster];
  std::mutex mu;
};
static State S;

inline int block_of(int fiber) { return fiber / S.block; }
inline void* dynamic_smem() { return S.smem + (size_t)block_of(S.cur) * S.smem_stride; }
inline unsigned dynamic_smem_size() { return (unsigned)S.smem_bytes; }  // PTX %dynamic_smem_size

inline std::string format(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof buf, fmt, ap);
  return buf;
}

// Abort the launch from inside a fiber: record the message and jump back to the launcher.
[[noreturn]] __attribute__((format(printf, 1, 2))) inline void fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  S.error = format(fmt, ap);
  va_end(ap);
  S.aborted = true;
  ctx_swap(&S.dead, &S.main);
  abort();  // unreachable: a fresh context is made for every fiber at the next launch
}

inline unsigned lanes_of_warp(int w) {  // lanes that exist in warp w (a block's last warp may be partial)
  int k = S.n - w * 32;  // a cluster's blocks are whole warps (run_blocks checks)
  return k >= 32 ? 0xffffffffu : (1u << k) - 1;
}

[[noreturn]] inline void deadlock() {
  int at_block = 0, at_cluster = 0, at_warp = 0, done = 0, at_mbar = 0, at_named = 0, first_warp = -1;
  for (int i = 0; i < S.n; ++i) {
    unsigned char s = S.th[i].state;
    at_block += s == kAtBlock;
    at_cluster += s == kAtCluster;
    at_mbar += s == kAtMbar;
    at_named += s == kAtNamed;
    done += s == kDone;
    if (s == kAtWarp && at_warp++ == 0) first_warp = i;
  }
  std::string msg = "deadlock: " + std::to_string(at_block) + " thread(s) wait at __syncthreads, " +
                    (S.cluster > 1 ? std::to_string(at_cluster) + " at cluster_sync, " : std::string()) +
                    std::to_string(at_warp) + " at warp operations, " +
                    (at_mbar ? std::to_string(at_mbar) + " at mbarrier waits, " : std::string()) +
                    (at_named ? std::to_string(at_named) + " at named barriers, " : std::string()) +
                    std::to_string(done) + " exited";
  if (first_warp >= 0) {
    const Thread& t = S.th[first_warp];
    int w = first_warp / 32;
    unsigned missing = t.mask & ~S.waiting[w];
    char buf[256];
    snprintf(buf, sizeof buf, "; thread %d waits in %s with mask 0x%08x for lanes 0x%08x (exited 0x%08x)",
             first_warp, kOpName[t.op], t.mask, missing, S.exited[w]);
    msg += buf;
  }
  fail("%s", msg.c_str());
}

// Switch from the running fiber to fiber `next`; returns when someone switches back to this one.
inline void switch_to(int next) {
  int me = S.cur;
  if (next == me) return;
  S.cur = next;
  threadIdx.x = (unsigned)(next % S.block);
  blockIdx.x = S.first_block + (unsigned)block_of(next);
  ctx_swap(&S.ctx[me], &S.ctx[next]);
}

// Which thread runs next: round-robin, or (lowest_first) always the runnable thread of lowest index, so the
// cluster's first block runs as far ahead of the others as its barriers let it: a missing cross-block
// dependency (a stage refilled before the other block released it) then shows.
static bool lowest_first = false;

// Park the running thread (its state is already set) and run the next runnable one.
inline void yield() {
  if (S.runnable == 0) deadlock();
  int i = S.cur;
  if (lowest_first) {
    for (i = 0; S.th[i].state != kRun; ++i) {}
  } else {
    do i = (i + 1 == S.n) ? 0 : i + 1;
    while (S.th[i].state != kRun);
  }
  switch_to(i);
}

// Wake every thread of block `b` (of the cluster) parked in state `at`.
inline void release(int b, unsigned char at) {
  const int lo = b < 0 ? 0 : b * S.block, hi = b < 0 ? S.n : lo + S.block;
  for (int i = lo; i < hi; ++i)
    if (S.th[i].state == at) S.th[i].state = kRun, ++S.runnable;
}

inline void sync_block() {
  const int b = block_of(S.cur);
  S.th[S.cur].state = kAtBlock;
  --S.runnable;
  S.unfenced_arrivals[b] += S.unfenced[S.cur];
  if (++S.at_block[b] == S.live_in[b]) {  // the block's live threads all here (exited ones do not count)
    S.at_block[b] = 0;
    S.block_unfenced[b] = S.unfenced_arrivals[b] > 0;
    S.unfenced_arrivals[b] = 0;
    release(b, kAtBlock);
    return;
  }
  yield();
}

// bar.sync id, count: a named barrier (1..15; 0 is __syncthreads) of `count` threads of the block.
struct Named {
  int arrived = 0, count = 0;
};
static Named named[kMaxCluster][16];

// One thread's arrival at named barrier `id` (`op`: bar.sync or bar.arrive); completing the count releases the
// threads parked there in bar.sync (the caller too, if it parked first).
inline void named_arrival(int id, int count, const char* op) {
  if (id < 1 || id > 15 || count < 32 || count % 32 || count > S.block)
    fail("thread %d: %s %d, %d: ids 1..15, a multiple of 32 threads up to the block's %d", S.cur, op, id, count,
         S.block);
  const int b = block_of(S.cur);
  Named& nb = named[b][id];
  if (nb.arrived && nb.count != count)
    fail("thread %d: %s %d with %d threads while others arrived there for %d", S.cur, op, id, count, nb.count);
  nb.count = count;
  if (++nb.arrived == count) {
    nb.arrived = 0;
    for (int i = b * S.block; i < (b + 1) * S.block; ++i)
      if (S.th[i].state == kAtNamed && S.th[i].val == (uint64_t)id) S.th[i].state = kRun, ++S.runnable;
  }
}

inline void sync_named(int id, int count) {
  S.th[S.cur].state = kAtNamed;
  S.th[S.cur].val = (uint64_t)id;
  --S.runnable;
  named_arrival(id, count, "bar.sync");
  if (S.th[S.cur].state == kAtNamed) yield();  // released at once if it completed the count
}

// bar.arrive: counts the thread toward barrier `id` and lets it run on.
inline void arrive_named(int id, int count) { named_arrival(id, count, "bar.arrive"); }

// After a cluster ended: a message if a named barrier was left with arrivals that never completed it (a
// bar.arrive whose partners never synced there).
inline const char* named_pending() {
  static char msg[160];
  for (int b = 0; b < S.cluster; ++b)
    for (int id = 1; id < 16; ++id)
      if (named[b][id].arrived) {
        snprintf(msg, sizeof msg, "block %d exited with %d of %d threads arrived at named barrier %d", b,
                 named[b][id].arrived, named[b][id].count, id);
        return msg;
      }
  return nullptr;
}

inline void named_reset() {
  for (auto& blk : named)
    for (Named& nb : blk) nb = Named();
}

// barrier.cluster: every live thread of every block of the cluster. Its halves: arrive counts the thread and
// lets it go on; wait parks it until every live thread has arrived in its phase. Between them the thread
// must not read another block's shared memory (a block that has passed its wait may already overwrite it).
inline void cluster_phase_done() {
  S.at_cluster = 0;
  ++S.cluster_gen;
  release(-1, kAtCluster);
}

inline void cluster_arrive() {
  Thread& t = S.th[S.cur];
  if (t.arrived) fail("thread %d: cluster_arrive twice without cluster_wait", S.cur);
  t.arrived = true;
  t.gen = S.cluster_gen;
  if (++S.at_cluster == S.live) cluster_phase_done();
}

inline void cluster_wait() {
  Thread& t = S.th[S.cur];
  if (!t.arrived) fail("thread %d: cluster_wait without cluster_arrive", S.cur);
  t.arrived = false;
  if (S.cluster_gen != t.gen) return;  // every live thread has arrived since
  t.state = kAtCluster;
  --S.runnable;
  yield();
}

inline void sync_cluster() {
  cluster_arrive();
  cluster_wait();
}

// All lanes in `need` of warp w have posted: compute every result, then wake them.
inline void complete(int w, unsigned need, unsigned char op) {
  Thread* t = &S.th[w * 32];
  unsigned ballot = 0;
  for (unsigned m = need; m; m &= m - 1) {
    int j = __builtin_ctz(m);
    if (t[j].val) ballot |= 1u << j;
  }
  for (unsigned m = need; m; m &= m - 1) {
    Thread& x = t[__builtin_ctz(m)];
    switch (op) {
      case kShfl: x.out = x.src < 0 ? x.val : t[x.src].val; break;
      case kBallot: x.out = ballot; break;
      case kAny: x.out = ballot != 0; break;
      case kAll: x.out = ballot == need; break;
      default: break;
    }
    if (x.state == kAtWarp) x.state = kRun, ++S.runnable;
  }
  S.waiting[w] &= ~need;
}

// A warp-synchronous operation: wait until every lane named in `mask` arrives (exited lanes count as
// arrived only for __syncwarp), exchanging `val`. Returns this lane's result.
inline uint64_t warp_op(unsigned char op, unsigned mask, uint64_t val, int src) {
  const int me = S.cur, w = me / 32, l = me % 32;
  if (!(mask >> l & 1u))
    fail("thread %d calls %s with mask 0x%08x, which excludes its own lane", me, kOpName[op], mask);
  mask &= lanes_of_warp(w);
  if (op != kSync && (mask & S.exited[w]))
    fail("thread %d calls %s with mask 0x%08x but lanes 0x%08x of its warp have exited", me, kOpName[op], mask,
         mask & S.exited[w]);
  if (src >= 0 && !(mask >> src & 1u))
    fail("thread %d: shuffle reads lane %d, which is not in mask 0x%08x or does not exist", me, src, mask);
  for (unsigned m = S.waiting[w]; m; m &= m - 1) {  // parked lanes that share lanes with us must agree
    const Thread& o = S.th[w * 32 + __builtin_ctz(m)];
    if ((o.mask & mask) && (o.mask != mask || o.op != op))
      fail("thread %d calls %s with mask 0x%08x while lane %d waits in %s with mask 0x%08x", me, kOpName[op],
           mask, __builtin_ctz(m), kOpName[o.op], o.mask);
  }
  Thread& t = S.th[me];
  t.op = op, t.mask = mask, t.val = val, t.src = src;
  const unsigned need = mask & ~S.exited[w];
  if (((S.waiting[w] | 1u << l) & need) == need) {
    complete(w, need, op);
    return t.out;
  }
  S.waiting[w] |= 1u << l;
  t.state = kAtWarp;
  --S.runnable;
  yield();
  return t.out;
}

// The running thread returned from the kernel.
inline void thread_exit() {
  const int me = S.cur, w = me / 32, l = me % 32, b = block_of(me);
  if (S.th[me].arrived) fail("thread %d exited between cluster_arrive and cluster_wait", me);
  S.th[me].state = kDone;
  --S.runnable;
  --S.live;
  --S.live_in[b];
  S.exited[w] |= 1u << l;
  for (unsigned m = S.waiting[w]; m; m &= m - 1) {
    const int j = __builtin_ctz(m);
    const Thread& o = S.th[w * 32 + j];
    if (!(o.mask >> l & 1u) || !(S.waiting[w] >> j & 1u)) continue;
    if (o.op != kSync)
      fail("thread %d exited while lane %d of its warp waits for it in %s (mask 0x%08x)", me, j, kOpName[o.op],
           o.mask);
    const unsigned need = o.mask & ~S.exited[w];  // a __syncwarp group may now be complete
    if ((S.waiting[w] & need) == need) complete(w, need, kSync);
  }
  if (S.at_block[b] && S.at_block[b] == S.live_in[b]) S.at_block[b] = 0, release(b, kAtBlock);
  if (S.at_cluster && S.at_cluster == S.live) cluster_phase_done();
  if (S.live == 0) {
    ctx_swap(&S.ctx[me], &S.main);  // block (cluster) finished; the next one resumes this fiber here
    return;
  }
  yield();
}

inline void fiber_main() {
  for (;;) {
    S.body(S.args);
    thread_exit();
  }
}

// One fiber's mapping: a guard page, then OFZ_EMU_STACK_BYTES rounded up to whole pages.
inline size_t fiber_map_bytes(size_t page) { return page + ((OFZ_EMU_STACK_BYTES + page - 1) / page) * page; }

inline bool prepare_fibers(int n) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE);
  const size_t bytes = fiber_map_bytes(page);
  for (int i = 0; i < n; ++i) {
    if (!S.stack[i]) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) return false;
      mprotect(p, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting memory
      S.stack[i] = static_cast<char*>(p);
    }
    // Fresh context every launch: an aborted launch leaves fibers mid-kernel.
    ctx_make(&S.ctx[i], S.stack[i] + page, bytes - page, fiber_main);
  }
  return true;
}

inline void async_reset(int n);  // tensor-core section below
inline const char* mbar_copies_in_flight();
inline void smem_traffic_block_done();

// Unmap the fiber stacks after a launch: every loaded module has its own State, and a process that loads
// hundreds of them (a test session) would otherwise keep two mappings per thread each and run out of
// vm.max_map_count.
inline void release_fibers() {
  const size_t bytes = fiber_map_bytes((size_t)sysconf(_SC_PAGESIZE));
  for (char*& p : S.stack) {
    if (p) munmap(p, bytes);
    p = nullptr;
  }
  free(S.smem);
  S.smem = nullptr;
  S.smem_cap = 0;
}

inline int run_blocks(unsigned grid, unsigned block, unsigned cluster, void (*body)(const void*), const void* args,
                      const char* name);

inline int launch(unsigned grid, unsigned block, unsigned cluster, void (*body)(const void*), const void* args,
                  const char* name) {
  std::lock_guard<std::mutex> lock(S.mu);
  const int rc = run_blocks(grid, block, cluster, body, args, name);
  release_fibers();
  return rc;
}

inline int run_blocks(unsigned grid, unsigned block, unsigned cluster, void (*body)(const void*), const void* args,
                      const char* name) {
  S.error.clear();
  S.aborted = false;
  char buf[200];
  if (block == 0 || block > (unsigned)kMaxThreads || grid == 0 || grid > 0x7fffffffu || !args || cluster == 0 ||
      cluster > (unsigned)kMaxCluster || grid % cluster != 0 || cluster * block > (unsigned)kMaxFibers ||
      (cluster > 1 && block % 32 != 0)) {
    snprintf(buf, sizeof buf, "kernel %s: invalid launch (grid %u, block %u, cluster %u, args %p)", name, grid, block,
             cluster, args);
    S.error = buf;
    return 1;
  }
  if (!prepare_fibers((int)(cluster * block))) {
    S.error = std::string("kernel ") + name + ": cannot allocate fiber stacks";
    return 1;
  }
  S.smem_stride = ((S.smem_bytes < 16 ? 16 : S.smem_bytes) + 127) / 128 * 128;
  const size_t want = S.smem_stride * cluster;
  if (want > S.smem_cap) {
    free(S.smem);
    S.smem = static_cast<unsigned char*>(aligned_alloc(128, (want + 127) / 128 * 128));
    S.smem_cap = S.smem ? want : 0;
    if (!S.smem) {
      S.error = std::string("kernel ") + name + ": cannot allocate dynamic shared memory";
      return 1;
    }
  }
  memset(S.smem, 0xff, S.smem_cap);  // uninitialized on a GPU; 0xff reads as NaN / -1 to expose bugs
  S.body = body;
  S.args = args;
  S.block = (int)block;
  S.cluster = (int)cluster;
  S.n = (int)(cluster * block);
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  for (unsigned b = 0; b < grid; b += cluster) {
    for (int i = 0; i < S.n; ++i) S.th[i].state = kRun, S.th[i].arrived = false;
    memset(S.waiting, 0, sizeof S.waiting);
    memset(S.exited, 0, sizeof S.exited);
    S.live = S.runnable = S.n;
    for (unsigned c = 0; c < cluster; ++c)
      S.live_in[c] = (int)block, S.at_block[c] = 0, S.unfenced_arrivals[c] = 0, S.block_unfenced[c] = false;
    S.at_cluster = 0;
    S.cur = 0;
    async_reset(S.n);
    S.first_block = b;
    blockIdx = {b, 0, 0};
    threadIdx = {0, 0, 0};
    ctx_swap(&S.main, &S.ctx[0]);
    smem_traffic_block_done();
    if (!S.aborted && mbar_copies_in_flight()) {
      S.aborted = true;
      S.error = mbar_copies_in_flight();
    }
    if (!S.aborted && named_pending()) {
      S.aborted = true;
      S.error = named_pending();
    }
    if (S.aborted) {
      if (cluster > 1)
        snprintf(buf, sizeof buf, "kernel %s, cluster of blocks %u-%u of %u (%u threads each): ", name, b,
                 b + cluster - 1, grid, block);
      else
        snprintf(buf, sizeof buf, "kernel %s, block %u of %u (%u threads): ", name, b, grid, block);
      S.error = buf + S.error;
      return 1;
    }
  }
  return 0;
}

template <class T> struct ident { using type = T; };

template <class T> inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp ops move at most 8 bytes");
  uint64_t b = 0;
  memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T> inline T from_bits(uint64_t b) {
  T v;
  memcpy(&v, &b, sizeof(T));
  return v;
}

// Source lane of a shuffle with PTX semantics (width-sized segments); -1 means "own value".
inline int shfl_lane(int mode, int arg, int width) {
  if (width < 1 || width > 32 || (width & (width - 1)))
    fail("thread %d: shuffle width %d is not a power of two in [1, 32]", S.cur, width);
  const int lane = S.cur % 32, first = lane & ~(width - 1), last = first + width - 1;
  int j;
  switch (mode) {
    case 0: j = first + (arg & (width - 1)); break;       // idx
    case 1: j = lane - arg; if (j < first) j = -1; break;  // up
    case 2: j = lane + arg; if (j > last) j = -1; break;   // down
    default: j = lane ^ arg; if (j > last || j < 0) j = -1; break;  // xor: may read earlier segments
  }
  return j == lane ? -1 : j;
}

template <class T> inline T shfl(unsigned mask, T var, int mode, int arg, int width) {
  return from_bits<T>(warp_op(kShfl, mask, to_bits(var), shfl_lane(mode, arg, width)));
}

// ---- IEEE conversions (bit-exact, round to nearest even; NaN -> canonical 0x7fff as on the GPU) --------
inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f2u(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;
  if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);  // >= 2^16 (incl. inf)
  if (a >= 0x38800000u) {                                   // normal half; the carry may round up to inf
    uint32_t h = (a >> 13) - (112u << 10), rem = a & 0x1fffu;
    h += (rem > 0x1000u) || (rem == 0x1000u && (h & 1u));
    return (uint16_t)(sign | h);
  }
  if (a < 0x33000000u) return (uint16_t)sign;  // below 2^-25: rounds to zero
  const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, s = 126u - e;  // s in [14, 24]
  uint32_t h = m >> s;
  const uint32_t rem = m & ((1u << s) - 1), half = 1u << (s - 1);
  h += (rem > half) || (rem == half && (h & 1u));
  return (uint16_t)(sign | h);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return u2f(sign | 0x7f800000u | (m << 13));
  if (e == 0) {
    const float v = (float)m * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

}  // namespace ofz_emu

// ---- warp and block primitives ----------------------------------------------------------------------------
inline void __syncthreads() { ofz_emu::sync_block(); }

// Thread-block clusters (ortfuse_kernel.h's ofz::cluster_* call these under emulation).
namespace ofz_emu {
inline unsigned cluster_rank() { return (unsigned)block_of(S.cur); }
inline unsigned cluster_size() { return (unsigned)S.cluster; }
inline unsigned cluster_id() { return S.first_block / (unsigned)S.cluster; }
inline unsigned cluster_count() { return gridDim.x / (unsigned)S.cluster; }
// mapa: the same offset in block `rank`'s dynamic shared memory (the only shared storage that is per block here)
inline const void* cluster_map(const void* p, unsigned rank) {
  if (S.th[S.cur].arrived && rank != (unsigned)block_of(S.cur))
    fail("thread %d: cluster_map to block %u between cluster_arrive and cluster_wait", S.cur, rank);
  const unsigned char* own = static_cast<const unsigned char*>(dynamic_smem());
  const unsigned char* q = static_cast<const unsigned char*>(p);
  if (q < own || q >= own + S.smem_bytes)
    fail("thread %d: cluster_map of %p, which is not in its block's dynamic shared memory", S.cur, p);
  if (rank >= (unsigned)S.cluster) fail("thread %d: cluster_map to rank %u of a %d-block cluster", S.cur, rank, S.cluster);
  return S.smem + (size_t)rank * S.smem_stride + (size_t)(q - own);
}
}  // namespace ofz_emu
inline void __syncwarp(unsigned mask = 0xffffffffu) { ofz_emu::warp_op(ofz_emu::kSync, mask, 0, -1); }
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() { ofz_emu::fail("thread %d called __trap()", ofz_emu::S.cur); }

template <class T> inline T __shfl_sync(unsigned mask, T var, int src, int width = warpSize) {
  return ofz_emu::shfl(mask, var, 0, src, width);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return ofz_emu::shfl(mask, var, 1, (int)delta, width);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return ofz_emu::shfl(mask, var, 2, (int)delta, width);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return ofz_emu::shfl(mask, var, 3, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)ofz_emu::warp_op(ofz_emu::kBallot, mask, pred != 0, -1);
}
inline int __any_sync(unsigned mask, int pred) { return (int)ofz_emu::warp_op(ofz_emu::kAny, mask, pred != 0, -1); }
inline int __all_sync(unsigned mask, int pred) { return (int)ofz_emu::warp_op(ofz_emu::kAll, mask, pred != 0, -1); }

// Fibers never run concurrently, so atomics are plain read-modify-writes.
template <class T> inline T atomicAdd(T* p, typename ofz_emu::ident<T>::type v) { T o = *p; *p = o + v; return o; }
template <class T> inline T atomicSub(T* p, typename ofz_emu::ident<T>::type v) { T o = *p; *p = o - v; return o; }
template <class T> inline T atomicMax(T* p, typename ofz_emu::ident<T>::type v) { T o = *p; *p = o < v ? v : o; return o; }
template <class T> inline T atomicMin(T* p, typename ofz_emu::ident<T>::type v) { T o = *p; *p = v < o ? v : o; return o; }
template <class T> inline T atomicExch(T* p, typename ofz_emu::ident<T>::type v) { T o = *p; *p = v; return o; }
template <class T> inline T atomicCAS(T* p, typename ofz_emu::ident<T>::type c, typename ofz_emu::ident<T>::type v) {
  T o = *p;
  if (o == c) *p = v;
  return o;
}
template <class T> inline T __ldg(const T* p) { return *p; }

// ---- half types -------------------------------------------------------------------------------------------
struct __half_raw { unsigned short x; };
struct __nv_bfloat16_raw { unsigned short x; };

struct __align__(2) __half {
  unsigned short __x;
  __half() = default;
  __half(float f) : __x(ofz_emu::f32_to_f16(f)) {}
  __half(__half_raw r) : __x(r.x) {}
  operator float() const { return ofz_emu::f16_to_f32(__x); }
  operator __half_raw() const { return {__x}; }
};

struct __align__(2) __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(ofz_emu::f32_to_bf16(f)) {}
  __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
  operator float() const { return ofz_emu::bf16_to_f32(__x); }
  operator __nv_bfloat16_raw() const { return {__x}; }
};

// Same-type arithmetic and comparisons, computed in fp32 and rounded once (matches the GPU for + - * /).
#define OFZ_EMU_HALF_OPS(H)                                                                                   \
  inline H operator+(const H& a, const H& b) { return H(float(a) + float(b)); }                              \
  inline H operator-(const H& a, const H& b) { return H(float(a) - float(b)); }                              \
  inline H operator*(const H& a, const H& b) { return H(float(a) * float(b)); }                              \
  inline H operator/(const H& a, const H& b) { return H(float(a) / float(b)); }                              \
  inline H operator-(const H& a) { H r = a; r.__x ^= 0x8000u; return r; }                                    \
  inline H& operator+=(H& a, const H& b) { return a = a + b; }                                                \
  inline H& operator-=(H& a, const H& b) { return a = a - b; }                                                \
  inline H& operator*=(H& a, const H& b) { return a = a * b; }                                                \
  inline H& operator/=(H& a, const H& b) { return a = a / b; }                                                \
  inline bool operator==(const H& a, const H& b) { return float(a) == float(b); }                            \
  inline bool operator!=(const H& a, const H& b) { return float(a) != float(b); }                            \
  inline bool operator<(const H& a, const H& b) { return float(a) < float(b); }                              \
  inline bool operator<=(const H& a, const H& b) { return float(a) <= float(b); }                            \
  inline bool operator>(const H& a, const H& b) { return float(a) > float(b); }                              \
  inline bool operator>=(const H& a, const H& b) { return float(a) >= float(b); }
OFZ_EMU_HALF_OPS(__half)
OFZ_EMU_HALF_OPS(__nv_bfloat16)
#undef OFZ_EMU_HALF_OPS

inline float __half2float(__half h) { return float(h); }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short x) { return __half_raw{x}; }
inline bool __hisnan(__half h) { return (h.__x & 0x7fffu) > 0x7c00u; }
inline bool __hisinf(__half h) { return (h.__x & 0x7fffu) == 0x7c00u; }
inline float __bfloat162float(__nv_bfloat16 h) { return float(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short x) { return __nv_bfloat16_raw{x}; }
inline bool __hisnan(__nv_bfloat16 h) { return (h.__x & 0x7fffu) > 0x7f80u; }

// ---- math missing on the host -----------------------------------------------------------------------------
// glibc's math.h already declares __expf, __logf, ... (its internal aliases), so these become macros that
// name our own functions; math.h is included above, so its declarations are not affected.
namespace ofz_emu {
inline float fast_expf(float x) { return expf(x); }
inline float fast_exp10f(float x) { return exp10f(x); }
inline float fast_logf(float x) { return logf(x); }
inline float fast_log2f(float x) { return log2f(x); }
inline float fast_log10f(float x) { return log10f(x); }
inline float fast_powf(float x, float y) { return powf(x, y); }
inline float fast_sinf(float x) { return sinf(x); }
inline float fast_cosf(float x) { return cosf(x); }
inline float fast_tanf(float x) { return tanf(x); }
}  // namespace ofz_emu
#define __expf ofz_emu::fast_expf
#define __exp10f ofz_emu::fast_exp10f
#define __logf ofz_emu::fast_logf
#define __log2f ofz_emu::fast_log2f
#define __log10f ofz_emu::fast_log10f
#define __powf ofz_emu::fast_powf
#define __sinf ofz_emu::fast_sinf
#define __cosf ofz_emu::fast_cosf
#define __tanf ofz_emu::fast_tanf

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float rcbrtf(float x) { return 1.0f / cbrtf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float normcdff(float x) { return 0.5f * erfcf(-x * 0.70710678118654752f); }
inline double normcdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752); }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }  // NaN -> 0
inline int __float2int_rn(float x) {  // as the GPU's cvt.rni.s32.f32: NaN gives 0, out-of-range values saturate
  if (x != x) return 0;
  const float r = nearbyintf(x);
  return r >= 2147483648.0f ? 2147483647 : r < -2147483648.0f ? (-2147483647 - 1) : (int)r;
}
inline int __float2int_rz(float x) { return (int)x; }
inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
inline long long __float2ll_rz(float x) { return (long long)x; }
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline int __float_as_int(float f) { int x; memcpy(&x, &f, 4); return x; }
inline float __uint_as_float(unsigned x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned x; memcpy(&x, &f, 4); return x; }
inline double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }
inline long long __double_as_longlong(double d) { long long x; memcpy(&x, &d, 8); return x; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }

// CUDA's global min/max accept any pair of arithmetic types; the result has their common type.
template <class A, class B, class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(b) < C(a) ? C(b) : C(a);
}
template <class A, class B, class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return C(a) < C(b) ? C(b) : C(a);
}

// ---- small vector types -------------------------------------------------------------------------------------
struct __align__(8) float2 { float x, y; };
struct float3 { float x, y, z; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) int2 { int x, y; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(8) uint2 { unsigned x, y; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(16) double2 { double x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float3 make_float3(float x, float y, float z) { return {x, y, z}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

// ---- tensor cores and asynchronous copies (sm_80 mma.sync, ldmatrix, cp.async) --------------------------------
// Warp-collective instructions post their operands per lane, meet at a warp barrier, compute each lane's
// result from every lane's operands (fragment layouts of the PTX ISA), and meet again so no lane overwrites
// its registers while another still reads them. cp.async copies are queued per thread and performed when
// cp.async.wait_group retires their group, so a kernel that reads shared memory too early reads stale data
// (0xff bytes: NaN) here too.
namespace ofz_emu {

struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes;           // copied from src; the rest of the 16 bytes is zero-filled
  unsigned group;      // index of the commit group it joins
};
static std::vector<AsyncCopy> async_queue[kMaxFibers];
static unsigned async_groups[kMaxFibers];  // commit groups closed so far by the thread
static const void* posted[kMaxFibers][2];   // per-lane operand pointers of a warp-collective op

inline void wgmma_reset(int n);

// ---- shared-memory traffic (opt-in statistics: ofz_emu_smem_traffic) ----------------------------------------
// Shared memory serves one 128-byte wavefront per clock: 32 banks of 4-byte words. The accesses of one phase
// (one 8 x 8 matrix of an ldmatrix: 8 rows of 16 bytes; a quarter-warp's 16-byte cp.async stores) take as
// many wavefronts as the most distinct words that fall in one bank; conflict-free, ceil(bytes / 128).
// ldmatrix phases are exact (the warp meets at the instruction); a warp's cp.async stores are paired by
// their order in each lane, which matches the instruction when every lane issued the same number of them
// (otherwise `exact` turns false). The dynamic shared memory is 128-byte aligned, so bank = address / 4 % 32.
struct SmemTraffic {
  unsigned long long ldmatrix = 0, ldmatrix_ideal = 0, cp_async = 0, cp_async_ideal = 0;
  bool exact = true;
};
static SmemTraffic traffic;
static bool traffic_on = false;
static std::vector<const void*> traffic_log[kMaxFibers];  // the block's cp.async destinations, per thread

// Wavefronts for `n` accesses of `bytes` each (a multiple of 4) starting at addr[i].
inline int phase_wavefronts(const void* const* addr, int n, int bytes) {
  uintptr_t words[32 * 4];
  int count = 0;
  for (int i = 0; i < n; ++i)
    for (int w = 0; w < bytes / 4; ++w) words[count++] = reinterpret_cast<uintptr_t>(addr[i]) / 4 + w;
  int most = 0;
  for (int bank = 0; bank < 32; ++bank) {
    int distinct = 0;
    for (int i = 0; i < count; ++i) {
      if (words[i] % 32 != (uintptr_t)bank) continue;
      bool seen = false;
      for (int j = 0; j < i && !seen; ++j) seen = words[j] == words[i];
      distinct += !seen;
    }
    most = distinct > most ? distinct : most;
  }
  return most;
}

// After each block (cluster): pair the warps' cp.async stores into quarter-warp phases.
inline void smem_traffic_block_done() {
  if (!traffic_on) return;
  for (int w = 0; w * 32 < S.n; ++w) {
    size_t len = 0;
    bool same = true;
    for (int l = 0; l < 32 && w * 32 + l < S.n; ++l) {
      const size_t k = traffic_log[w * 32 + l].size();
      if (l == 0) len = k;
      same = same && k == len;
    }
    if (!same) traffic.exact = false;
    for (size_t k = 0; same && k < len; ++k)
      for (int q = 0; q < 4 && w * 32 + 8 * q < S.n; ++q) {
        const void* addr[8];
        int n = 0;
        for (int l = 8 * q; l < 8 * q + 8 && w * 32 + l < S.n; ++l) addr[n++] = traffic_log[w * 32 + l][k];
        traffic.cp_async += (unsigned long long)phase_wavefronts(addr, n, 16);
        traffic.cp_async_ideal += (unsigned long long)((n * 16 + 127) / 128);
      }
  }
  for (int i = 0; i < S.n; ++i) traffic_log[i].clear();
}

inline void mbar_reset();

inline void async_reset(int n) {
  for (int i = 0; i < n; ++i) async_queue[i].clear(), async_groups[i] = 0, S.unfenced[i] = false;
  wgmma_reset(n);
  mbar_reset();
  named_reset();
}

inline void check_vector(const void* p, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(p) % bytes)
    fail("thread %d: a %zu-byte vector access at %p is misaligned (a GPU faults)", S.cur, bytes, p);
}

inline void async_copy(void* dst, const void* src, int src_bytes) {
  if ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u)
    fail("thread %d: cp.async of 16 bytes with a misaligned address (smem %p, global %p)", S.cur, dst, src);
  if (src_bytes < 0 || src_bytes > 16) fail("thread %d: cp.async src-size %d outside [0, 16]", S.cur, src_bytes);
  async_queue[S.cur].push_back({dst, src, src_bytes, async_groups[S.cur]});
  if (traffic_on) traffic_log[S.cur].push_back(dst);
}

inline void async_commit() { ++async_groups[S.cur]; }

// `*.wait_group keep`: completes (`done`) every queued operation of a committed group but the `keep` most
// recent ones, in issue order; the rest stay queued.
template <class Op, class Done> inline void retire_groups(std::vector<Op>& q, unsigned closed, unsigned keep, Done done) {
  const unsigned limit = closed > keep ? closed - keep : 0;
  size_t kept = 0;
  for (size_t i = 0; i < q.size(); ++i) {
    if (q[i].group < limit) {
      done(q[i]);
    } else {
      if (kept != i) q[kept] = std::move(q[i]);
      ++kept;
    }
  }
  q.resize(kept);
}

// Perform the copies of every committed group except the `keep` most recent ones.
inline void async_wait(unsigned keep) {
  retire_groups(async_queue[S.cur], async_groups[S.cur], keep, [](const AsyncCopy& c) {
    S.unfenced[S.cur] = true;
    if (c.bytes) memcpy(c.dst, c.src, (size_t)c.bytes);
    memset(static_cast<char*>(c.dst) + c.bytes, 0, (size_t)(16 - c.bytes));
  });
}

// A full-warp rendezvous for mma/ldmatrix: publishes two pointers, returns the lane's warp base index.
inline int collective_begin(const char* what, const void* p0, const void* p1) {
  const int w = S.cur / 32;
  if (lanes_of_warp(w) != 0xffffffffu) fail("thread %d: %s needs a full warp (block of %d threads)", S.cur, what, S.block);
  posted[S.cur][0] = p0;
  posted[S.cur][1] = p1;
  warp_op(kSync, 0xffffffffu, 0, -1);
  return w * 32;
}
inline void collective_end() { warp_op(kSync, 0xffffffffu, 0, -1); }

inline float half_bits(uint32_t reg, int hi, bool bf16) {
  const uint16_t h = (uint16_t)(hi ? reg >> 16 : reg & 0xffffu);
  return bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32, D = A * B + C in fp32.
inline void mma_16816(float* c, const unsigned* a, const unsigned* b, bool bf16) {
  const int base = collective_begin("mma.sync", a, b), l = S.cur % 32, g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    float acc = c[i];
    for (int k = 0; k < 16; ++k) {
      const unsigned* ra = static_cast<const unsigned*>(posted[base + 4 * (row % 8) + (k % 8) / 2][0]);
      const unsigned* rb = static_cast<const unsigned*>(posted[base + 4 * col + (k % 8) / 2][1]);
      acc += half_bits(ra[row / 8 + 2 * (k / 8)], k % 2, bf16) * half_bits(rb[k / 8], k % 2, bf16);
    }
    c[i] = acc;
  }
  collective_end();
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: operands are fp32 bit patterns of which the
// tensor core reads the top 19 bits.
inline void mma_1688_tf32(float* c, const unsigned* a, const unsigned* b) {
  const int base = collective_begin("mma.sync", a, b), l = S.cur % 32, g = l / 4, t = l % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
    float acc = c[i];
    for (int k = 0; k < 8; ++k) {
      const unsigned* ra = static_cast<const unsigned*>(posted[base + 4 * (row % 8) + k % 4][0]);
      const unsigned* rb = static_cast<const unsigned*>(posted[base + 4 * col + k % 4][1]);
      acc += u2f(ra[row / 8 + 2 * (k / 4)] & 0xffffe000u) * u2f(rb[k / 4] & 0xffffe000u);
    }
    c[i] = acc;
  }
  collective_end();
}

// cvt.rna.tf32.f32: round to nearest, ties away from zero, to 10 mantissa bits.
inline unsigned to_tf32(float x) {
  const uint32_t u = f2u(x);
  if ((u & 0x7fffffffu) >= 0x7f800000u) return u;  // inf / nan unchanged
  return (u + 0x1000u) & 0xffffe000u;
}

// ldmatrix.sync.aligned.m8n8.x{1,2,4}[.trans].shared.b16: lanes 8i..8i+7 give the row addresses of
// matrix i; lane l receives row l/4, columns 2(l%4) and 2(l%4)+1 of each matrix (.trans: the transpose).
inline void ldmatrix(unsigned* r, const void* row, int count, bool trans) {
  if (reinterpret_cast<uintptr_t>(row) & 15u) fail("thread %d: ldmatrix row address %p is not 16-byte aligned", S.cur, row);
  const int base = collective_begin("ldmatrix", row, nullptr), l = S.cur % 32;
  if (traffic_on && l == 0)
    for (int i = 0; i < count; ++i) {
      const void* rows[8];
      for (int r = 0; r < 8; ++r) rows[r] = posted[base + 8 * i + r][0];
      traffic.ldmatrix += (unsigned long long)phase_wavefronts(rows, 8, 16);
      traffic.ldmatrix_ideal += 1;
    }
  for (int i = 0; i < count; ++i) {
    uint16_t e[2];
    for (int j = 0; j < 2; ++j) {
      const uint16_t* p = trans ? static_cast<const uint16_t*>(posted[base + 8 * i + 2 * (l % 4) + j][0]) + l / 4
                                : static_cast<const uint16_t*>(posted[base + 8 * i + l / 4][0]) + 2 * (l % 4) + j;
      e[j] = *p;
    }
    r[i] = (unsigned)e[0] | (unsigned)e[1] << 16;
  }
  collective_end();
}


// ---- Hopper warpgroup MMA (sm_90a wgmma.mma_async, both operands in shared memory) --------------------------
// Shared-memory addresses (smem_u32, the 14-bit descriptor fields) are offsets into a shared window in which
// the block's dynamic shared memory starts at kSmemWindowBase: 512, not 1024, as when static shared memory
// precedes it on a GPU, so a kernel that assumes its dynamic shared memory is 1024-byte aligned reads
// swizzled tiles wrongly here. Only the descriptors ortfuse_gemm.h builds are emulated: K-major operands in
// the 128-byte swizzle (8-row atoms of 128-byte rows, 1024-byte aligned; chunk c of row r stored at c ^ r % 8,
// i.e. address bits 4-6 XOR bits 7-9), stride byte offset between 8-row groups.
// Each thread computes its own accumulator fragment (the PTX ISA's m64nNk16 layout: warp w of the warpgroup
// holds rows 16w + lane/4 (+8), columns 8j + 2(lane%4) (+1)) when it issues the instruction, from the
// shared memory it reads then, and records it; wgmma.wait_group adds the retired results to the registers,
// so registers read early hold stale values, and fails if any operand byte changed in between (a stage
// overwritten while the tensor cores may still read it). Issuing requires wgmma.fence since the thread's
// last wait and fence.proxy.async by every thread whose cp.async writes landed before the last barrier.
constexpr unsigned kSmemWindowBase = 512;

inline unsigned smem_addr(const void* p) {
  const unsigned char* own = static_cast<const unsigned char*>(dynamic_smem());
  const unsigned char* q = static_cast<const unsigned char*>(p);
  if (q < own || q > own + S.smem_stride)
    fail("thread %d: shared-window address of %p, which is not in its block's dynamic shared memory", S.cur, p);
  return kSmemWindowBase + (unsigned)(q - own);
}

struct WgmmaOp {
  float* d;
  int n;                                   // accumulator registers (N / 2)
  unsigned group;
  float prod[128];                         // A * B of this thread's fragment
  std::vector<std::pair<unsigned, uint16_t>> read;  // (window address, bits) of every operand element read
};
static std::vector<WgmmaOp> wgmma_queue[kMaxFibers];
static unsigned wgmma_groups[kMaxFibers];
static bool wgmma_fenced[kMaxFibers];

inline void wgmma_reset(int n) {
  for (int i = 0; i < n; ++i) wgmma_queue[i].clear(), wgmma_groups[i] = 0, wgmma_fenced[i] = false;
}

inline uint16_t smem_bits(unsigned addr) {
  if (addr < kSmemWindowBase || addr + 2 > kSmemWindowBase + S.smem_bytes)
    fail("thread %d: wgmma reads shared address 0x%x outside the block's %zu dynamic bytes", S.cur, addr,
         S.smem_bytes);
  uint16_t v;
  memcpy(&v, static_cast<const unsigned char*>(dynamic_smem()) + (addr - kSmemWindowBase), 2);
  return v;
}

// Window address of element (row, k) (k < 16) of the K-major 128-byte-swizzled operand `desc` describes.
inline unsigned wgmma_element(unsigned long long desc, int row, int k, const char* which) {
  const unsigned start = (unsigned)(desc & 0x3fffu) << 4, sbo = (unsigned)(desc >> 32 & 0x3fffu) << 4;
  if ((desc >> 62) != 1u || (desc >> 49 & 7u) != 0)
    fail("thread %d: wgmma %s descriptor 0x%016llx: only the 128-byte swizzle with base offset 0 is emulated", S.cur,
         which, desc);
  if ((start & 0x380u) != 0 || (start & 0x7fu) > 96)
    fail("thread %d: wgmma %s descriptor starts at 0x%x: not within the first row of a 1024-byte aligned "
         "swizzle atom with 16 elements to its end", S.cur, which, start);
  const unsigned addr = start + (unsigned)(row / 8) * sbo + (unsigned)(row % 8) * 128u + (unsigned)k * 2u;
  return addr ^ ((addr >> 7 & 7u) << 4);
}

inline void wgmma_fence() { wgmma_fenced[S.cur] = true; }
inline void fence_proxy_async() { S.unfenced[S.cur] = false; }

// wgmma.mma_async.sync.aligned.m64n{N}k16.f32.{f16,bf16}, scale-d 1, no negation, both operands K-major.
inline void wgmma(float* d, int N, unsigned long long da, unsigned long long db, bool bf16) {
  const int me = S.cur, tid = me % S.block;
  if (S.block % 128) fail("thread %d: wgmma needs whole warpgroups (block of %d threads)", me, S.block);
  if (!wgmma_fenced[me]) fail("thread %d: wgmma.mma_async without wgmma.fence since its last wait_group", me);
  if (S.block_unfenced[block_of(me)])
    fail("thread %d: wgmma.mma_async reads shared memory that cp.async wrote without fence.proxy.async before "
         "the last barrier", me);
  if (N % 8 || N < 8 || N > 256) fail("thread %d: wgmma N = %d", me, N);
  WgmmaOp op;
  op.d = d, op.n = N / 2, op.group = wgmma_groups[me];
  const int w = tid / 32 % 4, lane = tid % 32, g = lane / 4, t = lane % 4;
  float a[2][16];
  for (int h = 0; h < 2; ++h)
    for (int k = 0; k < 16; ++k) {
      const unsigned at = wgmma_element(da, 16 * w + g + 8 * h, k, "A");
      const uint16_t v = smem_bits(at);
      op.read.push_back({at, v});
      a[h][k] = bf16 ? bf16_to_f32(v) : f16_to_f32(v);
    }
  for (int j = 0; j < N / 8; ++j)
    for (int c = 0; c < 2; ++c) {
      float b[16];
      for (int k = 0; k < 16; ++k) {
        const unsigned at = wgmma_element(db, 8 * j + 2 * t + c, k, "B");
        const uint16_t v = smem_bits(at);
        op.read.push_back({at, v});
        b[k] = bf16 ? bf16_to_f32(v) : f16_to_f32(v);
      }
      for (int h = 0; h < 2; ++h) {
        float acc = 0.0f;
        for (int k = 0; k < 16; ++k) acc += a[h][k] * b[k];
        op.prod[4 * j + 2 * h + c] = acc;
      }
    }
  wgmma_queue[me].push_back(std::move(op));
}

inline void wgmma_commit() { ++wgmma_groups[S.cur]; }

// wgmma.wait_group N: every committed group but the N most recent completes.
inline void wgmma_wait(unsigned keep) {
  retire_groups(wgmma_queue[S.cur], wgmma_groups[S.cur], keep, [](const WgmmaOp& op) {
    for (const auto& r : op.read)
      if (smem_bits(r.first) != r.second)
        fail("thread %d: shared address 0x%x, an operand of a wgmma in flight, changed before wgmma.wait_group "
             "retired it", S.cur, r.first);
    for (int e = 0; e < op.n; ++e) op.d[e] += op.prod[e];
  });
  wgmma_fenced[S.cur] = false;
}

// ---- Hopper transaction barriers (mbarrier) and TMA tile copies ------------------------------------------------
// An mbarrier is kept by its block and shared-window address: arrivals expected per phase, arrivals and bytes
// still pending, the phase count. A TMA copy (cp.async.bulk.tensor) is queued on the barrier that counts its
// bytes and performed when a thread first waits on that barrier, i.e. at some moment before its phase can
// complete: a thread that reads the tile without waiting reads what was there before (0xff: NaN), and a
// copy into a stage a wgmma in flight still reads is caught when that wgmma retires. Waiting threads park
// until the phase they wait for completes (a switch point, like a block barrier); if every thread waits,
// the launch fails as a deadlock. Misuse that fails the launch: a barrier used before mbarrier.init, more
// arrivals than its count, more bytes landing than expected once every arrival came (bytes may land before
// their expect_tx while arrivals are pending: the tx-count may go negative), a tx-count outside the PTX
// ISA's +-(2^20 - 1), a phase completing with copies still queued on it, a TMA destination that is not
// 1024-byte aligned (the 128-byte swizzle's atom), a box of more than 256 rows, and a block that exits with
// copies still queued.
struct BulkCopy {
  unsigned char* dst;  // in the block's dynamic shared memory
  unsigned window;     // its shared-window address (the swizzle is a function of it)
  const unsigned char* base;
  unsigned long long dim0, dim1, stride1, box0, box1, esize;
  long long c0, c1;
};
struct Mbar {
  unsigned expected = 0, pending = 0, phase = 0;
  long long tx = 0;  // bytes expected and not yet landed in this phase
  std::vector<BulkCopy> copies;
};
static std::vector<std::pair<unsigned long long, Mbar>> mbars;  // (block << 32 | window address, barrier)

inline void mbar_reset() { mbars.clear(); }

// After a block (cluster) ended: a message if TMA copies were still queued (the kernel never waited for them).
inline const char* mbar_copies_in_flight() {
  for (const auto& e : mbars)
    if (!e.second.copies.empty()) return "the block exited with TMA copies in flight (nobody waited on their mbarrier)";
  return nullptr;
}

// The barrier at `bar`'s offset in block `rank` of the cluster (the calling thread's own block by default).
inline unsigned long long mbar_key(const void* bar, int rank = -1) {
  const unsigned addr = smem_addr(bar);
  if (addr % 8) fail("thread %d: mbarrier at shared address 0x%x is not 8-byte aligned", S.cur, addr);
  return (unsigned long long)(rank < 0 ? block_of(S.cur) : rank) << 32 | addr;
}

inline Mbar& mbar_at(unsigned long long key, bool create = false) {
  for (auto& e : mbars)
    if (e.first == key) return e.second;
  if (!create)
    fail("thread %d: mbarrier at shared address 0x%x of block %u used before mbarrier.init", S.cur, (unsigned)key,
         (unsigned)(key >> 32));
  mbars.push_back({key, Mbar()});
  return mbars.back().second;
}
inline Mbar& mbar_get(const void* bar, bool create = false) { return mbar_at(mbar_key(bar), create); }

// Wake the threads parked on this barrier (they check their phase again).
inline void mbar_wake_key(unsigned long long key) {
  for (int i = 0; i < S.n; ++i)
    if (S.th[i].state == kAtMbar && S.th[i].val == key) S.th[i].state = kRun, ++S.runnable;
}
inline void mbar_wake(const void* bar) { mbar_wake_key(mbar_key(bar)); }

// The phase completes when no arrival and no byte is pending.
inline void mbar_settle_key(unsigned long long key, Mbar& m) {
  if (m.pending || m.tx) return;
  if (!m.copies.empty())
    fail("thread %d: an mbarrier phase completed with %zu bulk copies still counted on it (expect_tx too small)",
         S.cur, m.copies.size());
  ++m.phase;
  m.pending = m.expected;
  mbar_wake_key(key);
}
inline void mbar_settle(const void* bar, Mbar& m) { mbar_settle_key(mbar_key(bar), m); }

// Whether every thread of block `rank` of the cluster has exited: on hardware its shared memory is gone, so a
// remote arrival or a multicast into it is an error (the kernel owes a cluster barrier before exiting).
inline bool block_exited(unsigned rank) {
  for (int i = (int)rank * S.block; i < ((int)rank + 1) * S.block; ++i)
    if (S.th[i].state != kDone) return false;
  return true;
}

inline void check_peer(unsigned rank, const char* what) {
  if (rank >= (unsigned)S.cluster) fail("thread %d: %s to rank %u of a %d-block cluster", S.cur, what, rank, S.cluster);
  if (block_exited(rank)) fail("thread %d: %s to block %u, whose threads have all exited", S.cur, what, rank);
}

inline void mbar_init(void* bar, unsigned count) {
  if (count == 0 || count >= (1u << 20)) fail("thread %d: mbarrier.init with count %u", S.cur, count);
  Mbar& m = mbar_get(bar, true);
  m = Mbar();
  m.expected = m.pending = count;
}

constexpr long long kTxLimit = (1 << 20) - 1;  // the tx-count's range is +-(2^20 - 1)

inline void mbar_check_tx(const Mbar& m) {
  if (m.tx > kTxLimit || m.tx < -kTxLimit)
    fail("thread %d: an mbarrier's tx-count %lld is outside +-(2^20 - 1)", S.cur, m.tx);
  if (m.pending == 0 && m.tx < 0)
    fail("thread %d: bulk copies completed %lld bytes more than the mbarrier expected", S.cur, -m.tx);
}

// mbarrier.arrive, with expect_tx bytes first when bytes > 0 (mbarrier.arrive.expect_tx).
inline void mbar_arrive(void* bar, unsigned bytes) {
  Mbar& m = mbar_get(bar);
  if (m.pending == 0) fail("thread %d: more arrivals on an mbarrier than its count %u", S.cur, m.expected);
  m.tx += bytes;
  --m.pending;
  mbar_check_tx(m);
  mbar_settle(bar, m);
}

// mbarrier.arrive.shared::cluster on the barrier at `bar`'s offset in block `rank` (mapa).
inline void mbar_arrive_remote(void* bar, unsigned rank) {
  check_peer(rank, "mbar_arrive_cluster");
  const unsigned long long key = mbar_key(bar, (int)rank);
  Mbar& m = mbar_at(key);
  if (m.pending == 0) fail("thread %d: more arrivals on an mbarrier than its count %u", S.cur, m.expected);
  --m.pending;
  mbar_check_tx(m);
  mbar_settle_key(key, m);
}

inline void bulk_perform(const BulkCopy& c) {
  const unsigned long long pitch = c.box0 * c.esize;
  for (unsigned long long r = 0; r < c.box1; ++r)
    for (unsigned long long e = 0; e < c.box0; ++e) {
      const long long row = c.c1 + (long long)r, col = c.c0 + (long long)e;
      const unsigned addr = c.window + (unsigned)(r * pitch + e * c.esize);
      const unsigned at = addr ^ ((addr >> 7 & 7u) << 4);  // 128-byte swizzle: bits 4-6 ^= bits 7-9
      unsigned char* d = c.dst + (at - c.window);
      if (row < 0 || col < 0 || (unsigned long long)row >= c.dim1 || (unsigned long long)col >= c.dim0)
        memset(d, 0, c.esize);
      else
        memcpy(d, c.base + (unsigned long long)row * c.stride1 + (unsigned long long)col * c.esize, c.esize);
    }
}

inline void mbar_wait(void* bar, unsigned parity) {
  for (;;) {
    Mbar& m = mbar_get(bar);
    if ((m.phase & 1u) != (parity & 1u)) return;
    if (!m.copies.empty()) {  // the copies land now, then count their bytes
      std::vector<BulkCopy> done;
      done.swap(m.copies);
      long long bytes = 0;
      for (const BulkCopy& c : done) bulk_perform(c), bytes += (long long)(c.box0 * c.box1 * c.esize);
      m.tx -= bytes;
      mbar_check_tx(m);
      mbar_settle(bar, m);
      continue;
    }
    S.th[S.cur].state = kAtMbar;
    S.th[S.cur].val = mbar_key(bar);
    --S.runnable;
    yield();
  }
}

// What the emulator reads from an OfzTensorMap (emulate.py writes it; on a GPU it is a CUtensorMap).
struct EmuTensorMap {
  unsigned long long magic, base, dim0, dim1, stride1, box0, box1, esize;
};
constexpr unsigned long long kTensorMapMagic = 0x50414d4f53544f46ull;  // "FOTSOMAP"

// One box of a tensor map for the shared memory at `dst` (checked as the hardware would), not yet queued.
inline BulkCopy tma_box(void* dst, const void* map, int c0, int c1) {
  EmuTensorMap t;
  memcpy(&t, map, sizeof t);
  if (reinterpret_cast<uintptr_t>(map) % 64 || t.magic != kTensorMapMagic)
    fail("thread %d: tma_load_2d with a tensor map the launch did not encode (or not 64-byte aligned)", S.cur);
  const unsigned window = smem_addr(dst);
  const unsigned long long bytes = t.box0 * t.box1 * t.esize;
  if (window % 1024)
    fail("thread %d: TMA destination 0x%x is not 1024-byte aligned (the 128-byte swizzle's atom)", S.cur, window);
  if (t.box1 < 1 || t.box1 > 256 || t.box0 > 256) fail("thread %d: TMA box of %llu x %llu elements", S.cur, t.box1, t.box0);
  if (t.box0 * t.esize != 128)
    fail("thread %d: TMA box rows of %llu bytes; the 128-byte swizzle is emulated for 128-byte rows", S.cur,
         t.box0 * t.esize);
  if (window - kSmemWindowBase + bytes > S.smem_bytes)
    fail("thread %d: TMA box of %llu bytes at 0x%x overruns the block's %zu dynamic bytes", S.cur, bytes, window,
         S.smem_bytes);
  return {static_cast<unsigned char*>(dst), window, reinterpret_cast<const unsigned char*>(t.base), t.dim0, t.dim1,
          t.stride1, t.box0, t.box1, t.esize, c0, c1};
}

// cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes, 128-byte swizzle. The copy
// lands when a thread waits on the barrier (so a read before the wait sees the old contents).
inline void tma_load_2d(void* dst, const void* map, int c0, int c1, void* bar) {
  const BulkCopy c = tma_box(dst, map, c0, c1);
  mbar_get(bar).copies.push_back(c);
  mbar_wake(bar);  // a thread already waiting performs the copy
}

// The same with .multicast::cluster: the box lands at dst's offset in every block of `mask`, each block's
// barrier at bar's offset counting its bytes. The issuing block's copy lands at its first wait, as above; the
// other blocks' land at once, so a copy into a stage another block still reads (a refill its consumers did
// not release) overwrites it there: a wgmma in flight on it fails at retirement, a later read gets the wrong
// tile, and its bytes count on that block's barrier early (too many bytes in the phase).
inline void tma_load_2d_multicast(void* dst, const void* map, int c0, int c1, void* bar, unsigned short mask) {
  if (mask == 0 || (S.cluster < 16 && (mask >> S.cluster) != 0))
    fail("thread %d: TMA multicast mask 0x%x in a %d-block cluster", S.cur, (unsigned)mask, S.cluster);
  const BulkCopy c = tma_box(dst, map, c0, c1);
  const unsigned char* own = static_cast<const unsigned char*>(dynamic_smem());
  const unsigned me = (unsigned)block_of(S.cur);
  for (unsigned r = 0; r < (unsigned)S.cluster; ++r) {
    if (!(mask >> r & 1u)) continue;
    check_peer(r, "a TMA multicast");
    BulkCopy to = c;
    to.dst = S.smem + (size_t)r * S.smem_stride + (size_t)(c.dst - own);
    const unsigned long long key = mbar_key(bar, (int)r);
    Mbar& m = mbar_at(key);
    if (r == me) {
      m.copies.push_back(to);
      mbar_wake_key(key);
      continue;
    }
    bulk_perform(to);
    m.tx -= (long long)(c.box0 * c.box1 * c.esize);
    mbar_check_tx(m);
    mbar_settle_key(key, m);
  }
}

}  // namespace ofz_emu

// ---- exported entry points ----------------------------------------------------------------------------------
#define OFZ_EMU_EXPORT extern "C" __attribute__((visibility("default")))

OFZ_EMU_EXPORT const char* ofz_emu_last_error() { return ofz_emu::S.error.c_str(); }
// Dynamic shared memory bytes for the following launches (the `smem` launch parameter).
OFZ_EMU_EXPORT void ofz_emu_set_dynamic_smem(unsigned long long bytes) { ofz_emu::S.smem_bytes = (size_t)bytes; }
// The thread order of the following launches: 0 round-robin, 1 lowest runnable index first (see yield).
OFZ_EMU_EXPORT void ofz_emu_set_schedule(int lowest_first) { ofz_emu::lowest_first = lowest_first != 0; }
// Shared-memory traffic of the following launches (see SmemTraffic): `on` starts counting from zero; out[] is
// ldmatrix wavefronts, their conflict-free count, cp.async wavefronts, theirs, and 1 if every cp.async
// phase was paired exactly.
OFZ_EMU_EXPORT void ofz_emu_smem_traffic_enable(int on) {
  ofz_emu::traffic = ofz_emu::SmemTraffic();
  ofz_emu::traffic_on = on != 0;
}
OFZ_EMU_EXPORT void ofz_emu_smem_traffic(unsigned long long* out) {
  const ofz_emu::SmemTraffic& t = ofz_emu::traffic;
  out[0] = t.ldmatrix, out[1] = t.ldmatrix_ideal, out[2] = t.cp_async, out[3] = t.cp_async_ideal, out[4] = t.exact;
}

// Placed after the kernel (at the end of the .cu file), where OfzArgs and the kernel are declared.
#define OFZ_EMU_ENTRY(name)                                                                                    \
  OFZ_EMU_EXPORT int ofz_emu_##name(unsigned grid, unsigned block, unsigned cluster, const OfzArgs* a) {       \
    return ::ofz_emu::launch(grid, block, cluster, [](const void* p) { name(*static_cast<const OfzArgs*>(p)); }, a, \
                             #name);                                                                           \
  }
// A kernel that also takes tensor maps (OfzTma): the launcher passes them beside the arguments.
#define OFZ_EMU_ENTRY_TMA(name)                                                                                \
  OFZ_EMU_EXPORT int ofz_emu_##name(unsigned grid, unsigned block, unsigned cluster, const OfzArgs* a,         \
                                    const OfzTma* t) {                                                         \
    static thread_local struct { OfzArgs a; const OfzTma* t; } both;                                           \
    both.a = *a, both.t = t;                                                                                   \
    return ::ofz_emu::launch(grid, block, cluster, [](const void* p) {                                         \
      const auto* q = static_cast<const decltype(both)*>(p);                                                   \
      name(q->a, *q->t);                                                                                       \
    }, &both, #name);                                                                                          \
  }
