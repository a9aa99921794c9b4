#include "kvferry/rendezvous.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <functional>
#include <random>
#include <thread>

#include "rendezvous/frame.h"
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
  auto decoded = rendezvous::DecodeFrame(reply, KeyOf(1));
  EXPECT_FALSE(decoded.ok());  // an unsigned refusal
  EXPECT_NE(decoded.status().message().find("magic"), std::string::npos)
      << decoded.status().ToString();
  // A header announcing a huge body is refused at once, not buffered.
  std::vector<std::byte> huge = rendezvous::EncodeFrame(
      rendezvous::Frame{rendezvous::FrameType::kGet, "k", {}, {}}, KeyOf(1));
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
  std::vector<std::byte> both = rendezvous::EncodeFrame(
      rendezvous::Frame{rendezvous::FrameType::kPut, "p", Bytes("piped"), {}}, KeyOf(1));
  const std::vector<std::byte> get = rendezvous::EncodeFrame(
      rendezvous::Frame{rendezvous::FrameType::kGet, "p", {}, {}}, KeyOf(1));
  both.insert(both.end(), get.begin(), get.end());
  std::vector<std::byte> replies = SendRaw(f.server->address(), both);
  ASSERT_GT(replies.size(), rendezvous::kHeaderBytes);
  auto length = rendezvous::DecodeHeader(std::span(replies).first(rendezvous::kHeaderBytes));
  ASSERT_TRUE(length.ok()) << length.status().ToString();
  const size_t first = rendezvous::kHeaderBytes + *length + rendezvous::kTagBytes;
  ASSERT_GT(replies.size(), first);
  auto ok = rendezvous::DecodeFrame(std::span(replies).first(first), KeyOf(1));
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->type, rendezvous::FrameType::kOk);
  auto value = rendezvous::DecodeFrame(std::span(replies).subspan(first), KeyOf(1));
  ASSERT_TRUE(value.ok()) << value.status().ToString();
  EXPECT_EQ(value->value, Bytes("piped"));
}

// Reads one whole reply frame from a raw connection.
// One whole frame's bytes from a raw connection.
StatusOr<std::vector<std::byte>> ReadFrameBytes(const rendezvous::Fd& fd) {
  std::vector<std::byte> in(rendezvous::kHeaderBytes);
  KVF_RETURN_IF_ERROR(rendezvous::ReadExactly(fd.get(), in, DeadlineIn(3s)));
  KVF_ASSIGN_OR_RETURN(size_t length, rendezvous::DecodeHeader(in));
  in.resize(rendezvous::kHeaderBytes + length + rendezvous::kTagBytes);
  KVF_RETURN_IF_ERROR(rendezvous::ReadExactly(
      fd.get(), std::span(in).subspan(rendezvous::kHeaderBytes), DeadlineIn(3s)));
  return in;
}

StatusOr<rendezvous::Frame> ReadReply(const rendezvous::Fd& fd) {
  KVF_ASSIGN_OR_RETURN(std::vector<std::byte> in, ReadFrameBytes(fd));
  return rendezvous::DecodeFrame(in, KeyOf(1));
}

// A fake server of an earlier protocol on `l`: `connections` connections, one request each,
// answered with answer(request bytes), then closed (as servers before kept connections did).
std::thread ServeOncePerConnection(
    const rendezvous::Listener& l, int connections,
    std::function<std::vector<std::byte>(const std::vector<std::byte>&)> answer) {
  return std::thread([&l, connections, answer = std::move(answer)] {
    for (int i = 0; i < connections; ++i) {
      pollfd p{l.fd.get(), POLLIN, 0};
      if (poll(&p, 1, 5000) != 1) return;
      rendezvous::Fd conn(accept(l.fd.get(), nullptr, nullptr));
      auto request = ReadFrameBytes(conn);
      if (!request.ok()) return;
      (void)rendezvous::WriteAll(conn.get(), answer(*request), DeadlineIn(1s));
    }
  });
}

// WAIT: the server holds the request until a PUT brings its key (one round trip where GET polls),
// answers NOT_FOUND when its time is up, and answers the frames sent behind it after it.
TEST(Rendezvous, WaitIsAnsweredByThePutAndFramesBehindItAfterIt) {
  Fixture f;
  const std::string a = f.server->address();
  const size_t colon = a.rfind(':');
  auto fd = rendezvous::ConnectTcp(a.substr(0, colon), a.substr(colon + 1), DeadlineIn(2s));
  ASSERT_TRUE(fd.ok());
  rendezvous::Frame wait{rendezvous::FrameType::kWait, "w", {}, {}};
  wait.wait_ms = rendezvous::kMaxWaitMs;
  std::vector<std::byte> both = rendezvous::EncodeFrame(wait, KeyOf(1));
  const std::vector<std::byte> get = rendezvous::EncodeFrame(
      rendezvous::Frame{rendezvous::FrameType::kGet, "other", {}, {}}, KeyOf(1));
  both.insert(both.end(), get.begin(), get.end());
  ASSERT_TRUE(rendezvous::WriteAll(fd->get(), both, DeadlineIn(2s)).ok());
  pollfd p{fd->get(), POLLIN, 0};
  EXPECT_EQ(poll(&p, 1, 150), 0) << "answered before the key existed";
  ASSERT_TRUE(f.client->Put("w", Bytes("now"), DeadlineIn(2s)).ok());
  auto first = ReadReply(*fd);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->type, rendezvous::FrameType::kOk);
  EXPECT_EQ(first->value, Bytes("now"));
  auto second = ReadReply(*fd);
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(second->type, rendezvous::FrameType::kNotFound);
  // A key that never comes: NOT_FOUND once the wait is over, not before.
  wait.key = "never";
  wait.wait_ms = 100;
  const auto start = Clock::now();
  ASSERT_TRUE(
      rendezvous::WriteAll(fd->get(), rendezvous::EncodeFrame(wait, KeyOf(1)), DeadlineIn(2s))
          .ok());
  auto late = ReadReply(*fd);
  ASSERT_TRUE(late.ok()) << late.status().ToString();
  EXPECT_EQ(late->type, rendezvous::FrameType::kNotFound);
  EXPECT_GE(Clock::now() - start, 100ms);
  // More than the bound is refused.
  wait.wait_ms = rendezvous::kMaxWaitMs + 1;
  EXPECT_FALSE(rendezvous::DecodeFrame(rendezvous::EncodeFrame(wait, KeyOf(1)), KeyOf(1)).ok());
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

// A server from before WAIT refuses the frame type (unsigned, as any frame it can't read) and
// closes; the client then asks it with GET, and keeps doing so.
TEST(Rendezvous, AClientAsksAServerWithoutWaitByGet) {
  auto l = rendezvous::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  std::atomic<int> waits{0}, gets{0};
  std::thread fake = ServeOncePerConnection(*l, 3, [&](const std::vector<std::byte>& request) {
    const bool wait = request[6] == static_cast<std::byte>(rendezvous::FrameType::kWait);
    ++(wait ? waits : gets);
    return rendezvous::EncodeFrame(
        wait ? rendezvous::Frame{rendezvous::FrameType::kRefused, {}, {}, "type 0x04 unknown"}
             : rendezvous::Frame{rendezvous::FrameType::kOk, {}, Bytes("old"), {}},
        KeyOf(1), /*sign=*/!wait);
  });
  auto c = ConnectRendezvous(l->address, KeyOf(1));
  ASSERT_TRUE(c.ok());
  for (int i = 0; i < 2; ++i) {
    auto got = (*c)->Get("k", DeadlineIn(3s));
    ASSERT_TRUE(got.ok()) << i << ": " << got.status().ToString();
    EXPECT_EQ(*got, Bytes("old"));
  }
  fake.join();
  EXPECT_EQ(waits.load(), 1);
  EXPECT_EQ(gets.load(), 2);
}

// A server of the earlier protocol: one request per connection, then it closes. A client's kept
// connection is then closed at its next call, which goes again on a new connection.
TEST(Rendezvous, AServerThatClosesAfterEachAnswerStillServesAKeepingClient) {
  auto l = rendezvous::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  std::atomic<int> served{0};
  std::thread fake = ServeOncePerConnection(*l, 3, [&](const std::vector<std::byte>&) {
    ++served;
    return rendezvous::EncodeFrame(
        rendezvous::Frame{rendezvous::FrameType::kOk, {}, Bytes("old"), {}}, KeyOf(1));
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

// A bad key refused by a server with WAIT does not make the client give WAIT up.
TEST(Rendezvous, ABadKeyDoesNotTurnWaitOff) {
  auto l = rendezvous::ListenTcp("127.0.0.1", 0);
  ASSERT_TRUE(l.ok());
  std::thread fake = ServeOncePerConnection(*l, 3, [&](const std::vector<std::byte>& request) {
    auto frame = rendezvous::DecodeFrame(request, KeyOf(1));
    if (!frame.ok()) {  // as the server refuses what it can't read: unsigned
      return rendezvous::EncodeFrame(
          rendezvous::Frame{rendezvous::FrameType::kRefused, {}, {}, "bad key"}, KeyOf(1), false);
    }
    const bool wait = frame->type == rendezvous::FrameType::kWait;
    return rendezvous::EncodeFrame(
        rendezvous::Frame{rendezvous::FrameType::kOk, {}, Bytes(wait ? "waited" : "polled"), {}},
        KeyOf(1));
  });
  auto c = ConnectRendezvous(l->address, KeyOf(1));
  ASSERT_TRUE(c.ok());
  auto bad = (*c)->Get("a\x01b", DeadlineIn(3s));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument) << bad.status().ToString();
  auto got = (*c)->Get("k", DeadlineIn(3s));
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(*got, Bytes("waited"));
  fake.join();
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
  const rendezvous::Frame frames[] = {
      {rendezvous::FrameType::kPut, "ctx/rank/0", Bytes("ucx:abcdef"), {}},
      {rendezvous::FrameType::kGet, "handle/42", {}, {}},
      {rendezvous::FrameType::kErase, "x", {}, {}},
      {rendezvous::FrameType::kWait, "handle/43", {}, {}, 1500},
      {rendezvous::FrameType::kOk, {}, Bytes("value"), {}},
      {rendezvous::FrameType::kNotFound, {}, {}, {}},
      {rendezvous::FrameType::kRefused, {}, {}, "store full"},
  };
  std::mt19937_64 rng(7);
  for (const auto& f : frames) {
    const std::vector<std::byte> bytes = rendezvous::EncodeFrame(f, key);
    auto back = rendezvous::DecodeFrame(bytes, key);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, f);
    EXPECT_FALSE(rendezvous::DecodeFrame(bytes, KeyOf(4)).ok());
    for (int i = 0; i < 5000; ++i) {
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
      auto d = rendezvous::DecodeFrame(m, key);  // must not crash; a change must not verify
      if (d.ok()) {
        EXPECT_EQ(m, bytes);
      }
    }
  }
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
