"""An embedding and a vocabulary head in the root, small blocks between: under FSDP the root's
unit (both of them) is all-gathered whole, and sets each rank's peak."""

import torch


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(4096, 64)
        self.blocks = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        self.head = torch.nn.Linear(64, 4096)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def build_model():
    return TinyLM()


def make_batch(batch_size):
    return torch.randint(0, 4096, (batch_size, 8))
