#include "kvferry/transport.h"

#include <algorithm>

#include "kvferry/config.h"
#include "kvferry/inproc_transport.h"
#include "kvferry/ucx_info.h"
#include "kvferry_build_config.h"
#include "transport/split_transport.h"

namespace kvferry {

#if KVFERRY_HAVE_UCX
StatusOr<std::unique_ptr<Transport>> CreateUcxTransport(const TransportOptions& options);
#endif
// nixl_transport.cc: NIXL's C API is loaded at run time, so it is always compiled in.
StatusOr<std::unique_ptr<Transport>> CreateNixlTransport(const TransportOptions& options);
#if KVFERRY_HAVE_MPI
StatusOr<std::unique_ptr<Transport>> CreateMpiTransport(const TransportOptions& options);
#endif

StatusOr<std::unique_ptr<MemoryRegistration>> Transport::RegisterMemory(void*, size_t, MemoryKind) {
  return Status::Unavailable("transport '" + caps().name + "' has no one-sided operations");
}

StatusOr<std::unique_ptr<TransportOp>> Transport::Put(PeerId, const void*, size_t, MemoryKind,
                                                      uint64_t, std::span<const std::byte>) {
  return Status::Unavailable("transport '" + caps().name + "' has no one-sided operations");
}

StatusOr<std::unique_ptr<TransportOp>> Transport::Flush(PeerId) {
  return Status::Unavailable("transport '" + caps().name + "' has no one-sided operations");
}

StatusOr<std::unique_ptr<TransportOp>> Transport::Get(PeerId, void*, size_t, MemoryKind, uint64_t,
                                                      std::span<const std::byte>) {
  return Status::Unavailable("transport '" + caps().name + "' has no one-sided operations");
}

std::string Transport::DescribePeer(PeerId) { return caps().name; }

StatusOr<std::unique_ptr<Transport>> CreateTransport(const TransportOptions& options) {
  if (options.name == "inproc") return CreateInProcTransport(options);
  if (options.name == "ucx") {
#if KVFERRY_HAVE_UCX
    return CreateUcxTransport(options);
#else
    return Status::Unavailable(
        "transport 'ucx' is not compiled in (the libucx-cu13 wheel was not found: scripts/setup)");
#endif
  }
  if (options.name == "mpi") {
#if KVFERRY_HAVE_MPI
    return CreateMpiTransport(options);
#else
    return Status::Unavailable("transport 'mpi' is not compiled in (libopenmpi-dev not found)");
#endif
  }
  if (options.name == "nixl") {
    if (Config::Global().String("nixl.control") == "notifications") {
      return CreateNixlTransport(options);
    }
#if KVFERRY_HAVE_UCX
    // nixl.control=ucx: NIXL's one-sided operations, kvferry's UCX for the rest.
    KVF_ASSIGN_OR_RETURN(auto nixl, CreateNixlTransport(options));
    auto ucx = CreateUcxTransport(options);
    if (!ucx.ok()) return ucx.status().WithContext("nixl.control=ucx");
    return MakeSplitTransport(std::move(nixl), std::move(ucx).value());
#else
    return Status::Unavailable("nixl.control=ucx: transport 'ucx' is not compiled in");
#endif
  }
  return Status::InvalidArgument("unknown transport '" + options.name +
                                 "' (expected inproc, ucx, mpi or nixl)");
}

std::vector<std::string> AvailableTransports() {
  std::vector<std::string> names = {"inproc"};
#if KVFERRY_HAVE_UCX
  names.push_back("ucx");
#endif
#if KVFERRY_HAVE_MPI
  names.push_back("mpi");
#endif
  names.push_back("nixl");  // loaded at run time: CreateTransport says when it is unusable
  return names;
}

Status WaitOp(Transport& transport, TransportOp& op, Deadline deadline) {
  while (!op.Done()) {
    if (Clock::now() >= deadline) return Status::DeadlineExceeded("transport op still pending");
    transport.Progress();
  }
  return op.status();
}

bool UcxRuntimeInfo::cuda() const {
  return std::find(memory_types.begin(), memory_types.end(), "cuda") != memory_types.end();
}

std::string DescribeUcxRuntime(const UcxRuntimeInfo& info) {
  std::string s = "UCX " + info.version + " from " + info.library_path + ":";
  for (const auto& t : info.transports) s += " " + t.transport + "/" + t.device;
  s += "; memory";
  for (size_t i = 0; i < info.memory_types.size(); ++i) {
    s += (i ? "," : " ") + info.memory_types[i];
  }
  return s;
}

#if !KVFERRY_HAVE_UCX
StatusOr<UcxRuntimeInfo> QueryUcxRuntime() {
  return Status::Unavailable("ucx is not compiled in (the libucx-cu13 wheel was not found)");
}
#endif

}  // namespace kvferry
