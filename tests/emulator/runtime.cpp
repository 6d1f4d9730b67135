// tq-mlx MSL emulator runtime: runs one kernel launch the way MLX dispatches
// it, with every Metal thread as a fiber.
//
// * Dispatch: group = min(threadgroup, grid) per axis; edge threadgroups are
//   smaller (non-uniform); exactly `grid` threads exist. Threadgroups are
//   handed out to `workers` OS threads; one OS thread runs a threadgroup to
//   completion, switching between its fibers (no preemption).
// * Scheduling: fibers run until they block (barrier, SIMD op) or return. Each
//   round resumes the runnable fibers in forward, reverse or seeded-random
//   lane order, so missing barriers show up as poison under some schedule.
// * SIMD ops: lanes of one simdgroup rendezvous per call site; the lane that
//   completes the set runs the op (a template from prelude.h) for everyone.
// * Memory: device buffers are copied into a guarded arena; every load/store
//   of the kernel reports to us (clang -fsanitize-coverage=trace-loads,
//   trace-stores), which gives per-buffer byte counts and precise bounds
//   checks *before* the access happens. Threadgroup memory lives in a
//   per-worker arena with red zones, checked the same way.
#include "runtime.h"

#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TQEMU_ASAN 1
#endif
#endif
#ifdef TQEMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__) && !defined(TQEMU_UCONTEXT)
#define TQEMU_UCONTEXT 1
#endif
#ifdef TQEMU_UCONTEXT
#include <ucontext.h>
#endif

#define TQ_HIDDEN __attribute__((visibility("hidden")))

// ------------------------------------------------------------ bf16 support
// Debian 12's libgcc lacks the float -> bfloat16 conversion clang emits.
extern "C" __attribute__((weak)) __bf16 __truncsfbf2(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t h;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    h = uint16_t((u >> 16) | 0x40u);  // quiet NaN, keep the sign
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    h = uint16_t(u >> 16);
  }
  return __builtin_bit_cast(__bf16, h);
}
extern "C" __attribute__((weak)) __bf16 __truncdfbf2(double d) {
  // Via float: double rounding differs from direct rounding only in cases no
  // Metal kernel can produce (Metal has no double).
  return __truncsfbf2(float(d));
}

namespace tqemu {
namespace {

// ---------------------------------------------------------- context switch
#ifndef TQEMU_UCONTEXT
extern "C" void tqemu_ctx_switch(void** save_sp, void* new_sp) TQ_HIDDEN;
extern "C" void tqemu_ctx_trampoline() TQ_HIDDEN;
// Saves callee-saved registers plus the x87/SSE control words on the current
// stack, stores the stack pointer, and resumes the other context. A new
// fiber "returns" into the trampoline, which calls the entry held in r12.
asm(R"(
  .text
  .p2align 4
  .globl tqemu_ctx_switch
  .hidden tqemu_ctx_switch
  .type tqemu_ctx_switch,@function
tqemu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size tqemu_ctx_switch, .-tqemu_ctx_switch

  .p2align 4
  .globl tqemu_ctx_trampoline
  .hidden tqemu_ctx_trampoline
  .type tqemu_ctx_trampoline,@function
tqemu_ctx_trampoline:
  callq *%r12
  ud2
  .size tqemu_ctx_trampoline, .-tqemu_ctx_trampoline
)");

struct Context {
  void* sp = nullptr;
};
void ctx_init(Context& c, char* lo, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~uintptr_t(15);
  top -= 16;
  uint64_t* p = reinterpret_cast<uint64_t*>(top - 72);
  p[0] = 0x037F;  // x87 control word
  p[1] = 0x1F80;  // MXCSR
  p[2] = p[3] = p[4] = 0;  // r15 r14 r13
  p[5] = reinterpret_cast<uint64_t>(entry);  // r12
  p[6] = p[7] = 0;  // rbx rbp
  p[8] = reinterpret_cast<uint64_t>(&tqemu_ctx_trampoline);
  c.sp = p;
}
inline void ctx_switch(Context& from, Context& to) { tqemu_ctx_switch(&from.sp, to.sp); }
#else
struct Context {
  ucontext_t uc;
};
void ctx_init(Context& c, char* lo, size_t size, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = lo;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
inline void ctx_switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
#endif

// -------------------------------------------------------------- structures
enum class FState : uint8_t { Runnable, WaitSimd, WaitBarrier, Done };

struct Fiber {
  Context ctx;
  char* stack_lo = nullptr;
  size_t stack_size = 0;
  FState st = FState::Done;
  uint32_t lid = 0;
  ThreadAttrs attrs{};
  SimdSlot slot{};
  SimdResolveFn fn = nullptr;
  const char* op = nullptr;
  Site site{};
  void* fake_stack = nullptr;
};

struct SimdGroup {
  uint32_t live = 0;     // lanes that exist and have not returned
  uint32_t waiting = 0;  // lanes blocked in a SIMD op
  bool mixed = false;    // waiting lanes are at different call sites
  Site site{};
  SimdResolveFn fn = nullptr;
};

struct DevBuffer {
  std::string name;
  int32_t kind = kAux;
  int64_t bytes = 0;
  void* host = nullptr;
  char* base = nullptr;    // what the kernel sees
  char* slot_lo = nullptr; // guarded arena slice (counted buffers)
  size_t slot_len = 0;
  std::vector<uint64_t> rd_bits, wr_bits;
  bool counted = false;
  std::atomic<bool> warned_input_write{false};
};

struct TgBlock {
  const void* key;
  size_t offset, bytes;
  const char* name;
  const char* file;
  unsigned line;
};

struct Launch;

struct Worker {
  Launch* L = nullptr;
  int index = 0;
  Context sched;
  const void* sched_bottom = nullptr;
  size_t sched_size = 0;
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  size_t stacks_len = 0;
  Fiber* cur = nullptr;
  // current threadgroup
  uint32_t n = 0, live = 0, exited = 0, at_barrier = 0;
  uint32_t tg_pos[3] = {0, 0, 0};
  uint32_t tg_dim[3] = {0, 0, 0};
  uint64_t tg_index = 0;
  std::vector<SimdGroup> sgs;
  Site barrier_site{};
  bool barrier_mixed = false;
  std::vector<uint32_t> order;
  uint64_t rng = 0;
  bool abort = false;
  // threadgroup memory
  char* tg_arena = nullptr;
  size_t tg_arena_len = 0;
  size_t tg_used_bytes = 0;  // sum of block sizes (the Metal footprint)
  size_t tg_cursor = 0;      // next free offset, red zones included
  std::vector<TgBlock> tg_blocks;
  // statistics
  std::vector<int64_t> rd_total, wr_total;
  uint64_t switches = 0;
  uint64_t threadgroups = 0;
  uint64_t tg_mem_max = 0;
  char* altstack = nullptr;
  stack_t old_altstack{};
};

struct Launch {
  LaunchDesc* d = nullptr;
  Thunk thunk = nullptr;
  std::vector<DevBuffer> bufs;
  std::vector<void*> kernel_ptrs;
  std::vector<int> counted;  // indices of input/output buffers
  char* arena = nullptr;
  size_t arena_len = 0;
  uint32_t group[3] = {1, 1, 1};
  uint32_t ntg[3] = {1, 1, 1};
  uint64_t total_tgs = 0;
  uint32_t max_group_threads = 0;
  std::atomic<uint64_t> next_tg{0};
  std::atomic<bool> abort{false};
  bool multi = false;
  std::mutex mu;
  std::string error;
  std::vector<std::string> warn_order;
  std::map<std::string, std::pair<std::string, int64_t>> warnings;
  // merged statistics
  std::vector<int64_t> rd_total, wr_total;
  uint64_t switches = 0, threadgroups = 0, tg_mem_max = 0;
};

thread_local Worker* tls_worker = nullptr;

// Address ranges checked on every instrumented access, before touching TLS.
uintptr_t g_dev_lo = 0, g_dev_span = 0;
uintptr_t g_tg_lo = 0, g_tg_span = 0;

constexpr size_t kPage = 4096;
constexpr size_t kTgArenaBytes = 1u << 20;  // per worker, red zones included
constexpr size_t kTgRedZone = 256;

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string site_str(const Site& s) {
  return fmt("%s:%u:%u", s.file ? s.file : "?", s.line, s.col);
}
bool same_site(const Site& a, const Site& b) {
  return a.line == b.line && a.col == b.col &&
         (a.file == b.file || (a.file && b.file && std::strcmp(a.file, b.file) == 0));
}

std::string where(const Worker* W) {
  std::string s = fmt("threadgroup (%u,%u,%u)", W->tg_pos[0], W->tg_pos[1], W->tg_pos[2]);
  if (W->cur) {
    const ThreadAttrs& a = W->cur->attrs;
    s += fmt(", thread (%u,%u,%u) in grid", a.thread_position_in_grid[0],
             a.thread_position_in_grid[1], a.thread_position_in_grid[2]);
  }
  return s;
}

void add_warning(Launch* L, const std::string& key, const std::string& msg) {
  std::lock_guard<std::mutex> g(L->mu);
  auto it = L->warnings.find(key);
  if (it != L->warnings.end()) {
    it->second.second++;
    return;
  }
  if (L->warnings.size() >= 200) return;
  L->warnings.emplace(key, std::make_pair(msg, int64_t(1)));
  L->warn_order.push_back(key);
}

void set_error(Worker* W, const std::string& msg) {
  Launch* L = W->L;
  {
    std::lock_guard<std::mutex> g(L->mu);
    if (L->error.empty()) L->error = msg;
  }
  W->abort = true;
  L->abort.store(true);
}

// ------------------------------------------------------------ fiber control
void switch_to_scheduler(Worker* W, bool finished) {
  Fiber* f = W->cur;
#ifdef TQEMU_ASAN
  __sanitizer_start_switch_fiber(finished ? nullptr : &f->fake_stack, W->sched_bottom,
                                 W->sched_size);
#else
  (void)finished;
#endif
  W->switches++;
  ctx_switch(f->ctx, W->sched);
#ifdef TQEMU_ASAN
  __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

// Called on the fiber when a rule is broken: record and never come back.
[[noreturn]] void fail_here(Worker* W, const std::string& msg) {
  set_error(W, msg);
  for (;;) switch_to_scheduler(W, false);
}

void run_fiber(Worker* W, Fiber* f) {
  W->cur = f;
#ifdef TQEMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f->stack_lo, f->stack_size);
#endif
  W->switches++;
  ctx_switch(W->sched, f->ctx);
#ifdef TQEMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  W->cur = nullptr;
}

void complete_simd(Worker* W, uint32_t sgi, uint32_t mask) {
  SimdGroup& g = W->sgs[sgi];
  SimdSlot slots[kSimdWidth];
  Fiber* lane0 = nullptr;
  for (uint32_t l = 0; l < kSimdWidth; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Fiber& f = W->fibers[sgi * kSimdWidth + l];
    slots[l] = f.slot;
    if (!lane0) lane0 = &f;
  }
  SimdCall call{mask, g.live, slots, lane0->op, lane0->site};
  lane0->fn(call);
  for (uint32_t l = 0; l < kSimdWidth; ++l)
    if ((mask >> l) & 1u) W->fibers[sgi * kSimdWidth + l].st = FState::Runnable;
  g.waiting &= ~mask;
  // Re-derive the call site of whoever is still waiting.
  g.mixed = false;
  bool first = true;
  for (uint32_t l = 0; l < kSimdWidth; ++l) {
    if (!((g.waiting >> l) & 1u)) continue;
    Fiber& f = W->fibers[sgi * kSimdWidth + l];
    if (first) {
      g.site = f.site;
      g.fn = f.fn;
      first = false;
    } else if (f.fn != g.fn || !same_site(f.site, g.site)) {
      g.mixed = true;
    }
  }
}

void release_barrier(Worker* W) {
  Launch* L = W->L;
  if (W->exited > 0) {
    std::string msg = fmt(
        "threadgroup_barrier at %s reached after %u of the %u threads of threadgroup "
        "(%u,%u,%u) returned (undefined behaviour on Metal: may hang or corrupt)",
        site_str(W->barrier_site).c_str(), W->exited, W->n, W->tg_pos[0], W->tg_pos[1],
        W->tg_pos[2]);
    if (L->d->strict) {
      set_error(W, msg);
      return;
    }
    add_warning(L, "barrier-after-return@" + site_str(W->barrier_site), msg);
  }
  if (W->barrier_mixed) {
    std::string msg = fmt(
        "threads of threadgroup (%u,%u,%u) wait at different threadgroup_barrier calls "
        "(first at %s): barriers in divergent control flow",
        W->tg_pos[0], W->tg_pos[1], W->tg_pos[2], site_str(W->barrier_site).c_str());
    if (L->d->strict) {
      set_error(W, msg);
      return;
    }
    add_warning(L, "barrier-divergent@" + site_str(W->barrier_site), msg);
  }
  for (uint32_t i = 0; i < W->n; ++i)
    if (W->fibers[i].st == FState::WaitBarrier) W->fibers[i].st = FState::Runnable;
  W->at_barrier = 0;
  W->barrier_mixed = false;
}

// Nothing can run: split the SIMD waiters by call site and run each part on
// the lanes that are there (Metal's divergent-execution semantics).
void resolve_stall(Worker* W) {
  bool any = false;
  for (uint32_t s = 0; s < W->sgs.size(); ++s) {
    SimdGroup& g = W->sgs[s];
    while (g.waiting) {
      uint32_t l0 = __builtin_ctz(g.waiting);
      Fiber& f0 = W->fibers[s * kSimdWidth + l0];
      uint32_t mask = 0;
      for (uint32_t l = l0; l < kSimdWidth; ++l) {
        if (!((g.waiting >> l) & 1u)) continue;
        Fiber& f = W->fibers[s * kSimdWidth + l];
        if (f.fn == f0.fn && same_site(f.site, f0.site)) mask |= 1u << l;
      }
      std::string key = std::string("divergent:") + f0.op + "@" + site_str(f0.site);
      add_warning(W->L, key,
                  fmt("%s at %s ran on lanes 0x%08x of simdgroup %u whose live lanes are "
                      "0x%08x (%s): the other lanes are elsewhere (divergent control flow)",
                      f0.op, site_str(f0.site).c_str(), mask, s, g.live,
                      fmt("threadgroup (%u,%u,%u)", W->tg_pos[0], W->tg_pos[1], W->tg_pos[2])
                          .c_str()));
      complete_simd(W, s, mask);
      any = true;
    }
  }
  if (any) return;
  if (W->at_barrier > 0 && W->at_barrier == W->live) {
    release_barrier(W);
    return;
  }
  set_error(W, "emulator internal error: no Metal thread can make progress");
}

extern "C" [[noreturn]] void tqemu_fiber_main() {
  Worker* W = tls_worker;
#ifdef TQEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &W->sched_bottom, &W->sched_size);
#endif
  Fiber* f = W->cur;
  W->L->thunk(W->L->kernel_ptrs.data(), &f->attrs);
  f->st = FState::Done;
  W->live--;
  W->exited++;
  uint32_t sgi = f->lid / kSimdWidth;
  SimdGroup& g = W->sgs[sgi];
  g.live &= ~(1u << (f->lid % kSimdWidth));
  if (g.waiting && !g.mixed && g.waiting == g.live) complete_simd(W, sgi, g.waiting);
  if (W->at_barrier > 0 && W->at_barrier == W->live) release_barrier(W);
  for (;;) switch_to_scheduler(W, true);
}

// ------------------------------------------------------------ threadgroups
uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void fill_attrs(Worker* W, Fiber& f, uint32_t x, uint32_t y, uint32_t z) {
  const Launch* L = W->L;
  const LaunchDesc* d = L->d;
  ThreadAttrs& a = f.attrs;
  uint32_t local[3] = {x, y, z};
  for (int k = 0; k < 3; ++k) {
    a.thread_position_in_threadgroup[k] = local[k];
    a.threadgroup_position_in_grid[k] = W->tg_pos[k];
    a.thread_position_in_grid[k] = W->tg_pos[k] * L->group[k] + local[k];
    a.threadgroups_per_grid[k] = L->ntg[k];
    a.threads_per_grid[k] = d->grid[k];
    a.grid_size[k] = d->grid[k];
    a.grid_origin[k] = 0;
    a.threads_per_threadgroup[k] = W->tg_dim[k];
    a.dispatch_threads_per_threadgroup[k] = L->group[k];
  }
  // Assumption (not verified on hardware): linear ids use the actual edge
  // group size, so they stay dense in 0..n-1.
  uint32_t lid = x + W->tg_dim[0] * (y + W->tg_dim[1] * z);
  uint32_t dispatch_n = L->group[0] * L->group[1] * L->group[2];
  a.thread_index_in_threadgroup = lid;
  a.thread_index_in_simdgroup = lid % kSimdWidth;
  a.simdgroup_index_in_threadgroup = lid / kSimdWidth;
  a.simdgroups_per_threadgroup = (W->n + kSimdWidth - 1) / kSimdWidth;
  a.dispatch_simdgroups_per_threadgroup = (dispatch_n + kSimdWidth - 1) / kSimdWidth;
  a.thread_index_in_quadgroup = lid % 4;
  a.quadgroup_index_in_threadgroup = lid / 4;
  a.quadgroups_per_threadgroup = (W->n + 3) / 4;
  a.dispatch_quadgroups_per_threadgroup = (dispatch_n + 3) / 4;
  a.thread_execution_width = kSimdWidth;
  a.threads_per_simdgroup = kSimdWidth;
  f.lid = lid;
}

void run_threadgroup(Worker* W, uint64_t t) {
  Launch* L = W->L;
  const LaunchDesc* d = L->d;
  W->tg_index = t;
  W->tg_pos[0] = uint32_t(t % L->ntg[0]);
  W->tg_pos[1] = uint32_t((t / L->ntg[0]) % L->ntg[1]);
  W->tg_pos[2] = uint32_t(t / (uint64_t(L->ntg[0]) * L->ntg[1]));
  for (int k = 0; k < 3; ++k)
    W->tg_dim[k] = std::min(L->group[k], d->grid[k] - W->tg_pos[k] * L->group[k]);
  uint32_t n = W->tg_dim[0] * W->tg_dim[1] * W->tg_dim[2];
  W->n = W->live = n;
  W->exited = W->at_barrier = 0;
  W->barrier_mixed = false;
  W->tg_used_bytes = W->tg_cursor = 0;
  W->tg_blocks.clear();
  uint32_t nsg = (n + kSimdWidth - 1) / kSimdWidth;
  W->sgs.assign(nsg, SimdGroup{});
  for (uint32_t s = 0; s < nsg; ++s) {
    uint32_t lanes = std::min<uint32_t>(kSimdWidth, n - s * kSimdWidth);
    W->sgs[s].live = lanes == 32 ? 0xFFFFFFFFu : ((1u << lanes) - 1u);
  }
  for (uint32_t z = 0; z < W->tg_dim[2]; ++z)
    for (uint32_t y = 0; y < W->tg_dim[1]; ++y)
      for (uint32_t x = 0; x < W->tg_dim[0]; ++x) {
        uint32_t lid = x + W->tg_dim[0] * (y + W->tg_dim[1] * z);
        Fiber& f = W->fibers[lid];
        fill_attrs(W, f, x, y, z);
        f.st = FState::Runnable;
        f.fn = nullptr;
        f.fake_stack = nullptr;
        ctx_init(f.ctx, f.stack_lo, f.stack_size, &tqemu_fiber_main);
      }
  W->order.resize(n);
  W->rng = d->seed * 0x9E3779B97F4A7C15ull ^ (t + 1) * 0xD1B54A32D192ED03ull;
  while (W->live > 0) {
    for (uint32_t i = 0; i < n; ++i) W->order[i] = d->schedule == kReverse ? n - 1 - i : i;
    if (d->schedule == kRandom)
      for (uint32_t i = n; i > 1; --i) std::swap(W->order[i - 1], W->order[splitmix(W->rng) % i]);
    bool progressed = false;
    for (uint32_t i = 0; i < n; ++i) {
      Fiber& f = W->fibers[W->order[i]];
      if (f.st != FState::Runnable) continue;
      progressed = true;
      run_fiber(W, &f);
      if (W->abort || L->abort.load(std::memory_order_relaxed)) {
        W->abort = true;
        return;
      }
    }
    if (W->live == 0) break;
    if (!progressed) {
      resolve_stall(W);
      if (W->abort) return;
    }
  }
  W->threadgroups++;
  W->tg_mem_max = std::max<uint64_t>(W->tg_mem_max, W->tg_used_bytes);
}

// --------------------------------------------------------------- faults
struct sigaction g_old_segv, g_old_bus;

void fault_handler(int sig, siginfo_t* si, void*) {
  Worker* W = tls_worker;
  if (W && W->cur) {
    uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
    std::string what = fmt("%s at address %p", sig == SIGSEGV ? "segmentation fault" : "bus error",
                           si->si_addr);
    uintptr_t s0 = reinterpret_cast<uintptr_t>(W->stacks);
    if (a >= s0 && a < s0 + W->stacks_len)
      what = "stack overflow of a Metal thread (private arrays too large?)";
    else if (a - g_dev_lo < g_dev_span)
      what += " (far out of bounds of a device buffer)";
    fail_here(W, what + " in " + where(W));
  }
  // Not ours: put the previous handler back and let the fault happen again.
  sigaction(sig, sig == SIGSEGV ? &g_old_segv : &g_old_bus, nullptr);
}

// ------------------------------------------------------- access tracking
void set_bits(std::vector<uint64_t>& bits, size_t off, size_t n, bool atomic) {
  while (n) {
    size_t w = off >> 6, b = off & 63, k = std::min<size_t>(n, 64 - b);
    uint64_t m = (k == 64 ? ~0ull : ((1ull << k) - 1)) << b;
    if (atomic) __atomic_fetch_or(&bits[w], m, __ATOMIC_RELAXED);
    else bits[w] |= m;
    off += k;
    n -= k;
  }
}

[[gnu::noinline]] void note_tg(uintptr_t p, size_t n, bool write) {
  Worker* W = tls_worker;
  if (!W || !W->cur) return;
  uintptr_t lo = reinterpret_cast<uintptr_t>(W->tg_arena);
  if (p - lo >= W->tg_arena_len) return;  // another worker's arena: impossible
  size_t off = p - lo;
  const TgBlock* near = nullptr;
  for (const TgBlock& b : W->tg_blocks) {
    if (off >= b.offset && off + n <= b.offset + b.bytes) return;  // in bounds
    if (!near || (off >= b.offset && b.offset >= near->offset)) near = &b;
  }
  if (near)
    fail_here(W, fmt("out-of-bounds threadgroup memory %s of %zu bytes at byte offset %lld of "
                     "'%s' (%zu bytes, declared at %s:%u) in %s",
                     write ? "write" : "read", n,
                     (long long)off - (long long)near->offset, near->name, near->bytes,
                     near->file, near->line, where(W).c_str()));
  fail_here(W, fmt("threadgroup memory %s outside any threadgroup array in %s",
                   write ? "write" : "read", where(W).c_str()));
}

[[gnu::noinline]] void note_dev(uintptr_t p, size_t n, bool write) {
  Worker* W = tls_worker;
  if (!W || !W->cur) return;
  Launch* L = W->L;
  for (int i : L->counted) {
    DevBuffer& b = L->bufs[i];
    uintptr_t base = reinterpret_cast<uintptr_t>(b.base);
    uintptr_t lo = b.slot_lo ? reinterpret_cast<uintptr_t>(b.slot_lo) : base;
    uintptr_t hi = b.slot_lo ? lo + b.slot_len : base + uint64_t(b.bytes);
    if (p < lo || p >= hi) continue;
    if (p < base || p + n > base + uint64_t(b.bytes)) {
      if (!b.slot_lo) return;  // plain (ASan) buffers: ASan reports it
      fail_here(W, fmt("out-of-bounds device %s of %zu bytes at byte offset %lld of buffer "
                       "'%s' (%lld bytes) in %s",
                       write ? "write" : "read", n, (long long)(p - base), b.name.c_str(),
                       (long long)b.bytes, where(W).c_str()));
    }
    size_t off = p - base;
    if (write) {
      W->wr_total[i] += int64_t(n);
      set_bits(b.wr_bits, off, n, L->multi);
      if (b.kind == kInput && !b.warned_input_write.exchange(true))
        add_warning(L, "input-write:" + b.name,
                    fmt("kernel wrote to input buffer '%s' (inputs are const in MLX)",
                        b.name.c_str()));
    } else {
      W->rd_total[i] += int64_t(n);
      set_bits(b.rd_bits, off, n, L->multi);
    }
    return;
  }
  if (!L->arena) return;  // plain (ASan) buffers: ASan judges the access
  // In a guard gap of the arena: name the nearest buffer.
  const DevBuffer* best = nullptr;
  long long best_off = 0;
  unsigned long long best_dist = ~0ull;
  for (int i : L->counted) {
    const DevBuffer& b = L->bufs[i];
    long long off = (long long)(p - reinterpret_cast<uintptr_t>(b.base));
    unsigned long long dist = off < 0 ? (unsigned long long)(-off)
                                      : (unsigned long long)(off - b.bytes);
    if (dist < best_dist) {
      best = &b;
      best_dist = dist;
      best_off = off;
    }
  }
  fail_here(W, fmt("out-of-bounds device %s of %zu bytes at byte offset %lld of buffer '%s' "
                   "(%lld bytes) in %s",
                   write ? "write" : "read", n, best_off, best ? best->name.c_str() : "?",
                   best ? (long long)best->bytes : 0LL, where(W).c_str()));
}

inline void note(const void* a, size_t n, bool write) {
  uintptr_t p = reinterpret_cast<uintptr_t>(a);
  if (p - g_dev_lo < g_dev_span) note_dev(p, n, write);
  else if (p - g_tg_lo < g_tg_span) note_tg(p, n, write);
}

// ------------------------------------------------------------ the launch
void* map_region(size_t len, int prot) {
  void* p = mmap(nullptr, len, prot, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

bool setup_buffers(Launch* L, std::string& err) {
  LaunchDesc* d = L->d;
  L->bufs = std::vector<DevBuffer>(size_t(d->n_buffers));
  L->kernel_ptrs.assign(size_t(d->n_buffers), nullptr);
  // Counted buffers live in one arena, each ending exactly (16-byte rounded)
  // at a page boundary and separated by large PROT_NONE gaps, so a stray
  // index lands in a gap rather than in a neighbouring buffer.
  size_t total = kPage;
  std::vector<size_t> slot_len(size_t(d->n_buffers), 0);
  for (int i = 0; i < d->n_buffers; ++i) {
    DevBuffer& b = L->bufs[i];
    b.name = d->buffer_names[i] ? d->buffer_names[i] : "?";
    b.kind = d->buffer_kinds[i];
    b.bytes = d->buffer_bytes[i];
    b.host = d->buffers[i];
    b.counted = b.kind != kAux;
    if (b.counted) {
      L->counted.push_back(i);
      size_t data = round_up(size_t(b.bytes) + 16, kPage);
      size_t gap = std::max<size_t>(1u << 20, data);
      slot_len[i] = gap + data;
      total += slot_len[i];
    }
  }
  total += 1u << 20;
  if (d->guard_buffers && !L->counted.empty()) {
    L->arena = static_cast<char*>(map_region(total, PROT_NONE));
    if (!L->arena) {
      err = "mmap of the device-buffer arena failed";
      return false;
    }
    L->arena_len = total;
  }
  size_t cursor = kPage;
  for (int i = 0; i < d->n_buffers; ++i) {
    DevBuffer& b = L->bufs[i];
    size_t nbytes = size_t(b.bytes);
    if (!b.counted) {
      L->kernel_ptrs[i] = b.host;
      continue;
    }
    if (L->arena) {
      size_t data = round_up(nbytes + 16, kPage);
      char* slot = L->arena + cursor;
      char* data_lo = slot + (slot_len[i] - data);
      if (mprotect(data_lo, data, PROT_READ | PROT_WRITE) != 0) {
        err = "mprotect of a device buffer failed";
        return false;
      }
      b.slot_lo = slot;
      b.slot_len = slot_len[i];
      b.base = data_lo + data - round_up(nbytes, 16);
      cursor += slot_len[i];
    } else {
      b.base = static_cast<char*>(std::malloc(nbytes ? nbytes : 1));
    }
    if (nbytes) std::memcpy(b.base, b.host, nbytes);
    b.rd_bits.assign((nbytes + 63) / 64 + 1, 0);
    b.wr_bits.assign((nbytes + 63) / 64 + 1, 0);
    L->kernel_ptrs[i] = b.base;
  }
  if (L->arena) {
    g_dev_lo = reinterpret_cast<uintptr_t>(L->arena);
    g_dev_span = L->arena_len;
  } else {
    // Plain buffers: one range spanning all of them (not gap-checked).
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i : L->counted) {
      uintptr_t b = reinterpret_cast<uintptr_t>(L->bufs[i].base);
      lo = std::min(lo, b);
      hi = std::max(hi, b + uint64_t(L->bufs[i].bytes) + 64);
    }
    g_dev_lo = L->counted.empty() ? 0 : lo;
    g_dev_span = L->counted.empty() ? 0 : hi - lo;
  }
  return true;
}

bool worker_setup(Worker* W, std::string& err) {
  Launch* L = W->L;
  size_t stack = round_up(size_t(L->d->stack_bytes), kPage);
  size_t stride = stack + kPage;
  W->stacks_len = stride * L->max_group_threads;
  W->stacks = static_cast<char*>(map_region(W->stacks_len, PROT_READ | PROT_WRITE));
  if (!W->stacks) {
    err = "mmap of fiber stacks failed";
    return false;
  }
  W->fibers = std::vector<Fiber>(L->max_group_threads);
  for (uint32_t i = 0; i < L->max_group_threads; ++i) {
    char* guard = W->stacks + i * stride;
    mprotect(guard, kPage, PROT_NONE);  // guard page below each stack
    W->fibers[i].stack_lo = guard + kPage;
    W->fibers[i].stack_size = stack;
  }
  W->rd_total.assign(L->bufs.size(), 0);
  W->wr_total.assign(L->bufs.size(), 0);
#ifndef TQEMU_ASAN
  // The fault handler runs on its own stack (the fiber's may be the problem).
  // The previous one (e.g. Python's faulthandler) is restored afterwards.
  W->altstack = static_cast<char*>(std::malloc(1u << 16));
  stack_t ss{};
  ss.ss_sp = W->altstack;
  ss.ss_size = 1u << 16;
  sigaltstack(&ss, &W->old_altstack);
#endif
  return true;
}

void worker_teardown(Worker* W) {
#ifndef TQEMU_ASAN
  if (W->altstack) {
    if (W->old_altstack.ss_flags & SS_DISABLE) {
      stack_t ss{};
      ss.ss_flags = SS_DISABLE;
      sigaltstack(&ss, nullptr);
    } else {
      sigaltstack(&W->old_altstack, nullptr);
    }
    std::free(W->altstack);
  }
#endif
  if (W->stacks) munmap(W->stacks, W->stacks_len);
  Launch* L = W->L;
  std::lock_guard<std::mutex> g(L->mu);
  for (size_t i = 0; i < L->bufs.size(); ++i) {
    L->rd_total[i] += W->rd_total[i];
    L->wr_total[i] += W->wr_total[i];
  }
  L->switches += W->switches;
  L->threadgroups += W->threadgroups;
  L->tg_mem_max = std::max(L->tg_mem_max, W->tg_mem_max);
}

void worker_main(Launch* L, int index, char* tg_arena) {
  Worker W;
  W.L = L;
  W.index = index;
  W.tg_arena = tg_arena;
  W.tg_arena_len = kTgArenaBytes;
  std::string err;
  tls_worker = &W;
  if (!worker_setup(&W, err)) {
    set_error(&W, err);
  } else {
    for (;;) {
      if (L->abort.load()) break;
      uint64_t t = L->next_tg.fetch_add(1);
      if (t >= L->total_tgs) break;
      run_threadgroup(&W, t);
      if (W.abort) break;
    }
  }
  worker_teardown(&W);
  tls_worker = nullptr;
}

void write_log(Launch* L) {
  LaunchDesc* d = L->d;
  std::string out;
  if (!L->error.empty()) out += "E:" + L->error + "\n";
  for (const std::string& k : L->warn_order) {
    auto& w = L->warnings[k];
    out += fmt("W:%lld:", (long long)w.second) + w.first + "\n";
  }
  d->n_warnings = int32_t(L->warn_order.size());
  if (d->log && d->log_capacity > 0) {
    size_t n = std::min<size_t>(out.size(), size_t(d->log_capacity - 1));
    std::memcpy(d->log, out.data(), n);
    d->log[n] = 0;
  }
}

}  // namespace

// ------------------------------------------------------------- public API
int run_launch(LaunchDesc* d, Thunk thunk) {
  Launch L;
  L.d = d;
  L.thunk = thunk;
  std::string err;
  for (int k = 0; k < 3; ++k) {
    if (d->grid[k] == 0 || d->threadgroup[k] == 0) err = "grid and threadgroup sizes must be >= 1";
    L.group[k] = std::min(d->threadgroup[k], d->grid[k] ? d->grid[k] : 1);
    L.ntg[k] = d->grid[k] ? (d->grid[k] + L.group[k] - 1) / L.group[k] : 0;
  }
  uint64_t requested = uint64_t(d->threadgroup[0]) * d->threadgroup[1] * d->threadgroup[2];
  if (err.empty() && requested > d->max_threads_per_threadgroup)
    err = fmt("Thread group size (%llu) is greater than the maximum allowed threads per "
              "threadgroup (%u).",
              (unsigned long long)requested, d->max_threads_per_threadgroup);
  L.total_tgs = uint64_t(L.ntg[0]) * L.ntg[1] * L.ntg[2];
  L.max_group_threads = L.group[0] * L.group[1] * L.group[2];
  L.rd_total.assign(size_t(d->n_buffers), 0);
  L.wr_total.assign(size_t(d->n_buffers), 0);
  if (err.empty()) setup_buffers(&L, err);

  int workers = std::max(1, std::min<int>(d->workers, int(std::min<uint64_t>(L.total_tgs, 64))));
  L.multi = workers > 1;
  char* tg_arenas = nullptr;
  size_t tg_len = kTgArenaBytes * size_t(workers);
  if (err.empty()) {
    tg_arenas = static_cast<char*>(map_region(tg_len, PROT_READ | PROT_WRITE));
    if (!tg_arenas) err = "mmap of threadgroup memory failed";
  }
  if (err.empty()) {
    g_tg_lo = reinterpret_cast<uintptr_t>(tg_arenas);
    g_tg_span = tg_len;
#ifndef TQEMU_ASAN
    struct sigaction sa {};
    sa.sa_sigaction = &fault_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_old_segv);
    sigaction(SIGBUS, &sa, &g_old_bus);
#endif
    std::vector<std::thread> threads;
    for (int w = 1; w < workers; ++w)
      threads.emplace_back(worker_main, &L, w, tg_arenas + kTgArenaBytes * size_t(w));
    worker_main(&L, 0, tg_arenas);
    for (auto& t : threads) t.join();
#ifndef TQEMU_ASAN
    sigaction(SIGSEGV, &g_old_segv, nullptr);
    sigaction(SIGBUS, &g_old_bus, nullptr);
#endif
    g_tg_lo = g_tg_span = 0;
  }
  if (!err.empty()) L.error = err;

  // Results: outputs back to the host, statistics, log.
  for (size_t i = 0; i < L.bufs.size(); ++i) {
    DevBuffer& b = L.bufs[i];
    if (!b.counted || !b.base) continue;
    if (b.kind == kOutput && L.error.empty() && b.bytes) std::memcpy(b.host, b.base, size_t(b.bytes));
    if (d->stats) {
      int64_t ur = 0, uw = 0;
      for (uint64_t w : b.rd_bits) ur += __builtin_popcountll(w);
      for (uint64_t w : b.wr_bits) uw += __builtin_popcountll(w);
      d->stats[4 * i + 0] = L.rd_total[i];
      d->stats[4 * i + 1] = L.wr_total[i];
      d->stats[4 * i + 2] = ur;
      d->stats[4 * i + 3] = uw;
    }
    if (!b.slot_lo) std::free(b.base);
  }
  if (L.arena) munmap(L.arena, L.arena_len);
  if (tg_arenas) munmap(tg_arenas, tg_len);
  g_dev_lo = g_dev_span = 0;
  d->threadgroup_memory = L.tg_mem_max;
  d->fiber_switches = L.switches;
  d->threadgroups_run = L.threadgroups;
  write_log(&L);
  d->error = L.error.empty() ? 0 : 1;
  return d->error;
}

void simd_op(const char* op, const void* in, const void* in2, void* out, uint32_t arg,
             uint32_t arg2, SimdResolveFn fn, Site site) {
  Worker* W = tls_worker;
  Fiber* f = W ? W->cur : nullptr;
  if (!f) std::abort();  // SIMD function called outside a kernel launch
  uint32_t sgi = f->lid / kSimdWidth, lane = f->lid % kSimdWidth;
  SimdGroup& g = W->sgs[sgi];
  f->slot = SimdSlot{in, in2, out, arg, arg2};
  f->fn = fn;
  f->op = op;
  f->site = site;
  if (g.waiting == 0) {
    g.site = site;
    g.fn = fn;
    g.mixed = false;
  } else if (g.fn != fn || !same_site(g.site, site)) {
    g.mixed = true;
  }
  g.waiting |= 1u << lane;
  f->st = FState::WaitSimd;
  if (!g.mixed && g.waiting == g.live) complete_simd(W, sgi, g.waiting);
  // Always yield, so the next phase starts in schedule order.
  switch_to_scheduler(W, false);
}

namespace {
void simd_rendezvous_only(const SimdCall&) {}
}  // namespace

void barrier(Site site, bool simdgroup_only) {
  if (simdgroup_only) {
    simd_op("simdgroup_barrier", nullptr, nullptr, nullptr, 0, 0, &simd_rendezvous_only, site);
    return;
  }
  Worker* W = tls_worker;
  Fiber* f = W ? W->cur : nullptr;
  if (!f) std::abort();
  if (W->at_barrier == 0) {
    W->barrier_site = site;
    W->barrier_mixed = false;
  } else if (!same_site(site, W->barrier_site)) {
    W->barrier_mixed = true;
  }
  f->st = FState::WaitBarrier;
  f->site = site;
  W->at_barrier++;
  if (W->at_barrier == W->live) release_barrier(W);
  switch_to_scheduler(W, false);
}

void* tg_alloc(const void* key, size_t bytes, size_t align, const char* name, const char* file,
               unsigned line) {
  Worker* W = tls_worker;
  if (!W || !W->cur) std::abort();
  for (const TgBlock& b : W->tg_blocks)
    if (b.key == key) return W->tg_arena + b.offset;
  size_t limit = W->L->d->max_threadgroup_memory;
  if (W->tg_used_bytes + bytes > limit)
    fail_here(W, fmt("threadgroup memory: '%s' (%zu bytes, %s:%u) brings the threadgroup to "
                     "%zu bytes, above the %zu-byte limit",
                     name, bytes, file, line, W->tg_used_bytes + bytes, limit));
  size_t a = std::max<size_t>(align, 16);
  size_t off = round_up(W->tg_cursor + kTgRedZone, a);
  if (off + bytes + kTgRedZone > W->tg_arena_len)
    fail_here(W, "threadgroup memory: too many threadgroup declarations for the emulator");
  W->tg_blocks.push_back(TgBlock{key, off, bytes, name, file, line});
  W->tg_cursor = off + bytes;
  W->tg_used_bytes += bytes;
  // Metal threadgroup memory starts uninitialised: poison it (NaN / -1).
  std::memset(W->tg_arena + off, 0xFF, bytes);
  return W->tg_arena + off;
}

void note_access(const void* addr, size_t bytes, bool is_write) { note(addr, bytes, is_write); }

void warn_inactive_read(const SimdCall& call, uint32_t lane, uint32_t src) {
  Worker* W = tls_worker;
  if (!W) return;
  add_warning(W->L, std::string("inactive-read:") + call.op + "@" + site_str(call.site),
              fmt("%s at %s: lane %u read lane %u, which is not taking part (returned, "
                  "diverged or past the end of the threadgroup); result poisoned (%s)",
                  call.op, site_str(call.site).c_str(), lane, src,
                  fmt("threadgroup (%u,%u,%u)", W->tg_pos[0], W->tg_pos[1], W->tg_pos[2])
                      .c_str()));
}

void warn(const char* key, const char* message) {
  Worker* W = tls_worker;
  if (W) add_warning(W->L, key, message);
}

}  // namespace tqemu

// --------------------------------------- sanitizer-coverage access hooks
// clang -fsanitize-coverage=trace-loads,trace-stores calls these before every
// load/store of the kernel translation unit (the runtime is not instrumented).
#define TQEMU_HOOKS(N)                                                                      \
  extern "C" TQ_HIDDEN void __sanitizer_cov_load##N(void* a) { tqemu::note(a, N, false); }  \
  extern "C" TQ_HIDDEN void __sanitizer_cov_store##N(void* a) { tqemu::note(a, N, true); }
TQEMU_HOOKS(1)
TQEMU_HOOKS(2)
TQEMU_HOOKS(4)
TQEMU_HOOKS(8)
TQEMU_HOOKS(16)
#undef TQEMU_HOOKS
extern "C" TQ_HIDDEN void __sanitizer_cov_8bit_counters_init(char*, char*) {}
extern "C" TQ_HIDDEN void __sanitizer_cov_pcs_init(const uintptr_t*, const uintptr_t*) {}
