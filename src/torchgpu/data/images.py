"""Synthetic image classification data for LeNet-5 and ResNet-50.

LeNet: 1x28x28 images, 10 classes. Each class has a fixed prototype (three Gaussian
blobs at class-specific places); an image is its class prototype shifted by up to
``MAX_SHIFT`` pixels plus Gaussian noise, so there is a real signal to learn (the loss
falls within an epoch) yet single pixels are unreliable.

ResNet-50: 3x128x128 standard-normal images with uniformly random labels, as in the
seed's model-parallel timing experiment; it measures speed and memory, not learning
(a network can only memorise random labels).
"""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from torchgpu.data.base import ExampleData
from torchgpu.errors import DataError

LENET_CLASSES = 10
LENET_SIZE = 2560  # 2048 train + 512 test
RESNET_SIZE = 72  # 48 train + 24 test: small, the example is about speed and memory
RESNET_CLASSES = 1000  # as the seed
MAX_SHIFT = 2  # pixels
NOISE_STD = 0.8


def _check_size(name: str, size: int, minimum: int) -> None:
    if size < minimum:
        raise DataError(
            f"size={size} is too small for the {name} example: it needs at least {minimum} "
            "images (some for training, some for testing); pass a larger size"
        )


def _prototypes(generator: torch.Generator) -> torch.Tensor:
    """``(10, 28, 28)``: three unit-height Gaussian blobs per class."""
    coords = torch.arange(28, dtype=torch.float32)
    centres = torch.rand(LENET_CLASSES, 3, 2, generator=generator) * 16 + 6  # keep inside
    widths = torch.rand(LENET_CLASSES, 3, generator=generator) * 2 + 2
    dy = coords.view(1, 1, 28, 1) - centres[..., 0].view(LENET_CLASSES, 3, 1, 1)
    dx = coords.view(1, 1, 1, 28) - centres[..., 1].view(LENET_CLASSES, 3, 1, 1)
    blobs = torch.exp(-(dy**2 + dx**2) / (2 * widths.view(LENET_CLASSES, 3, 1, 1) ** 2))
    return blobs.sum(dim=1).clamp(max=1.0) * 2.0


def lenet_data(seed: int = 0, size: int | None = None) -> ExampleData:
    """``size`` images (default 2560: 2048 train, 512 test; a fifth held out for testing)."""
    total = LENET_SIZE if size is None else size
    _check_size("lenet", total, 2)
    g = torch.Generator().manual_seed(seed)
    protos = _prototypes(torch.Generator().manual_seed(28))  # classes fixed across seeds
    labels = torch.randint(0, LENET_CLASSES, (total,), generator=g)
    images = protos[labels]
    shifts = torch.randint(-MAX_SHIFT, MAX_SHIFT + 1, (total, 2), generator=g)
    for sy in range(-MAX_SHIFT, MAX_SHIFT + 1):  # 25 vectorised rolls, not one per image
        for sx in range(-MAX_SHIFT, MAX_SHIFT + 1):
            mask = (shifts[:, 0] == sy) & (shifts[:, 1] == sx)
            images[mask] = torch.roll(images[mask], shifts=(sy, sx), dims=(1, 2))
    images = images + torch.randn(images.shape, generator=g) * NOISE_STD
    images = images.unsqueeze(1)
    n_test = max(1, round(total * 0.2))
    return ExampleData(
        train=TensorDataset(images[n_test:], labels[n_test:]),
        test=TensorDataset(images[:n_test], labels[:n_test]),
        task="classification",
        input_shape=(1, 28, 28),
        num_outputs=LENET_CLASSES,
        feature_names=None,
        description=f"synthetic 1x28x28 images, 10 classes (noisy shifted blob prototypes): "
        f"{total - n_test} train + {n_test} test",
    )


def resnet50_data(
    seed: int = 0,
    size: int | None = None,
    num_classes: int = RESNET_CLASSES,
    image_size: int = 128,
) -> ExampleData:
    """``size`` random images (default 72: 48 train, 24 test) with random labels."""
    total = RESNET_SIZE if size is None else size
    _check_size("resnet50", total, 2)
    if num_classes < 1 or image_size < 32:
        raise DataError(
            f"num_classes={num_classes}, image_size={image_size} cannot work: ResNet-50 "
            "needs at least 1 class and images of at least 32x32 pixels"
        )
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(total, 3, image_size, image_size, generator=g)
    labels = torch.randint(0, num_classes, (total,), generator=g)
    n_test = max(1, total // 3)
    return ExampleData(
        train=TensorDataset(images[n_test:], labels[n_test:]),
        test=TensorDataset(images[:n_test], labels[:n_test]),
        task="classification",
        input_shape=(3, image_size, image_size),
        num_outputs=num_classes,
        feature_names=None,
        description=f"random 3x{image_size}x{image_size} images with random labels over "
        f"{num_classes} classes (the seed's ResNet-50 timing data): "
        f"{total - n_test} train + {n_test} test",
    )
