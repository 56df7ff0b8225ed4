// Lock annotations that clang's -Wthread-safety analysis checks at compile time (every clang build
// of gradwatch turns violations into errors; GCC ignores them). A member declared
// `GUARDED_BY(mu_)` may only be touched with mu_ held; a function declared `REQUIRES(mu_)` may only
// be called with it held, `EXCLUDES(mu_)` only without. See
// https://clang.llvm.org/docs/ThreadSafetyAnalysis.html for the semantics.
//
// std::mutex carries no annotations in libstdc++, so annotated classes use gradwatch::Mutex and
// gradwatch::MutexLock below instead of std::mutex and std::lock_guard. gRPC's Abseil headers
// define some of the same macros with the same meaning; whichever comes first is used.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define GW_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define GW_THREAD_ANNOTATION(x)
#endif

// On a class: its objects are locks.
#ifndef CAPABILITY
#define CAPABILITY(name) GW_THREAD_ANNOTATION(capability(name))
#endif
// On an RAII class: it holds a lock from construction to destruction.
#ifndef SCOPED_CAPABILITY
#define SCOPED_CAPABILITY GW_THREAD_ANNOTATION(scoped_lockable)
#endif
// On a member: read and written only with the lock held.
#ifndef GUARDED_BY
#define GUARDED_BY(mu) GW_THREAD_ANNOTATION(guarded_by(mu))
#endif
// On a pointer member: what it points to is read and written only with the lock held.
#ifndef PT_GUARDED_BY
#define PT_GUARDED_BY(mu) GW_THREAD_ANNOTATION(pt_guarded_by(mu))
#endif
// On a lock member: it is taken after (before) the named locks, never the other way round.
#ifndef ACQUIRED_AFTER
#define ACQUIRED_AFTER(...) GW_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#endif
#ifndef ACQUIRED_BEFORE
#define ACQUIRED_BEFORE(...) GW_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#endif
// On a function: the caller holds (does not hold) the locks.
#ifndef REQUIRES
#define REQUIRES(...) GW_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#endif
#ifndef EXCLUDES
#define EXCLUDES(...) GW_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#endif
// On a function: it takes (releases) the locks and returns with them held (released).
#ifndef ACQUIRE
#define ACQUIRE(...) GW_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#endif
#ifndef RELEASE
#define RELEASE(...) GW_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#endif
#ifndef TRY_ACQUIRE
#define TRY_ACQUIRE(...) GW_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#endif
// On a function: it checks at run time that the lock is held; the analysis takes it as held after.
#ifndef ASSERT_CAPABILITY
#define ASSERT_CAPABILITY(x) GW_THREAD_ANNOTATION(assert_capability(x))
#endif
// On a function: it returns a reference to the named lock.
#ifndef RETURN_CAPABILITY
#define RETURN_CAPABILITY(x) GW_THREAD_ANNOTATION(lock_returned(x))
#endif
// On a function whose locking the analysis cannot follow; say why beside each use.
#ifndef NO_THREAD_SAFETY_ANALYSIS
#define NO_THREAD_SAFETY_ANALYSIS GW_THREAD_ANNOTATION(no_thread_safety_analysis)
#endif

namespace gradwatch {

// A std::mutex the analysis knows about. Not recursive.
class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ACQUIRE() { mu_.lock(); }
  void Unlock() RELEASE() { mu_.unlock(); }
  bool TryLock() TRY_ACQUIRE(true) { return mu_.try_lock(); }
  // Tells the analysis that the caller holds the lock (where it cannot see it, e.g. in a callback
  // the lock holder invokes). Checks nothing at run time.
  void AssertHeld() ASSERT_CAPABILITY(this) {}

 private:
  friend class CondVar;
  std::mutex mu_;
};

// Holds a Mutex for its scope (std::lock_guard for Mutex).
class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ACQUIRE(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() RELEASE() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

// A condition variable for Mutex. Every wait is called with the mutex held and returns with it
// held. Waits may wake spuriously: wait in a loop that tests the condition (written in the caller,
// where the analysis sees that the lock is held). Use one mutex with a given CondVar.
class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void Wait(Mutex* mu) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  // Returns false when the deadline passed.
  template <typename Clock, typename Duration>
  bool WaitUntil(Mutex* mu, const std::chrono::time_point<Clock, Duration>& deadline) REQUIRES(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool woken = cv_.wait_until(lock, deadline) == std::cv_status::no_timeout;
    lock.release();
    return woken;
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace gradwatch
