// Attention over the paged KV cache for query blocks of up to MAX_QUERIES (decode,
// tree verify, prefill chunks; paged_attention.py) on XLA:CPU, with the semantics of
// cache/attention.py:
//
//   key slot s is visible to query t of sequence b iff
//     s < kv_len[b] and (s < q_start[b] or block_mask[b, t, s - q_start[b]])
//   block_mask = causal (j <= t) or the given tree mask [B, T, T].
//
// Why: the jnp reference gathers every page of the context (the whole context
// bucket) per layer and runs masking, softmax and two small batched dots as
// separate XLA ops, which was most of a forward's non-matmul time. Here each
// (sequence, KV head) gathers only its kv_len slots, once, for all T x group
// query rows, and everything runs in one call. The cache is passed whole ([L, P, ...] plus a layer index) because a
// per-layer slice would be materialised as a copy for the custom call.
//
// With k_block/v_block the block's own K/V are read from those arrays instead
// of the cache (the verify-width switch of the n-gram loop only reads the
// cache and writes the block after the switch; see spec/loop._verify_forward).
//
// A query row with no visible slot (an empty padding sequence) gets zeros; the
// reference gives a finite average there. Neither is ever read.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "tile_gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxspec::kTile;
using jaxspec::tile_rows;

using jaxspec::load;
using jaxspec::store;
using jaxspec::v16;
typedef int32_t vi16 __attribute__((vector_size(64)));

// exp on 16 lanes (Cephes expf: range reduction by ln 2, degree-6 polynomial;
// within ~2 ulp of expf). Scalar expf was most of the softmax time.
inline v16 vexp(v16 x) {
  const v16 hi = v16{} + 88.3762626647949f, lo = v16{} - 87.3365447504019f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v16 fx = x * 1.44269504088896341f + 0.5f;
  vi16 n = __builtin_convertvector(fx, vi16);  // truncates toward zero
  v16 fn = __builtin_convertvector(n, v16);
  const vi16 one_i = vi16{} + 1;
  n = fn > fx ? n - one_i : n;  // floor
  fn = __builtin_convertvector(n, v16);
  x = x - fn * 0.693359375f - fn * -2.12194440e-4f;
  const v16 z = x * x;
  v16 y = v16{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const vi16 bits = (n + 127) << 23;  // 2^n
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

struct Dims {
  int64_t B, T, H, hd, L, P, ps, kvh, max_pages, group;
};

// Query rows [t0, t1) x group of sequence b that read KV head kh, as two small
// GEMMs on the shared micro-kernel: logits = (scale q) @ K^T, out = p @ V, with
// K^T and V gathered from their pages into 64-column tiles first (zero-padded
// to a multiple of 64 slots, so padded slots add exact zeros).
void attend(const Dims& d, const float* q, const float* cache_k, const float* cache_v, int64_t layer,
            const int32_t* page_table, const int32_t* q_start, const int32_t* kv_len, const bool* mask,
            const float* k_block, const float* v_block, bool causal, float scale, float* out, int64_t b,
            int64_t kh, int64_t t0, int64_t t1) {
  const int64_t rows = (t1 - t0) * d.group;
  const int64_t qs = q_start[b];
  // Slots come from the page table, or, with an in-flight block, from q_start on from the block:
  // a table narrower than the block (the scorer's one page under a 128-token block) bounds only
  // the prefix.
  const int64_t slots = k_block != nullptr ? qs + d.T : d.max_pages * d.ps;
  const int64_t S = std::clamp<int64_t>(kv_len[b], 0, slots);
  const int64_t S64 = std::max<int64_t>(kTile, (S + kTile - 1) / kTile * kTile);
  const int64_t hd64 = (d.hd + kTile - 1) / kTile * kTile;
  auto slot_ptr = [&](const float* cache, const float* block, int64_t s) {
    if (block != nullptr && s >= qs) return block + ((b * d.T + (s - qs)) * d.kvh + kh) * d.hd;
    // Never past the row's table either (a prefix longer than the table is invalid input).
    int64_t page = page_table[b * d.max_pages + std::min<int64_t>(s / d.ps, d.max_pages - 1)];
    page = std::clamp<int64_t>(page, 0, d.P - 1);  // never read outside the cache
    return cache + (((layer * d.P + page) * d.ps + s % d.ps) * d.kvh + kh) * d.hd;
  };
  auto visible = [&](int64_t t, int64_t s) {
    if (s < qs) return true;
    const int64_t rel = s - qs;
    if (rel >= d.T) return false;
    return causal ? rel <= t : mask[(b * d.T + t) * d.T + rel];
  };
  // 1. Gather: scaled query rows [rows, hd], K^T tiles [S64/64][hd][64], V tiles [hd64/64][S64][64].
  // Scratch reused across calls per thread: only the padding is zeroed, the rest is overwritten.
  thread_local std::vector<float> qloc, kt, vt, logits, acc;
  qloc.resize(static_cast<size_t>(rows) * d.hd);
  kt.resize(static_cast<size_t>(S64) * d.hd);
  vt.resize(static_cast<size_t>(hd64) * S64);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < d.group; ++g) {
      const float* src = q + ((b * d.T + t) * d.H + kh * d.group + g) * d.hd;
      float* dst = qloc.data() + ((t - t0) * d.group + g) * d.hd;
      for (int64_t i = 0; i < d.hd; ++i) dst[i] = src[i] * scale;
    }
  for (int64_t s = 0; s < S; ++s) {
    const float* k = slot_ptr(cache_k, k_block, s);
    const float* v = slot_ptr(cache_v, v_block, s);
    float* kcol = kt.data() + (s / kTile) * d.hd * kTile + s % kTile;
    for (int64_t i = 0; i < d.hd; ++i) kcol[i * kTile] = k[i];
    for (int64_t c = 0; c < hd64; c += kTile) {  // V rows stay rows: one copy per 64-wide chunk
      float* dst = vt.data() + ((c / kTile) * S64 + s) * kTile;
      const int64_t n = std::min<int64_t>(kTile, d.hd - c);
      std::memcpy(dst, v + c, sizeof(float) * n);
      if (n < kTile) std::memset(dst + n, 0, sizeof(float) * (kTile - n));
    }
  }
  for (int64_t s = S; s < S64; ++s) {  // padded slots: zero keys and values
    float* kcol = kt.data() + (s / kTile) * d.hd * kTile + s % kTile;
    for (int64_t i = 0; i < d.hd; ++i) kcol[i * kTile] = 0.f;
    for (int64_t i = 0; i < hd64; ++i) vt[((i / kTile) * S64 + s) * kTile + i % kTile] = 0.f;
  }
  // 2. Logits [rows, S64].
  logits.resize(static_cast<size_t>(rows) * S64);
  for (int64_t c = 0; c < S64 / kTile; ++c)
    tile_rows(qloc.data(), kt.data() + c * d.hd * kTile, nullptr, logits.data() + c * kTile, rows, d.hd, S64);
  // 3. Masked softmax in place; invisible and padded slots get exactly 0. The
  // prefix [0, qs) is visible to every row, so only the block's T slots need the mask.
  std::vector<float> inv_sum(rows, 0.f);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t prefix = std::clamp<int64_t>(qs, 0, S);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / d.group;
    float* l = logits.data() + r * S64;
    float mx = neg_inf;
    for (int64_t s = 0; s < prefix; ++s) mx = std::max(mx, l[s]);
    for (int64_t s = prefix; s < S; ++s)
      if (visible(t, s)) mx = std::max(mx, l[s]);
    if (mx == neg_inf) {  // nothing visible (an empty padding row): zeros
      std::memset(l, 0, sizeof(float) * S64);
      continue;
    }
    for (int64_t s = 0; s < S64; s += 16) store(l + s, vexp(load(l + s) - mx));
    for (int64_t s = prefix; s < S64; ++s)
      if (s >= S || !visible(t, s)) l[s] = 0.f;
    v16 vsum = v16{};
    for (int64_t s = 0; s < S64; s += 16) vsum += load(l + s);
    float sum = 0.f;
    for (int i = 0; i < 16; ++i) sum += vsum[i];
    inv_sum[r] = 1.f / sum;
  }
  // 4. Weighted values [rows, hd64], normalised on the way out.
  acc.resize(static_cast<size_t>(rows) * hd64);
  for (int64_t c = 0; c < hd64 / kTile; ++c)
    tile_rows(logits.data(), vt.data() + c * S64 * kTile, nullptr, acc.data() + c * kTile, rows, S64, hd64);
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t g = 0; g < d.group; ++g) {
      const int64_t r = (t - t0) * d.group + g;
      float* o = out + ((b * d.T + t) * d.H + kh * d.group + g) * d.hd;
      for (int64_t i = 0; i < d.hd; ++i) o[i] = acc[r * hd64 + i] * inv_sum[r];
    }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> cache_k,
                              ffi::Buffer<ffi::F32> cache_v, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> q_start,
                              ffi::Buffer<ffi::S32> kv_len, ffi::Buffer<ffi::PRED> mask,
                              ffi::Buffer<ffi::F32> k_block, ffi::Buffer<ffi::F32> v_block,
                              ffi::ResultBuffer<ffi::F32> out, float scale, bool causal, bool with_block) {
  const auto qd = q.dimensions();
  const auto cd = cache_k.dimensions();
  if (qd.size() != 4 || cd.size() != 5) return ffi::Error::InvalidArgument("q must be [B,T,H,hd], cache [L,P,ps,kvh,hd]");
  Dims d{qd[0], qd[1], qd[2], qd[3], cd[0], cd[1], cd[2], cd[3], 0, 0};
  if (cd[4] != d.hd || d.kvh <= 0 || d.H % d.kvh != 0) return ffi::Error::InvalidArgument("head dims do not match");
  const auto pd = page_table.dimensions();
  if (pd.size() != 2 || pd[0] != d.B) return ffi::Error::InvalidArgument("page_table must be [B, max_pages]");
  d.max_pages = pd[1];
  d.group = d.H / d.kvh;
  if (!causal && static_cast<int64_t>(mask.element_count()) != d.B * d.T * d.T)
    return ffi::Error::InvalidArgument("tree mask must be [B, T, T]");
  const int64_t block_size = d.B * d.T * d.kvh * d.hd;
  if (with_block && (static_cast<int64_t>(k_block.element_count()) != block_size ||
                     static_cast<int64_t>(v_block.element_count()) != block_size))
    return ffi::Error::InvalidArgument("k_block and v_block must be [B, T, kvh, hd]");
  const float* kb = with_block ? k_block.typed_data() : nullptr;
  const float* vb = with_block ? v_block.typed_data() : nullptr;
  const int64_t lyr = std::clamp<int64_t>(layer.typed_data()[0], 0, d.L - 1);
  const float* qp = q.typed_data();
  const float* kp = cache_k.typed_data();
  const float* vp = cache_v.typed_data();
  const int32_t* pt = page_table.typed_data();
  const int32_t* qs = q_start.typed_data();
  const int32_t* kl = kv_len.typed_data();
  const bool* mk = mask.typed_data();
  float* op = out->typed_data();
  // Short blocks (decode, verify) split the query block only when there are fewer
  // (sequence, KV head) pairs than threads: each split gathers its own K/V copy, which
  // costs more than the imbalance of, say, 3 pairs on 2 threads (measured on a batch-1
  // verify). A prefill chunk's rows outweigh that gather, so it splits into about four
  // pieces per thread, each of at least kMinSplitRows queries.
  constexpr int64_t kLongBlock = 64, kMinSplitRows = 32;
  const int64_t pairs = d.B * d.kvh;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t splits = d.T >= kLongBlock
                             ? std::clamp<int64_t>((4 * threads + pairs - 1) / pairs, 1, d.T / kMinSplitRows)
                             : std::clamp<int64_t>((threads + pairs - 1) / pairs, 1, d.T);
  const int64_t per = (d.T + splits - 1) / splits;
  jaxspec::parallel_for(pool, pairs * splits, 2, [&](int64_t i) {
    const int64_t pair = i / splits, t0 = (i % splits) * per, t1 = std::min(d.T, t0 + per);
    if (t0 < t1) attend(d, qp, kp, vp, lyr, pt, qs, kl, mk, kb, vb, causal, scale, op, pair / d.kvh, pair % d.kvh, t0, t1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxspecPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, T, H, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cache_k [L, P, ps, kvh, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // cache_v
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()   // page_table [B, max_pages]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // q_start [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_len [B]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // tree mask [B, T, T] (or [1,1,1] if causal)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_block [B, T, kvh, hd] (or [1] if none)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_block
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [B, T, H, hd]
                                  .Attr<float>("scale")
                                  .Attr<bool>("causal")
                                  .Attr<bool>("with_block"));
