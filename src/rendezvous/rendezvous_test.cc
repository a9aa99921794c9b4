// The rendezvous protocol and its server, client and instance records; the server against hostile
// peers: rendezvous_hostile_test.cc.
#include "kvferry/rendezvous.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <random>
#include <thread>

#include "rendezvous/frame.h"
#include "rendezvous/server.h"
#include "rendezvous/socket.h"
#include "testing/rendezvous_test_util.h"

// In the helpers' namespace (testing/rendezvous_test_util.h), which finds them.
namespace kvferry::rendezvous::testing {
namespace {

using namespace std::chrono_literals;

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
}  // namespace kvferry::rendezvous::testing
