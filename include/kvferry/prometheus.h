// Prometheus text exposition (format 0.0.4) of metrics snapshots, and a small HTTP endpoint.
//
// Why our own few lines rather than prometheus-cpp or the Python prometheus_client: the numbers
// are snapshots of objects the engine owns (kvferry/metrics.h), so there is no registry to keep in
// sync with objects that come and go, the library takes no new dependency, and one renderer serves
// the CLI (--metrics-port), C++ embedders and Python (kvferry.metrics.prometheus_text). An engine
// that already runs a Prometheus client serves PrometheusText() from its own handler instead.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <variant>

#include "kvferry/block_manager.h"
#include "kvferry/metrics.h"
#include "kvferry/status.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

struct MetricsSource {
  std::string name;  // the `source` label of every sample
  std::variant<TransceiverMetrics, TieringMetrics, BlockManagerStats> metrics;
};

// Every source's samples, grouped by metric family (HELP and TYPE once per family).
std::string PrometheusText(std::span<const MetricsSource> sources);

// Serves `render()` at http://HOST:PORT/metrics (and /) from one thread that polls every open
// connection without blocking on any: each is answered and closed (a scraper's pattern), closed
// 2 s after it opened whatever it sent, and at most 64 are open (the oldest closed to let a new
// one in), so silent or slow peers neither delay a scrape nor hold memory. `render` runs on that
// thread and must be thread-safe against the caller's own use of the objects it reads (snapshots
// are). Port 0 picks a free port (port()). Loopback unless the host says otherwise. The destructor
// stops the thread.
class MetricsServer {
 public:
  static StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host, uint16_t port,
                                                        std::function<std::string()> render);
  virtual ~MetricsServer() = default;
  virtual uint16_t port() const = 0;
  virtual int64_t scrapes() const = 0;  // requests answered
};

}  // namespace kvferry
#pragma GCC visibility pop
