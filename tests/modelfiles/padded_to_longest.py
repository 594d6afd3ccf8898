import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 100))


def make_batch(n):
    # padded to the longest sample of the batch: a length that changes with the batch
    length = 5 + 3 * n
    return torch.randint(0, 100, (n, length)), torch.randint(0, 100, (n, length))
