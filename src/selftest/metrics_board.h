// MetricsBoard: what a long run (soak, selftest ranks) shows on its --metrics-port while the
// objects it measures come and go (the soak builds a new rig per epoch). The run attaches a
// function returning the current sources and detaches it before destroying them; the endpoint's
// thread renders under the same mutex, so it never reads a destroyed side.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/thread_annotations.h"
#include "kvferry/prometheus.h"

namespace kvferry {

class MetricsBoard {
 public:
  using Sources = std::function<std::vector<MetricsSource>()>;
  void Attach(Sources sources) {
    MutexLock lock(mu_);
    sources_ = std::move(sources);
  }
  void Detach() { Attach({}); }
  std::string Text() const {
    MutexLock lock(mu_);
    if (!sources_) return "";
    const std::vector<MetricsSource> s = sources_();
    return PrometheusText(s);
  }
  // Serves Text() on 127.0.0.1:port (0: a free one); says where on stderr, naming `who`.
  StatusOr<std::unique_ptr<MetricsServer>> Serve(uint16_t port, const std::string& who) const;

 private:
  mutable Mutex mu_;
  Sources sources_ GUARDED_BY(mu_);
};

// Attaches for the lifetime of the scope (declare it after the objects it reads).
class BoardScope {
 public:
  BoardScope(MetricsBoard* board, MetricsBoard::Sources sources) : board_(board) {
    if (board_) board_->Attach(std::move(sources));
  }
  ~BoardScope() {
    if (board_) board_->Detach();
  }
  BoardScope(const BoardScope&) = delete;
  BoardScope& operator=(const BoardScope&) = delete;

 private:
  MetricsBoard* const board_;
};

}  // namespace kvferry
