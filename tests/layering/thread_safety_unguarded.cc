// Compiled by ctest thread_safety.* with clang -Wthread-safety: the guarded read below must fail,
// the guarded one beside it must not (proof that the annotations are live under clang, so that
// CI's clang builds, build-fuzz and the tsan preset, check the classes that use them).
#include "base/thread_annotations.h"

namespace kvferry {

class Counter {
 public:
  int Guarded() {
    MutexLock lock(mu_);
    return n_;
  }
#ifdef KVF_UNGUARDED
  int Unguarded() { return n_; }
#endif

 private:
  Mutex mu_;
  int n_ GUARDED_BY(mu_) = 0;
};

int Use() { return Counter().Guarded(); }

}  // namespace kvferry
