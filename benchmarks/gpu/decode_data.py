"""An image dataset that does real work in ``__getitem__`` (JPEG decode, random crop,
flip, normalise), and a ResNet-50 to train on it: does ``--num-workers auto`` keep the
GPU fed? Used by the GPU kit's ``train-data-wait`` step:

    torchgpu train --model benchmarks/gpu/decode_data.py:model \\
        --data benchmarks/gpu/decode_data.py:data --loss cross_entropy --num-workers auto

``summary.json``'s ``data_wait_share`` is the share of training time the loop waited for
a batch. ``TORCHGPU_DECODE_IMAGES`` sets the number of images (default 6144: 4096 to
train, 2048 held out); ``TORCHGPU_DECODE_SIZE`` the stored size (default 160, cropped
to 128).
"""

from __future__ import annotations

import io
import os

import torch
from torch import nn
from torch.utils.data import Dataset

CLASSES = 100
IMAGES_ENV = "TORCHGPU_DECODE_IMAGES"
SIZE_ENV = "TORCHGPU_DECODE_SIZE"
DISTINCT = 64  # encoded images kept in memory; item i decodes image i % DISTINCT


def _encoded(count: int, size: int, seed: int) -> list[bytes]:
    """``count`` smooth random RGB images as JPEG (quality 90): sizes a camera's photo
    compresses to, unlike white noise (which JPEG cannot shrink)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(count):
        small = torch.rand(3, size // 8, size // 8, generator=g)
        img = nn.functional.interpolate(small[None], size=(size, size), mode="bilinear",
                                        align_corners=False)[0]
        array = (img.clamp(0, 1) * 255).to(torch.uint8).permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=90)
        found.append(buffer.getvalue())
    return found


class JpegImages(Dataset[tuple[torch.Tensor, int]]):
    """``count`` labelled images decoded from JPEG on every access, randomly cropped to
    ``crop`` and flipped (a per-item generator: the same item gives the same crop)."""

    MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)

    def __init__(self, count: int, size: int = 160, crop: int = 128, seed: int = 0) -> None:
        self.count, self.size, self.crop, self.seed = count, size, crop, seed
        self.images = _encoded(DISTINCT, size, seed)
        g = torch.Generator().manual_seed(seed + 1)
        self.labels = torch.randint(0, CLASSES, (count,), generator=g).tolist()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        image = Image.open(io.BytesIO(self.images[index % DISTINCT])).convert("RGB")
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        x = pixels.view(self.size, self.size, 3).permute(2, 0, 1).float().div_(255)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        top, left = (int(v) for v in torch.randint(0, self.size - self.crop + 1, (2,),
                                                   generator=g))
        x = x[:, top:top + self.crop, left:left + self.crop]
        if bool(torch.rand((), generator=g) < 0.5):
            x = x.flip(-1)
        return (x - self.MEAN) / self.STD, self.labels[index]


def data() -> tuple[JpegImages, JpegImages]:
    """The (train, eval) pair ``--data`` takes."""
    count = int(os.environ.get(IMAGES_ENV, "6144"))
    size = int(os.environ.get(SIZE_ENV, "160"))
    held_out = count // 3
    return (JpegImages(count - held_out, size=size, crop=size * 4 // 5, seed=0),
            JpegImages(held_out, size=size, crop=size * 4 // 5, seed=1))


def model() -> nn.Module:
    from torchgpu.models.resnet import resnet50

    return resnet50(num_classes=CLASSES)
