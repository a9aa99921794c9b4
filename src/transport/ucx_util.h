// Pieces of the UCX backend that stand on their own: the one conversion of ucs_status_t into
// Status, and the move-only owners of UCX handles (context, worker, rkey, config, a memory
// registration). Included only by the UCX backend's sources.
#pragma once

#include <ucp/api/ucp.h>

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "kvferry/status.h"
#include "kvferry/transport.h"

namespace kvferry::ucx_detail {

// The directory UCX loads its modules from ("ucx" beside libucs when it exists, else UCX's
// configured MODULE_DIR), and the configured MODULE_DIR itself, which kvferry never changes.
// ucx_runtime.cc.
std::string ModuleDir();
std::string ConfiguredModuleDir();
// Gives SIGHUP back its previous action (the default one in a process that set none). libucs
// takes the signal when it loads (UCX_DEBUG_SIGNO, SIGHUP by default: flush the log, raise the
// log level) and so swallows the hangup that should end the process; kvferry processes keep
// their own. Once per process, before the first UCX context.
void KeepSighup();

inline Status FromUcs(ucs_status_t st, std::string_view what) {
  std::string msg = std::string(what) + ": " + ucs_status_string(st);
  switch (st) {
    case UCS_OK:
      return Status::Ok();
    case UCS_ERR_CANCELED:
      return Status::Cancelled(std::move(msg));
    case UCS_ERR_MESSAGE_TRUNCATED:
      return Status::InvalidArgument(std::move(msg) + " (message larger than receive buffer)");
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
      return Status::InvalidArgument(std::move(msg));
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return Status::ResourceExhausted(std::move(msg));
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_REJECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_SHMEM_SEGMENT:  // a dead peer over shared memory: its segment is gone
      return Status::Unavailable(std::move(msg));
    default:
      return Status::Internal(std::move(msg));
  }
}

// ---- move-only owners of UCX handles ----------------------------------------------------------

struct ContextDeleter {
  void operator()(ucp_context_h c) const { ucp_cleanup(c); }
};
using ContextPtr = std::unique_ptr<std::remove_pointer_t<ucp_context_h>, ContextDeleter>;

struct WorkerDeleter {
  void operator()(ucp_worker_h w) const { ucp_worker_destroy(w); }
};
using WorkerPtr = std::unique_ptr<std::remove_pointer_t<ucp_worker_h>, WorkerDeleter>;

struct RkeyDeleter {
  void operator()(ucp_rkey_h k) const { ucp_rkey_destroy(k); }
};
using RkeyPtr = std::unique_ptr<std::remove_pointer_t<ucp_rkey_h>, RkeyDeleter>;

struct ConfigDeleter {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};
using ConfigPtr = std::unique_ptr<ucp_config_t, ConfigDeleter>;

class UcxRegistration final : public MemoryRegistration {
 public:
  UcxRegistration(ucp_context_h ctx, ucp_mem_h memh, std::vector<std::byte> key, void* ptr,
                  size_t size)
      : ctx_(ctx), memh_(memh), key_(std::move(key)), ptr_(ptr), size_(size) {}
  ~UcxRegistration() override { ucp_mem_unmap(ctx_, memh_); }
  UcxRegistration(const UcxRegistration&) = delete;
  UcxRegistration& operator=(const UcxRegistration&) = delete;
  std::span<const std::byte> PackedKey() const override { return key_; }
  uint64_t address() const override { return reinterpret_cast<uintptr_t>(ptr_); }
  size_t size() const override { return size_; }

 private:
  const ucp_context_h ctx_;
  const ucp_mem_h memh_;
  const std::vector<std::byte> key_;
  void* const ptr_;
  const size_t size_;
};

}  // namespace kvferry::ucx_detail
