// y[M, N] = x[M, K] @ W[K, N] in float32 for XLA:CPU, with W pre-packed as
// column tiles `w[N/64, K, 64]` (see packed_matmul.py).
//
// Why this exists: XLA:CPU runs a 1-row dot as a bandwidth-bound matvec but
// switches to an Eigen GEMM for 2..64 rows that repacks the weights on every
// call, so a verify forward over 8 tokens (or a batch of 8) cost ~2x a 1-token
// forward. Here the weights are packed once at load time, each 64-column tile
// is one contiguous stream, and up to 8 rows share every weight load, so the
// cost stays flat until the FMAs, not the memory, are the limit (~8 rows).
//
// Every output row is summed over k in the same order whatever M is and
// wherever the row sits in the batch: results are batch-invariant, bit for bit.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "tile_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec::kTile;
using jaxspec::tile_rows;

// One 64-column tile for all M rows; the last tile may be partial.
void run_tile(const float* x, const float* w, float* y, int64_t t, int64_t M, int64_t K, int64_t N) {
  const float* tile = w + t * K * kTile;
  const int64_t col = t * kTile;
  if (col + kTile <= N) {
    tile_rows(x, tile, y + col, M, K, N);
    return;
  }
  // Compute into a full-width scratch, keep the valid columns.
  std::vector<float> scratch(static_cast<size_t>(M) * kTile);
  tile_rows(x, tile, scratch.data(), M, K, kTile);
  for (int64_t r = 0; r < M; ++r)
    std::memcpy(y + r * N + col, scratch.data() + r * kTile, sizeof(float) * (N - col));
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y, int64_t n_out) {
  const auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != kTile) return ffi::Error::InvalidArgument("packed weight must be [tiles, K, 64]");
  const int64_t tiles = wd[0], K = wd[1];
  if (K <= 0 || x.element_count() % K != 0) return ffi::Error::InvalidArgument("x's last axis must equal K");
  if (n_out <= (tiles - 1) * kTile || n_out > tiles * kTile)
    return ffi::Error::InvalidArgument("n_out does not match the number of packed tiles");
  const int64_t M = static_cast<int64_t>(x.element_count()) / K;
  if (static_cast<int64_t>(y->element_count()) != M * n_out)
    return ffi::Error::InvalidArgument("output must be [M, n_out]");
  if (M == 0) return ffi::Error::Success();

  const float* xd = x.typed_data();
  const float* wdata = w.typed_data();
  float* yd = y->typed_data();
  // A few chunks per thread, so a thread that starts late still finds work.
  jaxspec::parallel_for(pool, tiles, 4, [&](int64_t t) { run_tile(xd, wdata, yd, t, M, K, n_out); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [tiles, K, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., n_out]
                                  .Attr<int64_t>("n_out"));
