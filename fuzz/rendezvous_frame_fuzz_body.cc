#include "rendezvous_frame_fuzz_body.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "base/siphash.h"
#include "rendezvous/frame.h"

namespace kvferry {
namespace {

using rendezvous::Context;
using rendezvous::kHeaderBytes;
using rendezvous::kSealedHeaderBytes;
using rendezvous::kTagBytes;

void CheckAt(bool ok, int line, const Status* st = nullptr) {
  if (ok) return;
  std::fprintf(stderr, "rendezvous_frame_fuzz_body.cc:%d: check failed%s%s\n", line, st ? ": " : "",
               st ? st->ToString().c_str() : "");
  std::abort();
}
#define Check(ok) CheckAt((ok), __LINE__)
#define CheckRefusal(st) \
  CheckAt((st).code() == StatusCode::kInvalidArgument && !(st).message().empty(), __LINE__, &(st))

constexpr RendezvousKey kKey = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

Context OpenContext() {
  Context c;
  for (size_t i = 0; i < c.client.size(); ++i) {
    c.client[i] = std::byte(0x10 + i);
    c.server[i] = std::byte(0x80 + i);
  }
  return c;
}

void PutTag(std::span<std::byte> frame, size_t signed_bytes, const Context& context) {
  SipHash128 mac(kKey);
  mac.Update(context.client);
  mac.Update(context.server);
  mac.Update(frame.first(signed_bytes));
  const auto tag = mac.Finish();
  std::copy(tag.begin(), tag.end(), frame.begin() + static_cast<ptrdiff_t>(signed_bytes));
}

}  // namespace

int RendezvousFrameFuzzOne(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const Context context = (mode & 4) ? OpenContext() : Context{};
  std::vector<std::byte> in(size - 1);
  if (size > 1) std::memcpy(in.data(), data + 1, size - 1);
  if ((mode & 2) && in.size() >= kSealedHeaderBytes + kTagBytes) {
    const uint32_t body = static_cast<uint32_t>(in.size() - kSealedHeaderBytes - kTagBytes);
    for (int i = 0; i < 4; ++i) in[8 + i] = std::byte(body >> (8 * i));
  }
  if ((mode & 1) && in.size() >= kSealedHeaderBytes) {
    PutTag(in, kHeaderBytes, context);
    if (in.size() >= kSealedHeaderBytes + kTagBytes) PutTag(in, in.size() - kTagBytes, context);
  }

  // As the server reads: the version as soon as 6 bytes are in, then the sealed header.
  const std::span<const std::byte> bytes(in);
  Status version = rendezvous::CheckVersion(bytes.first(std::min(bytes.size(), size_t{6})));
  if (!version.ok()) CheckRefusal(version);
  if (bytes.size() < kSealedHeaderBytes) {
    auto h = rendezvous::VerifyHeader(bytes, kKey, context);
    Check(!h.ok());
    CheckRefusal(h.status());
    return 0;
  }
  auto parsed = rendezvous::ParseHeader(bytes);
  auto header = rendezvous::VerifyHeader(bytes, kKey, context);
  if (!parsed.ok()) CheckRefusal(parsed.status());
  if (!header.ok()) {
    CheckRefusal(header.status());
  } else {
    Check(parsed.ok() && parsed->sequence == header->sequence &&
          parsed->body_bytes == header->body_bytes && parsed->type == header->type);
    Check(header->frame_bytes() <= rendezvous::kMaxFrameBytes);
    Check(version.ok());
  }
  // The whole frame, as the header sizes it (or as the input is, when it does not parse).
  const size_t whole = parsed.ok() ? std::min(parsed->frame_bytes(), bytes.size()) : bytes.size();
  auto frame = rendezvous::DecodeFrame(bytes.first(whole), kKey, context);
  if (!frame.ok()) {
    CheckRefusal(frame.status());
    return 0;
  }
  Check(header.ok());  // what decodes, its header verified first
  const std::vector<std::byte> again = rendezvous::EncodeFrame(*frame, kKey, context);
  Check(std::equal(again.begin(), again.end(), bytes.begin(), bytes.begin() + whole) &&
        again.size() == whole);
  auto twice = rendezvous::DecodeFrame(again, kKey, context);
  Check(twice.ok() && *twice == *frame);
  RendezvousKey other = kKey;
  other[0] ^= 1;
  Check(!rendezvous::DecodeFrame(again, other, context).ok());
  Context elsewhere = context;
  elsewhere.server[0] ^= std::byte{1};
  Check(!rendezvous::DecodeFrame(again, kKey, elsewhere).ok());
  return 0;
}

}  // namespace kvferry
