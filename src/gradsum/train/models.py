"""Model definitions used by training, profiling and the scheduling simulator.

CIFAR-style networks (3×32×32 inputs) as used by the IMerge evaluation, plus two small models for
scikit-learn's 8×8 digits (64 inputs, 10 classes) that train in seconds on a CPU.

Parameter counts at ``num_classes=10`` (checked by tests):

=========== ============ ==========================================================
name        parameters   variant
=========== ============ ==========================================================
resnet18    11,173,962   BasicBlock ×[2, 2, 2, 2], 3×3 stem, no max-pool
resnet50    23,520,842   Bottleneck ×[3, 4, 6, 3], 3×3 stem, no max-pool
vgg16       14,728,266   13 conv3×3 + BatchNorm, one 512→classes linear layer
alexnet     23,272,266   5 conv + 4096-wide FC layers (see :class:`AlexNet`)
digits-mlp       9,610   64 → 128 → 10
digits-cnn       6,090   two 3×3 conv layers, pooled to 32×2×2, 128 → 10 linear layer
gpt          3,257,856   byte-level causal LM: 4 layers, width 256, 4 heads, context 128
                         (at ``num_classes=256``; sizes are options, see :class:`GPT`)
=========== ============ ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .config import MODEL_NAMES


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = _projection(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.shortcut = _projection(in_planes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


def _projection(in_planes: int, out_planes: int, stride: int) -> nn.Module:
    """Identity when shapes agree, else a 1×1 convolution + BatchNorm (ResNet option B)."""
    if stride == 1 and in_planes == out_planes:
        return nn.Identity()
    return nn.Sequential(
        nn.Conv2d(in_planes, out_planes, 1, stride, bias=False), nn.BatchNorm2d(out_planes)
    )


class ResNet(nn.Module):
    """CIFAR ResNet: 3×3 stem at full resolution, four stages, global average pool."""

    def __init__(
        self, block: type[BasicBlock | Bottleneck], depths: list[int], num_classes: int = 10
    ) -> None:
        super().__init__()
        self.in_planes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        stages = []
        for index, (planes, depth) in enumerate(zip((64, 128, 256, 512), depths, strict=True)):
            stages.append(self._stage(block, planes, depth, stride=1 if index == 0 else 2))
        self.layers = nn.Sequential(*stages)
        self.linear = nn.Linear(512 * block.expansion, num_classes)

    def _stage(self, block, planes: int, depth: int, stride: int) -> nn.Sequential:
        blocks = []
        for block_stride in [stride] + [1] * (depth - 1):
            blocks.append(block(self.in_planes, planes, block_stride))
            self.in_planes = planes * block.expansion
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.linear(torch.flatten(nn.functional.adaptive_avg_pool2d(out, 1), 1))


_VGG16_CONFIG = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M"]
_VGG16_CONFIG += [512, 512, 512, "M", 512, 512, 512, "M"]


class VGG16(nn.Module):
    """CIFAR VGG16 with BatchNorm; five pools take 32×32 to 1×1: the classifier is 512→classes."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in _VGG16_CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(channels, item, 3, padding=1), nn.BatchNorm2d(item)]
                layers.append(nn.ReLU(inplace=True))
                channels = item
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class AlexNet(nn.Module):
    """CIFAR AlexNet *with* the 4096-wide fully connected layers: 23,272,266 parameters.

    Features: conv 3→64 (3×3, stride 2), max-pool, conv 64→192, max-pool, conv 192→384,
    conv 384→256, conv 256→256, max-pool (all 3×3, padding 1), leaving 256×2×2. Classifier:
    dropout, 1024→4096, dropout, 4096→4096, 4096→classes. Of the variants in use (2.47M without the
    4096-wide layers, 23.3M with them, 57.0M torchvision-style) this is the 23.3M one: 90% of its
    parameters sit in the two FC layers whose compute is tiny, which is what makes AlexNet the
    communication-heavy benchmark of the IMerge evaluation.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 192, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(192, 384, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(),
            nn.Linear(256 * 2 * 2, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class DigitsMLP(nn.Module):
    """64 → 128 → classes; accepts (N, 64) or (N, 1, 8, 8)."""

    def __init__(self, num_classes: int = 10, hidden: int = 128) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.flatten(x, 1))


class DigitsWide(nn.Module):
    """64 → 2048 → 2048 → classes (4.35M parameters, 97% in the middle layer): a model whose
    gradient exchange dwarfs its compute, for comparing communication schedules."""

    def __init__(self, num_classes: int = 10, hidden: int = 2048) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(torch.flatten(x, 1))


class DigitsCNN(nn.Module):
    """Two 3×3 convolutions (1→16→32), pooled to 32×2×2, and a 128→classes linear layer."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(2),
        )
        self.classifier = nn.Linear(32 * 2 * 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = x.reshape(x.shape[0], 1, 8, 8)
        return self.classifier(torch.flatten(self.features(images), 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: attention and a 4×-wide GELU MLP, each residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


@dataclass(frozen=True)
class GPTSizes:
    layers: int = 4
    width: int = 256
    heads: int = 4
    context: int = 128


class GPT(nn.Module):
    """A GPT-2-style causal language model over bytes: token and learned position embeddings,
    pre-LayerNorm blocks, a final LayerNorm and an output layer tied to the token embedding.

    Input: (N, T) integer tokens (any integer dtype; T ≤ context). Output: (N, T, vocab) logits
    of each next token. Weights start as GPT-2's (normal, std 0.02; residual projections scaled
    by 1/√(2·layers)), so that a few hundred steps already show the loss curve's shape.
    """

    def __init__(self, vocab: int = 256, sizes: GPTSizes = GPTSizes()) -> None:
        super().__init__()
        self.sizes = sizes
        self.token = nn.Embedding(vocab, sizes.width)
        self.position = nn.Embedding(sizes.context, sizes.width)
        self.blocks = nn.Sequential(*(Block(sizes.width, sizes.heads) for _ in range(sizes.layers)))
        self.ln = nn.LayerNorm(sizes.width)
        self.head = nn.Linear(sizes.width, vocab, bias=False)
        self.head.weight = self.token.weight
        for name, parameter in self.named_parameters():
            if parameter.dim() >= 2:
                std = 0.02 / (2 * sizes.layers) ** 0.5 if name.endswith("proj.weight") else 0.02
                nn.init.normal_(parameter, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(parameter)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.sizes.context:
            raise ValueError(f"{length} tokens exceed the model's context of {self.sizes.context}")
        positions = torch.arange(length, device=tokens.device)
        x = self.token(tokens.long()) + self.position(positions)
        return self.head(self.ln(self.blocks(x)))


_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "resnet18": lambda classes: ResNet(BasicBlock, [2, 2, 2, 2], classes),
    "resnet50": lambda classes: ResNet(Bottleneck, [3, 4, 6, 3], classes),
    "vgg16": VGG16,
    "alexnet": AlexNet,
    "digits-mlp": DigitsMLP,
    "digits-cnn": DigitsCNN,
    "digits-wide": DigitsWide,
    "gpt": lambda vocab, **sizes: GPT(vocab, GPTSizes(**sizes)),
}

if tuple(_BUILDERS) != MODEL_NAMES:  # config.py lists them for the command line without torch
    raise ImportError(f"train/config.py lists {MODEL_NAMES}, the models are {tuple(_BUILDERS)}")

# Input shape of one sample, so profilers and benchmarks can make a batch without a data set.
INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "resnet18": (3, 32, 32),
    "resnet50": (3, 32, 32),
    "vgg16": (3, 32, 32),
    "alexnet": (3, 32, 32),
    "digits-mlp": (64,),
    "digits-cnn": (64,),
    "digits-wide": (64,),
    "gpt": (GPTSizes.context,),  # tokens; a run's --context sets its own
}


def build_model(name: str, num_classes: int = 10, **options) -> nn.Module:
    """A freshly initialised model by name (case-insensitive); see :data:`MODEL_NAMES`.
    ``options`` are the model's sizes (gpt: layers, width, heads, context); the others take
    none."""
    key = name.lower()
    if key not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    if options and key != "gpt":
        raise ValueError(f"model {name!r} takes no size options, got {sorted(options)}")
    return _BUILDERS[key](num_classes, **options)


def input_shape(name: str) -> tuple[int, ...]:
    """Shape of one input sample of model ``name``."""
    key = name.lower()
    if key not in INPUT_SHAPES:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODEL_NAMES)}")
    return INPUT_SHAPES[key]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_sizes(config) -> dict:
    """The size options a job's model is built with (a ``TrainConfig``: gpt's layers, width,
    heads and context; the other models have none)."""
    if config.model.lower() != "gpt":
        return {}
    return {"layers": config.layers, "width": config.width, "heads": config.heads,
            "context": config.context}  # fmt: skip


def sample_shape(config) -> tuple[int, ...]:
    """The shape of one input sample of a job's model (gpt: its configured context)."""
    return (config.context,) if config.model.lower() == "gpt" else input_shape(config.model)
