// GroupNorm (Wu & He, ECCV 2018), optionally followed by a ReLU, forward and backward on CPU,
// exposed to XLA as FFI handlers. Built on first use by fedjax_rcl/nn/onednn.py together with
// the convolutions; fedjax_rcl/nn/group_norm.py calls it.
//
// Why: XLA:CPU reduces through YNNPACK fusions that read materialised inputs, so the
// differentiated GroupNorm writes and rereads the activation about ten times (the ReLU mask,
// the product dy * xhat, four reductions, the input gradient). These kernels make the passes
// PyTorch's native kernels make: forward, one pass for the statistics and one for the output;
// backward, one pass for two per-channel sums and one for the input gradient.
//
// Layout: x is [N, S, C] (JAX's NHWC with the positions flattened); channel c belongs to group
// c / (C / G). float32 data. Statistics: sum x and sum x^2 accumulated in double (the one-pass
// variance keeps float32's precision unless |mean| / sd exceeds about 1e4). Backward sums: in
// float over blocks of 64 positions, then in double, of dy and dy * (x - mean). Samples run in
// parallel (OpenMP) and per-sample partial sums are combined in a fixed order, so the results do
// not depend on the number of threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;  // positions summed in float before adding into double

struct Shape {
  int64_t n, s, c, g, cg;  // samples, positions, channels, groups, channels per group
};

ffi::Error MakeShape(const ffi::Buffer<ffi::F32>& x, int64_t groups, Shape* out) {
  auto dims = x.dimensions();
  if (dims.size() < 2 || groups <= 0 || dims.back() % groups != 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "group_norm: x must be [N, ..., C] with C divisible by the groups");
  }
  Shape sh{dims.front(), 1, dims.back(), groups, dims.back() / groups};
  for (size_t i = 1; i + 1 < dims.size(); ++i) sh.s *= dims[i];
  *out = sh;
  return ffi::Error::Success();
}

// Per-channel values of sample n: the output is (x - mu[c]) * a[c] + beta[c], mu[c] the
// group's mean (centred first, as the two-pass formula, so a large mean cancels exactly).
void Affine(const Shape& sh, const float* gamma, const float* mean, const float* rstd,
            int64_t n, float* a, float* mu) {
  for (int64_t c = 0; c < sh.c; ++c) {
    const int64_t k = n * sh.g + c / sh.cg;
    a[c] = rstd[k] * gamma[c];
    mu[c] = mean[k];
  }
}

// The gradient reaching the normalised value: dy, or dy where the ReLU let it through
// (the same test as the forward's max((x - mu) * a + b, 0)).
template <bool kRelu>
inline float Through(float x, float dy, float mu, float a, float b) {
  const bool open = !kRelu || (x - mu) * a + b > 0.0f;
  return open ? dy : 0.0f;
}

// One position's contribution to sum d and sum d * (x - mu), per channel.
template <bool kRelu>
void SumsRow(int64_t c, const float* __restrict x, const float* __restrict dy,
             const float* __restrict a, const float* __restrict b, const float* __restrict mu,
             float* __restrict s1, float* __restrict s2) {
  for (int64_t i = 0; i < c; ++i) {
    const float d = Through<kRelu>(x[i], dy[i], mu[i], a[i], b[i]);
    s1[i] += d;
    s2[i] += d * (x[i] - mu[i]);
  }
}

// One position's input gradient: dx = coef d + p (x - mu) + q.
template <bool kRelu>
void GradRow(int64_t c, const float* __restrict x, const float* __restrict dy,
             const float* __restrict a, const float* __restrict b, const float* __restrict mu,
             const float* __restrict coef, const float* __restrict p,
             const float* __restrict q, float* __restrict dx) {
  for (int64_t i = 0; i < c; ++i) {
    dx[i] = coef[i] * Through<kRelu>(x[i], dy[i], mu[i], a[i], b[i]) + p[i] * (x[i] - mu[i]) +
            q[i];
  }
}

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> gamma,
                       ffi::Buffer<ffi::F32> beta, ffi::ResultBuffer<ffi::F32> y,
                       ffi::ResultBuffer<ffi::F32> mean, ffi::ResultBuffer<ffi::F32> rstd,
                       int64_t groups, double epsilon, int64_t relu) {
  Shape sh;
  if (auto e = MakeShape(x, groups, &sh); e.failure()) return e;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  float* mp = mean->typed_data();
  float* rp = rstd->typed_data();
#pragma omp parallel
  {
    std::vector<double> s1(sh.c), s2(sh.c);
    std::vector<float> a(sh.c), mu(sh.c);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < sh.n; ++n) {
      const float* xn = xp + n * sh.s * sh.c;
      std::fill(s1.begin(), s1.end(), 0.0);
      std::fill(s2.begin(), s2.end(), 0.0);
      for (int64_t s = 0; s < sh.s; ++s) {
        const float* row = xn + s * sh.c;
        for (int64_t c = 0; c < sh.c; ++c) {
          const double v = row[c];
          s1[c] += v;
          s2[c] += v * v;
        }
      }
      const double m = static_cast<double>(sh.s * sh.cg);
      for (int64_t g = 0; g < sh.g; ++g) {
        double t1 = 0, t2 = 0;
        for (int64_t c = g * sh.cg; c < (g + 1) * sh.cg; ++c) {
          t1 += s1[c];
          t2 += s2[c];
        }
        const double mu_g = t1 / m;
        const double var = std::max(t2 / m - mu_g * mu_g, 0.0);
        mp[n * sh.g + g] = static_cast<float>(mu_g);
        rp[n * sh.g + g] = static_cast<float>(1.0 / std::sqrt(var + epsilon));
      }
      Affine(sh, gamma.typed_data(), mp, rp, n, a.data(), mu.data());
      const float* b = beta.typed_data();
      float* yn = yp + n * sh.s * sh.c;
      for (int64_t s = 0; s < sh.s; ++s) {
        const float* row = xn + s * sh.c;
        float* out = yn + s * sh.c;
        if (relu) {
          for (int64_t c = 0; c < sh.c; ++c) {
            out[c] = std::max((row[c] - mu[c]) * a[c] + b[c], 0.0f);
          }
        } else {
          for (int64_t c = 0; c < sh.c; ++c) out[c] = (row[c] - mu[c]) * a[c] + b[c];
        }
      }
    }
  }
  return ffi::Error::Success();
}

// With d the gradient reaching the normalised value and xhat = (x - mean) * rstd:
// dx = rstd (gamma d - mean_g - xhat mean_gx), mean_g = sum_c gamma_c sum d / M and
// mean_gx = sum_c gamma_c sum d xhat / M over the group; dgamma = sum d xhat, dbeta = sum d.
ffi::Error BackwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                        ffi::Buffer<ffi::F32> gamma, ffi::Buffer<ffi::F32> beta,
                        ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd,
                        ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dgamma,
                        ffi::ResultBuffer<ffi::F32> dbeta, int64_t groups, int64_t relu) {
  Shape sh;
  if (auto e = MakeShape(x, groups, &sh); e.failure()) return e;
  const float* xp = x.typed_data();
  const float* dyp = dy.typed_data();
  const float* gp = gamma.typed_data();
  const float* mp = mean.typed_data();
  const float* rp = rstd.typed_data();
  float* dxp = dx->typed_data();
  // Per sample and channel: sum d and sum d xhat (combined over samples in order below).
  std::vector<double> sum_d(sh.n * sh.c), sum_d_xhat(sh.n * sh.c);
#pragma omp parallel
  {
    std::vector<float> a(sh.c), mu(sh.c), t1(sh.c), t2(sh.c), coef(sh.c), p(sh.c), q(sh.c);
    const float* b = beta.typed_data();
    std::vector<double> s1(sh.c), s2(sh.c);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < sh.n; ++n) {
      Affine(sh, gp, mp, rp, n, a.data(), mu.data());
      const float* xn = xp + n * sh.s * sh.c;
      const float* dyn = dyp + n * sh.s * sh.c;
      std::fill(s1.begin(), s1.end(), 0.0);
      std::fill(s2.begin(), s2.end(), 0.0);
      for (int64_t s0 = 0; s0 < sh.s; s0 += kBlock) {
        std::fill(t1.begin(), t1.end(), 0.0f);
        std::fill(t2.begin(), t2.end(), 0.0f);
        for (int64_t s = s0; s < std::min(s0 + kBlock, sh.s); ++s) {
          const float* xr = xn + s * sh.c;
          const float* dr = dyn + s * sh.c;
          if (relu) {
            SumsRow<true>(sh.c, xr, dr, a.data(), b, mu.data(), t1.data(), t2.data());
          } else {
            SumsRow<false>(sh.c, xr, dr, a.data(), b, mu.data(), t1.data(), t2.data());
          }
        }
        for (int64_t c = 0; c < sh.c; ++c) {
          s1[c] += t1[c];
          s2[c] += t2[c];
        }
      }
      const double m = static_cast<double>(sh.s * sh.cg);
      for (int64_t g = 0; g < sh.g; ++g) {
        const double r = rp[n * sh.g + g];
        double mean_g = 0, mean_gx = 0;
        for (int64_t c = g * sh.cg; c < (g + 1) * sh.cg; ++c) {
          const double sx = r * s2[c];  // sum d xhat
          sum_d[n * sh.c + c] = s1[c];
          sum_d_xhat[n * sh.c + c] = sx;
          mean_g += gp[c] * s1[c];
          mean_gx += gp[c] * sx;
        }
        mean_g /= m;
        mean_gx /= m;
        for (int64_t c = g * sh.cg; c < (g + 1) * sh.cg; ++c) {
          coef[c] = static_cast<float>(r * gp[c]);
          p[c] = static_cast<float>(-r * r * mean_gx);
          q[c] = static_cast<float>(-r * mean_g);
        }
      }
      float* dxn = dxp + n * sh.s * sh.c;
      for (int64_t s = 0; s < sh.s; ++s) {
        const float* xr = xn + s * sh.c;
        const float* dr = dyn + s * sh.c;
        float* out = dxn + s * sh.c;
        if (relu) {
          GradRow<true>(sh.c, xr, dr, a.data(), b, mu.data(), coef.data(), p.data(),
                        q.data(), out);
        } else {
          GradRow<false>(sh.c, xr, dr, a.data(), b, mu.data(), coef.data(), p.data(),
                         q.data(), out);
        }
      }
    }
  }
  float* dgp = dgamma->typed_data();
  float* dbp = dbeta->typed_data();
  for (int64_t c = 0; c < sh.c; ++c) {
    double tg = 0, tb = 0;
    for (int64_t n = 0; n < sh.n; ++n) {
      tg += sum_d_xhat[n * sh.c + c];
      tb += sum_d[n * sh.c + c];
    }
    dgp[c] = static_cast<float>(tg);
    dbp[c] = static_cast<float>(tb);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxGroupNormForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, ..., C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gamma [C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta [C]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y, x's shape
                                  .Ret<ffi::Buffer<ffi::F32>>()  // mean [N, G]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rstd [N, G]
                                  .Attr<int64_t>("groups")
                                  .Attr<double>("epsilon")
                                  .Attr<int64_t>("relu"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxGroupNormBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dy
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gamma
                                  .Arg<ffi::Buffer<ffi::F32>>()  // beta
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mean
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dgamma
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dbeta
                                  .Attr<int64_t>("groups")
                                  .Attr<int64_t>("relu"));
