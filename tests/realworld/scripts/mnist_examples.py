"""MNIST-shaped training: the shape of pytorch/examples ``mnist/main.py``, on synthetic digits.

Imitates: https://github.com/pytorch/examples/blob/main/mnist/main.py (``Net``, ``train``,
``test``, ``main`` with argparse, Adadelta + StepLR, ``DataLoader``). torchvision is not used:
the dataset keeps a uint8 ``(N, 28, 28)`` tensor in RAM (as ``torchvision.datasets.MNIST`` does
with ``self.data``) and applies its transforms in ``__getitem__``.

memkit pitfalls it exercises:

* the transforms are ``nn.Module`` objects (``ToFloat``, ``Normalize`` with mean/std
  buffers, composed with ``nn.Sequential``) called in ``__getitem__``, once per sample: module
  calls that are data loading, not the model's forward;
* ``test()`` runs ``model.eval()`` + ``torch.no_grad()`` forwards between epochs;
* ``F.log_softmax`` + ``F.nll_loss`` with ``reduction='sum'`` accumulated with ``.item()``;
* ``--num-workers`` > 0 runs the transforms in worker processes.

Run: ``python mnist_examples.py`` (about a second or two), or
``memkit run --device cpu --budget 300MiB mnist_examples.py --epochs 2``.
"""

# ruff: noqa: UP032  (kept as upstream writes it)

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(2304, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


class ToFloat(nn.Module):
    """uint8 (H, W) image -> float (1, H, W) in [0, 1], like transforms.ToTensor()."""

    def forward(self, img):
        return img.unsqueeze(0).float().div(255)


class Normalize(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor(std).view(-1, 1, 1))

    def forward(self, img):
        return (img - self.mean) / self.std


class SyntheticMNIST(Dataset):
    """Stand-in for datasets.MNIST: random "digits" whose label is drawn into the image."""

    def __init__(self, size, train=True, transform=None):
        g = torch.Generator().manual_seed(0 if train else 1)
        self.targets = torch.randint(0, 10, (size,), generator=g)
        data = torch.randint(0, 60, (size, 28, 28), dtype=torch.uint8, generator=g)
        # a bright bar whose row depends on the label, so the model has something to learn
        rows = 2 + 2 * self.targets
        for i in range(size):
            data[i, rows[i] : rows[i] + 2, 4:24] = 255
        self.data = data
        self.transform = transform

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        img, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        return img, target


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print(
                "Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                    epoch,
                    batch_idx * len(data),
                    len(train_loader.dataset),
                    100.0 * batch_idx / len(train_loader),
                    loss.item(),
                )
            )
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()  # sum up batch loss
            pred = output.argmax(dim=1, keepdim=True)  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)

    print(
        "\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n".format(
            test_loss,
            correct,
            len(test_loader.dataset),
            100.0 * correct / len(test_loader.dataset),
        )
    )


def main():
    # Training settings
    parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        metavar="N",
        help="input batch size for training (default: 64)",
    )
    parser.add_argument(
        "--test-batch-size",
        type=int,
        default=1000,
        metavar="N",
        help="input batch size for testing (default: 1000)",
    )
    parser.add_argument(
        "--epochs", type=int, default=2, metavar="N", help="number of epochs to train (default: 2)"
    )
    parser.add_argument(
        "--lr", type=float, default=1.0, metavar="LR", help="learning rate (default: 1.0)"
    )
    parser.add_argument(
        "--gamma",
        type=float,
        default=0.7,
        metavar="M",
        help="Learning rate step gamma (default: 0.7)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", default=False, help="quickly check a single pass"
    )
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (default: 1)")
    parser.add_argument(
        "--log-interval",
        type=int,
        default=10,
        metavar="N",
        help="how many batches to wait before logging training status",
    )
    parser.add_argument(
        "--num-workers",
        type=int,
        default=0,
        metavar="N",
        help="DataLoader worker processes (default: 0)",
    )
    parser.add_argument(
        "--train-size",
        type=int,
        default=1024,
        metavar="N",
        help="number of synthetic training images (default: 1024)",
    )
    parser.add_argument(
        "--test-size",
        type=int,
        default=512,
        metavar="N",
        help="number of synthetic test images (default: 512)",
    )
    parser.add_argument(
        "--save-model", action="store_true", default=False, help="For Saving the current Model"
    )
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cpu")

    train_kwargs = {"batch_size": args.batch_size}
    test_kwargs = {"batch_size": args.test_batch_size}
    if args.num_workers > 0:
        cuda_kwargs = {"num_workers": args.num_workers, "persistent_workers": True}
        train_kwargs.update(cuda_kwargs)
        test_kwargs.update(cuda_kwargs)

    transform = nn.Sequential(ToFloat(), Normalize((0.1307,), (0.3081,)))
    dataset1 = SyntheticMNIST(args.train_size, train=True, transform=transform)
    dataset2 = SyntheticMNIST(args.test_size, train=False, transform=transform)
    train_loader = DataLoader(dataset1, shuffle=True, **train_kwargs)
    test_loader = DataLoader(dataset2, **test_kwargs)

    model = Net().to(device)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)

    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model:
        torch.save(model.state_dict(), "mnist_cnn.pt")


if __name__ == "__main__":
    main()
