// Collectives between the tensor-parallel ranks of one host through shared memory.
//
// gloo's loopback all-reduce takes ~0.4-0.7 ms here (a TCP round trip and thread wake-ups per
// call), and a forward of the default model makes 61 of them; through a shared segment a
// collective is a copy, an atomic flag per rank and a sum. Every rank adds the ranks' parts
// itself, in rank order, so all ranks hold the same bits and a row's sum never depends on the
// other rows of the batch.
//
// Layout: one counter per rank (own cache line), then two generations x `world` slots of `cap`
// bytes. A collective (generation g) writes this rank's part into slot [g % 2][rank], publishes
// g, and waits until every rank has published g. A rank writes slot [g % 2] again only at
// g + 2, after every rank published g + 1, i.e. after every rank finished reading g.
#pragma once

#include <fcntl.h>
#include <immintrin.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

class ShmComm {
 public:
  // rank 0 creates the segment `name` (e.g. "/specserve-tp-<port>"); the others open it once
  // rank 0 has (the caller orders this with a barrier of its own), then rank 0 unlinks it.
  ShmComm(const std::string& name, int rank, int world, int64_t cap_bytes)
      : name_(name), rank_(rank), world_(world), cap_(cap_bytes & ~int64_t(63)) {
    if (world < 1 || rank < 0 || rank >= world || cap_ < 64) {
      throw std::invalid_argument("ShmComm: bad rank, world or capacity");
    }
    bytes_ = header_bytes() + 2 * (size_t)world_ * (size_t)cap_;
    const int fd = rank == 0 ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                             : shm_open(name.c_str(), O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error("ShmComm: cannot open shared memory " + name);
    if (rank == 0 && ftruncate(fd, (off_t)bytes_) != 0) {
      close(fd);
      throw std::runtime_error("ShmComm: cannot size shared memory " + name);
    }
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) throw std::runtime_error("ShmComm: cannot map shared memory " + name);
    base_ = static_cast<char*>(p);
  }
  ~ShmComm() {
    if (base_) munmap(base_, bytes_);
  }
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  // rank 0, once every rank has opened the segment: the name goes, the mappings stay
  void unlink() { shm_unlink(name_.c_str()); }
  int rank() const { return rank_; }
  int world() const { return world_; }

  // x [n] float32 summed over the ranks in rank order, in place
  void allreduce(float* x, int64_t n) {
    const int64_t per = cap_ / (int64_t)sizeof(float);
    for (int64_t at = 0; at < n; at += per) {
      const int64_t m = std::min(per, n - at);
      const uint64_t g = exchange(x + at, m * (int64_t)sizeof(float));
      const float* s0 = reinterpret_cast<const float*>(slot(g, 0));
      std::memcpy(x + at, s0, sizeof(float) * m);
      for (int r = 1; r < world_; ++r) {
        const float* s = reinterpret_cast<const float*>(slot(g, r));
        for (int64_t i = 0; i < m; ++i) x[at + i] += s[i];
      }
    }
  }

  // rank 0's bytes [n] into every rank's buffer
  void broadcast(void* buf, int64_t n) {
    char* b = static_cast<char*>(buf);
    for (int64_t at = 0; at < n; at += cap_) {
      const int64_t m = std::min(cap_, n - at);
      const uint64_t g = exchange(rank_ == 0 ? b + at : nullptr, rank_ == 0 ? m : 0);
      if (rank_ != 0) std::memcpy(b + at, slot(g, 0), m);
    }
  }

  // every rank's `n` bytes of `part`, into rank 0's `out` [world][n] (others: out unused)
  void gather(const void* part, int64_t n, void* out) {
    const char* p = static_cast<const char*>(part);
    char* o = static_cast<char*>(out);
    for (int64_t at = 0; at < n; at += cap_) {
      const int64_t m = std::min(cap_, n - at);
      const uint64_t g = exchange(p + at, m);
      if (rank_ != 0) continue;
      for (int r = 0; r < world_; ++r) std::memcpy(o + (int64_t)r * n + at, slot(g, r), m);
    }
  }

 private:
  size_t header_bytes() const { return 64 * (size_t)world_; }
  std::atomic<uint64_t>& counter(int r) {
    return *reinterpret_cast<std::atomic<uint64_t>*>(base_ + 64 * (size_t)r);
  }
  char* slot(uint64_t g, int r) {
    return base_ + header_bytes() + ((g & 1) * (size_t)world_ + (size_t)r) * (size_t)cap_;
  }

  // publish this rank's `m` bytes for the next generation, wait for every rank's; returns g
  uint64_t exchange(const void* part, int64_t m) {
    const uint64_t g = ++gen_;
    if (m > 0) std::memcpy(slot(g, rank_), part, m);
    counter(rank_).store(g, std::memory_order_release);
    for (int r = 0; r < world_; ++r) {
      std::atomic<uint64_t>& c = counter(r);
      for (int64_t i = 0; c.load(std::memory_order_acquire) < g; ++i) backoff(i);
    }
    return g;
  }

  // spin, then yield, then sleep: a rank waiting for the next command of an idle server
  // (hours, maybe) sleeps up to 1 ms at a time instead of holding a core
  static void backoff(int64_t i) {
    if (i < 4096) {
      _mm_pause();
    } else if (i < 65536) {
      sched_yield();
    } else {
      usleep((useconds_t)std::min<int64_t>(1000, 20 + (i - 65536) / 64));
    }
  }

  std::string name_;
  int rank_, world_;
  int64_t cap_;
  size_t bytes_ = 0;
  char* base_ = nullptr;
  uint64_t gen_ = 0;
};
