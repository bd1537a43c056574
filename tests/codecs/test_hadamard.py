import pytest
import torch

from gradsum.codecs.thc.hadamard import Rotation, fwht_, hadamard_matrix, padded_length


@pytest.mark.parametrize("size", [1, 2, 8, 32, 64, 256, 4096])
def test_fwht_matches_dense_matrix(size):
    x = torch.randn(size, generator=torch.Generator().manual_seed(size), dtype=torch.float32)
    expected = hadamard_matrix(size) @ x / size**0.5
    assert torch.allclose(fwht_(x.clone(), size), expected, atol=1e-4)


def test_blocked_transform_rotates_each_block_independently():
    x = torch.randn(4 * 64, generator=torch.Generator().manual_seed(1))
    blocked = fwht_(x.clone(), 64)
    for start in range(0, x.numel(), 64):
        alone = fwht_(x[start : start + 64].clone(), 64)
        assert torch.allclose(blocked[start : start + 64], alone, atol=1e-5)


@pytest.mark.parametrize(
    ("length", "block"), [(1, None), (1000, None), (1 << 12, None), (3000, 1024)]
)
def test_rotation_is_orthonormal_and_invertible(length, block):
    x = torch.randn(length, generator=torch.Generator().manual_seed(length))
    rotation = Rotation(length, block, seed=7, device="cpu")
    y = rotation.forward(x)
    assert y.numel() == padded_length(length, block)
    assert torch.linalg.vector_norm(y) == pytest.approx(
        float(torch.linalg.vector_norm(x)), rel=1e-5
    )
    assert torch.allclose(rotation.inverse(y.clone()), x, atol=1e-5)


def test_rotation_signs_depend_only_on_the_shared_seed():
    a = Rotation(512, None, seed=3, device="cpu")
    b = Rotation(512, None, seed=3, device="cpu")
    c = Rotation(512, None, seed=4, device="cpu")
    assert torch.equal(a.signs, b.signs)
    assert not torch.equal(a.signs, c.signs)


def test_padded_length():
    assert padded_length(1000, None) == 1024
    assert padded_length(1025, 256) == 1280
    assert padded_length(5, 64) == 64
    with pytest.raises(ValueError):
        padded_length(100, 100)
