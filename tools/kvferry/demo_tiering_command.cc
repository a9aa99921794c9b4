// `kvferry demo tiering`: prints RunTieringDemo's narration and its counts.
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "kvferry/config.h"
#include "kvferry/slab_store.h"
#include "testing/tiering_demo.h"
#include "tools/kvferry/commands.h"
#include "tools/kvferry/output.h"
#include "tools/kvferry/rank_processes.h"

namespace kvferry::tools {
namespace {

struct DemoTieringOptions {
  std::string device;
  std::string layout = "block-major";
  TieringDemoOptions demo;
  std::string dir;  // empty: a fresh temp dir under $TMPDIR (or /tmp), removed at the end
  std::string file_backend = "posix";
  OutputFlags out;
};

// The demo's own temp dir, removed however the demo ends: at destruction, or by a janitor process
// (RankGroup with no ranks) when this process dies by a signal (SIGKILL included).
class TempDir {
 public:
  TempDir() = default;
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    if (path_.empty()) return;
    janitor_.reset();  // removes the directory and waits for the janitor
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  StatusOr<std::string> Create() {
    std::error_code ec;
    std::string tmpl = (std::filesystem::temp_directory_path(ec) / "kvferry-demo-tiering-XXXXXX");
    if (ec) tmpl = "/tmp/kvferry-demo-tiering-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return Status::Internal(fmt::format("mkdtemp {}: {}", tmpl, std::strerror(errno)));
    }
    path_ = tmpl;
    KVF_ASSIGN_OR_RETURN(janitor_, RankGroup::Create(path_));
    return path_;
  }

 private:
  std::string path_;
  std::unique_ptr<RankGroup> janitor_;
};

int RunDemo(DemoTieringOptions o) {
  auto dev = OpenDevice(o.device.empty() ? Config::Global().String("device.default") : o.device);
  if (!dev.ok()) {
    fmt::print(stderr, "demo tiering: {}\n", dev.status().ToString());
    return 2;
  }
  auto layout = ParseLayoutKind(o.layout);
  if (!layout.ok()) {
    fmt::print(stderr, "demo tiering: {}\n", layout.status().ToString());
    return 2;
  }
  o.demo.layout = *layout;
  // The file tier: the real SlabStore on --dir (or a temp dir), unless --file-slots 0.
  TempDir temp;  // destroyed after the store (declared first)
  std::unique_ptr<SlabStore> file;
  if (o.demo.file_slots > 0) {
    std::string dir = o.dir;
    if (dir.empty()) {
      auto d = temp.Create();
      if (!d.ok()) {
        fmt::print(stderr, "demo tiering: {}\n", d.status().ToString());
        return 2;
      }
      dir = *d;
    }
    SlabStoreOptions so = SlabStoreOptionsFromConfig();
    so.dir = dir;
    so.backend = o.file_backend;
    so.slot_payload_bytes = TieringDemoBlockBytes();
    so.max_slots = o.demo.file_slots;
    so.slots_per_file = std::min<int64_t>(so.slots_per_file, o.demo.file_slots);
    so.recover = "none";  // the demo narrates one run from an empty cache
    auto store = SlabStore::Open(so);
    if (!store.ok()) {
      fmt::print(stderr, "demo tiering: file tier in {}: {}\n", dir, store.status().ToString());
      return 2;
    }
    file = std::move(store).value();
    if (!o.out.machine()) {
      const FileBackendCaps& caps = file->backend();
      fmt::print("file tier: {} backend in {}{}{}\n", caps.name, dir,
                 caps.direct_io ? ", O_DIRECT" : ", buffered",
                 caps.note.empty() ? "" : " (" + caps.note + ")");
    }
  }
  auto rep = RunTieringDemo(**dev, o.demo, file.get(), [&](std::string_view line) {
    if (!o.out.machine()) fmt::print("{}\n", line);
  });
  if (!rep.ok()) {
    fmt::print(stderr, "demo tiering: {}\n", rep.status().ToString());
    return 1;
  }
  if (o.out.machine()) {
    const auto& s = rep->stats;
    nlohmann::json j = {{"offloaded", s.offloaded},
                        {"demoted", s.demoted},
                        {"onboarded", s.onboarded},
                        {"hits", {s.hits[0], s.hits[1], s.hits[2]}},
                        {"dropped", {s.dropped[0], s.dropped[1], s.dropped[2]}},
                        {"reused_tokens", rep->reused_tokens},
                        {"prompt_tokens", rep->prompt_tokens},
                        {"verified_blocks", rep->verified_blocks},
                        {"file_backend", rep->file_backend},
                        {"file_note", file ? file->backend().note : ""}};
    Document doc("demo tiering");
    doc.config() = {{"device", (*dev)->info().name},           {"layout", o.layout},
                    {"conversations", o.demo.conversations},   {"rounds", o.demo.rounds},
                    {"primary_blocks", o.demo.primary_blocks}, {"host_blocks", o.demo.host_blocks},
                    {"file_slots", o.demo.file_slots},         {"file_backend", o.file_backend},
                    {"block_bytes", TieringDemoBlockBytes()}};
    doc.summary() = j;
    doc.Print(o.out.format());
  }
  return 0;
}

}  // namespace

void AddDemoTieringCommand(CLI::App& demo) {
  auto* cmd = demo.add_subcommand(
      "tiering", "shared prefixes, evictions offloading to host then file, prefix hits onboarded");
  auto o = std::make_shared<DemoTieringOptions>();
  cmd->add_option("--device", o->device, "cpu | cuda | cuda:N (default: device.default)");
  cmd->add_option("--layout", o->layout, "block-major | per-layer");
  cmd->add_option("--conversations", o->demo.conversations, "conversations per round")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--rounds", o->demo.rounds, "rounds of conversations")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  cmd->add_option("--primary-blocks", o->demo.primary_blocks)->check(CLI::Range(4, 1 << 20));
  cmd->add_option("--host-blocks", o->demo.host_blocks)->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--file-slots", o->demo.file_slots, "0 = no file tier")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option(
      "--dir", o->dir,
      "directory of the file tier (must exist; its slab files are left there; default: a "
      "fresh temp dir under $TMPDIR or /tmp, removed however the demo ends)");
  cmd->add_option("--file-backend", o->file_backend,
                  "posix | io_uring | cufile (unavailable ones fall back to posix, logged)")
      ->check(CLI::IsMember({"posix", "io_uring", "cufile"}));
  AddOutputFlags(cmd, o->out);
  cmd->callback([o] { std::exit(RunDemo(*o)); });
}

}  // namespace kvferry::tools
