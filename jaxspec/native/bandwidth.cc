// Multi-threaded streaming-read bandwidth: the memory roofline of the CPU benchmarks.
//
// One buffer of float32 ones, split into one contiguous slice per thread and
// first-touched by the thread that reads it. Every pass, all threads start
// together (a barrier), sum their slice with wide vectors and several
// independent accumulators, and stop the clock; a pass lasts from the first
// thread's start to the last thread's end. The caller gets each pass's seconds
// and takes the best: the peak a decode that streams its weights could reach.
// The sum is returned as a checksum (it equals the number of floats read, so
// the reads cannot have been skipped). Plain C ABI, loaded with ctypes; no XLA.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

// 64-byte vectors of floats: the compiler lowers them to AVX-512, 2x AVX2, 4x SSE or 4x NEON.
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kUnroll = 4;                     // independent accumulators
constexpr int64_t kBlock = kUnroll * sizeof(v16);  // 256 bytes per loop step

double sum_slice(const float* p, int64_t bytes) {
  const v16* v = reinterpret_cast<const v16*>(p);
  v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  const int64_t steps = bytes / kBlock;
  for (int64_t i = 0; i < steps; ++i) {
    a0 += v[4 * i + 0];
    a1 += v[4 * i + 1];
    a2 += v[4 * i + 2];
    a3 += v[4 * i + 3];
  }
  v16 s = (a0 + a1) + (a2 + a3);
  double total = 0.0;
  for (int k = 0; k < 16; ++k) total += s[k];
  return total;
}

// A reusable barrier (C++17 has none); waiting threads sleep, so the cores that
// are not in a pass stay free.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(lock, [&] { return gen_ != gen; });
    }
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_, count_ = 0;
  int64_t gen_ = 0;
};

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

extern "C" {

// Reads about `num_bytes` (rounded down to a whole 256-byte block per thread)
// `passes` times with `threads` threads, from huge pages if `huge_pages` (and the
// kernel grants them), else from whatever pages malloc gives. Writes the bytes read per pass to
// *bytes_out, each pass's seconds to seconds_out[0..passes) and the last
// pass's sum to *checksum_out. Returns 0, or -1 for bad arguments, -2 when the
// buffer cannot be allocated, -3 when a thread cannot be started.
int jaxspec_read_bandwidth(int64_t num_bytes, int32_t threads, int32_t passes, int32_t huge_pages,
                           int64_t* bytes_out, double* seconds_out, double* checksum_out) {
  if (num_bytes <= 0 || threads <= 0 || passes <= 0 || !bytes_out || !seconds_out || !checksum_out) return -1;
  const int64_t slice = (num_bytes / threads) / kBlock * kBlock;
  if (slice <= 0) return -1;
  const int64_t total = slice * threads;
  // 2 MiB aligned and, on Linux, advised onto transparent huge pages (as numpy
  // advises its large arrays), to keep TLB misses out of the figure. On the 2-core
  // EPYC this was written on it made no measurable difference (81-87 GB/s either
  // way); the figure there is bimodal (~85 or ~50 GB/s) from run to run, which
  // is why the caller takes the best of several spaced rounds.
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t alloc = (static_cast<size_t>(total) + kHuge - 1) / kHuge * kHuge;
  float* buf = static_cast<float*>(std::aligned_alloc(kHuge, alloc));
  if (!buf) return -2;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (huge_pages) madvise(buf, alloc, MADV_HUGEPAGE);  // advice only: without THP the pass is just slower
#endif

  std::vector<double> start(static_cast<size_t>(passes) * threads), end(start.size());
  std::vector<double> sums(threads, 0.0);
  Barrier barrier(threads);
  // Helpers wait at this gate until all of them are running (go), or leave
  // (abort) when one could not be started: nobody is left waiting at the barrier.
  std::mutex gate_mu;
  std::condition_variable gate_cv;
  int gate = 0;  // 0 wait, 1 go, 2 abort
  auto work = [&](int t) {
    {
      std::unique_lock<std::mutex> lock(gate_mu);
      gate_cv.wait(lock, [&] { return gate != 0; });
      if (gate == 2) return;
    }
    float* mine = buf + t * (slice / static_cast<int64_t>(sizeof(float)));
    std::fill(mine, mine + slice / sizeof(float), 1.0f);  // first touch by the reader
    for (int p = 0; p < passes; ++p) {
      barrier.wait();
      start[p * threads + t] = now_s();
      sums[t] = sum_slice(mine, slice);
      end[p * threads + t] = now_s();
    }
  };
  std::vector<std::thread> pool;
  int rc = 0;
  try {
    for (int t = 1; t < threads; ++t) pool.emplace_back(work, t);
  } catch (...) {
    rc = -3;
  }
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    gate = rc == 0 ? 1 : 2;
  }
  gate_cv.notify_all();
  if (rc == 0) work(0);
  for (auto& th : pool) th.join();
  if (rc == 0) {
    for (int p = 0; p < passes; ++p) {
      double t0 = start[p * threads], t1 = end[p * threads];
      for (int t = 1; t < threads; ++t) {
        t0 = std::min(t0, start[p * threads + t]);
        t1 = std::max(t1, end[p * threads + t]);
      }
      seconds_out[p] = t1 - t0;
    }
    double s = 0.0;
    for (double x : sums) s += x;
    *checksum_out = s;
    *bytes_out = total;
  }
  std::free(buf);
  return rc;
}

}  // extern "C"
