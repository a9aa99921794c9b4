#include "selftest/metrics_board.h"

#include <fmt/format.h>

namespace kvferry {

StatusOr<std::unique_ptr<MetricsServer>> MetricsBoard::Serve(uint16_t port,
                                                             const std::string& who) const {
  KVF_ASSIGN_OR_RETURN(auto server,
                       MetricsServer::Start("127.0.0.1", port, [this] { return Text(); }));
  fmt::print(stderr, "kvferry: {} metrics at http://127.0.0.1:{}/metrics\n", who, server->port());
  std::fflush(stderr);
  return server;
}

}  // namespace kvferry
