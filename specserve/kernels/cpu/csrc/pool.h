// A small fork-join thread pool for one model forward: the caller is thread 0, workers spin
// between the steps of a forward (barriers cost ~0.1 us, not the ~5 us of waking a pool per op)
// and sleep on a condition variable when no forward has come for a while, so an idle server
// burns no CPU.
#pragma once
#include <immintrin.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace specserve {

class ThreadPool {
 public:
  using Fn = void (*)(void* ctx, int tid, int nthreads);

  explicit ThreadPool(int nthreads) : n_(nthreads < 1 ? 1 : nthreads), sense_(n_, 0) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_; }

  // Run fn(ctx, tid, n) on every thread (the caller is tid 0) and wait for all of them.
  void run(Fn fn, void* ctx) {
    if (n_ == 1) {
      fn(ctx, 0, 1);
      return;
    }
    fn_ = fn;
    ctx_ = ctx;
    pending_.store(n_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(ctx, 0, n_);
    wait_until([&] { return pending_.load(std::memory_order_acquire) == 0; });
  }

  // All threads of the running job meet here (sense-reversing spin barrier).
  void barrier(int tid) {
    if (n_ == 1) return;
    const int s = sense_[tid] ^= 1;
    if (count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      count_.store(0, std::memory_order_relaxed);
      flag_.store(s, std::memory_order_release);
    } else {
      wait_until([&] { return flag_.load(std::memory_order_acquire) == s; });
    }
  }

 private:
  // Spin, then yield: if the thread we wait for was queued on our core (the kernel may wake a
  // thread on the waker's core), a pure spin would keep it off the core for a whole scheduler
  // tick (4 ms, measured); yielding hands the core over at once.
  template <class Pred>
  static void wait_until(Pred done) {
    for (int i = 0; !done(); ++i) {
      if (i < kSpinBeforeYield) _mm_pause();
      else std::this_thread::yield();
    }
  }

  static constexpr int kSpinBeforeYield = 256;
  static constexpr int kSpinPause = 4000;
  static constexpr int kSpinYield = 20000;

  void loop(int tid) {
    uint64_t seen = 0;
    for (;;) {
      // Spin briefly (the next step of a decode loop follows within microseconds), then spin
      // with sched_yield, which hands the core to any other runnable thread (torch's own pool
      // between our forwards), then sleep.
      uint64_t g = gen_.load(std::memory_order_acquire);
      for (int spin = 0; g == seen && spin < kSpinPause + kSpinYield; ++spin) {
        if (spin < kSpinPause) _mm_pause();
        else std::this_thread::yield();
        g = gen_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        g = gen_.load(std::memory_order_acquire);
      }
      seen = g;
      if (stop_) return;
      fn_(ctx_, tid, n_);
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  const int n_;
  std::vector<std::thread> workers_;
  std::vector<int> sense_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  alignas(64) std::atomic<int> count_{0};
  alignas(64) std::atomic<int> flag_{0};
  Fn fn_ = nullptr;
  void* ctx_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
};

inline void split_range(int total, int tid, int n, int* a, int* b) {
  *a = (int)((int64_t)total * tid / n);
  *b = (int)((int64_t)total * (tid + 1) / n);
}

}  // namespace specserve
