"""The housing regression MLP of the seeds (13 -> 16 -> 32 -> 1, ReLU).

Same attribute names as the seed's ``Net1`` (``layer1``/``layer2``/``layer3``, each an
``nn.Sequential`` holding one ``nn.Linear``), so its state_dict keys
(``layer1.0.weight`` ...) load weights saved by the seed's script.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class HousingNet(nn.Module):
    """``in_dim -> n_hidden_1 -> n_hidden_2 -> out_dim`` with ReLU between layers.

    Unlike the seed, ``forward`` prints nothing (a print per call costs time in the loop).
    """

    def __init__(
        self, in_dim: int = 13, n_hidden_1: int = 16, n_hidden_2: int = 32, out_dim: int = 1
    ) -> None:
        super().__init__()
        self.layer1 = nn.Sequential(nn.Linear(in_dim, n_hidden_1))
        self.layer2 = nn.Sequential(nn.Linear(n_hidden_1, n_hidden_2))
        self.layer3 = nn.Sequential(nn.Linear(n_hidden_2, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The submodules from _modules: ``self.layer1`` goes through nn.Module.__getattr__
        # (~0.5 us each, three per step, in a loop whose steps take ~300 us). The same
        # objects, so hooks, wrappers set with setattr and replicas behave alike.
        layers = self._modules
        layer1, layer2, layer3 = layers["layer1"], layers["layer2"], layers["layer3"]
        assert layer1 is not None and layer2 is not None and layer3 is not None
        out: torch.Tensor = layer3(F.relu(layer2(F.relu(layer1(x)))))
        return out

    def as_sequential(self) -> nn.Sequential:
        """``Sequential(layer1, ReLU, layer2, ReLU, layer3)`` sharing this model's layers.

        Its output equals ``forward``'s; training either trains both.
        """
        return nn.Sequential(self.layer1, nn.ReLU(), self.layer2, nn.ReLU(), self.layer3)
