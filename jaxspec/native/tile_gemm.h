// The register-blocked micro-kernel shared by the native kernels:
// y[M, 64] = x[M, K] @ tile[K, 64], one 64-column tile at a time.
#pragma once

#include <cstdint>
#include <cstring>

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

// R rows of x (stride K) times one tile [K, 64] -> R rows of y (stride ldy).
template <int R>
void micro(const float* x, const float* tile, float* y, int64_t K, int64_t ldy) {
  v16 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = v16{};
  const float* wp = tile;
  for (int64_t k = 0; k < K; ++k, wp += kTile) {
    const v16 w0 = load(wp), w1 = load(wp + 16), w2 = load(wp + 32), w3 = load(wp + 48);
    for (int r = 0; r < R; ++r) {
      const float s = x[r * K + k];
      acc[r][0] += s * w0;
      acc[r][1] += s * w1;
      acc[r][2] += s * w2;
      acc[r][3] += s * w3;
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) store(y + r * ldy + 16 * v, acc[r][v]);
}

// All M rows against one tile; y points at the tile's first column.
inline void tile_rows(const float* x, const float* tile, float* y, int64_t M, int64_t K, int64_t ldy) {
  int64_t r = 0;
  for (; r + kRowBlock <= M; r += kRowBlock) micro<kRowBlock>(x + r * K, tile, y + r * ldy, K, ldy);
  const float* xr = x + r * K;
  float* yr = y + r * ldy;
  switch (M - r) {
    case 1: micro<1>(xr, tile, yr, K, ldy); break;
    case 2: micro<2>(xr, tile, yr, K, ldy); break;
    case 3: micro<3>(xr, tile, yr, K, ldy); break;
    case 4: micro<4>(xr, tile, yr, K, ldy); break;
    case 5: micro<5>(xr, tile, yr, K, ldy); break;
    case 6: micro<6>(xr, tile, yr, K, ldy); break;
    case 7: micro<7>(xr, tile, yr, K, ldy); break;
    default: break;
  }
}

}  // namespace jaxspec
