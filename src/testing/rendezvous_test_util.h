// What the rendezvous tests share (rendezvous_test.cc, rendezvous_hostile_test.cc): keys and
// values, a server with one client, and a raw client connection driven frame by frame (greeted,
// then requests numbered 1, 2, ...) to send what a well-behaved client never would.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvferry/rendezvous.h"
#include "rendezvous/frame.h"
#include "rendezvous/server.h"
#include "rendezvous/socket.h"

namespace kvferry::rendezvous::testing {

using namespace std::chrono_literals;

inline std::vector<std::byte> Bytes(std::string_view s) {
  auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

inline RendezvousKey KeyOf(uint8_t seed) {
  RendezvousKey k;
  for (size_t i = 0; i < k.size(); ++i) k[i] = static_cast<uint8_t>(seed + i);
  return k;
}

struct Fixture {
  std::unique_ptr<RendezvousServer> server;
  std::unique_ptr<Rendezvous> client;
  explicit Fixture(const RendezvousKey& key = KeyOf(1)) {
    auto s = RendezvousServer::Start("127.0.0.1", 0, key);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    server = std::move(*s);
    auto c = ConnectRendezvous(server->address(), key);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    client = std::move(*c);
  }
};

inline Nonce NonceOf(uint8_t seed) {
  rendezvous::Nonce n;
  for (size_t i = 0; i < n.size(); ++i) n[i] = std::byte(seed + i);
  return n;
}

// One whole frame's bytes from a raw connection.
inline StatusOr<std::vector<std::byte>> ReadFrameBytes(const rendezvous::Fd& fd,
                                                       Deadline deadline = DeadlineIn(3s)) {
  std::vector<std::byte> in(rendezvous::kSealedHeaderBytes);
  KVF_RETURN_IF_ERROR(rendezvous::ReadExactly(fd.get(), in, deadline));
  KVF_ASSIGN_OR_RETURN(rendezvous::Header header, rendezvous::ParseHeader(in));
  in.resize(header.frame_bytes());
  KVF_RETURN_IF_ERROR(rendezvous::ReadExactly(
      fd.get(), std::span(in).subspan(rendezvous::kSealedHeaderBytes), deadline));
  return in;
}

// A client connection driven frame by frame: greeted, then requests numbered 1, 2, ...
struct RawSession {
  rendezvous::Fd fd;
  rendezvous::Context context;
  uint64_t next = 1;

  explicit RawSession(const std::string& address, const RendezvousKey& key = KeyOf(1)) {
    const size_t colon = address.rfind(':');
    auto c =
        rendezvous::ConnectTcp(address.substr(0, colon), address.substr(colon + 1), DeadlineIn(2s));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    fd = std::move(*c);
    context.client = NonceOf(static_cast<uint8_t>(next + reinterpret_cast<uintptr_t>(this)));
    const rendezvous::Frame hello{.type = rendezvous::FrameType::kHello, .nonce = context.client};
    EXPECT_TRUE(Send(rendezvous::EncodeFrame(hello, key, {})).ok());
    auto bytes = ReadFrameBytes(fd);
    EXPECT_TRUE(bytes.ok()) << bytes.status().ToString();
    if (!bytes.ok()) return;
    auto challenge = rendezvous::DecodeFrame(*bytes, key, {context.client, {}});
    EXPECT_TRUE(challenge.ok()) << challenge.status().ToString();
    if (challenge.ok()) context.server = challenge->nonce;
  }
  std::vector<std::byte> Encode(rendezvous::Frame f, const RendezvousKey& key = KeyOf(1)) {
    f.sequence = next++;
    return rendezvous::EncodeFrame(f, key, context);
  }
  Status Send(std::span<const std::byte> bytes) {
    return rendezvous::WriteAll(fd.get(), bytes, DeadlineIn(2s));
  }
  StatusOr<rendezvous::Frame> Reply(Deadline deadline = DeadlineIn(3s)) {
    KVF_ASSIGN_OR_RETURN(std::vector<std::byte> in, ReadFrameBytes(fd, deadline));
    return rendezvous::DecodeFrame(in, KeyOf(1), context);
  }
};

}  // namespace kvferry::rendezvous::testing
