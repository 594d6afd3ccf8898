"""A word-language-model-style LSTM whose batches are (seq, batch): the batch is dimension 1."""

import torch
from torch import nn

SEQ, VOCAB = 35, 500


class LanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(VOCAB, 64)
        self.rnn = nn.LSTM(64, 64)  # batch_first=False, as in pytorch/examples
        self.decoder = nn.Linear(64, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.encoder(tokens))
        logits = self.decoder(output)
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.reshape(-1))


def build_model() -> nn.Module:
    return LanguageModel()


def make_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (SEQ, batch_size)), torch.randint(0, VOCAB, (SEQ, batch_size))
