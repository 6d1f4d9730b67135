// tq-mlx MSL emulator: interface between a compiled kernel (prelude.h + the
// generated source + glue) and the fiber runtime (runtime.cpp).
//
// Everything here is plain C++17; it is included before the address-space
// macros of prelude.h are defined, so it never sees `device` & co.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tqemu {

constexpr uint32_t kSimdWidth = 32;

// A call site of a SIMD function or barrier. Lanes rendezvous per call site,
// which is how divergent control flow is told apart from converged flow.
struct Site {
  const char* file;
  unsigned line;
  unsigned col;
};

// What one lane deposits when it reaches a SIMD function.
struct SimdSlot {
  const void* in;   // the lane's operand
  const void* in2;  // second operand (shuffle_and_fill's filling value)
  void* out;        // where the lane's result goes
  uint32_t arg;     // lane index / delta / mask argument of this lane
  uint32_t arg2;    // modulo for shuffle_and_fill
};

// Handed to the resolve function once the participating lanes are known.
struct SimdCall {
  uint32_t mask;           // lanes taking part in this call
  uint32_t exists;         // lanes that exist and have not returned
  const SimdSlot* slots;   // [kSimdWidth], valid where mask has a bit
  const char* op;
  Site site;
};
using SimdResolveFn = void (*)(const SimdCall&);

// Blocks the calling Metal thread until the op can run, then returns with
// `out` filled by `fn` (called on whichever lane completes the rendezvous).
void simd_op(const char* op, const void* in, const void* in2, void* out, uint32_t arg,
             uint32_t arg2, SimdResolveFn fn, Site site);
void barrier(Site site, bool simdgroup_only);

// Storage for one `threadgroup T name[N];` declaration (the source rewrite
// turns each into a reference bound to this). All threads of a threadgroup get
// the same block; the first caller in each threadgroup poisons it with 0xFF
// bytes. `key` is the address of a static unique to the declaration (and
// template instantiation). Blocks sit in a per-worker arena with red zones, so
// out-of-bounds threadgroup accesses are reported too.
void* tg_alloc(const void* key, size_t bytes, size_t align, const char* name, const char* file,
               unsigned line);

// Counts a device access done outside ordinary loads/stores (atomics).
void note_access(const void* addr, size_t bytes, bool is_write);

// A lane read a value from a lane that does not exist / has returned.
void warn_inactive_read(const SimdCall& call, uint32_t lane, uint32_t src);
void warn(const char* key, const char* message);

// Per-thread attribute values, computed by the runtime as MLX dispatches.
struct ThreadAttrs {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t threads_per_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t grid_origin[3];
  uint32_t grid_size[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
  uint32_t thread_execution_width;
  uint32_t threads_per_simdgroup;
};

using Thunk = void (*)(void* const* buffers, const ThreadAttrs* attrs);

enum BufferKind : int32_t { kAux = 0, kInput = 1, kOutput = 2 };
enum Schedule : int32_t { kForward = 0, kReverse = 1, kRandom = 2 };

// C-layout launch description; mirrored by ctypes in launch.py. Keep in sync.
struct LaunchDesc {
  int32_t n_buffers;
  int32_t schedule;
  uint64_t seed;
  void* const* buffers;           // host memory, kernel-parameter order
  const int64_t* buffer_bytes;
  const int32_t* buffer_kinds;    // BufferKind
  const char* const* buffer_names;
  uint32_t grid[3];
  uint32_t threadgroup[3];
  int32_t strict;                 // barrier-after-return etc. are errors
  int32_t guard_buffers;          // 1: device buffers in a guarded arena (bounds checked);
                                  // 0: plain malloc copies (ASan checks them instead)
  int32_t workers;                // OS threads running threadgroups
  uint64_t stack_bytes;           // per Metal thread
  uint32_t max_threads_per_threadgroup;
  uint32_t max_threadgroup_memory;
  // outputs
  int64_t* stats;                 // 4 per buffer: total rd, total wr, unique rd, unique wr
  char* log;                      // "E:..." / "W:..." lines
  int64_t log_capacity;
  int32_t error;                  // 0 = ok
  int32_t n_warnings;
  uint64_t threadgroup_memory;    // largest per-threadgroup footprint seen
  uint64_t fiber_switches;
  uint64_t threadgroups_run;
};

int run_launch(LaunchDesc* desc, Thunk thunk);

}  // namespace tqemu
