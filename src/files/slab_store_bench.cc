// slab_store_bench: SlabStore write/read GB/s for each backend against raw O_DIRECT pwrite/pread
// of the same bytes in the same directory, measured in the same run.
//
//   slab_store_bench [DIR] [SLOT_MIB] [TOTAL_MIB] [BATCH] [REPEATS]
//
// Defaults: DIR=/tmp (must be disk-backed for honest numbers), 2 MiB slots, 1024 MiB, batches of
// 16 slots, 3 repeats (best of). Host payloads are 4096-aligned (moved in place, no staging).
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "files/raw_io_bench.h"
#include "files/slab_store.h"
#include "files/test_util.h"

namespace kvferry {
namespace {

struct Result {
  double write_gbps = 0;
  double read_gbps = 0;
};

StatusOr<Result> RunStore(const std::string& dir, const std::string& backend, int64_t slot_bytes,
                          int64_t total, int batch, int repeats) {
  testing_files::ScratchDir scratch(dir);
  if (scratch.path().empty()) return Status::Internal("can't make a scratch dir in " + dir);
  SlabStoreOptions o = SlabStoreOptionsFromConfig();
  o.dir = scratch.path();
  o.backend = backend;
  o.slot_payload_bytes = slot_bytes;
  o.max_slots = total / slot_bytes;
  o.slots_per_file = 256;
  o.max_in_flight = batch;
  KVF_ASSIGN_OR_RETURN(std::unique_ptr<SlabStore> store, SlabStore::Open(o));
  if (store->backend().name != backend) {
    return Status::Unavailable(fmt::format("{} fell back to {}: {}", backend, store->backend().name,
                                           store->backend().note));
  }
  const int64_t n = o.max_slots;
  auto mem = testing_files::AlignedAlloc(static_cast<size_t>(batch * slot_bytes));
  testing_files::FillPattern(mem.get(), batch * slot_bytes, 1);
  std::vector<SlotId> ids;
  for (int64_t i = 0; i < n; ++i) ids.push_back(*store->Allocate());
  // Pre-create every slab file (untimed), like a warmed-up tier.
  {
    std::vector<SlotWrite> ws;
    for (int64_t i = 0; i < n; i += o.slots_per_file) {
      ws.push_back({ids[i], {0, 0}, mem.get(), slot_bytes, MemoryKind::kHost});
    }
    for (const Status& s : store->Write(ws)) KVF_RETURN_IF_ERROR(s);
  }
  Result best;
  for (int rep = 0; rep < repeats; ++rep) {
    std::vector<SlotWrite> ws;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t b = 0; b < n; b += batch) {
      ws.clear();
      for (int64_t i = b; i < std::min(n, b + batch); ++i) {
        ws.push_back({ids[i],
                      {1, uint64_t(i)},
                      mem.get() + (i - b) * slot_bytes,
                      slot_bytes,
                      MemoryKind::kHost});
      }
      for (const Status& s : store->Write(ws)) KVF_RETURN_IF_ERROR(s);
    }
    double w = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::vector<SlotRead> rs;
    t0 = std::chrono::steady_clock::now();
    for (int64_t b = 0; b < n; b += batch) {
      rs.clear();
      for (int64_t i = b; i < std::min(n, b + batch); ++i) {
        rs.push_back({ids[i],
                      {1, uint64_t(i)},
                      mem.get() + (i - b) * slot_bytes,
                      slot_bytes,
                      MemoryKind::kHost});
      }
      for (const Status& s : store->Read(rs)) KVF_RETURN_IF_ERROR(s);
    }
    double r = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best.write_gbps = std::max(best.write_gbps, n * slot_bytes / w / 1e9);
    best.read_gbps = std::max(best.read_gbps, n * slot_bytes / r / 1e9);
  }
  return best;
}

int Main(int argc, char** argv) {
  std::string dir = argc > 1 ? argv[1] : "/tmp";
  int64_t slot = (argc > 2 ? std::atoll(argv[2]) : 2) << 20;
  int64_t total = (argc > 3 ? std::atoll(argv[3]) : 1024) << 20;
  int batch = argc > 4 ? std::atoi(argv[4]) : 16;
  int repeats = argc > 5 ? std::atoi(argv[5]) : 3;
  fmt::print(
      "slab_store_bench: dir {}, slots of {} MiB, {} MiB per pass, batches of {}, best of {}\n",
      dir, slot >> 20, total >> 20, batch, repeats);
  double raw_w = 0, raw_r = 0;
  for (int rep = 0; rep < repeats; ++rep) {
    auto w = RawDirectIoGbps(dir, total, slot, true);
    auto r = RawDirectIoGbps(dir, total, slot, false);
    if (!w.ok() || !r.ok()) {
      fmt::print("baseline raw O_DIRECT: unavailable: {}\n",
                 (!w.ok() ? w.status() : r.status()).ToString());
      break;
    }
    raw_w = std::max(raw_w, *w);
    raw_r = std::max(raw_r, *r);
  }
  fmt::print("{:<26} {:>10} {:>10}\n", "path", "write GB/s", "read GB/s");
  fmt::print("{:<26} {:>10.2f} {:>10.2f}\n", "raw O_DIRECT pwrite/pread", raw_w, raw_r);
  for (const std::string& name : FileBackendNames()) {
    auto res = RunStore(dir, name, slot, total, batch, repeats);
    if (!res.ok()) {
      fmt::print("{:<26} {}\n", "SlabStore " + name, res.status().ToString());
      continue;
    }
    fmt::print("{:<26} {:>10.2f} {:>10.2f}   ({:.0f}% / {:.0f}% of raw)\n", "SlabStore " + name,
               res->write_gbps, res->read_gbps, raw_w > 0 ? 100 * res->write_gbps / raw_w : 0,
               raw_r > 0 ? 100 * res->read_gbps / raw_r : 0);
  }
  return 0;
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Main(argc, argv); }
