// A stride-1 2-D convolution with few output channels (at most 8) and narrow output rows (at
// most 32 positions), with the image's positions in the vector lanes: CPU, float32, exposed to
// XLA as an FFI handler. Built on first use by fedjax_rcl/nn/onednn.py with the convolutions;
// fedjax_rcl/nn/narrow_conv.py calls it.
//
// Why: a direct convolution kernel that puts channels in the vector lanes (oneDNN's, for NHWC)
// leaves most lanes empty when a layer has 6 output channels (MOON's CNN: the first layer's
// forward, and the second layer's input gradient, a convolution with 6 output channels). Here
// each output row of each output channel is one or two 16-float vectors of positions: for an
// output row, the accumulators of every output channel stay in registers while the taps
// (input channel, kernel row, kernel column) stream past as shifted loads of the input row and
// broadcasts of one kernel value. The product [Cout, K] x [K, positions], formed in registers,
// never as a patch matrix in memory.
//
// Layout: x [..., N, H, W, Cin] (NHWC), w [..., KH, KW, I, O] (HWIO), y [..., N, OH, OW, Cout];
// zero padding pad_top / pad_left, the bottom and right padding implied by y's size.
//   forward (flip = 0):
//     y[n, i, j, o] = sum_{c, a, b} xpad[n, i + a, j + b, c] w[a, b, c, o]   (Cin = I)
//   input gradient (flip = 1):
//     y[n, i, j, c] = sum_{o, a, b} xpad[n, i + a, j + b, o] w[KH-1-a, KW-1-b, c, o]
//     (Cin = O, Cout = I): with x the output gradient of a stride-1 convolution by w and
//     padding KH-1-pt, KW-1-pl, this is that convolution's input gradient.
// Under jax.vmap (clients side by side) the call takes them all (vmap_method="expand_dims"):
// x, w and y have the same leading axes, x's and w's each the result's size or 1 (shared).
// Each output is summed over its taps in one fixed order (input channel, kernel row, kernel
// column), whatever the thread count or the batch; samples run in parallel (OpenMP).

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FEDJAX_X86 1
#define FEDJAX_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FEDJAX_X86 0
#define FEDJAX_CLONES
#endif
#define FEDJAX_INLINE __attribute__((always_inline)) inline

constexpr int kMaxCout = 8;  // output channels whose accumulators a tile keeps (AVX-512)
constexpr int kMaxWidth = 32;  // output positions a row

// L floats in one vector register: 16 (AVX-512), 8 (AVX2), 4 (SSE2, the x86-64 baseline).
template <int L>
struct VecOf {
  typedef float type __attribute__((vector_size(L * sizeof(float))));
};

template <int L>
FEDJAX_INLINE typename VecOf<L>::type LoadU(const float* p) {
  typename VecOf<L>::type v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int L>
FEDJAX_INLINE void StoreU(float* p, typename VecOf<L>::type v) {
  std::memcpy(p, &v, sizeof v);
}

// One sample's convolution: the input as planes [cin][hp][wp], zero-padded, each row long
// enough for every vector load; the kernel as wt [cin][kh][kw][cout]. A row's outputs are
// computed in blocks of `block` positions: one vector of L lanes when the row fits in one (two
// rows a tile then), else two.
struct Shape {
  int64_t h, w, cin, kh, kw, cout, pt, pl, oh, ow, block;
  int64_t blocks() const { return (ow + block - 1) / block; }
  int64_t hp() const { return oh + kh - 1; }
  int64_t wp() const { return std::max(w + pl, blocks() * block + kw - 1); }
  int64_t plane() const { return hp() * wp(); }
};

// The accumulators of R output rows from oh0, CO output channels from co0, NV vectors of the
// row's block from column j0; written to out [CO][R][NV * L]. Kernel rows that read only
// padding rows are skipped.
template <int L, int CO, int NV, int R>
FEDJAX_INLINE void Tile(const Shape& s, const float* __restrict xp, const float* __restrict wt,
                        int64_t oh0, int64_t j0, int64_t co0, float* __restrict out) {
  typedef typename VecOf<L>::type V;
  V acc[CO][R][NV];
  for (int c = 0; c < CO; ++c)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) acc[c][r][v] = V{};
  const int64_t a_lo = std::max<int64_t>(0, s.pt - (oh0 + R - 1));
  const int64_t a_hi = std::min<int64_t>(s.kh, s.pt + s.h - oh0);
  const int64_t wp = s.wp();
  for (int64_t ci = 0; ci < s.cin; ++ci) {
    for (int64_t a = a_lo; a < a_hi; ++a) {
      const float* row = xp + (ci * s.hp() + oh0 + a) * wp + j0;
      const float* wk = wt + ((ci * s.kh + a) * s.kw) * s.cout + co0;
      for (int64_t b = 0; b < s.kw; ++b) {
        V xv[R][NV];
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < NV; ++v) xv[r][v] = LoadU<L>(row + r * wp + v * L + b);
        for (int c = 0; c < CO; ++c) {
          const float wv = wk[b * s.cout + c];
          for (int r = 0; r < R; ++r)
            for (int v = 0; v < NV; ++v) acc[c][r][v] += wv * xv[r][v];
        }
      }
    }
  }
  for (int c = 0; c < CO; ++c)
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < NV; ++v) StoreU<L>(out + ((c * R + r) * NV + v) * L, acc[c][r][v]);
}

// Rows of accumulators (tmp [CO][rows][n]) for positions j0 .. j0 + n - 1 into y's interleaved
// channels: position by position when the tile holds every channel (CO a constant, so the
// compiler interleaves whole vectors), else channel by channel.
template <int CO>
FEDJAX_INLINE void Emit(const Shape& s, const float* __restrict tmp, int rows, int64_t n,
                        int64_t oh, int64_t j0, int64_t co0, float* __restrict y) {
  const int64_t end = std::min<int64_t>(n, s.ow - j0);
  if (CO == s.cout) {
    for (int r = 0; r < rows; ++r) {
      float* __restrict yr = y + ((oh + r) * s.ow + j0) * CO;
      const float* __restrict t = tmp + r * n;
      for (int64_t j = 0; j < end; ++j)
        for (int c = 0; c < CO; ++c) yr[j * CO + c] = t[c * rows * n + j];
    }
    return;
  }
  for (int c = 0; c < CO; ++c) {
    for (int r = 0; r < rows; ++r) {
      const float* t = tmp + (c * rows + r) * n;
      float* yr = y + ((oh + r) * s.ow + j0) * s.cout + co0 + c;
      for (int64_t j = 0; j < end; ++j) yr[j * s.cout] = t[j];
    }
  }
}

// One sample, CO output channels from co0, every block of every row: two rows a tile when a
// block is one vector (so that a tile keeps 2 CO independent accumulators), one row when two.
template <int L, int CO, int NV>
FEDJAX_INLINE void Sample(const Shape& s, const float* xp, const float* wt, int64_t co0,
                          float* tmp, float* y) {
  constexpr int R = NV == 1 ? 2 : 1;
  for (int64_t j0 = 0; j0 < s.ow; j0 += NV * L) {
    int64_t oh = 0;
    for (; oh + R <= s.oh; oh += R) {
      Tile<L, CO, NV, R>(s, xp, wt, oh, j0, co0, tmp);
      Emit<CO>(s, tmp, R, NV * L, oh, j0, co0, y);
    }
    for (; oh < s.oh; ++oh) {
      Tile<L, CO, NV, 1>(s, xp, wt, oh, j0, co0, tmp);
      Emit<CO>(s, tmp, 1, NV * L, oh, j0, co0, y);
    }
  }
}

#define FEDJAX_NARROW_CASE(K)                                 \
  case K:                                                     \
    if (nv == 1) {                                            \
      Sample<L, K, 1>(s, xp, wt, co0, tmp, y);                \
    } else {                                                  \
      Sample<L, K, 2>(s, xp, wt, co0, tmp, y);                \
    }                                                         \
    break;

// One sample's output y [oh, ow, cout] from its planes, with L-lane vectors: output channels
// in chunks of 8 (AVX-512's 32 registers hold 16 accumulators and the operands) or 6 (16
// registers: 12 accumulators).
template <int L>
FEDJAX_INLINE void SampleConv(const Shape& s, const float* xp, const float* wt, float* tmp,
                              float* y) {
  constexpr int chunk = L == 16 ? kMaxCout : 6;
  const int64_t nv = s.block / L;
  for (int64_t co0 = 0; co0 < s.cout; co0 += chunk) {
    switch (static_cast<int>(std::min<int64_t>(chunk, s.cout - co0))) {
      FEDJAX_NARROW_CASE(1)
      FEDJAX_NARROW_CASE(2)
      FEDJAX_NARROW_CASE(3)
      FEDJAX_NARROW_CASE(4)
      FEDJAX_NARROW_CASE(5)
      FEDJAX_NARROW_CASE(6)
      FEDJAX_NARROW_CASE(7)
      FEDJAX_NARROW_CASE(8)
      default: break;  // chunks hold 1 to 8 channels
    }
  }
}

// The instruction sets, each compiled for its own vector width (target_clones would compile
// one width for all three, and a 16-float vector without AVX-512 runs 50x slower).
enum Isa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512"};

#if FEDJAX_X86
__attribute__((target("avx512f"))) void SampleConvAvx512(const Shape& s, const float* xp,
                                                         const float* wt, float* tmp, float* y) {
  SampleConv<16>(s, xp, wt, tmp, y);
}
__attribute__((target("avx2,fma"))) void SampleConvAvx2(const Shape& s, const float* xp,
                                                       const float* wt, float* tmp, float* y) {
  SampleConv<8>(s, xp, wt, tmp, y);
}
#endif
void SampleConvBaseline(const Shape& s, const float* xp, const float* wt, float* tmp, float* y) {
  SampleConv<4>(s, xp, wt, tmp, y);
}

// What this CPU has, capped by $FEDJAX_NARROW_CONV_ISA ("avx512", "avx2" or "baseline": a
// test's or a timing's way to run a narrower path here); read once per process.
int DetectIsa() {
  int isa = kBaseline;
#if FEDJAX_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) isa = kAvx2;
  if (__builtin_cpu_supports("avx512f")) isa = kAvx512;
#endif
  if (const char* cap = std::getenv("FEDJAX_NARROW_CONV_ISA")) {
    for (int i = kBaseline; i <= kAvx512; ++i) {
      if (std::strcmp(cap, kIsaNames[i]) == 0) isa = std::min(isa, i);
    }
  }
  return isa;
}

int ActiveIsa() {
  static const int isa = DetectIsa();
  return isa;
}

// Lanes of the active path's vectors.
int Lanes() { return ActiveIsa() == kAvx512 ? 16 : ActiveIsa() == kAvx2 ? 8 : 4; }

void RunSample(const Shape& s, const float* xp, const float* wt, float* tmp, float* y) {
#if FEDJAX_X86
  if (ActiveIsa() == kAvx512) return SampleConvAvx512(s, xp, wt, tmp, y);
  if (ActiveIsa() == kAvx2) return SampleConvAvx2(s, xp, wt, tmp, y);
#endif
  SampleConvBaseline(s, xp, wt, tmp, y);
}

// One sample x [h, w, cin] into the planes [cin][hp][wp] (their padding, zeroed once, is never
// written): a row's channels apart, CIN a constant where it is one of the common counts so
// that the compiler de-interleaves whole vectors.
template <int CIN>
FEDJAX_INLINE void PlanesOf(const Shape& s, const float* __restrict x, float* __restrict xp) {
  const int64_t cin = CIN > 0 ? CIN : s.cin;
  for (int64_t i = 0; i < s.h; ++i) {
    const float* __restrict xr = x + i * s.w * cin;
    for (int64_t c = 0; c < cin; ++c) {
      float* __restrict d = xp + c * s.plane() + (i + s.pt) * s.wp() + s.pl;
      for (int64_t j = 0; j < s.w; ++j) d[j] = xr[j * cin + c];
    }
  }
}

FEDJAX_CLONES
void Planes(const Shape& s, const float* x, float* xp) {
  switch (s.cin) {
    case 1: PlanesOf<1>(s, x, xp); break;
    case 2: PlanesOf<2>(s, x, xp); break;
    case 3: PlanesOf<3>(s, x, xp); break;
    case 4: PlanesOf<4>(s, x, xp); break;
    case 6: PlanesOf<6>(s, x, xp); break;
    case 8: PlanesOf<8>(s, x, xp); break;
    case 16: PlanesOf<16>(s, x, xp); break;
    default: PlanesOf<0>(s, x, xp); break;
  }
}

// The element offset of batch element t's slice of an operand whose leading axes are `dims`
// (each the batch's size or 1) over slices of `inner` elements.
int64_t Offset(int64_t t, const std::vector<int64_t>& batch, ffi::Span<const int64_t> dims,
               int64_t inner) {
  int64_t offset = 0, stride = inner;
  for (size_t i = batch.size(); i-- > 0;) {
    const int64_t index = t % batch[i];
    t /= batch[i];
    if (dims[i] != 1) offset += index * stride;
    stride *= dims[i];
  }
  return offset;
}

ffi::Error NarrowConv(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                      ffi::ResultBuffer<ffi::F32> y, int64_t pad_top, int64_t pad_left,
                      bool flip) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  const size_t r = yd.size();
  auto fail = [](const std::string& what) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "narrow_conv: " + what);
  };
  if (r < 4 || xd.size() != r || wd.size() != r) {
    return fail("x [..., N, H, W, C], w [..., KH, KW, I, O], y [..., N, OH, OW, C]");
  }
  const size_t l = r - 4;
  std::vector<int64_t> batch(yd.begin(), yd.begin() + l);
  int64_t count = 1;
  for (size_t i = 0; i < l; ++i) {
    if ((xd[i] != batch[i] && xd[i] != 1) || (wd[i] != batch[i] && wd[i] != 1)) {
      return fail("leading axes differ from the result's");
    }
    count *= batch[i];
  }
  const int64_t n = xd[l], kh = wd[l], kw = wd[l + 1], wi = wd[l + 2], wo = wd[l + 3];
  const int64_t lanes = Lanes();
  Shape s{xd[l + 1], xd[l + 2], xd[l + 3], kh, kw, yd[l + 3], pad_top, pad_left,
          yd[l + 1], yd[l + 2], yd[l + 2] <= lanes ? lanes : 2 * lanes};
  const int64_t want_cin = flip ? wo : wi, want_cout = flip ? wi : wo;
  if (yd[l] != n || s.cin != want_cin || s.cout != want_cout) {
    return fail("channels or batch do not match the kernel");
  }
  if (pad_top < 0 || pad_left < 0 || s.oh < 1 || s.ow < 1 || s.oh + kh - 1 < s.h + pad_top ||
      s.ow + kw - 1 < s.w + pad_left || s.ow > kMaxWidth) {
    return fail("padding must be >= 0 and output rows at most 32 positions");
  }
  // Every kernel slice arranged as [cin][kh][kw][cout] (flipped for flip = 1).
  const int64_t ksize = kh * kw * wi * wo;
  int64_t kslices = 1;
  for (size_t i = 0; i < l; ++i) kslices *= wd[i];
  std::vector<float> wt(kslices * ksize);
  const float* wp = w.typed_data();
  for (int64_t k = 0; k < kslices; ++k) {
    const float* src = wp + k * ksize;
    float* dst = wt.data() + k * ksize;
    for (int64_t a = 0; a < kh; ++a)
      for (int64_t b = 0; b < kw; ++b)
        for (int64_t i = 0; i < wi; ++i)
          for (int64_t o = 0; o < wo; ++o) {
            const float v = src[((a * kw + b) * wi + i) * wo + o];
            if (flip) {
              dst[((o * kh + (kh - 1 - a)) * kw + (kw - 1 - b)) * wi + i] = v;
            } else {
              dst[((i * kh + a) * kw + b) * wo + o] = v;
            }
          }
  }
  const int64_t xs = s.h * s.w * s.cin, ys = s.oh * s.ow * s.cout;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
#pragma omp parallel
  {
    std::vector<float> planes(s.cin * s.plane(), 0.0f);  // the padding stays 0
    std::vector<float> tmp(kMaxCout * 2 * s.block);  // a tile: [CO][rows][block]
#pragma omp for schedule(static)
    for (int64_t e = 0; e < count * n; ++e) {
      const int64_t t = e / n, i = e % n;
      Planes(s, xp + Offset(t, batch, xd, n * xs) + i * xs, planes.data());
      const float* wk = wt.data() + Offset(t, batch, wd, ksize);
      RunSample(s, planes.data(), wk, tmp.data(), yp + e * ys);
    }
  }
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y, int64_t pad_top, int64_t pad_left) {
  return NarrowConv(x, w, y, pad_top, pad_left, false);
}

ffi::Error BackwardDataImpl(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> w,
                            ffi::ResultBuffer<ffi::F32> dx, int64_t pad_top, int64_t pad_left) {
  return NarrowConv(dy, w, dx, pad_top, pad_left, true);
}

}  // namespace

// The vector path the kernel runs here: 2 AVX-512, 1 AVX2, 0 the x86-64 baseline (SSE2) or
// another architecture's generic vectors.
extern "C" int FedjaxNarrowConvIsa() { return ActiveIsa(); }

// flip = 0 and flip = 1 above, as two targets so that profiles name what each call computes.
XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxNarrowConvForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., N, H, W, I]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [..., KH, KW, I, O]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., N, OH, OW, O]
                                  .Attr<int64_t>("pad_top")
                                  .Attr<int64_t>("pad_left"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxNarrowConvBackwardData, BackwardDataImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dy [..., N, OH, OW, O]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [..., KH, KW, I, O]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dx [..., N, H, W, I]
                                  .Attr<int64_t>("pad_top")
                                  .Attr<int64_t>("pad_left"));
