// `kvferry soak --processes`: the soak over UCX processes (one per rank), crash faults included
// (process_soak.cc says what each epoch checks).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "kvferry/status.h"

namespace kvferry::tools {

struct ProcessSoakConfig {
  int64_t requests = 240;
  int64_t epoch_requests = 24;  // requests per multi-process run (one fault each)
  std::chrono::milliseconds timeout{2000};
  uint64_t seed = 1;
};

struct ProcessSoakReport {
  int64_t epochs = 0, requests = 0;
  int64_t verified = 0, failed = 0;  // requests complete and checked / not
  int64_t crashed_epochs = 0;        // epochs whose crash fault ended a rank's process
  std::map<std::string, int64_t> faults_by_kind, faults_by_step;  // armed, one per epoch
  int64_t verify_failures = 0;  // completed requests with wrong bytes
  int64_t broken = 0;           // broken promises (a request never ended, a rank hung or died)
  double seconds = 0;
  std::vector<std::string> errors;  // the first few
};

StatusOr<ProcessSoakReport> RunProcessSoak(
    const ProcessSoakConfig& cfg,
    const std::function<void(const ProcessSoakReport&)>& progress = {});

}  // namespace kvferry::tools
