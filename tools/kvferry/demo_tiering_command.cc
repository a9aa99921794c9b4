// `kvferry demo tiering`: prints RunTieringDemo's narration and its counts.
#include <fmt/format.h>

#include <cstdio>
#include <nlohmann/json.hpp>

#include "kvferry/config.h"
#include "kvferry/tiering_demo.h"
#include "tools/kvferry/commands.h"

namespace kvferry::tools {
namespace {

struct Options {
  std::string device;
  std::string layout = "block-major";
  TieringDemoOptions demo;
  bool json = false;
};

int RunDemo(Options o) {
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
  auto rep = RunTieringDemo(**dev, o.demo, nullptr, [&](std::string_view line) {
    if (!o.json) fmt::print("{}\n", line);
  });
  if (!rep.ok()) {
    fmt::print(stderr, "demo tiering: {}\n", rep.status().ToString());
    return 1;
  }
  if (o.json) {
    const auto& s = rep->stats;
    nlohmann::json j = {{"offloaded", s.offloaded},
                        {"demoted", s.demoted},
                        {"onboarded", s.onboarded},
                        {"hits", {s.hits[0], s.hits[1], s.hits[2]}},
                        {"dropped", {s.dropped[0], s.dropped[1], s.dropped[2]}},
                        {"reused_tokens", rep->reused_tokens},
                        {"prompt_tokens", rep->prompt_tokens},
                        {"verified_blocks", rep->verified_blocks},
                        {"file_backend", rep->file_backend}};
    std::puts(j.dump().c_str());
  }
  return 0;
}

}  // namespace

void AddDemoTieringCommand(CLI::App& demo) {
  auto* cmd = demo.add_subcommand(
      "tiering", "shared prefixes, evictions offloading to host then file, prefix hits onboarded");
  auto o = std::make_shared<Options>();
  cmd->add_option("--device", o->device, "cpu | cuda | cuda:N (default: device.default)");
  cmd->add_option("--layout", o->layout, "block-major | per-layer");
  cmd->add_option("--conversations", o->demo.conversations, "conversations per round")
      ->check(CLI::Range(1, 1000));
  cmd->add_option("--primary-blocks", o->demo.primary_blocks)->check(CLI::Range(4, 1 << 20));
  cmd->add_option("--host-blocks", o->demo.host_blocks)->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--file-slots", o->demo.file_slots, "0 = no file tier")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_flag("--json", o->json, "counts as one JSON object");
  cmd->callback([o] { std::exit(RunDemo(*o)); });
}

}  // namespace kvferry::tools
