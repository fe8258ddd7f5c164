// parallel_for over XLA:CPU's intra-op thread pool, shared by the native kernels.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace jaxspec {

// Runs fn(i) for i in [0, n), in chunks, on the calling thread plus up to
// num_threads-1 pool helpers. Pool tasks may start late, even after this call
// has returned (XLA promises nothing about when they run), so the shared state
// is reference-counted and a late helper finds no chunk left. The caller waits
// only for chunks already claimed by running helpers, so it cannot deadlock on
// a busy or single-threaded pool.
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, int64_t chunks_per_thread,
                         const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (threads == 1 || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    int64_t n = 0, per = 0, chunks = 0;
    std::function<void(int64_t)> fn;
    void drain() {
      for (;;) {
        const int64_t c = next.fetch_add(1, std::memory_order_relaxed);
        if (c >= chunks) return;
        const int64_t end = std::min(n, (c + 1) * per);
        for (int64_t i = c * per; i < end; ++i) fn(i);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto st = std::make_shared<State>();
  const int64_t want = std::max<int64_t>(1, std::min<int64_t>(n, threads * chunks_per_thread));
  st->n = n;
  st->per = (n + want - 1) / want;
  st->chunks = (n + st->per - 1) / st->per;
  st->fn = fn;
  for (int64_t i = 1; i < threads && i < st->chunks; ++i) pool.Schedule([st] { st->drain(); });
  st->drain();
  while (st->done.load(std::memory_order_acquire) < st->chunks) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
}

}  // namespace jaxspec
