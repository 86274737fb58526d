"""``fedjax_rcl.bench.flops``: the benchmark's FLOP counts, from our models' traced programs.

(Against the PyTorch reference's models, layer by layer: ``tests/test_torch_reference.py``.)"""

import pytest

from fedjax_rcl.bench import flops


def _cnn_macs(side, cin, num_classes=10):
    macs = 0
    for cout in (6, 16):  # 5x5 valid convolutions, each followed by a 2x2 max-pool
        side -= 4
        macs += side * side * cout * cin * 25
        side //= 2
        cin = cout
    dims = [side * side * cin, 120, 84, num_classes]
    return macs + sum(a * b for a, b in zip(dims[:-1], dims[1:], strict=True))


def test_forward_counts_of_moons_cnn_and_resnet18():
    assert flops.forward_flops("cnn") == 2 * _cnn_macs(32, 3) == 1_303_440  # 3.91 MFLOP train
    assert flops.forward_flops("cnn", image_size=28, in_channels=1) == 2 * _cnn_macs(28, 1)
    head = 2 * (84 * 84 + 84 * 256)  # MOON's projection head on the 84-wide embedding
    assert flops.forward_flops("cnn", projection_dim=256) == 1_303_440 + head
    assert flops.forward_flops("resnet18") == 1_110_845_440
    assert flops.forward_flops("resnet18") == pytest.approx(3.33e9 / 3, rel=0.01)
    assert flops.forward_flops("resnet10", width=16) < flops.forward_flops("resnet10")


def test_a_training_step_is_three_forwards_and_moons_five():
    assert flops.train_step_flops("cnn", "fedavg", 50) == 50 * 3 * flops.forward_flops("cnn")
    moon = 50 * 5 * flops.forward_flops("cnn", projection_dim=256)
    assert flops.train_step_flops("cnn", "moon", 50) == moon
