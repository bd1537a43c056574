import pytest
import torch

from gradsum.train.models import MODEL_NAMES, build_model, count_parameters, input_shape

# Reference counts for the CIFAR variants (docs/scheduling.md, IMerge evaluation).
EXPECTED = {
    "vgg16": 14_728_266,
    "resnet18": 11_173_962,
    "resnet50": 23_520_842,
    "alexnet": 23_272_266,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parameter_counts_match_the_reference(name):
    assert count_parameters(build_model(name)) == EXPECTED[name]


@pytest.mark.parametrize("name", ["resnet18", "alexnet", "digits-mlp", "digits-cnn"])
def test_forward_gives_one_logit_per_class(name):
    model = build_model(name, num_classes=7)
    out = model(torch.randn(2, *input_shape(name)))
    assert out.shape == (2, 7)


def test_digits_models_accept_images_and_flat_vectors():
    model = build_model("digits-cnn")
    flat = torch.randn(3, 64)
    assert torch.allclose(model(flat), model(flat.reshape(3, 1, 8, 8)))


def test_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="resnet18") as error:
        build_model("lenet")
    assert all(name in str(error.value) for name in MODEL_NAMES)


def test_names_are_case_insensitive():
    assert count_parameters(build_model("VGG16")) == EXPECTED["vgg16"]
