"""fedjax_rcl.bench.trace_summary: operations are put in the right category from the optimised HLO,
and a trace's time is split into category shares and idle time by its intervals."""

import gzip
import json

import pytest

from fedjax_rcl.bench import trace_summary

HLO = """HloModule jit_run_rounds, is_scheduled=true

%fused_conv (param_0: f32[8,16,16,4], param_1: f32[3,3,4,8]) -> f32[8,16,16,8] {
  %param_0 = f32[8,16,16,4]{3,2,1,0} parameter(0)
  %param_1 = f32[3,3,4,8]{3,2,1,0} parameter(1)
  %convolution.3 = f32[8,16,16,8]{3,2,1,0} convolution(%param_0, %param_1), window={size=3x3}
  ROOT %tanh.1 = f32[8,16,16,8]{3,2,1,0} tanh(%convolution.3)
}

%fused_moves (param_0.1: f32[8,64]) -> f32[64,8] {
  %param_0.1 = f32[8,64]{1,0} parameter(0)
  %slice.2 = f32[8,32]{1,0} slice(%param_0.1), slice={[0:8], [0:32]}
  ROOT %transpose.1 = f32[64,8]{0,1} transpose(%param_0.1), dimensions={1,0}
}

%fused_add (param_0.2: f32[64], param_1.2: f32[64]) -> f32[64] {
  %param_0.2 = f32[64]{0} parameter(0)
  %param_1.2 = f32[64]{0} parameter(1)
  ROOT %add.7 = f32[64]{0} add(%param_0.2, %param_1.2)
}

%inner_dot (p: f32[8,64], q: f32[64,10]) -> f32[8,10] {
  %p = f32[8,64]{1,0} parameter(0)
  %q = f32[64,10]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,10]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (arg: (s32[], f32[64])) -> (s32[], f32[64]) {
  %arg = (s32[], f32[64]{0}) parameter(0)
  %gte = f32[64]{0} get-tuple-element(%arg), index=1
  %loop_add_fusion = f32[64]{0} fusion(%gte, %gte), kind=kLoop, calls=%fused_add
  %copy.4 = f32[64]{0} copy(%loop_add_fusion)
  %loop_add_fusion.1 = f32[64]{0} fusion(%copy.4, %gte), kind=kLoop, calls=%fused_add
  ROOT %tuple = (s32[], f32[64]{0}) tuple(%gte, %copy.4)
}

ENTRY %main.9 (x: f32[8,16,16,4], w: f32[3,3,4,8], y: f32[8,64], z: f32[64,10]) -> f32[8,10] {
  %x = f32[8,16,16,4]{3,2,1,0} parameter(0)
  %w = f32[3,3,4,8]{3,2,1,0} parameter(1)
  %y = f32[8,64]{1,0} parameter(2)
  %z = f32[64,10]{1,0} parameter(3)
  %conv_fusion = f32[8,16,16,8]{3,2,1,0} fusion(%x, %w), kind=kOutput, calls=%fused_conv
  %gemm_fusion_dot.2 = f32[8,10]{1,0} fusion(%y, %z), kind=kCustom, calls=%inner_dot
  %transpose_fusion = f32[64,8]{0,1} fusion(%y), kind=kLoop, calls=%fused_moves
  %cudnn-conv.1 = (f32[8,8], u8[0]) custom-call(%x, %w), custom_call_target="__cudnn$convForward"
  %cublas-gemm.1 = (f32[8,10], s8[0]) custom-call(%y, %z), custom_call_target="__cublas$gemm"
  %gn.1 = (f32[8,64], f32[8,2]) custom-call(%y), custom_call_target="fedjax_group_norm_forward"
  %mp.1 = f32[8,8,8,8] custom-call(%x), custom_call_target="fedjax_bias_relu_max_pool_forward"
  %o1 = f32[8,16,16,8] custom-call(%x, %w), custom_call_target="fedjax_onednn_conv_forward"
  %o2 = f32[3,3,4,8] custom-call(%x, %o1), custom_call_target="fedjax_onednn_conv_backward_weights"
  %xb = f32[5,8,16,16,4]{4,3,2,1,0} parameter(4)
  %wb = f32[5,3,3,4,8]{4,3,2,1,0} parameter(5)
  %o3 = f32[5,8,16,16,8] custom-call(%xb, %wb), custom_call_target="fedjax_onednn_conv_forward"
  %n1 = f32[8,16,16,8] custom-call(%x, %w), custom_call_target="fedjax_narrow_conv_forward"
  %n2 = f32[8,16,16,4] custom-call(%o1, %w), custom_call_target="fedjax_narrow_conv_backward_data"
  %rng = u32[4]{0} rng-bit-generator(%w), algorithm=rng_default
  %while.1 = (s32[], f32[64]{0}) while(%x), condition=%cond, body=%body
  ROOT %dot.9 = f32[8,10]{1,0} dot(%y, %z), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_operations_are_categorised_by_what_the_hlo_says_they_compute():
    cats = trace_summary.hlo_categories(HLO)
    assert cats["conv_fusion"] == "convolution"  # a fusion holding a convolution
    assert cats["cudnn-conv.1"] == "convolution"  # cuDNN's custom call
    assert cats["gemm_fusion_dot.2"] == "matmul"  # a fusion holding a dot
    assert cats["cublas-gemm.1"] == "matmul"
    assert cats["gn.1"] == "elementwise"  # the GroupNorm kernels do what XLA's fusions would
    assert cats["mp.1"] == "elementwise"  # and the bias + ReLU + pool kernels
    assert cats["dot.9"] == "matmul"
    assert cats["transpose_fusion"] == "copy"  # only slicing and transposing
    assert cats["loop_add_fusion"] == "elementwise"
    assert cats["copy.4"] == "copy"
    assert cats["o1"] == cats["o2"] == "convolution"
    assert cats["n1"] == cats["n2"] == "convolution"  # the positions-in-lanes kernel
    assert cats["rng"] == "other"
    assert cats["while.1"] == cats["tuple"] == "control"


def test_each_operation_has_its_flops_and_bytes_from_the_hlo():
    costs = trace_summary.hlo_costs(HLO)
    conv = 2 * (8 * 16 * 16 * 8) * (3 * 3 * 4)  # 2 x outputs x multiply-adds per output
    conv_bytes = 4 * (8 * 16 * 16 * 8 + 8 * 16 * 16 * 4 + 3 * 3 * 4 * 8)  # y, x and w
    assert (costs["conv_fusion"]["flops"], costs["conv_fusion"]["bytes"]) == (conv, conv_bytes)
    # oneDNN's forward and weight-gradient convolutions: the same multiply-adds.
    assert costs["o1"]["flops"] == costs["o2"]["flops"] == conv
    assert costs["o3"]["flops"] == 5 * conv  # five clients in one call (vmap)
    # nn.narrow_conv's forward and input gradient: the same multiply-adds, named so
    assert costs["n1"]["flops"] == costs["n2"]["flops"] == conv
    assert costs["n2"]["what"].startswith("narrow_conv_backward_data(f32[8,16,16,8], ")
    assert costs["o2"]["bytes"] == conv_bytes
    assert (costs["dot.9"]["flops"], costs["dot.9"]["bytes"]) == (2 * 8 * 10 * 64,
                                                         4 * (8 * 10 + 8 * 64 + 64 * 10))
    assert costs["gemm_fusion_dot.2"]["flops"] == 2 * 8 * 10 * 64
    assert costs["loop_add_fusion"]["bytes"] == 4 * 3 * 64  # its operand counted twice
    assert costs["o2"]["what"] == ("conv_backward_weights(f32[8,16,16,4], f32[8,16,16,8]) -> "
                                   "f32[3,3,4,8]")
    assert costs["cudnn-conv.1"]["flops"] == 0  # not a convolution whose layout we know
    assert "while.1" not in costs and "tuple" not in costs


def test_costs_of_a_compiled_program_add_up_to_its_convolution_and_dot():
    import jax
    import jax.numpy as jnp

    def f(x, w, a, b):
        y = jax.lax.conv_general_dilated(x, w, (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.tanh(y).sum() + (a @ b).sum()

    args = (jnp.ones((4, 12, 12, 3)), jnp.ones((5, 5, 3, 6)), jnp.ones((7, 9)),
            jnp.ones((9, 11)))
    text = jax.jit(f).lower(*args).compile().as_text()
    costs = trace_summary.hlo_costs(text)
    want = 2 * (4 * 8 * 8 * 6) * (5 * 5 * 3) + 2 * (7 * 11) * 9
    assert sum(c["flops"] for c in costs.values()) == want


def _event(ts, dur, name, pid=1, tid=1, **args):
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name,
            "args": args}


def test_a_gpu_trace_splits_kernel_time_by_category_and_counts_idle_gaps(tmp_path):
    """Device tracks only (the derived "XLA Ops" track repeats the kernels; host events are not
    device time); a kernel known by its hlo_op takes the HLO's category, a memory copy without
    one its name's; idle is the span less the union of kernels (here one 20 us gap)."""
    meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "pid": 1, "tid": 1, "name": "thread_name",
             "args": {"name": "Stream #13(Compute)"}},
            {"ph": "M", "pid": 1, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
            {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/host:CPU"}}]
    events = [_event(0, 40, "sm90_xmma_fprop", hlo_op="conv_fusion"),
              _event(40, 20, "triton_gemm", hlo_op="gemm_fusion_dot.2"),
              _event(80, 10, "loop_add_fusion", hlo_op="loop_add_fusion"),
              _event(90, 10, "MemcpyD2D"),
              _event(100, 10, "nvjet_tst_64x8", kernel_details="x"),  # in a CUDA graph
              _event(110, 10, "k", kernel_annotation="while.1:#hlo_op=while.1#::"
                     "cublas-gemm.1:#hlo_op=cublas-gemm.1,hlo_module=jit_run_rounds#"),
              _event(120, 5, "loop_add_fusion_1", kernel_annotation=  # a CUDA graph's kernel
                     "command_buffer_3:#hlo_op=command_buffer_3,hlo_module=jit_run_rounds#"),
              _event(0, 120, "conv_fusion", tid=2, hlo_op="conv_fusion"),  # derived track
              _event(0, 500, "PjitFunction", pid=9, hlo_op="dot.9")]  # host, not device
    path = tmp_path / "plugins" / "profile" / "run1" / "perfetto_trace.json.gz"
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    assert trace_summary.trace_file(tmp_path) == path
    s = trace_summary.summarise(*trace_summary.load_events(path),
                                trace_summary.hlo_categories(HLO))
    assert s["where"] == "device" and s["events"] == 7
    assert s["seconds"]["convolution"] == pytest.approx(40e-6)
    # The triton dot, the nvjet kernel (by its name) and the annotated cuBLAS call.
    assert s["seconds"]["matmul"] == pytest.approx(40e-6)
    assert s["seconds"]["elementwise"] == pytest.approx(15e-6)
    assert s["seconds"]["copy"] == pytest.approx(10e-6)
    assert s["shares"]["convolution"] == pytest.approx(40 / 105)
    assert s["span_s"] == pytest.approx(125e-6) and s["idle_s"] == pytest.approx(20e-6)
    assert s["share_named_by_hlo"] == pytest.approx(85 / 105)
    assert s["top_ops"][0] == {"op": "conv_fusion", "category": "convolution", "s": 40e-6,
                               "count": 1}
    # The graph's kernel is listed under its own fusion, not the command buffer.
    assert {"op": "loop_add_fusion.1", "category": "elementwise", "s": 5e-6,
            "count": 1} in s["top_ops"]


def test_a_cpu_trace_counts_operations_on_every_thread_and_skips_control_flow():
    """On a CPU the operations are the host events naming an HLO op; a while loop's event spans
    its body's and is left out; two threads' overlapping operations count once in the busy
    time."""
    names = {"pid": {1: "/host:CPU"}, "tid": {}}
    events = [_event(0, 100, "while.1", hlo_op="while.1"),
              _event(0, 50, "conv_fusion", tid=1, hlo_op="conv_fusion"),
              _event(25, 50, "dot.9", tid=2, hlo_op="dot.9"),
              _event(50, 1, "end: conv_fusion", tid=1),
              _event(90, 10, "copy.4", tid=1, hlo_op="copy.4"),
              _event(0, 300, "PjitFunction", tid=3)]
    s = trace_summary.summarise(events, names, trace_summary.hlo_categories(HLO))
    assert s["where"] == "host" and s["events"] == 3
    assert s["op_s"] == pytest.approx(110e-6)
    assert s["busy_s"] == pytest.approx(85e-6) and s["span_s"] == pytest.approx(100e-6)
    assert s["idle_share_of_span"] == pytest.approx(0.15)


def test_overlap_counts_only_time_shared_with_another_tracks_operations():
    """A convolution on thread 1 over [0, 100): thread 2's two overlapping operations cover
    [10, 30) once, a third [90, 110) adds 10; an operation on its own thread (a nested event)
    does not count. Thread 2's dot overlaps the convolution for all of [10, 25), the copy for
    [90, 100); thread 1's nested add sees nothing on thread 2 at [40, 50)."""
    names = {"pid": {1: "/host:CPU"}, "tid": {}}
    events = [_event(0, 100, "conv_fusion", tid=1, hlo_op="conv_fusion"),
              _event(40, 10, "loop_add_fusion", tid=1, hlo_op="loop_add_fusion"),
              _event(10, 15, "dot.9", tid=2, hlo_op="dot.9"),
              _event(15, 15, "transpose_fusion", tid=2, hlo_op="transpose_fusion"),
              _event(90, 20, "copy.4", tid=2, hlo_op="copy.4")]
    s = trace_summary.summarise(events, names, trace_summary.hlo_categories(HLO))
    o = s["overlapped_s"]
    assert o["convolution"] == pytest.approx(30e-6)
    assert o["matmul"] == pytest.approx(15e-6)
    assert o["copy"] == pytest.approx(15e-6 + 10e-6)  # the transpose [15, 30), the copy [90, 100)
    assert o["elementwise"] == 0.0 and o["other"] == 0.0
    # The same operations on one thread share nothing.
    alone = trace_summary.summarise([dict(e, tid=1) for e in events], names,
                                    trace_summary.hlo_categories(HLO))
    assert set(alone["overlapped_s"].values()) == {0.0}
