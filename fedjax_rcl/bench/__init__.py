"""The benchmark kit: what ``tools/bench_*.py`` and the benchmark studies need beside the
simulator, never imported by it (``tests/test_architecture.py`` holds the rule).

- ``flops``: the FLOP counts GFLOP/s are reported in, taken from our own models' traced
  programs (``fedjax_rcl.engine.layout``'s counter);
- ``torch_reference``: the PyTorch eager implementation of our client update that the round
  benchmark compares against (needs the ``bench`` extra, ``pip install 'fedjax-rcl[bench]'``);
- ``trace_summary``: a JAX profiler trace summarised as shares of kernel categories.
"""
