// The child side of ucx_two_process_test: ucx_peer_helper MODE PARENT_ADDRESS [BW_TOTAL_MIB]
//   echo  receive 64 MiB (tag 1) and send it back (tag 2)
//   hang  connect, say ready, then only progress (the parent kills it)
//   hangaddr  like hang, but says its own LocalAddress() instead of "ready"
//   hangreg  like hang, after registering a 64 MiB region of its own memory and sending
//            (address, key) (the parent puts into it, then kills it)
//   bw    register a 64 MiB region, send (address, key), receive tag-send bandwidth traffic
//   cuda  register 64 MiB of GPU memory (cuda:0), send (address, key); on each control message
//         "check" answer with the FNV-1a hash of the region's bytes (copied to the host)
//   badhello  (raw UCX, no kvferry transport) send the parent one hello whose address is the
//         parent's own with the first byte of its control worker address changed (what a forged
//         handle or hello may carry), then exit 0
// Each other mode first connects to the parent and sends the control message "ready"; each ends on
// the parent's control message "exit" or after 60 s. Exit status 0 on success.
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "kvferry/device.h"
#include "kvferry/transport.h"
#include "testing/bandwidth.h"
#include "transport/ucx_address.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;

int Fail(const Status& st) {
  std::fprintf(stderr, "ucx_peer_helper: %s\n", st.ToString().c_str());
  return 1;
}

std::vector<std::byte> Bytes(std::string_view s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

bool AwaitExit(Transport& t, Deadline deadline) {
  while (Clock::now() < deadline) {
    if (auto m = t.PollControl()) {
      if (std::string(reinterpret_cast<const char*>(m->bytes.data()), m->bytes.size()) == "exit")
        return true;
    }
    t.Progress();
  }
  return false;
}

uint32_t Fnv1a(const std::vector<std::byte>& v) {
  uint32_t h = 2166136261u;
  for (std::byte b : v) h = (h ^ static_cast<uint8_t>(b)) * 16777619u;
  return h;
}

int CudaTarget(Transport& t, PeerId parent, Deadline deadline) {
  auto dev = OpenDevice("cuda:0");
  if (!dev.ok()) return Fail(dev.status());
  constexpr size_t kBytes = size_t{64} << 20;
  auto region = (*dev)->Allocate(MemoryKind::kDevice, kBytes);
  if (!region.ok()) return Fail(region.status());
  auto stream = (*dev)->CreateStream();
  if (!stream.ok()) return Fail(stream.status());
  Status st = (*stream)->Fill(region->data(), 0, kBytes);
  if (st.ok()) st = (*stream)->Synchronize(deadline);
  if (!st.ok()) return Fail(st);
  auto reg = t.RegisterMemory(region->data(), kBytes, MemoryKind::kDevice);
  if (!reg.ok()) return Fail(reg.status());
  std::vector<std::byte> msg(8);
  const uint64_t addr = (*reg)->address();
  std::memcpy(msg.data(), &addr, 8);
  auto key = (*reg)->PackedKey();
  msg.insert(msg.end(), key.begin(), key.end());
  if (st = t.SendControl(parent, msg); !st.ok()) return Fail(st);
  std::vector<std::byte> host(kBytes);
  while (Clock::now() < deadline) {
    auto m = t.PollControl();
    if (!m) {
      t.Progress();
      continue;
    }
    const std::string text(reinterpret_cast<const char*>(m->bytes.data()), m->bytes.size());
    if (text == "exit") return 0;
    if (text != "check") continue;
    st = (*stream)->Copy(host.data(), region->data(), kBytes);
    if (st.ok()) st = (*stream)->Synchronize(deadline);
    if (!st.ok()) return Fail(st);
    if (st = t.SendControl(parent, Bytes(std::to_string(Fnv1a(host)))); !st.ok()) return Fail(st);
  }
  return Fail(Status::DeadlineExceeded("no 'exit' from parent"));
}

// One control message (ucx_transport.cc: tag bit 63 | the sender's instance; byte 0 = 1, hello)
// carrying `address`, sent on a raw UCX endpoint to the parent's control worker.
int BadHello(const std::string& parent) {
  auto workers = DecodeUcxWorkerAddresses(parent);
  if (!workers.ok()) return Fail(workers.status());
  UcxWorkerAddresses bad = *workers;
  bad.control[0] ^= 0x5a;
  const std::string text = EncodeUcxWorkerAddresses(bad);
  std::vector<uint8_t> msg{1};
  const uint32_t n = static_cast<uint32_t>(text.size());
  for (int i = 0; i < 4; ++i) msg.push_back(static_cast<uint8_t>(n >> (8 * i)));
  msg.insert(msg.end(), text.begin(), text.end());
  msg.push_back('h');
  msg.push_back('i');
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  ucp_config_t* config = nullptr;
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return 4;
  if (ucp_init(&params, config, &ctx) != UCS_OK) return 4;
  ucp_config_release(config);
  ucp_worker_params_t wp{};
  if (ucp_worker_create(ctx, &wp, &worker) != UCS_OK) return 4;
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(workers->control.data());
  ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  if (ucp_ep_create(worker, &ep_params, &ep) != UCS_OK) return 4;
  ucp_request_param_t prm{};
  ucs_status_ptr_t r =
      ucp_tag_send_nbx(ep, msg.data(), msg.size(), (uint64_t{1} << 63) | 0x1234567, &prm);
  const Deadline deadline = DeadlineIn(milliseconds(10000));
  while (UCS_PTR_IS_PTR(r) && ucp_request_check_status(r) == UCS_INPROGRESS &&
         Clock::now() < deadline) {
    ucp_worker_progress(worker);
  }
  const bool sent =
      !UCS_PTR_IS_ERR(r) && (!UCS_PTR_IS_PTR(r) || ucp_request_check_status(r) == UCS_OK);
  if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
  // Leave the endpoint for the process's end to close: the parent is not expected to answer.
  return sent ? 0 : 5;
}

int Main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(
        stderr,
        "usage: ucx_peer_helper echo|hang|hangaddr|hangreg|bw|cuda|badhello PARENT_ADDRESS "
        "[BW_TOTAL_MIB]\n");
    return 2;
  }
  alarm(90);  // never outlive a broken parent
  const std::string mode = argv[1];
  if (mode == "badhello") return BadHello(argv[2]);
  const Deadline deadline = DeadlineIn(milliseconds(60000));
  TransportOptions o;
  o.name = "ucx";
  o.device_memory_is_host = mode != "cuda";
  auto made = CreateTransport(o);
  if (!made.ok()) return Fail(made.status());
  Transport& t = **made;
  auto parent = t.Connect(argv[2], deadline);
  if (!parent.ok()) return Fail(parent.status());
  // "hangaddr": like hang, saying its own address instead of "ready".
  Status st = t.SendControl(*parent, Bytes(mode == "hangaddr" ? t.LocalAddress() : "ready"));
  if (!st.ok()) return Fail(st);

  if (mode == "echo") {
    std::vector<std::byte> buf(size_t{64} << 20);
    auto r = t.Recv(*parent, 1, buf.data(), buf.size(), MemoryKind::kHost);
    if (!r.ok()) return Fail(r.status());
    if (st = WaitOp(t, **r, deadline); !st.ok()) return Fail(st);
    auto s = t.Send(*parent, 2, buf.data(), (*r)->bytes(), MemoryKind::kHost);
    if (!s.ok()) return Fail(s.status());
    if (st = WaitOp(t, **s, deadline); !st.ok()) return Fail(st);
  } else if (mode == "hang" || mode == "hangaddr") {
    while (Clock::now() < deadline) t.Progress();
    return 3;
  } else if (mode == "hangreg") {
    std::vector<std::byte> region(size_t{64} << 20);
    auto reg = t.RegisterMemory(region.data(), region.size(), MemoryKind::kHost);
    if (!reg.ok()) return Fail(reg.status());
    std::vector<std::byte> msg(8);
    const uint64_t addr = (*reg)->address();
    std::memcpy(msg.data(), &addr, 8);
    auto key = (*reg)->PackedKey();
    msg.insert(msg.end(), key.begin(), key.end());
    if (st = t.SendControl(*parent, msg); !st.ok()) return Fail(st);
    while (Clock::now() < deadline) t.Progress();
    return 3;
  } else if (mode == "cuda") {
    return CudaTarget(t, *parent, deadline);
  } else if (mode == "bw") {
    // The transport allocates the region (shared memory on one host: the fastest put target).
    auto reg = t.RegisterMemory(nullptr, size_t{64} << 20, MemoryKind::kHost);
    if (!reg.ok()) return Fail(reg.status());
    std::span<std::byte> region(reinterpret_cast<std::byte*>((*reg)->address()), (*reg)->size());
    std::vector<std::byte> msg(8);
    const uint64_t addr = (*reg)->address();
    std::memcpy(msg.data(), &addr, 8);
    auto key = (*reg)->PackedKey();
    msg.insert(msg.end(), key.begin(), key.end());
    if (st = t.SendControl(*parent, msg); !st.ok()) return Fail(st);
    BandwidthParams params;
    if (argc == 4) params.total_bytes = std::stoull(argv[3]) << 20;
    auto r = ReceiveBandwidth(t, *parent, region.data(), region.size(), MemoryKind::kHost,
                              uint64_t{1} << 40, params, deadline);
    if (!r.ok()) return Fail(r.status());
  } else {
    return Fail(Status::InvalidArgument("unknown mode " + mode));
  }
  return AwaitExit(t, deadline) ? 0 : Fail(Status::DeadlineExceeded("no 'exit' from parent"));
}

}  // namespace
}  // namespace kvferry

int main(int argc, char** argv) { return kvferry::Main(argc, argv); }
