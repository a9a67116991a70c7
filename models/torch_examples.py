"""Small PyTorch modules for `source: {torch: ...}` manifests (configs/models/torch/).

Each factory returns a module in eval mode whose weights come from torch's
default initialisation; the fetch stage calls it under torch.manual_seed(0), so
the export is the same every time. Importing this file needs torch.
"""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    """MobileNetV3-style: pointwise expand, depthwise 3x3, hard-swish, squeeze-excite, project, residual."""

    def __init__(self, channels: int, expand: int) -> None:
        super().__init__()
        wide = channels * expand
        self.expand = nn.Sequential(nn.Conv2d(channels, wide, 1, bias=False), nn.BatchNorm2d(wide), nn.Hardswish())
        self.depthwise = nn.Sequential(
            nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False), nn.BatchNorm2d(wide), nn.Hardswish()
        )
        self.excite = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(wide, wide // 4, 1),
            nn.ReLU(),
            nn.Conv2d(wide // 4, wide, 1),
            nn.Hardsigmoid(),
        )
        self.project = nn.Sequential(nn.Conv2d(wide, channels, 1, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.depthwise(self.expand(x))
        return x + self.project(y * self.excite(y))


class TinyCNN(nn.Module):
    """Stem conv, two residual blocks, upsample + concat (a detector-style neck), pooled classifier."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.SiLU())
        self.blocks = nn.Sequential(_Block(16, 4), _Block(16, 2))
        self.down = nn.Conv2d(16, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        up = nn.functional.interpolate(self.down(x), scale_factor=2.0, mode="nearest")
        features = torch.cat([x, up], dim=1).mean(dim=(2, 3))
        return torch.softmax(self.head(features), dim=-1)


def tiny_cnn() -> nn.Module:
    """The TinyCNN above, 10 classes, in eval mode."""
    return TinyCNN().eval()
