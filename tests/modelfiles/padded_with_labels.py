import torch


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(100, 8)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, tokens):
        return self.head(self.emb(tokens).mean(1))


def build_model():
    return Classifier()


def make_batch(n):
    # a classifier's batch padded to its longest sample, with one label per sample: the
    # labels grow as a batch does, the tokens' length with the batch too
    length = 5 + 3 * n
    return torch.randint(0, 100, (n, length)), torch.randint(0, 4, (n,))
