// A convolution's bias, a ReLU and a max-pool over non-overlapping k x k windows, forward and
// backward in one pass each on CPU, exposed to XLA as FFI handlers. Built on first use by
// fedjax_rcl/nn/onednn.py with the convolutions; fedjax_rcl/nn/pool.py calls it.
//
// Why: after a convolution with few output channels (MOON's CNN: 6 and 16), XLA:CPU runs the
// bias, the ReLU and the pool as fusions that move 6- or 16-float pieces, at a quarter to a
// half of the memory's bandwidth, and the gradient as two more fusions (the tie counts, then
// the masked gradient) and a separate reduction for the bias's gradient. Here each image row
// pair is handled as whole rows: every step but two small gathers is a contiguous loop the
// compiler vectorises for the CPU it runs on (target_clones).
//
// Layout: y is the convolution's output without its bias, [N, H, W, C] (NHWC), float32; the
// pooled output p is [N, H / k, W / k, C] (floor: trailing rows and columns that do not fill a
// window are dropped, and get a zero gradient). Under vmap (clients side by side) the call
// takes them all at once: leading axes on y, p and b ([..., C]), each index with its own bias.
//   forward:  p = max over the window of max(y + b, 0)
//   backward: with z = y + b and r = max(z, 0), each position of a window whose r equals the
//             window's maximum p receives dp / (how many do), where z > 0; others 0 (JAX's
//             gradient of reduce_max after jax.nn.relu, so ties split equally). db = sum dy.
// Maxima propagate NaN as XLA's do. Samples run in parallel (OpenMP); the bias gradient is
// summed per sample in double and then over samples in order, so it does not depend on the
// number of threads.

#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FEDJAX_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FEDJAX_CLONES
#endif

// max(a, b), NaN if either is NaN (XLA's maximum).
inline float NanMax(float a, float b) { return (a > b || a != a) ? a : b; }

struct Geometry {
  int64_t n, h, w, c, k, ho, wo;
  int64_t per_bias;  // consecutive samples sharing one bias (a client's batch under vmap)
  int64_t row() const { return w * c; }         // floats in an input row
  int64_t used() const { return wo * k * c; }   // of them inside a window
  int64_t out_row() const { return wo * c; }    // floats in an output row
};

// y is [..., N, H, W, C] and b [..., C] with the same leading (vmap) axes: every leading index
// is a client with its own bias, whose N samples are consecutive.
ffi::Error MakeGeometry(const ffi::Buffer<ffi::F32>& y, const ffi::Buffer<ffi::F32>& b,
                        int64_t window, Geometry* g) {
  auto d = y.dimensions();
  const size_t r = d.size();
  if (r < 4 || window < 1 || b.dimensions().size() != r - 3 || b.dimensions().back() != d[r - 1]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "bias_relu_max_pool: y must be [..., N, H, W, C], b [..., C], window >= 1");
  }
  int64_t lead = 1;
  for (size_t i = 0; i + 4 < r; ++i) {
    if (b.dimensions()[i] != d[i]) {
      return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                        "bias_relu_max_pool: y and b must share their leading axes");
    }
    lead *= d[i];
  }
  *g = Geometry{lead * d[r - 4], d[r - 3], d[r - 2], d[r - 1], window, d[r - 3] / window,
                d[r - 2] / window, d[r - 4]};
  return ffi::Error::Success();
}

// The index table of an input row: wide[i] is the output position (j, c) that input column
// position i (< used) pools into.
std::vector<int32_t> WideTable(const Geometry& g) {
  std::vector<int32_t> wide(g.used());
  for (int64_t i = 0; i < g.used(); ++i) {
    wide[i] = static_cast<int32_t>((i / g.c) / g.k * g.c + i % g.c);
  }
  return wide;
}

// The index table of an output row: narrow[bb * out_row + q] is the input position of window
// column bb of output position q.
std::vector<int32_t> NarrowTable(const Geometry& g) {
  std::vector<int32_t> narrow(g.k * g.out_row());
  for (int64_t bb = 0; bb < g.k; ++bb) {
    for (int64_t q = 0; q < g.out_row(); ++q) {
      narrow[bb * g.out_row() + q] =
          static_cast<int32_t>(((q / g.c) * g.k + bb) * g.c + q % g.c);
    }
  }
  return narrow;
}

// A sample's bias tiled over a row of len positions (channels fastest): the bias of the
// client whose batch holds sample n (per_bias consecutive samples share one).
void TileBias(const Geometry& g, const float* bp, int64_t n, int64_t len, float* out) {
  const float* bc = bp + (n / g.per_bias) * g.c;
  for (int64_t i = 0; i < len; ++i) out[i] = bc[i % g.c];
}

FEDJAX_CLONES
void MaxRows(int64_t len, const float* __restrict a, float* __restrict t) {
  for (int64_t i = 0; i < len; ++i) t[i] = NanMax(t[i], a[i]);
}

// m[q] = max(m[q], t[cols[q]]): one column of the windows.
FEDJAX_CLONES
void MaxColumn(int64_t len, const float* __restrict t, const int32_t* __restrict cols,
               float* __restrict m) {
  for (int64_t q = 0; q < len; ++q) m[q] = NanMax(m[q], t[cols[q]]);
}

// p = max(m + b, 0): bias and ReLU once on the window's maximum (both monotone, so the same
// float as the maximum of max(y + b, 0)).
FEDJAX_CLONES
void BiasRelu(int64_t len, const float* __restrict m, const float* __restrict bias_out,
              float* __restrict p) {
  for (int64_t q = 0; q < len; ++q) p[q] = NanMax(m[q] + bias_out[q], 0.0f);
}

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> b,
                       ffi::ResultBuffer<ffi::F32> p, int64_t window) {
  Geometry g;
  if (auto e = MakeGeometry(y, b, window, &g); e.failure()) return e;
  const std::vector<int32_t> narrow = NarrowTable(g);
  const float* yp = y.typed_data();
  const float* bp = b.typed_data();
  float* pp = p->typed_data();
#pragma omp parallel
  {
    std::vector<float> t(g.used()), m(g.out_row()), bias_out(g.out_row());
    int64_t client = -1;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.n; ++n) {
      if (n / g.per_bias != client) {  // this sample's bias, tiled over an output row
        client = n / g.per_bias;
        TileBias(g, bp, n, g.out_row(), bias_out.data());
      }
      for (int64_t i = 0; i < g.ho; ++i) {
        const float* rows = yp + ((n * g.h) + i * g.k) * g.row();
        std::copy(rows, rows + g.used(), t.begin());
        for (int64_t a = 1; a < g.k; ++a) MaxRows(g.used(), rows + a * g.row(), t.data());
        for (int64_t q = 0; q < g.out_row(); ++q) m[q] = t[narrow[q]];
        for (int64_t bb = 1; bb < g.k; ++bb) {
          MaxColumn(g.out_row(), t.data(), narrow.data() + bb * g.out_row(), m.data());
        }
        BiasRelu(g.out_row(), m.data(), bias_out.data(), pp + (n * g.ho + i) * g.out_row());
      }
    }
  }
  return ffi::Error::Success();
}

// One input row of a window row: z = y + b; hit = (max(z, 0) == the window's maximum), counted
// into cnt.
FEDJAX_CLONES
void Hits(int64_t len, const float* __restrict y, const float* __restrict bias_in,
          const float* __restrict pmax, float* __restrict hit, float* __restrict cnt) {
  for (int64_t i = 0; i < len; ++i) {
    const float r = NanMax(y[i] + bias_in[i], 0.0f);
    const float h = r == pmax[i] ? 1.0f : 0.0f;
    hit[i] = h;
    cnt[i] += h;
  }
}

// c[q] += cnt[cols[q]]: one column of the windows' counts.
FEDJAX_CLONES
void AddColumn(int64_t len, const float* __restrict cnt, const int32_t* __restrict cols,
               float* __restrict c) {
  for (int64_t q = 0; q < len; ++q) c[q] += cnt[cols[q]];
}

FEDJAX_CLONES
void Divide(int64_t len, const float* __restrict dp, const float* __restrict c,
            float* __restrict share) {
  for (int64_t q = 0; q < len; ++q) share[q] = dp[q] / c[q];
}

FEDJAX_CLONES
void Expand(int64_t len, const int32_t* __restrict wide, const float* __restrict narrow_row,
            float* __restrict out) {
  for (int64_t i = 0; i < len; ++i) out[i] = narrow_row[wide[i]];
}

// dy = share where the position is a maximum and z > 0, else 0; summed into acc.
FEDJAX_CLONES
void Grad(int64_t len, const float* __restrict y, const float* __restrict bias_in,
          const float* __restrict hit, const float* __restrict share, float* __restrict dy,
          float* __restrict acc) {
  for (int64_t i = 0; i < len; ++i) {
    const float d = (hit[i] != 0.0f && y[i] + bias_in[i] > 0.0f) ? share[i] : 0.0f;
    dy[i] = d;
    acc[i] += d;
  }
}

ffi::Error BackwardImpl(ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> b,
                        ffi::Buffer<ffi::F32> p, ffi::Buffer<ffi::F32> dp,
                        ffi::ResultBuffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> db,
                        int64_t window) {
  Geometry g;
  if (auto e = MakeGeometry(y, b, window, &g); e.failure()) return e;
  const std::vector<int32_t> wide = WideTable(g), narrow = NarrowTable(g);
  const float* bp = b.typed_data();
  const float* yp = y.typed_data();
  const float* pp = p.typed_data();
  const float* dpp = dp.typed_data();
  float* dyp = dy->typed_data();
  std::vector<double> sums(g.n * g.c, 0.0);  // per sample and channel: sum dy
#pragma omp parallel
  {
    std::vector<float> pmax(g.used()), hits(g.k * g.used()), cnt(g.used()),
        count(g.out_row()), share(g.out_row()), wide_share(g.used()), acc(g.used()),
        bias_in(g.used());
    int64_t client = -1;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < g.n; ++n) {
      if (n / g.per_bias != client) {  // this sample's bias, tiled over an input row
        client = n / g.per_bias;
        TileBias(g, bp, n, g.used(), bias_in.data());
      }
      float* dyn = dyp + n * g.h * g.row();
      std::fill(dyn, dyn + g.h * g.row(), 0.0f);  // trailing rows and columns stay 0
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t i = 0; i < g.ho; ++i) {
        const int64_t out = (n * g.ho + i) * g.out_row();
        Expand(g.used(), wide.data(), pp + out, pmax.data());
        std::fill(cnt.begin(), cnt.end(), 0.0f);
        for (int64_t a = 0; a < g.k; ++a) {
          const float* yr = yp + (n * g.h + i * g.k + a) * g.row();
          Hits(g.used(), yr, bias_in.data(), pmax.data(), hits.data() + a * g.used(),
               cnt.data());
        }
        std::fill(count.begin(), count.end(), 0.0f);
        for (int64_t bb = 0; bb < g.k; ++bb) {
          AddColumn(g.out_row(), cnt.data(), narrow.data() + bb * g.out_row(), count.data());
        }
        Divide(g.out_row(), dpp + out, count.data(), share.data());
        Expand(g.used(), wide.data(), share.data(), wide_share.data());
        for (int64_t a = 0; a < g.k; ++a) {
          const int64_t r = (n * g.h + i * g.k + a) * g.row();
          Grad(g.used(), yp + r, bias_in.data(), hits.data() + a * g.used(),
               wide_share.data(), dyp + r, acc.data());
        }
      }
      double* s = sums.data() + n * g.c;
      for (int64_t i = 0; i < g.used(); ++i) s[i % g.c] += acc[i];
    }
  }
  float* dbp = db->typed_data();
  for (int64_t client = 0; client < g.n / g.per_bias; ++client) {
    for (int64_t c = 0; c < g.c; ++c) {
      double t = 0;
      for (int64_t n = client * g.per_bias; n < (client + 1) * g.per_bias; ++n) {
        t += sums[n * g.c + c];
      }
      dbp[client * g.c + c] = static_cast<float>(t);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxBiasReluMaxPoolForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y [..., N, H, W, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b [..., C]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // p [..., N, H/k, W/k, C]
                                  .Attr<int64_t>("window"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxBiasReluMaxPoolBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Arg<ffi::Buffer<ffi::F32>>()  // p (the forward's)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dp
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dy, y's shape
                                  .Ret<ffi::Buffer<ffi::F32>>()  // db, b's shape
                                  .Attr<int64_t>("window"));
