"""Models for the study that no library ships: an LSTM classifier and a small UNet.

vramplan estimate benchmarks/accuracy/models.py:lstm --input-shape 64x128
"""

from __future__ import annotations

import torch
from torch import nn


class LSTMClassifier(nn.Module):
    """Two-layer LSTM over (batch, time, features) with a linear head on the last step."""

    def __init__(self, features: int = 128, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class UNet(nn.Module):
    """A two-level UNet for 3-channel images, 10 output channels per pixel."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1),
                nn.BatchNorm2d(cout),
                nn.ReLU(),
                nn.Conv2d(cout, cout, 3, padding=1),
                nn.ReLU(),
            )

        self.down1, self.down2 = block(3, width), block(width, 2 * width)
        self.bottom = block(2 * width, 4 * width)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = block(4 * width, 2 * width)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = block(2 * width, width)
        self.out = nn.Conv2d(width, 10, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(nn.functional.max_pool2d(d1, 2))
        b = self.bottom(nn.functional.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.out(u1)


def lstm() -> nn.Module:
    return LSTMClassifier()


def unet() -> nn.Module:
    return UNet()
