// y[M, N] = x[M, K] @ W[K, N] for XLA:CPU with W in GGUF's 32-weight blocks, computed on
// the blocks' own bits: 4-bit (Q4_0 / Q4_1: w = d * q + m, q in 0..15) or 8-bit (Q8_0:
// w = d * q, q int8), with a float16 d (and m) per block of 32 input rows of a column.
//
// Why this exists: a GGUF decode step is bandwidth-bound, and Q4_1 is 0.625 bytes a weight
// against float32's 4 and int8's ~1. The weights stay in their blocks and are dequantized in
// registers inside the same column-tile micro-kernel as packed_matmul.cc, so a verify block or
// batch of up to 8 rows still reads each weight once.
//
// Layout (block_matmul.py packs it once at load; llama.cpp repacks Q4_0 for AVX the same way):
// column tiles of 64, each tile's K rows one contiguous stream.
//   4-bit: q [tiles, K, 32] uint8, byte i = column i (low nibble) | column 32 + i (high nibble)
//   8-bit: q [tiles, K, 64] int8
//   d, m:  [tiles, K / 32, 64] float16, the block scales (and minimums) of the tile's columns
// Sums run over k in the same order whatever M is: results are batch-invariant, bit for bit.
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "tile_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec::kPrefetchBytes;
using jaxspec::kTile;
using jaxspec::load;
using jaxspec::store;
using jaxspec::v16;

constexpr int64_t kBlock = 32;  // GGUF's block: 32 consecutive input rows of one column

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float
    const float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    return sign ? -f : f;
  }
  bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline v16 load_half(const uint16_t* p) {
  v16 v;
#if defined(__AVX512F__)
  const __m512 r = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &r, sizeof(v));
#elif defined(__F16C__)
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
#else
  for (int i = 0; i < 16; ++i) v[i] = half_to_float(p[i]);
#endif
  return v;
}

// 32 bytes -> the 64 columns' 4-bit values as floats: q[0] columns 0-15, q[1] 16-31 (low
// nibbles), q[2] 32-47, q[3] 48-63 (high nibbles).
inline void load_nibbles(const uint8_t* p, v16 q[4]) {
#if defined(__AVX512F__)
  const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  const __m512i low = _mm512_set1_epi32(0xF);
  const __m512 r[4] = {_mm512_cvtepi32_ps(_mm512_and_si512(a, low)), _mm512_cvtepi32_ps(_mm512_and_si512(b, low)),
                       _mm512_cvtepi32_ps(_mm512_srli_epi32(a, 4)), _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
  std::memcpy(q, r, sizeof(r));
#elif defined(__AVX2__)
  const __m256i low = _mm256_set1_epi32(0xF);
  for (int h = 0; h < 4; ++h) {  // 8 bytes at a time: columns 8h..8h+7 and 32+8h..32+8h+7
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(a, low)), hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    std::memcpy(reinterpret_cast<char*>(q) + 32 * h, &lo, sizeof(lo));
    std::memcpy(reinterpret_cast<char*>(q) + 128 + 32 * h, &hi, sizeof(hi));
  }
#else
  for (int i = 0; i < 32; ++i) {
    q[i / 16][i % 16] = static_cast<float>(p[i] & 0xF);
    q[2 + i / 16][i % 16] = static_cast<float>(p[i] >> 4);
  }
#endif
}

// R rows of x (stride K) times one tile of blocks -> R rows of y (stride ldy).
template <int R, int Bits>
void micro(const float* x, const uint8_t* tile, const uint16_t* d, const uint16_t* m, float* y, int64_t K,
           int64_t ldy) {
  constexpr int64_t row_bytes = Bits == 4 ? kTile / 2 : kTile;
  v16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = v16{};
  const uint8_t* wp = tile;
  for (int64_t b = 0; b < K / kBlock; ++b) {
    v16 dv[4], mv[4];
    for (int v = 0; v < 4; ++v) {
      dv[v] = load_half(d + b * kTile + 16 * v);
      mv[v] = Bits == 4 ? load_half(m + b * kTile + 16 * v) : v16{};
    }
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k, wp += row_bytes) {
      // Several rows fill the out-of-order window with FMAs; ask for the stream early (see tile_gemm.h).
      if constexpr (R > 1) __builtin_prefetch(wp + kPrefetchBytes, 0, 1);
      v16 w[4];
      if constexpr (Bits == 4) {
        load_nibbles(wp, w);
        for (int v = 0; v < 4; ++v) w[v] = w[v] * dv[v] + mv[v];
      } else {
        const int8_t* qp = reinterpret_cast<const int8_t*>(wp);
        for (int v = 0; v < 4; ++v) w[v] = load(qp + 16 * v) * dv[v];
      }
      for (int r = 0; r < R; ++r) {
        const float s = x[r * K + k];
        for (int v = 0; v < 4; ++v) acc[r][v] += s * w[v];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) store(y + r * ldy + 16 * v, acc[r][v]);
}

template <int Bits>
ffi::Error Run(ffi::ThreadPool& pool, const float* xd, size_t x_count, const uint8_t* q,
               ffi::Span<const int64_t> qd, const uint16_t* d, size_t d_count, const uint16_t* m, float* yd,
               size_t y_count, int64_t n_out) {
  constexpr int64_t row_bytes = Bits == 4 ? kTile / 2 : kTile;
  if (qd.size() != 3 || qd[2] != row_bytes)
    return ffi::Error::InvalidArgument(Bits == 4 ? "4-bit blocks must be [tiles, K, 32] uint8"
                                                 : "8-bit blocks must be [tiles, K, 64] int8");
  const int64_t tiles = qd[0], K = qd[1];
  if (K <= 0 || K % kBlock != 0) return ffi::Error::InvalidArgument("K must be a positive multiple of 32");
  if (static_cast<int64_t>(d_count) != tiles * (K / kBlock) * kTile)
    return ffi::Error::InvalidArgument("block scales must be [tiles, K / 32, 64]");
  if (x_count % K != 0) return ffi::Error::InvalidArgument("x's last axis must equal K");
  if (n_out <= (tiles - 1) * kTile || n_out > tiles * kTile)
    return ffi::Error::InvalidArgument("n_out does not match the number of packed tiles");
  const int64_t M = static_cast<int64_t>(x_count) / K;
  if (static_cast<int64_t>(y_count) != M * n_out) return ffi::Error::InvalidArgument("output must be [M, n_out]");
  if (M == 0) return ffi::Error::Success();
  const int64_t scales_per_tile = (K / kBlock) * kTile;
  jaxspec::parallel_for(pool, tiles, 4, [&](int64_t t) {
    const uint8_t* tile = q + t * K * row_bytes;
    const uint16_t* dt = d + t * scales_per_tile;
    const uint16_t* mt = m == nullptr ? nullptr : m + t * scales_per_tile;
    jaxspec::tile_columns(yd, t * kTile, M, n_out, [&](float* y, int64_t ldy) {
      jaxspec::row_blocks(M, [&](auto rows, int64_t r) {
        micro<decltype(rows)::value, Bits>(xd + r * K, tile, dt, mt, y + r * ldy, K, ldy);
      });
    });
  });
  return ffi::Error::Success();
}

ffi::Error BlockMatmulQ4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                             ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> m, ffi::ResultBuffer<ffi::F32> y,
                             int64_t n_out) {
  if (m.element_count() != d.element_count()) return ffi::Error::InvalidArgument("m must have d's shape");
  return Run<4>(pool, x.typed_data(), x.element_count(), q.typed_data(), q.dimensions(), d.typed_data(),
                d.element_count(), m.typed_data(), y->typed_data(), y->element_count(), n_out);
}

ffi::Error BlockMatmulQ8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                             ffi::Buffer<ffi::F16> d, ffi::ResultBuffer<ffi::F32> y, int64_t n_out) {
  return Run<8>(pool, x.typed_data(), x.element_count(), reinterpret_cast<const uint8_t*>(q.typed_data()),
                q.dimensions(), d.typed_data(), d.element_count(), nullptr, y->typed_data(), y->element_count(),
                n_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecBlockMatmulQ4, BlockMatmulQ4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // q [tiles, K, 32] two 4-bit values a byte
                                  .Arg<ffi::Buffer<ffi::F16>>()  // d [tiles, K / 32, 64]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // m [tiles, K / 32, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., n_out]
                                  .Attr<int64_t>("n_out"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecBlockMatmulQ8, BlockMatmulQ8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q [tiles, K, 64]
                                  .Arg<ffi::Buffer<ffi::F16>>()  // d [tiles, K / 32, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., n_out]
                                  .Attr<int64_t>("n_out"));
