// The in-process transport: transports that share one InProcFabric reach each other by address
// ("inproc:N"). For unit tests of everything above the transport, and for fault injection:
// InProcFabric::Kill makes a transport die the way a crashed peer would.
//
// Semantics: matching on (peer, tag) in posting order; bytes are copied when a send meets its
// receive (so a send completes when it is matched, like a rendezvous send); control messages are
// queued at the receiver in order. Destroying a transport kills it. One-sided: RegisterMemory
// hands out keys naming the region; Put copies at once after checking the key names a live
// registration of that peer and the range lies inside it (else the op fails, nothing written);
// Flush completes at once.
//
// Thread-safety: an InProcFabric is thread-safe; each transport is thread-compatible (one owner
// thread), and transports of one fabric may be driven by different threads.
#pragma once

#include <memory>
#include <string_view>

#include "kvferry/status.h"
#include "kvferry/transport.h"

#pragma GCC visibility push(default)  // the public API (kvferry/export.h)
namespace kvferry {

class InProcFabric {
 public:
  virtual ~InProcFabric() = default;
  static std::shared_ptr<InProcFabric> Create();

  // Kills the transport at `address`: its pending ops and every pending op of another transport
  // that names it fail with kUnavailable, and so do later ops. kNotFound for an unknown address.
  virtual Status Kill(std::string_view address) = 0;
};

StatusOr<std::unique_ptr<Transport>> CreateInProcTransport(const TransportOptions& options);

}  // namespace kvferry
#pragma GCC visibility pop
