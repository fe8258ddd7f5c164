// The register-blocked micro-kernel shared by the native kernels:
// y[M, 64] = x[M, K] @ tile[K, 64], one 64-column tile at a time.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxspec {

constexpr int64_t kTile = 64;  // columns per packed tile: 4 vectors of 16 floats
constexpr int kRowBlock = 8;   // rows sharing each weight load (8 x 4 accumulators)

// GCC vector extension: one AVX-512 register with -march=native on AVX-512
// machines, two AVX2 registers elsewhere.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// Weight-only int8: 16 weights widened to floats in registers, so the stream from memory is a
// quarter of float32's; the per-column scale is applied once to the finished sums. Intrinsics:
// GCC 12 lowers __builtin_convertvector(int8 x 16 -> float x 16) to 16 scalar conversions.
inline v16 load(const int8_t* p) {
  v16 v;
#if defined(__AVX512F__)
  const __m512 r = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &r, sizeof(v));
#elif defined(__AVX2__)
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  const __m256 hi =
      _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
#else
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}

// With 2+ rows the FMAs per weight line fill the out-of-order window, fewer loads stay in flight
// and the stream slows (measured on a 2-core Xeon, 576 x 3072 float32 weights from DRAM: 24 GB/s at
// 1 row, 20 at 3, 16 at 8). Asking for the lines 8 KiB ahead into L2 (prefetcht2) keeps the
// stream at 24-27 GB/s for 2-8 rows, so a verify block costs about one row's weight traffic, as
// the kernel promises. One row needs no help (the hardware prefetcher keeps up) and is left alone.
constexpr int64_t kPrefetchBytes = 8192;

template <typename W>
inline void prefetch_ahead(const W* wp) {
  const char* p = reinterpret_cast<const char*>(wp) + kPrefetchBytes;
  for (int64_t line = 0; line < static_cast<int64_t>(sizeof(W)) * kTile; line += 64) __builtin_prefetch(p + line, 0, 1);
}

// R rows of x (stride K) times one tile [K, 64] of W (float or int8) -> R rows of y (stride ldy),
// each column times scale[c] when scale is given.
template <int R, typename W>
void micro(const float* x, const W* tile, const float* scale, float* y, int64_t K, int64_t ldy) {
  v16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = v16{};
  const W* wp = tile;
  for (int64_t k = 0; k < K; ++k, wp += kTile) {
    if constexpr (R > 1) prefetch_ahead(wp);
    const v16 w0 = load(wp), w1 = load(wp + 16), w2 = load(wp + 32), w3 = load(wp + 48);
    for (int r = 0; r < R; ++r) {
      const float s = x[r * K + k];
      acc[r][0] += s * w0;
      acc[r][1] += s * w1;
      acc[r][2] += s * w2;
      acc[r][3] += s * w3;
    }
  }
  if (scale != nullptr)
    for (int v = 0; v < 4; ++v) {
      const v16 sv = load(scale + 16 * v);
      for (int r = 0; r < R; ++r) acc[r][v] *= sv;
    }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) store(y + r * ldy + 16 * v, acc[r][v]);
}

// All M rows of x, kRowBlock at a time and then the rest, each block through
// `rows_fn(std::integral_constant<int, R>, first_row)`: one driver for every micro-kernel
// (float / int8 tiles here, GGUF blocks in block_matmul.cc), R a compile-time row count.
template <typename F>
inline void row_blocks(int64_t M, F&& rows_fn) {
  int64_t r = 0;
  for (; r + kRowBlock <= M; r += kRowBlock) rows_fn(std::integral_constant<int, kRowBlock>{}, r);
  switch (M - r) {
    case 1: rows_fn(std::integral_constant<int, 1>{}, r); break;
    case 2: rows_fn(std::integral_constant<int, 2>{}, r); break;
    case 3: rows_fn(std::integral_constant<int, 3>{}, r); break;
    case 4: rows_fn(std::integral_constant<int, 4>{}, r); break;
    case 5: rows_fn(std::integral_constant<int, 5>{}, r); break;
    case 6: rows_fn(std::integral_constant<int, 6>{}, r); break;
    case 7: rows_fn(std::integral_constant<int, 7>{}, r); break;
    default: break;
  }
}

// One 64-column tile of y [M, N] starting at column col, through `tile_fn(y_tile, ldy)`; the
// partial last tile is computed into a full-width scratch and only its valid columns kept.
template <typename F>
inline void tile_columns(float* y, int64_t col, int64_t M, int64_t N, F&& tile_fn) {
  if (col + kTile <= N) {
    tile_fn(y + col, N);
    return;
  }
  std::vector<float> scratch(static_cast<size_t>(M) * kTile);
  tile_fn(scratch.data(), kTile);
  for (int64_t r = 0; r < M; ++r) std::memcpy(y + r * N + col, scratch.data() + r * kTile, sizeof(float) * (N - col));
}

// All M rows against one tile [K, 64] of W; y points at the tile's first column, scale (or nullptr) at its scales.
template <typename W>
inline void tile_rows(const float* x, const W* tile, const float* scale, float* y, int64_t M, int64_t K,
                      int64_t ldy) {
  row_blocks(M, [&](auto rows, int64_t r) {
    micro<decltype(rows)::value>(x + r * K, tile, scale, y + r * ldy, K, ldy);
  });
}

}  // namespace jaxspec
