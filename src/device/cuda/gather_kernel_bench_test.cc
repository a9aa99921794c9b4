// The gather kernel alone (LaunchGather, no Stream, no routing), timed with CUDA events on the
// shapes the peer-memory sender hands it, beside one cudaMemcpyAsync of the same bytes and one
// cudaMemcpy2DAsync of the same shape (the same-run baselines), and the same work split over two
// processes on the one GPU (what TP2 -> TP4 does: two context ranks, each its own CUDA context,
// time-sliced on the SMs without MPS) beside one process doing all of it.
//
// Shapes (Llama-3-8B, bf16, 32 tokens per block, block-major HND pool): a context rank of TP2
// holds 4 of the 8 KV heads, a generation rank of TP4 2, so each (block, layer, kv) row sends
// 16 KiB of a 32 KiB source row into a packed 16 KiB destination row; consecutive blocks merge
// into one tall descriptor (ExtendRows), scattered blocks stay one descriptor of 64 rows each.
// TP1 -> TP2: 32 KiB of 64 KiB rows. Narrow: 256-byte rows (a partial-token copy).
//
// The tests skip without a GPU; they assert that every launch succeeded and that timings are
// positive, and print the numbers (docs/design.md's GPU section quotes them).
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "device/cuda/cuda_kernels.h"

namespace kvferry {
namespace {

using internal::cuda::GatherDesc;
using internal::cuda::LaunchGather;

struct Shape {
  const char* name;
  uint64_t row, src_pitch, dst_pitch, rows_per_desc;  // rows_per_desc 0: one tall descriptor
};

const Shape kShapes[] = {
    {"tp2->tp4 tall", 16 << 10, 32 << 10, 16 << 10, 0},
    {"tp2->tp4 per block", 16 << 10, 32 << 10, 16 << 10, 64},
    {"tp1->tp2 tall", 32 << 10, 64 << 10, 32 << 10, 0},
    {"narrow 256 B rows", 256, 512, 256, 0},
    // vLLM NHD -> HND: a (layer, head) descriptor of a block's tokens, 512 B rows (K and V).
    {"512 B rows, 4096 per descriptor", 512, 1024, 512, 4096},
    {"1 KiB rows, 2048 per descriptor", 1024, 2048, 1024, 2048},
};

std::vector<GatherDesc> Descs(const Shape& s, uint64_t bytes, char* dst, const char* src) {
  const uint64_t rows = bytes / s.row;
  const uint64_t per = s.rows_per_desc == 0 ? rows : s.rows_per_desc;
  std::vector<GatherDesc> out;
  for (uint64_t r = 0; r < rows; r += per) {
    const uint64_t n = std::min(per, rows - r);
    out.push_back(GatherDesc{reinterpret_cast<uint64_t>(dst + r * s.dst_pitch),
                             reinterpret_cast<uint64_t>(src + r * s.src_pitch), s.row, n,
                             s.dst_pitch, s.src_pitch, 1, 0, 0});
  }
  return out;
}

#define CUDA_OK(x)                                                      \
  do {                                                                  \
    cudaError_t e_ = (x);                                               \
    ASSERT_EQ(e_, cudaSuccess) << #x << ": " << cudaGetErrorString(e_); \
  } while (0)

bool HaveGpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(GatherKernelBench, PeerShapesBesideOneCudaMemcpy) {
  if (!HaveGpu()) GTEST_SKIP() << "no CUDA GPU present";
  CUDA_OK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const uint32_t sms = static_cast<uint32_t>(prop.multiProcessorCount);
  constexpr uint64_t kMax = uint64_t{512} << 20;
  char *src = nullptr, *dst = nullptr, *contig = nullptr;
  GatherDesc* ddesc = nullptr;
  CUDA_OK(cudaMalloc(&src, 2 * kMax));
  CUDA_OK(cudaMalloc(&dst, kMax));
  CUDA_OK(cudaMalloc(&contig, kMax));
  CUDA_OK(cudaMalloc(&ddesc, sizeof(GatherDesc) * 16384));
  CUDA_OK(cudaMemset(src, 0x5a, 2 * kMax));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  struct Variant {
    std::string name;
    uint32_t cap;  // the grid cap (cuda.gather_max_blocks) of a kernel variant
    int baseline;  // 0 kernel, 1 cudaMemcpyAsync contiguous, 2 cudaMemcpy2DAsync
  };
  std::vector<Variant> variants = {
      {"cudaMemcpyAsync, contiguous", 0, 1},
      {"cudaMemcpy2DAsync, same shape", 0, 2},
      {fmt::format("kernel, {} blocks (default cap)", 2 * sms), 2 * sms, 0},
      {fmt::format("kernel, {} blocks", 4 * sms), 4 * sms, 0},
      {fmt::format("kernel, {} blocks", 8 * sms), 8 * sms, 0},
  };
  std::printf("gather kernel alone, %s, %u SMs; CUDA events, median of 9 after 2 warm-ups\n",
              prop.name, sms);
  for (uint64_t bytes : {uint64_t{64} << 20, kMax}) {
    for (const Shape& sh : kShapes) {
      const uint64_t moved = bytes / sh.row * sh.row;
      std::vector<GatherDesc> descs = Descs(sh, moved, dst, src);
      ASSERT_LE(descs.size(), 16384u);
      CUDA_OK(cudaMemcpy(ddesc, descs.data(), descs.size() * sizeof(GatherDesc),
                         cudaMemcpyHostToDevice));
      auto enqueue = [&](const Variant& v) {
        if (v.baseline == 1) return cudaMemcpyAsync(contig, src, moved, cudaMemcpyDefault, s);
        if (v.baseline == 2) {
          return cudaMemcpy2DAsync(dst, sh.dst_pitch, src, sh.src_pitch, sh.row, moved / sh.row,
                                   cudaMemcpyDefault, s);
        }
        return LaunchGather(ddesc, static_cast<uint32_t>(descs.size()), v.cap, s);
      };
      std::vector<std::vector<double>> ms(variants.size());
      for (int it = 0; it < 11; ++it) {  // round-robin: drift hits every variant alike
        for (size_t k = 0; k < variants.size(); ++k) {
          CUDA_OK(cudaEventRecord(a, s));
          CUDA_OK(enqueue(variants[k]));
          CUDA_OK(cudaEventRecord(b, s));
          CUDA_OK(cudaEventSynchronize(b));
          float t = 0;
          CUDA_OK(cudaEventElapsedTime(&t, a, b));
          if (it >= 2) ms[k].push_back(t);
        }
      }
      const double base = moved / (Median(ms[0]) * 1e-3) / 1e9;
      std::printf("  %s, %llu MiB in %zu descriptor(s) of %llu B rows (pitches %llu/%llu):\n",
                  sh.name, static_cast<unsigned long long>(moved >> 20), descs.size(),
                  static_cast<unsigned long long>(sh.row),
                  static_cast<unsigned long long>(sh.src_pitch),
                  static_cast<unsigned long long>(sh.dst_pitch));
      for (size_t k = 0; k < variants.size(); ++k) {
        const double gbps = moved / (Median(ms[k]) * 1e-3) / 1e9;
        EXPECT_GT(gbps, 0);
        std::printf("    %-44s %7.0f GB/s  ratio to cudaMemcpy %.2f\n", variants[k].name.c_str(),
                    gbps, gbps / base);
      }
    }
  }
  // Byte check of the last launch (narrow rows, 512 MiB): every row landed.
  std::vector<char> row(256);
  CUDA_OK(cudaMemcpy(row.data(), dst + (kMax / 256 - 1) * 256, 256, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(row.begin(), row.end(), 0x5a), 256);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaStreamDestroy(s);
  cudaFree(src);
  cudaFree(dst);
  cudaFree(contig);
  cudaFree(ddesc);
}

int64_t MonoNs() {
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

struct ChildResult {
  int ok = 0;
  double bytes = 0;
  double p50_us = 0;  // Work::one_at_a_time: the median launch, from its call to its end
  int64_t t0 = 0, t1 = 0;
  char err[160] = {};
};

struct Work {
  std::string name;
  bool kernel;          // else cudaMemcpyAsync of contiguous bytes (the copy engine)
  uint64_t launch;      // bytes per launch
  uint32_t cap_per_sm;  // gather blocks per SM
  // Each launch waited for alone, as a 128-token request's copy is: the child reports the median
  // from the launch call to the synchronize's return (the latency, not the rate, of sharing).
  bool one_at_a_time = false;
};

// What one child does besides its Work: nothing after its set-up (idle), or one-at-a-time
// launches in turns with the other child: it waits for a byte on `turn_in` before each launch and
// writes one to `turn_out` after it (0 instead once its time is up: the turns end).
struct Role {
  bool idle = false;
  int turn_in = -1, turn_out = -1;
};

// One process's share: `launch` bytes per launch, launches queued back to back (eight, then a
// synchronize) or one at a time, until `run_ms` passed. Runs in a forked child; never returns.
[[noreturn]] void Child(const Work& w, Role role, int ready_fd, int go_fd, int out_fd, int run_ms) {
  const bool idle = role.idle;
  ChildResult r;
  auto fail = [&](const char* what, cudaError_t e) {
    std::snprintf(r.err, sizeof(r.err), "%s: %s", what, cudaGetErrorString(e));
    char c = 0;
    (void)!write(ready_fd, &c, 1);
    (void)!write(out_fd, &r, sizeof(r));
    _exit(0);
  };
  cudaError_t e = cudaSetDevice(0);
  if (e != cudaSuccess)
    fail("cudaSetDevice (CUDA initialized before fork? run this test alone)", e);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const Shape& sh = kShapes[0];
  char *src = nullptr, *dst = nullptr;
  GatherDesc* ddesc = nullptr;
  if ((e = cudaMalloc(&src, 2 * w.launch)) != cudaSuccess) fail("cudaMalloc", e);
  if ((e = cudaMalloc(&dst, w.launch)) != cudaSuccess) fail("cudaMalloc", e);
  if ((e = cudaMalloc(&ddesc, sizeof(GatherDesc))) != cudaSuccess) fail("cudaMalloc", e);
  std::vector<GatherDesc> d = Descs(sh, w.launch, dst, src);
  cudaMemcpy(ddesc, d.data(), sizeof(GatherDesc), cudaMemcpyHostToDevice);
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  const uint32_t cap = w.cap_per_sm * static_cast<uint32_t>(prop.multiProcessorCount);
  auto launch = [&] {
    return w.kernel ? LaunchGather(ddesc, 1, cap, s)
                    : cudaMemcpyAsync(dst, src, w.launch, cudaMemcpyDefault, s);
  };
  for (int i = 0; i < 3; ++i) launch();  // warm-up
  if ((e = cudaStreamSynchronize(s)) != cudaSuccess) fail("warm-up", e);
  char c = 1;
  (void)!write(ready_fd, &c, 1);
  (void)!read(go_fd, &c, 1);
  r.t0 = MonoNs();
  const int64_t end = r.t0 + int64_t{run_ms} * 1000000;
  uint64_t n = 0;
  std::vector<double> waited_us;
  while (idle && MonoNs() < end) usleep(1000);
  while (!idle && w.one_at_a_time && MonoNs() < end) {
    if (role.turn_in >= 0 && (read(role.turn_in, &c, 1) != 1 || c == 0)) break;
    const int64_t t = MonoNs();
    if ((e = launch()) != cudaSuccess) fail("launch", e);
    if ((e = cudaStreamSynchronize(s)) != cudaSuccess) fail("synchronize", e);
    waited_us.push_back(static_cast<double>(MonoNs() - t) * 1e-3);
    ++n;
    c = 1;
    if (role.turn_out >= 0) (void)!write(role.turn_out, &c, 1);
  }
  c = 0;
  if (role.turn_out >= 0) (void)!write(role.turn_out, &c, 1);
  if (!waited_us.empty()) r.p50_us = Median(waited_us);
  while (!idle && !w.one_at_a_time && MonoNs() < end) {
    for (int i = 0; i < 8; ++i, ++n) {
      if ((e = launch()) != cudaSuccess) fail("launch", e);
    }
    if ((e = cudaStreamSynchronize(s)) != cudaSuccess) fail("synchronize", e);
  }
  r.t1 = MonoNs();
  r.bytes = static_cast<double>(n) * static_cast<double>(w.launch / sh.row * sh.row);
  r.ok = 1;
  (void)!write(out_fd, &r, sizeof(r));
  _exit(0);
}

// Runs `procs` children on `w` at once, the last `idle` of them idle, or (`take_turns`, two
// children) launching in turns; aggregate GB/s over the span from the first start to the last
// end, or a negative value with the error in `err`. `p50_us`: the largest of the children's
// median launch latencies (Work::one_at_a_time).
double RunProcs(const Work& w, int procs, std::string& err, int idle = 0, double* p50_us = nullptr,
                bool take_turns = false) {
  constexpr int kRunMs = 400;
  int ready[2], go[2], out[2], turns[2][2];
  if (pipe(ready) != 0 || pipe(go) != 0 || pipe(out) != 0 || pipe(turns[0]) != 0 ||
      pipe(turns[1]) != 0) {
    return -1;
  }
  std::vector<pid_t> kids;
  for (int i = 0; i < procs; ++i) {
    Role role{i >= procs - idle};
    if (take_turns) role = Role{false, turns[i % 2][0], turns[(i + 1) % 2][1]};
    pid_t p = fork();
    if (p == 0) Child(w, role, ready[1], go[0], out[1], kRunMs);
    kids.push_back(p);
  }
  for (int i = 0; i < procs; ++i) {
    char c;
    (void)!read(ready[0], &c, 1);
  }
  const char go_bytes[8] = {};
  (void)!write(go[1], go_bytes, procs);
  const char first_turn = 1;
  if (take_turns) (void)!write(turns[0][1], &first_turn, 1);
  double bytes = 0;
  int64_t t0 = INT64_MAX, t1 = 0;
  bool ok = true;
  for (int i = 0; i < procs; ++i) {
    ChildResult r;
    if (read(out[0], &r, sizeof(r)) != static_cast<ssize_t>(sizeof(r))) {
      ok = false;
      err = "a child died";
      continue;
    }
    if (!r.ok) {
      ok = false;
      err = r.err;
      continue;
    }
    bytes += r.bytes;
    if (p50_us != nullptr) *p50_us = std::max(*p50_us, r.p50_us);
    t0 = std::min(t0, r.t0);
    t1 = std::max(t1, r.t1);
  }
  for (pid_t p : kids) waitpid(p, nullptr, 0);
  for (int fd : {ready[0], ready[1], go[0], go[1], out[0], out[1], turns[0][0], turns[0][1],
                 turns[1][0], turns[1][1]}) {
    close(fd);
  }
  return ok ? bytes / ((t1 - t0) * 1e-9) / 1e9 : -1;
}

// Whether a forked child can use CUDA (the parent itself must not: children fork from a
// CUDA-free process), in `*has`.
void ProbeChildCuda(bool* has_cuda) {
  int probe[2];
  ASSERT_EQ(pipe(probe), 0);
  pid_t p = fork();
  if (p == 0) {
    // Counting devices works in a child of a process that used CUDA; making a context does not
    // (on the H100 the whole binary in one process failed here instead of skipping).
    int n = 0;
    char has = cudaGetDeviceCount(&n) == cudaSuccess && n > 0 && cudaSetDevice(0) == cudaSuccess &&
               cudaFree(nullptr) == cudaSuccess;
    (void)!write(probe[1], &has, 1);
    _exit(0);
  }
  char has = 0;
  (void)!read(probe[0], &has, 1);
  waitpid(p, nullptr, 0);
  close(probe[0]);
  close(probe[1]);
  *has_cuda = has != 0;
}

// Two processes (two CUDA contexts, time-sliced without MPS) beside one process with the same
// per-launch work: the aggregate each gets, kernel vs copy engine, short vs long launches.
TEST(GatherKernelBench, TwoProcessesBesideOne) {
  bool has_cuda = false;
  ASSERT_NO_FATAL_FAILURE(ProbeChildCuda(&has_cuda));
  if (!has_cuda) {
    GTEST_SKIP() << "no CUDA in a forked child: no GPU, or this process used CUDA before (run the "
                    "test alone, as ctest does)";
  }
  const Work works[] = {
      {"copy engine, 64 MiB per cudaMemcpyAsync", false, 64 << 20, 0},
      {"kernel, 2 blocks/SM, 64 MiB per launch", true, 64 << 20, 2},
      {"kernel, 8 blocks/SM, 64 MiB per launch", true, 64 << 20, 8},
      {"kernel, 2 blocks/SM, 128 MiB per launch", true, 128 << 20, 2},
      {"kernel, 2 blocks/SM, 256 MiB per launch", true, 256 << 20, 2},
      {"kernel, 2 blocks/SM, 512 MiB per launch", true, 512 << 20, 2},
      {"copy engine, 512 MiB per cudaMemcpyAsync", false, 512 << 20, 0},
  };
  std::printf(
      "one process vs two at once on one GPU (aggregate GB/s, 400 ms each; tp2->tp4 "
      "head slices for the kernel, contiguous bytes for the copy engine)\n");
  for (const Work& w : works) {
    std::string err;
    const double one = RunProcs(w, 1, err);
    ASSERT_GT(one, 0) << w.name << ": " << err;
    const double two = RunProcs(w, 2, err);
    ASSERT_GT(two, 0) << w.name << ": " << err;
    std::printf("  %-50s one %6.0f  two %6.0f GB/s  ratio %.2f\n", w.name.c_str(), one, two,
                two / one);
  }
}

// The latency side of sharing one GPU: a 128-token TP2->TP4 request makes each of two context
// ranks launch one small gather (8 MiB of 16 KiB head slices) and wait for it. The median wait
// of one process alone, of two launching at once (time-sliced contexts), of two taking turns (one
// launches only once the other's launch ended: is it the switch, or only work queued in both
// contexts at once, that costs?), and of one launching beside a second context that holds memory
// but launches nothing.
TEST(GatherKernelBench, SmallLaunchesOfTwoProcessesWaitForEachOther) {
  bool has_cuda = false;
  ASSERT_NO_FATAL_FAILURE(ProbeChildCuda(&has_cuda));
  if (!has_cuda) {
    GTEST_SKIP() << "no CUDA in a forked child: no GPU, or this process used CUDA before (run the "
                    "test alone, as ctest does)";
  }
  std::printf("one launch at a time, median wait from launch to synchronize (us), 400 ms each\n");
  for (const Work& w : {Work{"kernel, 8 MiB of 16 KiB rows", true, 8 << 20, 2, true},
                        Work{"copy engine, 8 MiB contiguous", false, 8 << 20, 0, true}}) {
    std::string err;
    double alone = 0, both = 0, turns = 0, beside_idle = 0;
    ASSERT_GT(RunProcs(w, 1, err, 0, &alone), 0) << w.name << ": " << err;
    ASSERT_GT(RunProcs(w, 2, err, 0, &both), 0) << w.name << ": " << err;
    ASSERT_GT(RunProcs(w, 2, err, 1, &beside_idle), 0) << w.name << ": " << err;
    ASSERT_GT(RunProcs(w, 2, err, 0, &turns, /*take_turns=*/true), 0) << w.name << ": " << err;
    ASSERT_GT(alone, 0);
    std::printf(
        "  %-34s alone %7.1f  two launching %7.1f  two in turns %7.1f  beside an idle context "
        "%7.1f\n",
        w.name.c_str(), alone, both, turns, beside_idle);
  }
}

}  // namespace
}  // namespace kvferry
