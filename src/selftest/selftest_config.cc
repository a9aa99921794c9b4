#include "selftest/selftest_config.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "kvferry/device.h"
#include "planner/planner.h"
#include "testing/faulty_transport.h"

namespace kvferry {
namespace {
// A side as the planner sees it with pools of `blocks` blocks (a custom layout's strides too).
InstanceDesc SideDesc(const SelftestConfig& cfg, bool context, int64_t blocks) {
  const LayoutSpec& spec = context ? cfg.ctx_layout : cfg.gen_layout;
  InstanceDesc d{SideShape(cfg, context), context ? cfg.ctx : cfg.gen, spec.kind, blocks};
  d.scales = SideScales(cfg, context);
  if (spec.kind == LayoutKind::kCustom) {
    // An invalid parallel config leaves the span zero; CheckCompatible names it first.
    auto span = InstancePoolDims(d.shape, d.parallel, blocks);
    d.split = spec.split;
    d.strides = spec.Strides(span.ok() ? *span : PoolDims{});
  }
  return d;
}
}  // namespace

int64_t TokensOf(const SelftestConfig& cfg, int i) {
  return cfg.prompt_tokens[i % cfg.prompt_tokens.size()];
}

int SlotsOf(const SelftestConfig& cfg, bool context) {
  return cfg.concurrency + (context ? cfg.ctx_ahead : 0);
}

std::vector<int> GroupRanks(const KvShape& shape, const ParallelConfig& p, int group) {
  std::vector<int> out;
  for (int r = 0; r < p.world_size(); ++r) {
    const auto slice = SliceOf(shape, p, r);  // fails only for a config Validate refuses
    if (slice.ok() && slice->dp_group == group) out.push_back(r);
  }
  return out;
}

std::string RankDevice(const SelftestConfig& cfg, bool context, int rank) {
  if (cfg.device.rfind("cuda", 0) != 0) return cfg.device;
  if (cfg.gpus.empty() && cfg.device != "cuda") return cfg.device;  // "cuda:N": every rank on N
  // Local rank: context ranks first, then generation ranks, so the two instances land on
  // different GPUs when there are several.
  const int local = context ? rank : cfg.ctx.world_size() + rank;
  if (!cfg.gpus.empty()) return fmt::format("cuda:{}", cfg.gpus[local % cfg.gpus.size()]);
  int visible = 0;
  for (const std::string& d : ListDevices()) visible += d.rfind("cuda:", 0) == 0;
  return fmt::format("cuda:{}", visible > 0 ? local % visible : 0);
}

Status ValidateSelftest(const SelftestConfig& cfg) {
  // Bounds first, so that nothing below sizes anything by an absurd value.
  for (const auto& [side, p] : {std::pair{"ctx", &cfg.ctx}, std::pair{"gen", &cfg.gen}}) {
    for (const auto& [name, v] :
         {std::pair{"tp", p->tp}, std::pair{"pp", p->pp}, std::pair{"dp", p->dp_size}}) {
      if (v < 1 || v > kSelftestMaxRanks) {
        return Status::InvalidArgument(
            fmt::format("--{}-{} {} must be in [1, {}]", side, name, v, kSelftestMaxRanks));
      }
    }
  }
  const int ranks = cfg.ctx.world_size() + cfg.gen.world_size();
  if (ranks > kSelftestMaxRanks) {
    return Status::InvalidArgument(fmt::format(
        "{} context + {} generation ranks: a run on one host has at most {} ranks (processes, "
        "or threads with --transport inproc)",
        cfg.ctx.world_size(), cfg.gen.world_size(), kSelftestMaxRanks));
  }
  if (cfg.requests > kSelftestMaxRequests) {
    return Status::InvalidArgument(
        fmt::format("--requests {} is more than {}", cfg.requests, kSelftestMaxRequests));
  }
  if (cfg.metrics_port < -1 || cfg.metrics_port > 65535 ||
      (cfg.metrics_port > 0 && cfg.metrics_port + ranks - 1 > 65535)) {
    return Status::InvalidArgument(fmt::format(
        "--metrics-port {}: the {} ranks serve on ports {} to {}; the last must be at most 65535",
        cfg.metrics_port, ranks, cfg.metrics_port, int64_t{cfg.metrics_port} + ranks - 1));
  }
  if (cfg.concurrency > kSelftestMaxConcurrency || cfg.ctx_ahead > kSelftestMaxConcurrency) {
    return Status::InvalidArgument(fmt::format("--concurrency {} must be at most {}",
                                               std::max(cfg.concurrency, cfg.ctx_ahead),
                                               kSelftestMaxConcurrency));
  }
  KVF_RETURN_IF_ERROR(cfg.shape.Validate());
  KVF_RETURN_IF_ERROR(SideShape(cfg, false).Validate().WithContext("generation shape"));
  if ((cfg.gen_dtype && *cfg.gen_dtype != cfg.shape.dtype) ||
      cfg.ctx_scales != ScaleGranularity::kNone || cfg.gen_scales != ScaleGranularity::kNone) {
    KVF_RETURN_IF_ERROR(CheckCompatible(SideDesc(cfg, true, 1), SideDesc(cfg, false, 1)));
  }
  if (cfg.gen_tokens_per_block != 0 && cfg.gen_tokens_per_block != cfg.shape.tokens_per_block) {
    KVF_RETURN_IF_ERROR(CheckCompatible(SideDesc(cfg, true, 1), SideDesc(cfg, false, 1)));
    if (cfg.shared_prefix_blocks > 0) {
      return Status::InvalidArgument(fmt::format(
          "--shared-prefix-blocks {} needs the same tokens per block on both sides "
          "(context {}, generation {})",
          cfg.shared_prefix_blocks, cfg.shape.tokens_per_block, cfg.gen_tokens_per_block));
    }
  }
  // The pools hold every request in flight: bounded before any is allocated (in doubles: the
  // product of absurd flags overflows int64).
  for (int64_t t : cfg.prompt_tokens) {
    for (bool context : {true, false}) {
      const KvShape shape = SideShape(cfg, context);
      const double blocks =
          std::ceil(static_cast<double>(t) / shape.tokens_per_block) * SlotsOf(cfg, context) +
          std::max(0, cfg.shared_prefix_blocks);
      const double bytes =
          blocks * shape.tokens_per_block * static_cast<double>(shape.BytesPerToken());
      if (bytes > static_cast<double>(kSelftestMaxPoolBytes)) {
        return Status::InvalidArgument(fmt::format(
            "{}-token requests, {} in flight: the {} instance's pools would hold {:.1f} GiB; at "
            "most {} GiB (fewer or shorter requests, or a smaller shape)",
            t, SlotsOf(cfg, context), context ? "context" : "generation", bytes / (1 << 30),
            kSelftestMaxPoolBytes >> 30));
      }
    }
  }
  KVF_RETURN_IF_ERROR(cfg.ctx.Validate(cfg.shape).WithContext("context split"));
  KVF_RETURN_IF_ERROR(cfg.gen.Validate(cfg.shape).WithContext("generation split"));
  if (cfg.requests < 1) return Status::InvalidArgument("--requests must be at least 1");
  if (cfg.concurrency < 1) return Status::InvalidArgument("--concurrency must be at least 1");
  if (cfg.ctx_ahead < 0)
    return Status::InvalidArgument(fmt::format("ctx_ahead {} must not be negative", cfg.ctx_ahead));
  if (cfg.prompt_tokens.empty()) return Status::InvalidArgument("--prompt-tokens is empty");
  for (int64_t t : cfg.prompt_tokens) {
    if (t < 1)
      return Status::InvalidArgument(fmt::format("--prompt-tokens {} must be positive", t));
  }
  if (cfg.dir.empty()) return Status::InvalidArgument("no run directory");
  const std::vector<std::string> transports = AvailableTransports();
  if (std::find(transports.begin(), transports.end(), cfg.transport) == transports.end())
    return Status::InvalidArgument(fmt::format("--transport {}: this build has {}", cfg.transport,
                                               fmt::join(transports, ", ")));
  if (cfg.timeout.count() < 1)
    return Status::InvalidArgument(
        fmt::format("--timeout-ms {} must be at least 1", cfg.timeout.count()));
  if (cfg.crash_ctx_rank < -1 || cfg.crash_ctx_rank >= cfg.ctx.world_size())
    return Status::InvalidArgument(
        fmt::format("--crash-ctx-rank {} is not a context rank (0 to {}, or -1 for none)",
                    cfg.crash_ctx_rank, cfg.ctx.world_size() - 1));
  if (!cfg.fault.empty()) {
    KVF_ASSIGN_OR_RETURN(FaultPoint f, ParseFaultPoint(cfg.fault));
    const int world = f.context ? cfg.ctx.world_size() : cfg.gen.world_size();
    if (f.rank >= world) {
      return Status::InvalidArgument(
          fmt::format("--fault {}: rank {} is outside the {} ranks of the "
                      "{} instance",
                      cfg.fault, f.rank, world, f.context ? "context" : "generation"));
    }
    if (f.spec.kind == FaultKind::kCrash && cfg.transport == "inproc") {
      return Status::InvalidArgument(
          fmt::format("--fault {}: a crash ends a rank's process; inproc runs every rank in one "
                      "(use --transport ucx)",
                      cfg.fault));
    }
  }
  if (!cfg.gpus.empty() && cfg.device.rfind("cuda", 0) != 0) {
    return Status::InvalidArgument(
        fmt::format("--gpus needs --device cuda (the device is {})", cfg.device));
  }
  for (int g : cfg.gpus) {
    if (g < 0) return Status::InvalidArgument(fmt::format("--gpus: {} is not a GPU ordinal", g));
  }
  for (int64_t t : cfg.prompt_tokens) {
    if (cfg.shared_prefix_blocks < 0 ||
        t <= int64_t{cfg.shared_prefix_blocks} * cfg.shape.tokens_per_block) {
      return Status::InvalidArgument(fmt::format(
          "--shared-prefix-blocks {} ({} tokens) must be shorter than every prompt ({} tokens)",
          cfg.shared_prefix_blocks, int64_t{cfg.shared_prefix_blocks} * cfg.shape.tokens_per_block,
          t));
    }
  }
  return Status::Ok();
}

KvScales SideScales(const SelftestConfig& cfg, bool context) {
  KvScales s;
  s.granularity = context ? cfg.ctx_scales : cfg.gen_scales;
  const KvShape shape = SideShape(cfg, context);
  const int64_t n = KvScales::CountFor(s.granularity, shape);
  for (int64_t i = 0; i < n; ++i) {
    s.values.push_back(context ? 0.5f + 0.0137f * static_cast<float>(i)
                               : 0.25f + 0.0071f * static_cast<float>(i));
  }
  return s;
}

KvShape SideShape(const SelftestConfig& cfg, bool context) {
  KvShape s = cfg.shape;
  if (!context && cfg.gen_tokens_per_block != 0) s.tokens_per_block = cfg.gen_tokens_per_block;
  if (!context && cfg.gen_dtype) s.dtype = *cfg.gen_dtype;
  return s;
}

}  // namespace kvferry
