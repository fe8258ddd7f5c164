// y[M, N] = x[M, K] @ W[K, N] in float32 for XLA:CPU, with W pre-packed as
// column tiles `w[N/64, K, 64]` (see packed_matmul.py): float32, or weight-only
// int8 with a float32 scale per output column (a quarter of the bytes to stream).
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
#include <cstdint>

#include "parallel.h"
#include "tile_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec::kTile;

// Shapes checked, then every tile over the pool; scales: [tiles * 64] or nullptr (float32 W).
template <typename W>
ffi::Error Run(ffi::ThreadPool& pool, const float* xd, size_t x_count, const W* wdata,
               ffi::Span<const int64_t> wd, const float* scales, float* yd, size_t y_count, int64_t n_out) {
  if (wd.size() != 3 || wd[2] != kTile) return ffi::Error::InvalidArgument("packed weight must be [tiles, K, 64]");
  const int64_t tiles = wd[0], K = wd[1];
  if (K <= 0 || x_count % K != 0) return ffi::Error::InvalidArgument("x's last axis must equal K");
  if (n_out <= (tiles - 1) * kTile || n_out > tiles * kTile)
    return ffi::Error::InvalidArgument("n_out does not match the number of packed tiles");
  const int64_t M = static_cast<int64_t>(x_count) / K;
  if (static_cast<int64_t>(y_count) != M * n_out) return ffi::Error::InvalidArgument("output must be [M, n_out]");
  if (M == 0) return ffi::Error::Success();
  // A few chunks per thread, so a thread that starts late still finds work.
  jaxspec::parallel_for(pool, tiles, 4, [&](int64_t t) {
    const W* tile = wdata + t * K * kTile;
    const float* scale = scales == nullptr ? nullptr : scales + t * kTile;
    jaxspec::tile_columns(yd, t * kTile, M, n_out,
                          [&](float* y, int64_t ldy) { jaxspec::tile_rows(xd, tile, scale, y, M, K, ldy); });
  });
  return ffi::Error::Success();
}

ffi::Error PackedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> y, int64_t n_out) {
  return Run(pool, x.typed_data(), x.element_count(), w.typed_data(), w.dimensions(), nullptr, y->typed_data(),
             y->element_count(), n_out);
}

ffi::Error PackedMatmulI8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                              ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y, int64_t n_out) {
  const auto wd = w.dimensions();
  if (wd.size() == 3 && static_cast<int64_t>(scales.element_count()) != wd[0] * kTile)
    return ffi::Error::InvalidArgument("scales must be [tiles * 64]");
  return Run(pool, x.typed_data(), x.element_count(), w.typed_data(), wd, scales.typed_data(), y->typed_data(),
             y->element_count(), n_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPackedMatmul, PackedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [tiles, K, 64]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., n_out]
                                  .Attr<int64_t>("n_out"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPackedMatmulI8, PackedMatmulI8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., K]
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w [tiles, K, 64] int8
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales [tiles * 64]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., n_out]
                                  .Attr<int64_t>("n_out"));
