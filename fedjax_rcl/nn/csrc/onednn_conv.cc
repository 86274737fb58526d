// 2-D convolutions on CPU through oneDNN, exposed to XLA as FFI handlers.
//
// Why: XLA:CPU has no fast kernel-gradient convolution (inside lax.scan its native one takes a
// slow generic path, jax-ml/jax#12868), so on CPU the library otherwise writes convolutions as
// image patches times a matrix, which materialises k*k copies of every activation. oneDNN (the
// library behind PyTorch's CPU convolutions) runs forward, input-gradient and kernel-gradient
// convolutions as direct JIT kernels. Built on first use by fedjax_rcl/nn/onednn.py.
//
// Layouts are JAX's: activations NHWC, kernels HWIO; float32, bfloat16 or float16 (all operands
// of a call alike; oneDNN accumulates in float32 and refuses a low type the CPU lacks). Each
// handler caches its oneDNN primitives by geometry and type (built once per shape, i.e. once
// per compiled layer) and executes them with a per-call scratchpad, so concurrent calls from
// XLA's threads are safe.
//
// Under jax.vmap (clients side by side, each with its own kernel) a handler takes the whole
// batch in one call (vmap_method="expand_dims"): every operand and result has the same number
// of leading axes, an operand's either the result's size or 1 (one slice shared by all), and
// the handler runs the convolution once per leading index on slices of the buffers, in order.
// XLA would otherwise loop over the clients itself, copying each client's slices in and out.

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using dnnl::memory;
using tag = dnnl::memory::format_tag;

dnnl::engine& Engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// One convolution's shape: NHWC input [b, h, w, cin], HWIO kernel [kh, kw, cin, cout],
// NHWC output [b, ho, wo, cout], strides and explicit (low, high) padding, and the type.
struct Geometry {
  int64_t b, h, w, cin, ho, wo, cout, kh, kw, sh, sw, pt, pb, pl, pr;
  memory::data_type dt;

  std::string Key() const {
    std::string key;
    for (int64_t v : {b, h, w, cin, ho, wo, cout, kh, kw, sh, sw, pt, pb, pl, pr,
                      static_cast<int64_t>(dt)}) {
      key += std::to_string(v);
      key += ',';
    }
    return key;
  }
};

// The three primitives of one geometry, and the reorders between JAX's HWIO kernel and the
// blocked kernel layouts oneDNN picks for speed.
struct Primitives {
  memory::desc src, dst, weights_user;
  dnnl::convolution_forward::primitive_desc fwd_pd;
  dnnl::convolution_backward_data::primitive_desc bwd_data_pd;
  dnnl::convolution_backward_weights::primitive_desc bwd_weights_pd;
  dnnl::convolution_forward fwd;
  dnnl::convolution_backward_data bwd_data;
  dnnl::convolution_backward_weights bwd_weights;
  dnnl::reorder::primitive_desc to_fwd_pd, to_bwd_data_pd, from_bwd_weights_pd;
  dnnl::reorder to_fwd, to_bwd_data, from_bwd_weights;
};

std::unique_ptr<Primitives> Build(const Geometry& g) {
  auto& eng = Engine();
  auto p = std::make_unique<Primitives>();
  // oneDNN's logical order is NCHW / OIHW whatever the memory layout; the tags give JAX's.
  p->src = memory::desc({g.b, g.cin, g.h, g.w}, g.dt, tag::nhwc);
  p->dst = memory::desc({g.b, g.cout, g.ho, g.wo}, g.dt, tag::nhwc);
  p->weights_user = memory::desc({g.cout, g.cin, g.kh, g.kw}, g.dt, tag::hwio);
  memory::desc weights_any({g.cout, g.cin, g.kh, g.kw}, g.dt, tag::any);
  memory::dims strides = {g.sh, g.sw}, pad_lo = {g.pt, g.pl}, pad_hi = {g.pb, g.pr};
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  p->fwd_pd = dnnl::convolution_forward::primitive_desc(
      eng, dnnl::prop_kind::forward_training, dnnl::algorithm::convolution_direct, p->src,
      weights_any, p->dst, strides, pad_lo, pad_hi, attr);
  p->bwd_data_pd = dnnl::convolution_backward_data::primitive_desc(
      eng, dnnl::algorithm::convolution_direct, p->src, weights_any, p->dst, strides, pad_lo,
      pad_hi, p->fwd_pd, attr);
  p->bwd_weights_pd = dnnl::convolution_backward_weights::primitive_desc(
      eng, dnnl::algorithm::convolution_direct, p->src, weights_any, p->dst, strides, pad_lo,
      pad_hi, p->fwd_pd, attr);
  p->fwd = dnnl::convolution_forward(p->fwd_pd);
  p->bwd_data = dnnl::convolution_backward_data(p->bwd_data_pd);
  p->bwd_weights = dnnl::convolution_backward_weights(p->bwd_weights_pd);
  p->to_fwd_pd = dnnl::reorder::primitive_desc(eng, p->weights_user, eng,
                                               p->fwd_pd.weights_desc(), attr);
  p->to_bwd_data_pd = dnnl::reorder::primitive_desc(eng, p->weights_user, eng,
                                                    p->bwd_data_pd.weights_desc(), attr);
  p->from_bwd_weights_pd = dnnl::reorder::primitive_desc(
      eng, p->bwd_weights_pd.diff_weights_desc(), eng, p->weights_user, attr);
  p->to_fwd = dnnl::reorder(p->to_fwd_pd);
  p->to_bwd_data = dnnl::reorder(p->to_bwd_data_pd);
  p->from_bwd_weights = dnnl::reorder(p->from_bwd_weights_pd);
  return p;
}

// Primitives are built once per geometry and never freed (a program has a few dozen shapes).
const Primitives& Lookup(const Geometry& g) {
  static std::mutex mu;
  static auto* cache = new std::unordered_map<std::string, std::unique_ptr<Primitives>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*cache)[g.Key()];
  if (!slot) slot = Build(g);
  return *slot;
}

// A per-call scratchpad: with the user scratchpad mode, executing one primitive from several
// threads at once is safe.
memory Scratch(const memory::desc& md) { return memory(md, Engine()); }

// Runs `reorder` from `from` into a fresh buffer of `to_md`, unless the layouts already agree.
memory Reordered(dnnl::stream& s, const dnnl::reorder& reorder,
                 const dnnl::reorder::primitive_desc& pd, const memory& from,
                 const memory::desc& to_md) {
  if (from.get_desc() == to_md) return from;
  memory to(to_md, Engine());
  reorder.execute(s, {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to},
                      {DNNL_ARG_SCRATCHPAD, Scratch(pd.scratchpad_desc())}});
  return to;
}

template <typename F>
ffi::Error Guarded(F&& body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("oneDNN: ") + e.what());
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, e.what());
  }
}

using Any = ffi::AnyBuffer;
using AnyResult = ffi::Result<ffi::AnyBuffer>;

// The oneDNN type of a call whose operands all have one of the supported types.
memory::data_type DataType(ffi::DataType a, ffi::DataType b, ffi::DataType c) {
  if (a != b || a != c) throw std::invalid_argument("operands of different types");
  switch (a) {
    case ffi::DataType::F32: return memory::data_type::f32;
    case ffi::DataType::BF16: return memory::data_type::bf16;
    case ffi::DataType::F16: return memory::data_type::f16;
    default: throw std::invalid_argument("unsupported type (float32, bfloat16, float16)");
  }
}

// The leading (vmap) axes of a call: `lead` of them on every operand and result; the result's
// give the number of convolutions, an operand's are the result's or 1.
class Batch {
 public:
  Batch(ffi::Span<const int64_t> result, size_t lead) : dims_(result.begin(),
                                                            result.begin() + lead) {
    for (int64_t d : dims_) count_ *= d;
  }
  int64_t count() const { return count_; }
  size_t lead() const { return dims_.size(); }

  // The element offset of convolution t's slice of an operand of shape `dims`.
  int64_t Offset(int64_t t, ffi::Span<const int64_t> dims) const {
    int64_t inner = 1;
    for (size_t i = dims_.size(); i < dims.size(); ++i) inner *= dims[i];
    int64_t offset = 0, stride = inner;
    for (size_t i = dims_.size(); i-- > 0;) {
      const int64_t index = t % dims_[i];
      t /= dims_[i];
      if (dims[i] != 1) offset += index * stride;
      stride *= dims[i];
    }
    return offset;
  }

  void Check(ffi::Span<const int64_t> dims) const {
    if (dims.size() != dims_.size() + 4) throw std::invalid_argument("operand rank");
    for (size_t i = 0; i < dims_.size(); ++i) {
      if (dims[i] != dims_[i] && dims[i] != 1) {
        throw std::invalid_argument("leading axes differ from the result's");
      }
    }
  }

 private:
  std::vector<int64_t> dims_;
  int64_t count_ = 1;
};

size_t Bytes(memory::data_type dt) { return dt == memory::data_type::f32 ? 4 : 2; }

// Convolution t's slice of a buffer.
void* Slice(void* data, const Batch& batch, int64_t t, ffi::Span<const int64_t> dims,
            memory::data_type dt) {
  return static_cast<char*>(data) + batch.Offset(t, dims) * Bytes(dt);
}

Geometry MakeGeometry(ffi::Span<const int64_t> in, ffi::Span<const int64_t> kernel,
                      ffi::Span<const int64_t> out, int64_t sh, int64_t sw, int64_t pt,
                      int64_t pb, int64_t pl, int64_t pr, memory::data_type dt,
                      const Batch& batch) {
  batch.Check(in);
  batch.Check(kernel);
  batch.Check(out);
  const size_t l = batch.lead();
  return Geometry{in[l], in[l + 1], in[l + 2], in[l + 3], out[l + 1], out[l + 2], out[l + 3],
                  kernel[l], kernel[l + 1], sh, sw, pt, pb, pl, pr, dt};
}

// y = conv(x, w): x [B, H, W, Cin], w [kh, kw, Cin, Cout] -> y [B, Ho, Wo, Cout].
ffi::Error ConvForwardImpl(Any x, Any w, AnyResult y, int64_t sh, int64_t sw, int64_t pt,
                           int64_t pb, int64_t pl, int64_t pr) {
  return Guarded([&] {
    const Batch batch(y->dimensions(), y->dimensions().size() - 4);
    const auto dt = DataType(x.element_type(), w.element_type(), y->element_type());
    const auto g = MakeGeometry(x.dimensions(), w.dimensions(), y->dimensions(), sh, sw, pt,
                                pb, pl, pr, dt, batch);
    const auto& p = Lookup(g);
    auto& eng = Engine();
    dnnl::stream s(eng);
    for (int64_t t = 0; t < batch.count(); ++t) {
      memory src(p.src, eng, Slice(x.untyped_data(), batch, t, x.dimensions(), dt));
      memory dst(p.dst, eng, Slice(y->untyped_data(), batch, t, y->dimensions(), dt));
      memory weights = Reordered(
          s, p.to_fwd, p.to_fwd_pd,
          memory(p.weights_user, eng, Slice(w.untyped_data(), batch, t, w.dimensions(), dt)),
          p.fwd_pd.weights_desc());
      p.fwd.execute(s, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst},
                        {DNNL_ARG_SCRATCHPAD, Scratch(p.fwd_pd.scratchpad_desc())}});
      s.wait();
    }
  });
}

// dx = the input gradient of conv at w for output gradient dy; dx's shape gives H, W.
ffi::Error ConvBackwardDataImpl(Any dy, Any w, AnyResult dx, int64_t sh, int64_t sw, int64_t pt,
                                int64_t pb, int64_t pl, int64_t pr) {
  return Guarded([&] {
    const Batch batch(dx->dimensions(), dx->dimensions().size() - 4);
    const auto dt = DataType(dy.element_type(), w.element_type(), dx->element_type());
    const auto g = MakeGeometry(dx->dimensions(), w.dimensions(), dy.dimensions(), sh, sw, pt,
                                pb, pl, pr, dt, batch);
    const auto& p = Lookup(g);
    auto& eng = Engine();
    dnnl::stream s(eng);
    for (int64_t t = 0; t < batch.count(); ++t) {
      memory diff_dst(p.dst, eng, Slice(dy.untyped_data(), batch, t, dy.dimensions(), dt));
      memory diff_src(p.src, eng, Slice(dx->untyped_data(), batch, t, dx->dimensions(), dt));
      memory weights = Reordered(
          s, p.to_bwd_data, p.to_bwd_data_pd,
          memory(p.weights_user, eng, Slice(w.untyped_data(), batch, t, w.dimensions(), dt)),
          p.bwd_data_pd.weights_desc());
      p.bwd_data.execute(s, {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, weights},
                             {DNNL_ARG_DIFF_SRC, diff_src},
                             {DNNL_ARG_SCRATCHPAD, Scratch(p.bwd_data_pd.scratchpad_desc())}});
      s.wait();
    }
  });
}

// dw = the kernel gradient of conv at input x for output gradient dy; dw's shape gives kh, kw.
ffi::Error ConvBackwardWeightsImpl(Any x, Any dy, AnyResult dw, int64_t sh, int64_t sw,
                                   int64_t pt, int64_t pb, int64_t pl, int64_t pr) {
  return Guarded([&] {
    const Batch batch(dw->dimensions(), dw->dimensions().size() - 4);
    const auto dt = DataType(x.element_type(), dy.element_type(), dw->element_type());
    const auto g = MakeGeometry(x.dimensions(), dw->dimensions(), dy.dimensions(), sh, sw, pt,
                                pb, pl, pr, dt, batch);
    const auto& p = Lookup(g);
    auto& eng = Engine();
    dnnl::stream s(eng);
    const auto& internal_md = p.bwd_weights_pd.diff_weights_desc();
    for (int64_t t = 0; t < batch.count(); ++t) {
      memory src(p.src, eng, Slice(x.untyped_data(), batch, t, x.dimensions(), dt));
      memory diff_dst(p.dst, eng, Slice(dy.untyped_data(), batch, t, dy.dimensions(), dt));
      memory user(p.weights_user, eng,
                  Slice(dw->untyped_data(), batch, t, dw->dimensions(), dt));
      memory diff_weights = internal_md == p.weights_user ? user : memory(internal_md, eng);
      p.bwd_weights.execute(s, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst},
                                {DNNL_ARG_DIFF_WEIGHTS, diff_weights},
                                {DNNL_ARG_SCRATCHPAD,
                                 Scratch(p.bwd_weights_pd.scratchpad_desc())}});
      if (internal_md != p.weights_user) {
        p.from_bwd_weights.execute(
            s, {{DNNL_ARG_FROM, diff_weights}, {DNNL_ARG_TO, user},
                {DNNL_ARG_SCRATCHPAD, Scratch(p.from_bwd_weights_pd.scratchpad_desc())}});
      }
      s.wait();
    }
  });
}

}  // namespace

#define FEDJAX_CONV_ATTRS                                                                  \
  .Attr<int64_t>("stride_h").Attr<int64_t>("stride_w").Attr<int64_t>("pad_top")           \
      .Attr<int64_t>("pad_bottom").Attr<int64_t>("pad_left").Attr<int64_t>("pad_right")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxOnednnConvForward, ConvForwardImpl,
                              ffi::Ffi::Bind().Arg<Any>().Arg<Any>().Ret<Any>()
                                  FEDJAX_CONV_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxOnednnConvBackwardData, ConvBackwardDataImpl,
                              ffi::Ffi::Bind().Arg<Any>().Arg<Any>().Ret<Any>()
                                  FEDJAX_CONV_ATTRS);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FedjaxOnednnConvBackwardWeights, ConvBackwardWeightsImpl,
                              ffi::Ffi::Bind().Arg<Any>().Arg<Any>().Ret<Any>()
                                  FEDJAX_CONV_ATTRS);

// The oneDNN version this file was built against, for diagnostics.
extern "C" int FedjaxOnednnVersion() {
  const dnnl_version_t* v = dnnl_version();
  return v->major * 10000 + v->minor * 100 + v->patch;
}
