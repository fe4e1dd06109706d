// Clocks. Code that makes timing decisions (schedulers, deadlines, SLO windows) takes a
// Clock& so tests can drive it with ManualClock; everything else may call steadyNow().
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace pd {

using SteadyTime = std::chrono::steady_clock::time_point;
using Duration = std::chrono::steady_clock::duration;

inline SteadyTime steadyNow() { return std::chrono::steady_clock::now(); }

inline double secondsBetween(SteadyTime from, SteadyTime to) {
  return std::chrono::duration<double>(to - from).count();
}

class Clock {
 public:
  virtual ~Clock() = default;
  virtual SteadyTime now() const = 0;
};

class SystemClock final : public Clock {
 public:
  SteadyTime now() const override { return steadyNow(); }
  static SystemClock& instance() {
    static SystemClock c;
    return c;
  }
};

// A clock that moves only when told; thread-safe.
class ManualClock final : public Clock {
 public:
  SteadyTime now() const override { return SteadyTime(Duration(ticks_.load())); }
  void advance(Duration d) { ticks_.fetch_add(d.count()); }

 private:
  std::atomic<Duration::rep> ticks_{Duration(std::chrono::seconds(1)).count()};
};

// A deadline: a point in time after which a wait gives up. Default-constructed = never.
class Deadline {
 public:
  Deadline() = default;
  explicit Deadline(SteadyTime at) : at_(at), set_(true) {}
  static Deadline in(Duration d, const Clock& clock = SystemClock::instance()) { return Deadline(clock.now() + d); }
  bool expired(const Clock& clock = SystemClock::instance()) const { return set_ && clock.now() >= at_; }
  bool isSet() const { return set_; }
  SteadyTime at() const { return at_; }

 private:
  SteadyTime at_{};
  bool set_ = false;
};

}  // namespace pd
