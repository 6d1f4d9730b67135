// tq-mlx MSL emulator: standalone launcher for the ASan build.
//
// ASan needs its runtime loaded first, which is awkward inside a Python
// process, so ASan builds link the kernel into this small executable instead.
// Usage: driver IN OUT. IN holds the launch (format written by launch.py:
// write_launch_file), OUT receives status, statistics, log and the outputs.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime.h"

extern "C" int tqemu_launch(tqemu::LaunchDesc* d);

namespace {

struct Reader {
  FILE* f;
  template <class T>
  T get() {
    T v{};
    if (std::fread(&v, sizeof(T), 1, f) != 1) {
      std::fprintf(stderr, "tqemu driver: truncated launch file\n");
      std::exit(3);
    }
    return v;
  }
  void bytes(void* p, size_t n) {
    if (n && std::fread(p, 1, n, f) != n) {
      std::fprintf(stderr, "tqemu driver: truncated launch file\n");
      std::exit(3);
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s LAUNCH_IN RESULT_OUT\n", argv[0]);
    return 2;
  }
  FILE* in = std::fopen(argv[1], "rb");
  if (!in) return 2;
  Reader r{in};
  char magic[8];
  r.bytes(magic, 8);
  if (std::memcmp(magic, "TQEMU01\0", 8) != 0) return 2;
  tqemu::LaunchDesc d{};
  d.n_buffers = r.get<int32_t>();
  d.schedule = r.get<int32_t>();
  d.strict = r.get<int32_t>();
  d.workers = r.get<int32_t>();
  d.guard_buffers = r.get<int32_t>();
  d.seed = r.get<uint64_t>();
  d.stack_bytes = r.get<uint64_t>();
  for (int k = 0; k < 3; ++k) d.grid[k] = r.get<uint32_t>();
  for (int k = 0; k < 3; ++k) d.threadgroup[k] = r.get<uint32_t>();
  d.max_threads_per_threadgroup = r.get<uint32_t>();
  d.max_threadgroup_memory = r.get<uint32_t>();
  size_t n = size_t(d.n_buffers);
  std::vector<std::vector<char>> data(n);
  std::vector<std::string> names(n);
  std::vector<void*> ptrs(n);
  std::vector<int64_t> sizes(n);
  std::vector<int32_t> kinds(n);
  std::vector<const char*> cnames(n);
  for (size_t i = 0; i < n; ++i) {
    kinds[i] = r.get<int32_t>();
    int32_t len = r.get<int32_t>();
    names[i].resize(size_t(len));
    r.bytes(&names[i][0], size_t(len));
    sizes[i] = r.get<int64_t>();
    data[i].resize(size_t(sizes[i]) + 1);
    r.bytes(data[i].data(), size_t(sizes[i]));
    ptrs[i] = data[i].data();
    cnames[i] = names[i].c_str();
  }
  std::fclose(in);
  std::vector<int64_t> stats(4 * n, 0);
  std::vector<char> log(1 << 16, 0);
  d.buffers = ptrs.data();
  d.buffer_bytes = sizes.data();
  d.buffer_kinds = kinds.data();
  d.buffer_names = cnames.data();
  d.stats = stats.data();
  d.log = log.data();
  d.log_capacity = int64_t(log.size());
  tqemu_launch(&d);

  FILE* out = std::fopen(argv[2], "wb");
  if (!out) return 2;
  int32_t head[2] = {d.error, d.n_warnings};
  uint64_t counters[3] = {d.threadgroup_memory, d.fiber_switches, d.threadgroups_run};
  std::fwrite(head, sizeof head, 1, out);
  std::fwrite(counters, sizeof counters, 1, out);
  std::fwrite(stats.data(), sizeof(int64_t), stats.size(), out);
  int64_t log_len = int64_t(std::strlen(log.data()));
  std::fwrite(&log_len, sizeof log_len, 1, out);
  std::fwrite(log.data(), 1, size_t(log_len), out);
  for (size_t i = 0; i < n; ++i)
    if (kinds[i] == tqemu::kOutput) std::fwrite(data[i].data(), 1, size_t(sizes[i]), out);
  std::fclose(out);
  return 0;
}
