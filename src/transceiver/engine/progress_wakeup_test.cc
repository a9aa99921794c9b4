// ProgressWakeup: a sleep that hears peers arms the transport and ends on a control message; one
// that does not hear them leaves the transport unarmed (its peers send without waking this
// thread), ends on a Notify or at its timeout, and the message waits for the next look.
#include "transceiver/engine/progress_wakeup.h"

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "kvferry/inproc_transport.h"
#include "testing/transceiver_test_cluster.h"

namespace kvferry {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// Counts the arms of an in-process transport (which has a wakeup fd).
class CountingArms final : public txtest::TestTransport {
 public:
  using TestTransport::TestTransport;
  int WakeupFd() override { return base_->WakeupFd(); }
  bool ArmWakeup() override {
    ++arms;
    return base_->ArmWakeup();
  }
  int arms = 0;
};

struct Pair {
  Pair() {
    auto fabric = InProcFabric::Create();
    TransportOptions o;
    o.fabric = fabric;
    sender = std::move(CreateInProcTransport(o).value());
    receiver = std::make_unique<CountingArms>(std::move(CreateInProcTransport(o).value()));
    peer = sender->Connect(receiver->LocalAddress(), DeadlineIn(milliseconds(5000))).value();
    wakeup = ProgressWakeup::Create(*receiver);
  }
  // A control message from the sender, `after` from now, on another thread.
  std::thread SendAfter(milliseconds after) {
    return std::thread([this, after] {
      std::this_thread::sleep_for(after);
      const std::byte b[1] = {std::byte{7}};
      ASSERT_TRUE(sender->SendControl(peer, b).ok());
    });
  }
  std::unique_ptr<Transport> sender;
  std::unique_ptr<CountingArms> receiver;
  PeerId peer = 0;
  std::unique_ptr<ProgressWakeup> wakeup;
};

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(ProgressWakeup, ASleepThatHearsPeersEndsOnAControlMessage) {
  Pair p;
  ASSERT_NE(p.wakeup, nullptr);
  std::thread send = p.SendAfter(milliseconds(20));
  const auto start = Clock::now();
  EXPECT_TRUE(p.wakeup->Sleep(std::chrono::seconds(5), true, [] { return false; }));
  EXPECT_LT(SecondsSince(start), 2.5) << "the message did not end the sleep";
  EXPECT_EQ(p.receiver->arms, 1);
  send.join();
  EXPECT_TRUE(p.receiver->PollControl().has_value());
}

TEST(ProgressWakeup, ASleepThatDoesNotHearPeersLeavesTheTransportUnarmed) {
  Pair p;
  ASSERT_NE(p.wakeup, nullptr);
  std::thread send = p.SendAfter(milliseconds(1));
  const auto start = Clock::now();
  EXPECT_TRUE(p.wakeup->Sleep(milliseconds(300), false, [] { return false; }));
  EXPECT_GE(SecondsSince(start), 0.29) << "the message ended a sleep that does not hear peers";
  EXPECT_EQ(p.receiver->arms, 0);
  send.join();
  EXPECT_TRUE(p.receiver->PollControl().has_value()) << "the message waits for the next look";
}

TEST(ProgressWakeup, ANotifyEndsASleepThatDoesNotHearPeers) {
  Pair p;
  ASSERT_NE(p.wakeup, nullptr);
  std::thread notify([&] {
    std::this_thread::sleep_for(milliseconds(20));
    p.wakeup->Notify();
  });
  const auto start = Clock::now();
  EXPECT_TRUE(p.wakeup->Sleep(std::chrono::seconds(5), false, [] { return false; }));
  EXPECT_LT(SecondsSince(start), 2.5) << "Notify did not end the sleep";
  notify.join();
}

TEST(ProgressWakeup, WorkAlreadyQueuedMeansNoSleep) {
  Pair p;
  ASSERT_NE(p.wakeup, nullptr);
  EXPECT_FALSE(p.wakeup->Sleep(std::chrono::seconds(5), false, [] { return true; }));
  EXPECT_FALSE(p.wakeup->Sleep(std::chrono::seconds(5), true, [] { return true; }));
  EXPECT_EQ(p.receiver->arms, 0);
}

}  // namespace
}  // namespace kvferry
