// The instance secret, made from the OS's random source. ContextSide::Create refuses the all-zero
// default (context_side.cc).
#include <sys/random.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <random>

#include "kvferry/transceiver.h"

namespace kvferry {

std::array<uint8_t, 16> NewInstanceSecret() {
  std::array<uint8_t, 16> s{};
  // getrandom blocks only until the kernel's pool is first seeded and returns 16 bytes whole but
  // for a signal. A kernel without it (ENOSYS, before 3.17) gets std::random_device, which reads
  // the same source through /dev/urandom.
  size_t got = 0;
  while (got < s.size()) {
    const ssize_t n = getrandom(s.data() + got, s.size() - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      std::random_device rd;
      for (; got < s.size(); ++got) s[got] = static_cast<uint8_t>(rd());
    }
  }
  // All zero is the refused default: odds of 2^-128, but the promise is "never".
  if (std::all_of(s.begin(), s.end(), [](uint8_t b) { return b == 0; })) s[0] = 1;
  return s;
}

}  // namespace kvferry
