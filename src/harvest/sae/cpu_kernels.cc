// CPU kernels for a TopK SAE's step (sae/cpu_kernels.py builds and loads them): each row's k largest of
// ReLU(pre + bias), the k chosen rows' dot products, and the scatter of their gradients, none of them through a
// [B, k, d] array (XLA:CPU writes one out for a gather feeding a reduction or a scatter, at memory speed, and runs
// its top-k and scatters on one thread). Threads: XLA's own intra-op pool.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Runs fn(lo, hi) over [0, n) in chunks of `grain`, taken in turn by this thread and by the pool's threads (as
// many as it has) that start while chunks are left. It waits only for helpers that took a chunk, never for a task
// still queued: XLA may call this from its pool's own threads (two devices at once), so waiting for a queued task
// could wait for itself. A helper that starts late finds no chunk and touches only the shared counters it owns.
template <typename F>
void parallel(ffi::ThreadPool& pool, int64_t n, int64_t grain, F fn) {
  struct Shared {
    std::atomic<int64_t> next{0};
    int64_t busy = 0;
    std::mutex mu;
    std::condition_variable idle;
  };
  auto shared = std::make_shared<Shared>();
  const int64_t chunks = (n + grain - 1) / grain;
  auto take = [chunks, n, grain](Shared& s, F& f) {
    for (int64_t c; (c = s.next.fetch_add(1)) < chunks;) f(c * grain, std::min(n, (c + 1) * grain));
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks - 1);
  for (int64_t h = 0; h < helpers; ++h) {
    pool.Schedule([shared, &fn, take, chunks] {
      {
        std::lock_guard<std::mutex> lock(shared->mu);
        if (shared->next.load() >= chunks) return;  // late: every chunk is taken, and fn may be gone
        ++shared->busy;
      }
      take(*shared, fn);
      std::lock_guard<std::mutex> lock(shared->mu);
      if (--shared->busy == 0) shared->idle.notify_all();
    });
  }
  take(*shared, fn);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->idle.wait(lock, [&] { return shared->busy == 0; });
}

// A candidate as one integer that sorts as lax.top_k orders: a value >= 0's bits sort as the value, and the
// complemented index puts the lower index first among equals.
inline uint64_t key_of(float v, int64_t i) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (static_cast<uint64_t>(bits) << 32) | static_cast<uint32_t>(~static_cast<uint32_t>(i));
}

constexpr int64_t kGroup = 16;

// One row's k largest of ReLU(pre + bias), in lax.top_k's order. A first pass takes each group of 16 values' largest:
// the k-th largest of those is at most the row's k-th largest, so only the groups whose largest reaches it are looked
// at again, their values kept in a buffer of 2k that is cut back to its k best whenever it fills.
struct Scratch {
  std::vector<uint64_t> buf;
  std::vector<float> most, order;
};

void topk_row(const float* pre, const float* bias, int64_t n, int64_t k, Scratch& s, float* values,
              int32_t* indices) {
  std::vector<uint64_t>& buf = s.buf;
  std::vector<float>& most = s.most;
  const int64_t groups = n / kGroup;
  most.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    float m = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) m = std::max(m, pre[i] + bias[i]);
    most[g] = m;
  }
  float thr = -1.0f;  // a value passes when above it: every ReLU value does at first
  if (groups >= k) {
    std::vector<float>& order = s.order;
    order.assign(most.begin(), most.end());
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), std::greater<float>());
    if (order[k - 1] > 0.0f) thr = std::nextafter(order[k - 1], -1.0f);
  }
  buf.clear();
  auto take = [&](float v, int64_t i) {
    if (!(v > thr)) return;
    buf.push_back(key_of(v, i));
    if (static_cast<int64_t>(buf.size()) == 2 * k) {
      std::nth_element(buf.begin(), buf.begin() + (k - 1), buf.end(), std::greater<uint64_t>());
      buf.resize(k);
      const uint32_t bits = static_cast<uint32_t>(buf[k - 1] >> 32);
      std::memcpy(&thr, &bits, sizeof thr);
    }
  };
  auto relu = [](float v) { return v > 0.0f ? v : 0.0f; };  // -0.0 and NaN as 0
  for (int64_t g = 0; g < groups; ++g) {
    if (!(most[g] > thr)) continue;
    for (int64_t i = g * kGroup; i < (g + 1) * kGroup; ++i) take(relu(pre[i] + bias[i]), i);
  }
  for (int64_t i = groups * kGroup; i < n; ++i) take(relu(pre[i] + bias[i]), i);
  std::partial_sort(buf.begin(), buf.begin() + k, buf.end(), std::greater<uint64_t>());
  for (int64_t j = 0; j < k; ++j) {
    const uint32_t bits = static_cast<uint32_t>(buf[j] >> 32);
    std::memcpy(values + j, &bits, sizeof(float));
    indices[j] = static_cast<int32_t>(~static_cast<uint32_t>(buf[j]));
  }
}

ffi::Error TopKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> pre, ffi::Buffer<ffi::F32> bias,
                    ffi::ResultBuffer<ffi::F32> values, ffi::ResultBuffer<ffi::S32> indices) {
  auto dims = pre.dimensions();
  const int64_t rows = dims[0], n = dims[1], k = values->dimensions()[1];
  if (k > n || static_cast<int64_t>(bias.element_count()) != n || values->dimensions()[0] != rows)
    return ffi::Error::InvalidArgument("top-k: shapes do not agree (k at most the row, a bias per column)");
  const float* p = pre.typed_data();
  const float* b = bias.typed_data();
  float* v = values->typed_data();
  int32_t* ix = indices->typed_data();
  parallel(pool, rows, 16, [&](int64_t lo, int64_t hi) {
    Scratch scratch;
    scratch.buf.reserve(2 * k);
    for (int64_t r = lo; r < hi; ++r)
      topk_row(p + r * n, b, n, k, scratch, v + r * k, ix + r * k);
  });
  return ffi::Error::Success();
}

// The backward of decoded = sum_j values[b, j] W_dec[indices[b, j]] after values = TopK(ReLU(centred W_enc + b_enc)),
// given d_decoded [B, d] (and d_values [B, k]): for each chosen (b, j) with latent l,
//   g[b, j]      = (d_decoded[b] . W_dec[l] + d_values[b, j]) where values[b, j] > 0, else 0
//   d_W_dec[l]  += values[b, j] d_decoded[b]
//   d_W_encT[l] += g[b, j] centred[b]      (W_enc's gradient, transposed: rows per latent)
//   d_b_enc[l]  += g[b, j]
// The pairs are bucketed by blocks of kLatents latents, so that a block's rows stay in cache while its pairs are
// added; each thread takes whole blocks and adds their pairs in (b, j) order: the same sums whatever the threads.
constexpr int64_t kLatents = 64;

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> indices, ffi::Buffer<ffi::F32> values,
                        ffi::Buffer<ffi::F32> d_values, ffi::Buffer<ffi::F32> d_decoded,
                        ffi::Buffer<ffi::F32> centred, ffi::Buffer<ffi::F32> w_dec, ffi::ResultBuffer<ffi::F32> g,
                        ffi::ResultBuffer<ffi::F32> d_w_dec, ffi::ResultBuffer<ffi::F32> d_rows_enc,
                        ffi::ResultBuffer<ffi::F32> d_b_enc) {
  const int64_t b = indices.dimensions()[0], k = indices.dimensions()[1], d = centred.dimensions()[1];
  const int64_t n = w_dec.dimensions()[0], pairs = b * k;
  const auto count = [](auto& buffer) { return static_cast<int64_t>(buffer.element_count()); };
  if (count(values) != pairs || count(d_values) != pairs || w_dec.dimensions()[1] != d ||
      d_decoded.dimensions()[0] != b || d_decoded.dimensions()[1] != d || centred.dimensions()[0] != b)
    return ffi::Error::InvalidArgument("backward: shapes do not agree");
  const int32_t* ix = indices.typed_data();
  for (int64_t p = 0; p < pairs; ++p)
    if (ix[p] < 0 || ix[p] >= n) return ffi::Error::InvalidArgument("a latent index is outside the SAE");
  const int64_t blocks = (n + kLatents - 1) / kLatents;
  std::vector<int64_t> start(blocks + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++start[ix[p] / kLatents + 1];
  for (int64_t c = 0; c < blocks; ++c) start[c + 1] += start[c];
  std::vector<int32_t> order(pairs);
  {
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[at[ix[p] / kLatents]++] = static_cast<int32_t>(p);
  }
  const float *v = values.typed_data(), *dv = d_values.typed_data(), *e = d_decoded.typed_data();
  const float *c = centred.typed_data(), *w = w_dec.typed_data();
  float *go = g->typed_data(), *gd = d_w_dec->typed_data(), *ge = d_rows_enc->typed_data(), *gb = d_b_enc->typed_data();
  parallel(pool, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t block = lo; block < hi; ++block) {
      const int64_t first = block * kLatents, last = std::min(n, first + kLatents);
      std::memset(gd + first * d, 0, sizeof(float) * (last - first) * d);
      std::memset(ge + first * d, 0, sizeof(float) * (last - first) * d);
      std::memset(gb + first, 0, sizeof(float) * (last - first));
      for (int64_t q = start[block]; q < start[block + 1]; ++q) {
        const int64_t p = order[q], l = ix[p], row = p / k;
        const float* er = e + row * d;
        const float* cr = c + row * d;
        const float* wr = w + l * d;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < d; ++i) dot += er[i] * wr[i];
        const float gp = v[p] > 0.0f ? dot + dv[p] : 0.0f;
        go[p] = gp;
        const float vp = v[p];
        float* od = gd + l * d;
        float* oe = ge + l * d;
        for (int64_t i = 0; i < d; ++i) {
          od[i] += vp * er[i];
          oe[i] += gp * cr[i];
        }
        gb[l] += gp;
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HarvestTopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(HarvestBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
