// RunWatch: a request that ends by its deadline is not progress (a stopped peer makes every
// request end that way), nor is a start; an end before the deadline is.
#include "selftest/run_watch.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "kvferry/config.h"

namespace kvferry {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

TEST(RunWatch, OnlyEndsBeforeTheDeadlineAreProgress) {
  ASSERT_TRUE(Config::Global().Set("transfer.abort_grace_ms", "0").ok());
  std::string tmpl = (fs::temp_directory_path() / "kvferry-watch-XXXXXX").string();
  ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
  const fs::path dir = tmpl;
  SelftestConfig cfg;
  cfg.timeout = milliseconds(1);
  cfg.dir = dir.string();
  RunWatch watch(cfg, dir / "progress", 3);
  EXPECT_EQ(watch.limit(), milliseconds(1001));  // deadline + abort grace (0) + 1 s
  // Starts and timed-out ends keep coming, as when a peer is stopped: the watch stalls anyway.
  for (int i = 0; i < 2; ++i) {
    std::this_thread::sleep_for(milliseconds(600));
    watch.Started();
    watch.Ended(/*progress=*/false);
  }
  EXPECT_TRUE(watch.Stalled());
  watch.Started();
  watch.Ended(/*progress=*/true);  // the last of 3: written at once
  EXPECT_FALSE(watch.Stalled());
  std::ifstream f(dir / "progress");
  int done = 0, total = 0, started = 0, progressed = 0;
  ASSERT_TRUE(f >> done >> total >> started >> progressed);
  EXPECT_EQ(done, 3);
  EXPECT_EQ(total, 3);
  EXPECT_EQ(started, 3);
  EXPECT_EQ(progressed, 1);
  ASSERT_TRUE(Config::Global().Set("transfer.abort_grace_ms", "1000").ok());
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvferry
