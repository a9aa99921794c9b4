// Clang thread-safety annotations (-Wthread-safety) and an annotated mutex.
//
// Why: which mutex guards which member is part of a class's contract; written as GUARDED_BY and
// REQUIRES, clang checks it at compile time (the tsan preset builds with
// -Werror=thread-safety). libstdc++'s std::mutex carries no annotations, so classes whose members
// are checked use kvferry::Mutex and kvferry::MutexLock, thin wrappers over std::mutex and
// std::unique_lock. The macros are no-ops on other compilers (gcc, nvcc).
#pragma once

#include <condition_variable>
#include <mutex>

#if defined(__clang__) && !defined(__CUDACC__)
#define KVF_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define KVF_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) KVF_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY KVF_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) KVF_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) KVF_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) KVF_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) KVF_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) KVF_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) KVF_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define RETURN_CAPABILITY(x) KVF_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS KVF_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace kvferry {

class CAPABILITY("mutex") Mutex {
 public:
  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  // For std::condition_variable waits (MutexLock::Wait): the analysis does not see through them.
  std::mutex& native() RETURN_CAPABILITY(this) { return mu_; }

 private:
  std::mutex mu_;
};

// Holds a Mutex for its scope; Wait/WaitUntil release and retake it around a condition variable
// wait, as std::unique_lock does.
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : lock_(mu.native()) {}
  ~MutexLock() RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  // Around work done without the mutex (a worker running a queued job).
  void Unlock() RELEASE() { lock_.unlock(); }
  void Lock() ACQUIRE() { lock_.lock(); }

  template <typename Pred>
  void Wait(std::condition_variable& cv, Pred pred) {
    cv.wait(lock_, pred);
  }
  template <typename Rep, typename Period, typename Pred>
  bool WaitFor(std::condition_variable& cv, std::chrono::duration<Rep, Period> d, Pred pred) {
    return cv.wait_for(lock_, d, pred);
  }
  template <typename Clock, typename Duration, typename Pred>
  bool WaitUntil(std::condition_variable& cv, std::chrono::time_point<Clock, Duration> t,
                 Pred pred) {
    return cv.wait_until(lock_, t, pred);
  }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace kvferry
