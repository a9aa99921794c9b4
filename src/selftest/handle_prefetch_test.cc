#include "selftest/handle_prefetch.h"

#include <gtest/gtest.h>

#include <iostream>
#include <thread>

#include "kvferry/rendezvous.h"

namespace kvferry {
namespace {

using namespace std::chrono_literals;

// A rendezvous whose every Get takes `delay` to answer (a slow link: the round trip of hosts
// apart), answering kDeadlineExceeded when the caller's deadline comes first.
class SlowRendezvous : public Rendezvous {
 public:
  SlowRendezvous(std::unique_ptr<Rendezvous> target, std::chrono::milliseconds delay)
      : target_(std::move(target)), delay_(delay) {}
  Status Put(std::string_view key, std::span<const std::byte> value, Deadline deadline) override {
    return target_->Put(key, value, deadline);
  }
  StatusOr<std::vector<std::byte>> Get(std::string_view key, Deadline deadline) override {
    const Deadline answer = Clock::now() + delay_;
    if (deadline < answer) {
      std::this_thread::sleep_until(deadline);
      return Status::DeadlineExceeded("slow link: no answer before the deadline");
    }
    std::this_thread::sleep_until(answer);
    return target_->Get(key, deadline);
  }
  Status Erase(std::string_view key, Deadline deadline) override {
    return target_->Erase(key, deadline);
  }

 private:
  std::unique_ptr<Rendezvous> target_;
  std::chrono::milliseconds delay_;
};

struct Rig {
  std::unique_ptr<RendezvousServer> server;
  std::unique_ptr<Rendezvous> publisher;
  explicit Rig(const RendezvousKey& key) {
    auto s = RendezvousServer::Start("127.0.0.1", 0, key);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    server = std::move(*s);
    auto c = ConnectRendezvous(server->address(), key);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    publisher = std::move(*c);
  }
  std::unique_ptr<Rendezvous> Client(const RendezvousKey& key) {
    auto c = ConnectRendezvous(server->address(), key);
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    return std::move(*c);
  }
};

std::vector<std::byte> HandleOf(uint8_t seed) { return std::vector<std::byte>(8, std::byte{seed}); }

TEST(HandlePrefetch, TakesHandlesInOrderAsTheyArePublished) {
  const RendezvousKey key = RandomKey();
  Rig rig(key);
  HandlePrefetch prefetch(rig.Client(key), {7, 8, 9}, 2);
  EXPECT_FALSE(prefetch.Take(0, 50ms).has_value()) << "nothing published yet";
  for (uint8_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(PublishHandle(*rig.publisher, 7 + i, HandleOf(i), DeadlineIn(2000ms)).ok());
  }
  for (size_t i = 0; i < 3; ++i) {
    auto h = prefetch.Take(i, std::chrono::microseconds(5s));
    ASSERT_TRUE(h.has_value()) << "handle " << i;
    EXPECT_EQ(*h, HandleOf(static_cast<uint8_t>(i)));
  }
}

// Behind a link slower than the first per-call deadline, calls that time out lengthen the next
// one's deadline, so handles still arrive (a fixed deadline fetched none, ever).
TEST(HandlePrefetch, ASlowLinkStillDeliversEveryHandle) {
  const RendezvousKey key = RandomKey();
  Rig rig(key);
  for (uint8_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(PublishHandle(*rig.publisher, 40 + i, HandleOf(i), DeadlineIn(2000ms)).ok());
  }
  HandlePrefetch prefetch(std::make_unique<SlowRendezvous>(rig.Client(key), 300ms), {40, 41, 42},
                          3);
  for (size_t i = 0; i < 3; ++i) {
    auto h = prefetch.Take(i, std::chrono::microseconds(10s));
    ASSERT_TRUE(h.has_value()) << "handle " << i << " never came over the slow link";
    EXPECT_EQ(*h, HandleOf(static_cast<uint8_t>(i)));
  }
}

// LastError: what the rendezvous answered the last look-up that failed (a rank that gives up
// says it), cleared by a handle that came.
TEST(HandlePrefetch, SaysWhatTheRendezvousLastAnswered) {
  const RendezvousKey key = RandomKey();
  Rig rig(key);
  HandlePrefetch prefetch(rig.Client(key), {60, 61}, 2);
  EXPECT_FALSE(prefetch.Take(0, 500ms).has_value());
  EXPECT_FALSE(prefetch.LastError().ok()) << "no handle yet: the look-up timed out";
  ASSERT_TRUE(PublishHandle(*rig.publisher, 60, HandleOf(1), DeadlineIn(2000ms)).ok());
  ASSERT_TRUE(prefetch.Take(0, std::chrono::microseconds(5s)).has_value());
  EXPECT_TRUE(prefetch.LastError().ok()) << prefetch.LastError().ToString();
  rig.server.reset();  // the rendezvous goes away
  EXPECT_FALSE(prefetch.Take(1, 1s).has_value());
  // The look-up in flight ends by its deadline (2 s at most) if the closed connection is not
  // noticed first.
  for (Deadline end = DeadlineIn(5s); prefetch.LastError().ok() && Clock::now() < end;)
    std::this_thread::sleep_for(10ms);
  const Status e = prefetch.LastError();
  EXPECT_FALSE(e.ok());
  std::cout << "after the rendezvous went away: " << e.ToString() << "\n";
}

}  // namespace
}  // namespace kvferry
