// Metrics: histogram buckets, the transceiver's counters and timelines over a real in-process
// transfer, per-direction tier copies, the Prometheus text and the HTTP endpoint scraped.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kvferry/inproc_transport.h"
#include "kvferry/prometheus.h"
#include "kvferry/tiering.h"
#include "kvferry/transceiver.h"
#include "kvferry/transport.h"
#include "rendezvous/socket.h"

namespace kvferry {
namespace {

using namespace std::chrono_literals;

TEST(LatencyHistogram, BucketsAreMicrosecondPowersOfTwo) {
  EXPECT_DOUBLE_EQ(LatencyHistogram::UpperBound(0), 1e-6);
  EXPECT_DOUBLE_EQ(LatencyHistogram::UpperBound(10), 1024e-6);
  EXPECT_TRUE(std::isinf(LatencyHistogram::UpperBound(LatencyHistogram::kBuckets)));
  EXPECT_EQ(LatencyHistogram::BucketOf(0), 0);
  EXPECT_EQ(LatencyHistogram::BucketOf(1e-6), 0);
  EXPECT_EQ(LatencyHistogram::BucketOf(1.5e-6), 1);
  EXPECT_EQ(LatencyHistogram::BucketOf(1e9), LatencyHistogram::kBuckets);
  LatencyHistogram h;
  for (int i = 0; i < 99; ++i) h.Add(3e-6);  // bucket 2 (<= 4 us)
  h.Add(0.5);                                // bucket 19 (<= 524 ms)
  EXPECT_EQ(h.count(), 100);
  EXPECT_NEAR(h.sum(), 99 * 3e-6 + 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(h.Quantile(0.5), 4e-6);
  EXPECT_DOUBLE_EQ(h.Quantile(0.99), 4e-6);
  EXPECT_DOUBLE_EQ(h.Quantile(1.0), LatencyHistogram::UpperBound(19));
  EXPECT_EQ(LatencyHistogram().Quantile(0.5), 0);
}

// One context rank, one generation rank, in-process; `n` requests of `tokens` tokens.
struct Pair {
  Pair() : dev(OpenCpuDevice()), fabric(InProcFabric::Create()) {
    const KvShape shape{4, 2, 16, DType::kBf16, 2, 8};
    const PoolSpec spec{shape, ParallelConfig{}, 0, LayoutKind::kBlockMajor, MemoryKind::kHost, 32};
    ctx_pool.emplace(std::move(BlockPool::Create(*dev, spec).value()));
    gen_pool.emplace(std::move(BlockPool::Create(*dev, spec).value()));
    TransceiverOptions o;
    o.transport = "inproc";
    o.timeout = 5000ms;
    o.chunk_bytes = 4096;  // several chunks per request
    o.direct_min_bytes = int64_t{1} << 40;
    o.instance_secret = NewInstanceSecret();
    ctx = std::move(ContextSide::Create(*dev, *ctx_pool, o, Make()).value());
    EXPECT_TRUE(ctx->SetInstanceAddresses({ctx->address()}).ok());
    gen = std::move(GenerationSide::Create(*dev, *gen_pool, o, Make()).value());
  }
  std::unique_ptr<Transport> Make() {
    TransportOptions t;
    t.name = "inproc";
    t.fabric = fabric;
    return std::move(CreateTransport(t).value());
  }
  void Run(uint64_t id, int64_t tokens) {
    std::vector<int64_t> blocks;
    for (int64_t b = 0; b * 8 < tokens; ++b) blocks.push_back(b);
    auto h = ctx->MarkReady(id, blocks, tokens);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    ASSERT_TRUE(gen->Fetch(*h, blocks, 0).ok());
    auto g = gen->Poll(1, DeadlineIn(10s));
    auto c = ctx->Poll(1, DeadlineIn(10s));
    ASSERT_EQ(g.size(), 1u);
    ASSERT_EQ(c.size(), 1u);
    ASSERT_EQ(g[0].state, TransferState::kComplete) << g[0].reason.ToString();
  }
  std::unique_ptr<Device> dev;
  std::shared_ptr<InProcFabric> fabric;
  std::optional<BlockPool> ctx_pool, gen_pool;
  std::unique_ptr<ContextSide> ctx;
  std::unique_ptr<GenerationSide> gen;
};

TEST(TransceiverMetrics, CountsRequestsChunksAndTimelines) {
  Pair p;
  p.Run(1, 64);
  p.Run(2, 100);
  // A fetch the context rank refuses (unknown request): an error on the generation side.
  std::vector<int64_t> blocks{0, 1};
  auto h = p.ctx->MarkReady(3, blocks, 16);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(p.ctx->Cancel(3).ok());
  ASSERT_TRUE(p.gen->Fetch(*h, blocks, 0).ok());
  auto g = p.gen->Poll(1, DeadlineIn(10s));
  ASSERT_EQ(g.size(), 1u);
  EXPECT_NE(g[0].state, TransferState::kComplete);
  (void)p.ctx->Poll(1, DeadlineIn(1s));

  const TransceiverMetrics gm = p.gen->metrics();
  EXPECT_EQ(gm.side, "generation");
  EXPECT_EQ(gm.transport, "inproc");
  EXPECT_EQ(gm.requests_started, 3);
  EXPECT_EQ(gm.requests_complete, 2);
  EXPECT_EQ(gm.requests_error + gm.requests_timed_out, 1);
  ASSERT_EQ(gm.errors_by_code.size(), 1u);
  EXPECT_EQ(gm.errors_by_code[0].second, 1);
  const int64_t per_token = 4 * 2 * 16 * 2 * 2;  // layers x heads x dim x bf16 x (K, V)
  EXPECT_EQ(gm.bytes, (64 + 100) * per_token);
  EXPECT_EQ(gm.chunk_bytes, gm.bytes);
  EXPECT_GE(gm.chunks, (64 + 100) * per_token / 4096);
  EXPECT_EQ(gm.chunk_latency.count(), gm.chunks);
  EXPECT_EQ(gm.request_latency.count(), 3);
  EXPECT_EQ(gm.live_requests, 0);
  EXPECT_EQ(gm.staging_slots_in_use, 0);
  EXPECT_GT(gm.staging_slots, 0);

  const TransceiverMetrics cm = p.ctx->metrics();
  EXPECT_EQ(cm.side, "context");
  EXPECT_EQ(cm.requests_complete, 2);
  EXPECT_EQ(cm.requests_cancelled, 1);
  EXPECT_EQ(cm.bytes, gm.bytes);

  // Timelines: in order, steps in time order, the failed request without bytes.
  const std::vector<RequestTimeline> t = p.gen->timelines();
  ASSERT_EQ(t.size(), 3u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(t[i].request_id, uint64_t(i + 1));
    EXPECT_EQ(t[i].state, "complete");
    EXPECT_EQ(t[i].code, "OK");
    EXPECT_GE(t[i].fetch, 0);
    EXPECT_GE(t[i].first_byte, t[i].fetch);
    EXPECT_GE(t[i].last_byte, t[i].first_byte);
    EXPECT_GE(t[i].end, t[i].last_byte);
    EXPECT_GT(t[i].chunks, 1);
  }
  EXPECT_EQ(t[2].request_id, 3u);
  EXPECT_EQ(t[2].first_byte, -1);
  const std::vector<RequestTimeline> ct = p.ctx->timelines();
  ASSERT_EQ(ct.size(), 3u);
  EXPECT_GE(ct[0].first_byte, ct[0].fetch);
  EXPECT_EQ(ct[2].state, "cancelled");
}

TEST(TieringMetrics, CountsEachDirection) {
  auto dev = OpenCpuDevice();
  const KvShape shape{2, 2, 16, DType::kBf16, 2, 8};
  auto primary = BlockPool::Create(
      *dev, PoolSpec{shape, {}, 0, LayoutKind::kBlockMajor, MemoryKind::kDevice, 8});
  auto host = BlockPool::Create(
      *dev, PoolSpec{shape, {}, 0, LayoutKind::kBlockMajor, MemoryKind::kPinnedHost, 8});
  ASSERT_TRUE(primary.ok() && host.ok());
  auto tm = TransferManager::Create(*dev, *primary, &*host, nullptr);
  ASSERT_TRUE(tm.ok()) << tm.status().ToString();
  std::vector<BlockMove> out = {{0, 4}, {1, 5}, {2, 6}};
  auto b = (*tm)->Offload(Tier::kHost, out);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(b->Wait(DeadlineIn(10s)).ok());
  std::vector<BlockMove> in = {{4, 3}};
  auto c = (*tm)->Onboard(Tier::kHost, in);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c->Wait(DeadlineIn(10s)).ok());
  const TieringMetrics m = (*tm)->metrics();
  ASSERT_EQ(m.copies.size(), 2u);
  const int64_t block = primary->layout().block_bytes();
  EXPECT_EQ(m.copies[0].from, "primary");
  EXPECT_EQ(m.copies[0].to, "host");
  EXPECT_EQ(m.copies[0].batches, 1);
  EXPECT_EQ(m.copies[0].blocks, 3);
  EXPECT_EQ(m.copies[0].bytes, 3 * block);
  EXPECT_EQ(m.copies[0].latency.count(), 1);
  EXPECT_EQ(m.copies[1].from, "host");
  EXPECT_EQ(m.copies[1].to, "primary");
  EXPECT_EQ(m.copies[1].bytes, block);
  EXPECT_EQ(m.copies[1].latency.count(), 1);
}

TEST(Prometheus, FamiliesOnceHistogramsCumulative) {
  TransceiverMetrics a;
  a.side = "context";
  a.transport = "ucx";
  a.data_path = "one-sided";
  a.requests_complete = 5;
  a.errors_by_code = {{"UNAVAILABLE", 2}};
  a.request_latency.Add(2e-6);
  a.request_latency.Add(2e-6);
  a.request_latency.Add(1.0);
  TransceiverMetrics b = a;
  b.side = "generation";
  std::vector<MetricsSource> sources{{"ctx0", a}, {"gen0", b}, {"tier", TieringMetrics{}}};
  const std::string text = PrometheusText(sources);
  auto count = [&](const std::string& s) {
    size_t n = 0;
    for (size_t at = text.find(s); at != std::string::npos; at = text.find(s, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("# TYPE kvferry_requests_total counter\n"), 1u);
  EXPECT_EQ(count("# TYPE kvferry_request_latency_seconds histogram\n"), 1u);
  EXPECT_NE(text.find("kvferry_requests_total{source=\"ctx0\",side=\"context\",transport=\"ucx\","
                      "state=\"complete\"} 5\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("kvferry_request_errors_total{source=\"gen0\",side=\"generation\","
                      "transport=\"ucx\",code=\"UNAVAILABLE\"} 2\n"),
            std::string::npos);
  // Cumulative: 2 at le=2e-06, still 2 below one second, 3 at +Inf and _count.
  EXPECT_NE(text.find("le=\"2e-06\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("le=\"0.524288\"} 2\n"), std::string::npos);
  EXPECT_NE(text.find("le=\"+Inf\"} 3\n"), std::string::npos);
  EXPECT_NE(text.find("kvferry_request_latency_seconds_count{source=\"ctx0\",side=\"context\","
                      "transport=\"ucx\"} 3\n"),
            std::string::npos);
  EXPECT_NE(text.find("kvferry_file_jobs_queued{source=\"tier\"} 0\n"), std::string::npos);
  // Every sample line's family was declared before it.
  std::string declared;
  for (size_t at = 0; at < text.size();) {
    const size_t end = text.find('\n', at);
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    if (line.starts_with("# TYPE ")) declared = line.substr(7, line.find(' ', 7) - 7);
    if (line.starts_with("#")) continue;
    EXPECT_TRUE(line.starts_with(declared)) << line << " after family " << declared;
  }
}

std::string Get(uint16_t port, const std::string& path) {
  auto fd = rendezvous::ConnectTcp("127.0.0.1", std::to_string(port), DeadlineIn(2s));
  EXPECT_TRUE(fd.ok()) << fd.status().ToString();
  if (!fd.ok()) return "";
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
  EXPECT_TRUE(rendezvous::WriteAll(fd->get(), std::as_bytes(std::span(req.data(), req.size())),
                                   DeadlineIn(2s))
                  .ok());
  std::string out;
  std::byte c;
  while (rendezvous::ReadExactly(fd->get(), std::span(&c, 1), DeadlineIn(2s)).ok())
    out += static_cast<char>(c);
  return out;
}

TEST(MetricsServer, ServesTheRenderedTextAndRefusesOtherPaths) {
  int renders = 0;
  auto s = MetricsServer::Start("127.0.0.1", 0, [&] {
    ++renders;
    return std::string("kvferry_up 1\n");
  });
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_GT((*s)->port(), 0);
  const std::string ok = Get((*s)->port(), "/metrics");
  EXPECT_TRUE(ok.starts_with("HTTP/1.1 200 OK\r\n")) << ok;
  EXPECT_NE(ok.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  EXPECT_TRUE(ok.ends_with("\r\n\r\nkvferry_up 1\n")) << ok;
  EXPECT_TRUE(Get((*s)->port(), "/nothing").starts_with("HTTP/1.1 404"));
  EXPECT_EQ((*s)->scrapes(), 1);
  EXPECT_EQ(renders, 1);
  // A port in use is refused with the address.
  auto again = MetricsServer::Start("127.0.0.1", (*s)->port(), [] { return std::string(); });
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().ToString().find("metrics endpoint on 127.0.0.1"), std::string::npos);
}

// Silent connections (a port scanner, a stuck scraper) neither delay a scrape nor pile up: each
// is closed 2 s after it opened, and beyond 64 open the oldest silent one is closed.
TEST(MetricsServer, SilentConnectionsDoNotDelayAScrape) {
  auto s = MetricsServer::Start("127.0.0.1", 0, [] { return std::string("kvferry_up 1\n"); });
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::vector<rendezvous::Fd> silent;
  for (int i = 0; i < 10; ++i) {
    auto fd = rendezvous::ConnectTcp("127.0.0.1", std::to_string((*s)->port()), DeadlineIn(2s));
    ASSERT_TRUE(fd.ok());
    // Half a request head: the server has started reading it.
    const std::string part = "GET /metrics HTTP/1.1\r\n";
    ASSERT_TRUE(rendezvous::WriteAll(fd->get(), std::as_bytes(std::span(part.data(), part.size())),
                                     DeadlineIn(1s))
                    .ok());
    silent.push_back(std::move(*fd));
  }
  const auto start = Clock::now();
  const std::string ok = Get((*s)->port(), "/metrics");
  const auto took = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  printf("scrape behind 10 silent connections: %.1f ms\n", took);
  EXPECT_TRUE(ok.ends_with("kvferry_up 1\n")) << ok;
  EXPECT_LT(took, 500);
  // Many more than the bound: a scrape still gets in.
  for (int i = 0; i < 100; ++i) {
    auto fd = rendezvous::ConnectTcp("127.0.0.1", std::to_string((*s)->port()), DeadlineIn(2s));
    ASSERT_TRUE(fd.ok());
    silent.push_back(std::move(*fd));
  }
  const auto again = Clock::now();
  EXPECT_TRUE(Get((*s)->port(), "/metrics").ends_with("kvferry_up 1\n"));
  EXPECT_LT(Clock::now() - again, 500ms);
}

}  // namespace
}  // namespace kvferry
