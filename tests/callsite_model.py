"""A model file for the call-site tests (tests/test_views.py): they find these lines by their text."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # LINE fc1
        h = F.gelu(h)  # LINE gelu
        return self.fc2(h)  # LINE fc2


def loss_of(net: Net, x: torch.Tensor) -> torch.Tensor:
    return net(x).square().mean()  # LINE loss
