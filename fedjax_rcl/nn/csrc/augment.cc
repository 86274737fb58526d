// The training augmentation of fedjax_rcl/data/augment.py (rotation, padded crop, flip, then
// normalisation) as one CPU pass over the output images, exposed to XLA as an FFI handler.
// Built on first use by fedjax_rcl/nn/onednn.py with the convolutions; augment.py calls it.
//
// Why: XLA:CPU compiles the composed inverse map and the normalisation as one gather fusion
// that computes the source coordinate again for every channel of every pixel and reads one byte
// at a time; on a small CNN's round that is about a tenth of the time. Here the coordinates of
// a row of pixels are computed eight at a time (AVX2), each pixel's channels are copied as a
// unit, and the row is normalised by a loop the compiler vectorises.
//
// The images are bitwise those of XLA's gather (a test compares them): the per-sample draws and
// the rotation's cosine and sine come from augment.py's XLA code, and the float32 arithmetic is
// the one XLA:CPU compiles for the same expressions, multiply-adds fused as it fuses them:
//   r = round(fma(sin, dv, cos * du) + cy),   c = round(fma(cos, dv, -sin * du) + cx)
//   out[..., k] = fma(byte, 1/255, -mean[k]) * (1/std[k])     (the zero fill: byte 0)
// with rounding half to even, du = u - cy and dv = v - cx the output pixel's position (after
// flip, crop offset and reflection) about the centre cy = (H-1)/2, cx = (W-1)/2, and 1/255,
// 1/std as XLA folds its divisions by constants (float32 reciprocals, passed in).
//
// Compiled twice, with hardware fused multiply-adds (AVX2 and FMA) and without (std::fma a
// library call, the same floats); the first where the CPU has them, unless the environment
// variable FEDJAX_AUGMENT_ISA is "baseline" (the tests run both).
//
// Layout: images uint8 [..., N, H, W, C] (NHWC); per sample cos, sin (float32), the crop
// offsets oy, ox and the flip (int32), each [..., N]; the output float32 [..., N, H, W, C].
// Leading (vmap) axes are flattened: samples are independent. Samples run in parallel (OpenMP).

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__GNUC__)
#define FEDJAX_INLINE __attribute__((always_inline)) inline
#else
#define FEDJAX_INLINE inline
#endif

// One sample's draws: the rotation's cosine and sine, the crop's offsets, the flip.
struct Draws {
  float cos, sin;
  int32_t oy, ox, flip;
};

struct Geometry {
  int64_t h, w, c, pad;
  bool reflect;
};

// numpy.pad(mode="reflect")'s index for i in [-n + 1, 2n - 2].
FEDJAX_INLINE int64_t Reflect(int64_t i, int64_t n) {
  i = i < 0 ? -i : i;
  return i > n - 1 ? 2 * (n - 1) - i : i;
}

// Round half to even, as XLA's round-nearest-even: the conversion under the default rounding
// mode (exact for the small coordinates here).
FEDJAX_INLINE int32_t RoundEven(float x) {
#if defined(__x86_64__)
  return _mm_cvtss_si32(_mm_set_ss(x));
#else
  return static_cast<int32_t>(std::nearbyint(x));
#endif
}

// Output row y's sources: for each x the byte offset of its source pixel in the image, or -1
// (the zero fill). kAvx2: eight pixels at a time (the same operations lane by lane; the
// conversion rounds as RoundEven does), in functions compiled for AVX2 with FMA.
struct RowGeometry {
  float cy, cx, cos_du, neg_sin_du;
  int64_t u;
  bool row_in;
};

FEDJAX_INLINE RowGeometry RowOf(const Draws& s, const Geometry& g, int64_t y) {
  RowGeometry r;
  r.cy = static_cast<float>((g.h - 1) / 2.0);
  r.cx = static_cast<float>((g.w - 1) / 2.0);
  r.u = y + s.oy - g.pad;
  if (g.reflect) r.u = Reflect(r.u, g.h);
  r.row_in = r.u >= 0 && r.u < g.h;
  const float du = static_cast<float>(r.u) - r.cy;
  r.cos_du = s.cos * du;
  r.neg_sin_du = -s.sin * du;
  return r;
}

#if defined(__x86_64__) && defined(__GNUC__)
// Pixels [0, 8 * floor(w / 8)) of a row whose source row is inside the image.
__attribute__((target("avx2,fma"))) int64_t RowSourcesAvx2(
    const Draws& s, const Geometry& g, const RowGeometry& row, int32_t* src) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i minus1 = _mm256_set1_epi32(-1);
  const __m256i hv = _mm256_set1_epi32(static_cast<int32_t>(g.h));
  const __m256i wv = _mm256_set1_epi32(static_cast<int32_t>(g.w));
  const __m256i cv = _mm256_set1_epi32(static_cast<int32_t>(g.c));
  const __m256i shift = _mm256_set1_epi32(static_cast<int32_t>(s.ox - g.pad));
  const __m256i last2 = _mm256_set1_epi32(static_cast<int32_t>(2 * (g.w - 1)));
  const __m256 sin = _mm256_set1_ps(s.sin), cos = _mm256_set1_ps(s.cos);
  const __m256 a_r = _mm256_set1_ps(row.cos_du), a_q = _mm256_set1_ps(row.neg_sin_du);
  const __m256 cyv = _mm256_set1_ps(row.cy), cxv = _mm256_set1_ps(row.cx);
  int64_t x = 0;
  for (; x + 8 <= g.w; x += 8) {
    __m256i xi = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(x)), lane);
    if (s.flip) xi = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int32_t>(g.w - 1)), xi);
    __m256i v = _mm256_add_epi32(xi, shift);
    if (g.reflect) {  // numpy's reflection for i in [-n + 1, 2n - 2]: min(|i|, 2(n - 1) - |i|)
      v = _mm256_abs_epi32(v);
      v = _mm256_min_epi32(v, _mm256_sub_epi32(last2, v));
    }
    const __m256 dv = _mm256_sub_ps(_mm256_cvtepi32_ps(v), cxv);
    const __m256i r = _mm256_cvtps_epi32(_mm256_add_ps(_mm256_fmadd_ps(sin, dv, a_r), cyv));
    const __m256i q = _mm256_cvtps_epi32(_mm256_add_ps(_mm256_fmadd_ps(cos, dv, a_q), cxv));
    // 0 <= i < n for v, r and q, as i > -1 and n > i.
    __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(v, minus1), _mm256_cmpgt_epi32(wv, v));
    ok = _mm256_and_si256(ok, _mm256_and_si256(_mm256_cmpgt_epi32(r, minus1),
                                               _mm256_cmpgt_epi32(hv, r)));
    ok = _mm256_and_si256(ok, _mm256_and_si256(_mm256_cmpgt_epi32(q, minus1),
                                               _mm256_cmpgt_epi32(wv, q)));
    const __m256i off = _mm256_mullo_epi32(_mm256_add_epi32(_mm256_mullo_epi32(r, wv), q), cv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(src + x), _mm256_blendv_epi8(minus1, off, ok));
  }
  return x;
}
#endif

template <bool kAvx2>
FEDJAX_INLINE void RowSources(const Draws& s, const Geometry& g, int64_t y, int32_t* src) {
  const RowGeometry row = RowOf(s, g, y);
  int64_t x = 0;
#if defined(__x86_64__) && defined(__GNUC__)
  if constexpr (kAvx2) {
    if (row.row_in) x = RowSourcesAvx2(s, g, row, src);
  }
#endif
  for (; x < g.w; ++x) {
    int64_t v = (s.flip ? g.w - 1 - x : x) + s.ox - g.pad;
    if (g.reflect) v = Reflect(v, g.w);
    const float dv = static_cast<float>(v) - row.cx;
    const int32_t r = RoundEven(std::fma(s.sin, dv, row.cos_du) + row.cy);
    const int32_t q = RoundEven(std::fma(s.cos, dv, row.neg_sin_du) + row.cx);
    const bool ok = row.row_in && v >= 0 && v < g.w && r >= 0 && r < g.h && q >= 0 && q < g.w;
    src[x] = ok ? static_cast<int32_t>((r * g.w + q) * g.c) : -1;
  }
}

// Per-row constants of the normalisation: each output float's channel's -mean and 1/std, and
// a row of gathered bytes.
struct RowScratch {
  std::vector<float> neg_mean, inv_std;
  std::vector<uint8_t> bytes;
  std::vector<int32_t> src;
  RowScratch(const Geometry& g, const float* neg_mean_c, const float* inv_std_c)
      : neg_mean(g.w * g.c), inv_std(g.w * g.c), bytes(g.w * g.c), src(g.w) {
    for (int64_t j = 0; j < g.w * g.c; ++j) {
      neg_mean[j] = neg_mean_c[j % g.c];
      inv_std[j] = inv_std_c[j % g.c];
    }
  }
};

// One sample, row by row: each pixel's source bytes (0 for the zero fill) gathered into a row,
// then the row normalised, out = fma(byte, 1/255, -mean) * (1/std), a loop the compiler
// vectorises.
template <bool kAvx2, int kC>
FEDJAX_INLINE void AugmentSample(const uint8_t* __restrict image, const Draws& s,
                                 const Geometry& g, float inv_255, RowScratch& row,
                                 float* __restrict out) {
  const int64_t c = kC > 0 ? kC : g.c;
  const int64_t len = g.w * c;
  uint8_t* __restrict bytes = row.bytes.data();
  const float* __restrict nm = row.neg_mean.data();
  const float* __restrict is = row.inv_std.data();
  for (int64_t y = 0; y < g.h; ++y) {
    RowSources<kAvx2>(s, g, y, row.src.data());
    for (int64_t x = 0; x < g.w; ++x) {
      const int32_t from = row.src[x];
      for (int64_t k = 0; k < c; ++k) bytes[x * c + k] = from >= 0 ? image[from + k] : 0;
    }
    float* __restrict o = out + y * len;
    for (int64_t j = 0; j < len; ++j) {
      o[j] = std::fma(static_cast<float>(bytes[j]), inv_255, nm[j]) * is[j];
    }
  }
}

template <bool kAvx2, int kC>
FEDJAX_INLINE void AugmentRange(const uint8_t* ip, const Draws* draws, const Geometry& g,
                                const float* neg_mean, const float* inv_std, float inv_255,
                                float* op, int64_t begin, int64_t end) {
  const int64_t size = g.h * g.w * g.c;
  RowScratch row(g, neg_mean, inv_std);
  for (int64_t i = begin; i < end; ++i) {
    AugmentSample<kAvx2, kC>(ip + i * size, draws[i], g, inv_255, row, op + i * size);
  }
}

// The samples [begin, end), compiled twice: with hardware fused multiply-adds (x86-64 with FMA,
// where std::fma is one instruction) and without (std::fma a library call); the same floats.
#define FEDJAX_AUGMENT_RANGE(name, avx2, attrs)                                                 \
  attrs void name(const uint8_t* ip, const Draws* draws, const Geometry& g,                     \
                  const float* neg_mean, const float* inv_std, float inv_255, float* op,        \
                  int64_t begin, int64_t end) {                                                 \
    if (g.c == 3) {                                                                             \
      return AugmentRange<avx2, 3>(ip, draws, g, neg_mean, inv_std, inv_255, op, begin, end);   \
    }                                                                                           \
    AugmentRange<avx2, 0>(ip, draws, g, neg_mean, inv_std, inv_255, op, begin, end);            \
  }
#if defined(__x86_64__) && defined(__GNUC__)
FEDJAX_AUGMENT_RANGE(AugmentSamplesFma, true, __attribute__((target("avx2,fma"))))
#endif
FEDJAX_AUGMENT_RANGE(AugmentSamplesPlain, false, )

bool HasFma() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = [] {
    const char* cap = std::getenv("FEDJAX_AUGMENT_ISA");
    if (cap != nullptr && std::string(cap) == "baseline") return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return has;
#else
  return false;
#endif
}

ffi::Error AugmentImpl(ffi::Buffer<ffi::U8> images, ffi::Buffer<ffi::F32> cos,
                       ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::S32> oy,
                       ffi::Buffer<ffi::S32> ox, ffi::Buffer<ffi::S32> flip,
                       ffi::ResultBuffer<ffi::F32> out, ffi::Span<const float> neg_mean,
                       ffi::Span<const float> inv_std, float inv_255, int64_t pad,
                       int64_t reflect) {
  auto d = images.dimensions();
  const size_t rank = d.size();
  if (rank < 4) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "augment_images: images must be [..., N, H, W, C]");
  }
  const Geometry g{d[rank - 3], d[rank - 2], d[rank - 1], pad, reflect != 0};
  const int64_t size = g.h * g.w * g.c;
  const int64_t n = size ? images.element_count() / size : 0;
  if (cos.element_count() != n || sin.element_count() != n || oy.element_count() != n ||
      ox.element_count() != n || flip.element_count() != n ||
      static_cast<int64_t>(neg_mean.size()) != g.c ||
      static_cast<int64_t>(inv_std.size()) != g.c) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "augment_images: one cos, sin, oy, ox and flip per sample, one mean and "
                      "std per channel");
  }
  std::vector<Draws> draws(n);
  const float *cp = cos.typed_data(), *sp = sin.typed_data();
  const int32_t *oyp = oy.typed_data(), *oxp = ox.typed_data(), *fp = flip.typed_data();
  for (int64_t i = 0; i < n; ++i) draws[i] = Draws{cp[i], sp[i], oyp[i], oxp[i], fp[i]};
  const uint8_t* ip = images.typed_data();
  float* op = out->typed_data();
  const bool fma = HasFma();
#pragma omp parallel
  {
#if defined(_OPENMP)
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
    const int64_t t = 0, threads = 1;
#endif
    const int64_t begin = n * t / threads, end = n * (t + 1) / threads;
#if defined(__x86_64__) && defined(__GNUC__)
    if (fma) {
      AugmentSamplesFma(ip, draws.data(), g, neg_mean.begin(), inv_std.begin(), inv_255, op,
                        begin, end);
    } else {
      AugmentSamplesPlain(ip, draws.data(), g, neg_mean.begin(), inv_std.begin(), inv_255, op,
                          begin, end);
    }
#else
    AugmentSamplesPlain(ip, draws.data(), g, neg_mean.begin(), inv_std.begin(), inv_255, op,
                        begin, end);
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxAugmentImages, AugmentImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()   // images [..., N, H, W, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // cos [..., N]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // sin [..., N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // oy [..., N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ox [..., N]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // flip [..., N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out, images' shape
                                  .Attr<ffi::Span<const float>>("neg_mean")
                                  .Attr<ffi::Span<const float>>("inv_std")
                                  .Attr<float>("inv_255")
                                  .Attr<int64_t>("pad")
                                  .Attr<int64_t>("reflect"));
