// BackgroundThread: a thread that keeps an owner (the engine's core) alive while it runs,
// and that can be waited for until a deadline: one still running then is detached and
// finishes alone, so that closing an engine never waits longer than asked for.
// Thread-safety: Start() and JoinUntil() are called by one owner thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace nebulite {

using Clock = std::chrono::steady_clock;

// The deadline `seconds` from now; NaN or anything beyond ~30 years is "never", negative
// values are "now".
inline Clock::time_point DeadlineAfter(double seconds) {
  if (!(seconds < 1e9)) return Clock::time_point::max();
  if (seconds < 0) seconds = 0;
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

inline double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

class BackgroundThread {
 public:
  BackgroundThread() = default;
  BackgroundThread(const BackgroundThread&) = delete;
  BackgroundThread& operator=(const BackgroundThread&) = delete;
  ~BackgroundThread() {
    if (!thread_.joinable()) return;
    if (thread_.get_id() == std::this_thread::get_id()) {
      thread_.detach();  // the owner is being destroyed by this very thread
    } else {
      thread_.join();
    }
  }

  void Start(std::shared_ptr<void> keepalive, std::function<void()> fn) {
    done_ = std::make_shared<Done>();
    thread_ = std::thread([keepalive = std::move(keepalive), done = done_, fn = std::move(fn)] {
      fn();
      std::lock_guard<std::mutex> lock(done->mu);
      done->finished = true;
      done->cv.notify_all();
    });
  }

  // Joins the thread if it finishes before `deadline`, else detaches it. True if joined.
  bool JoinUntil(Clock::time_point deadline) {
    if (!thread_.joinable()) return true;
    bool finished;
    {
      std::unique_lock<std::mutex> lock(done_->mu);
      if (deadline == Clock::time_point::max()) {
        done_->cv.wait(lock, [&] { return done_->finished; });
      } else {
        done_->cv.wait_until(lock, deadline, [&] { return done_->finished; });
      }
      finished = done_->finished;
    }
    if (finished) {
      thread_.join();
    } else {
      thread_.detach();
    }
    return finished;
  }

 private:
  struct Done {
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;
  };
  std::shared_ptr<Done> done_;
  std::thread thread_;
};

}  // namespace nebulite
