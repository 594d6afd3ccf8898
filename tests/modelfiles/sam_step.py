"""SAM (davda54/sam, abridged): its second_step() steps a base optimizer over the same
parameters, the optimizer the probe built from build_optimizer() never steps itself."""

import torch


class SAM(torch.optim.Optimizer):  # davda54/sam, abridged
    def __init__(self, params, base_optimizer, rho=0.05, **kwargs):
        defaults = dict(rho=rho, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                e = p.grad * 0.05
                p.add_(e)
                self.state[p]["e_w"] = e

    @torch.no_grad()
    def second_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                p.sub_(self.state[p]["e_w"])
        self.base_optimizer.step()


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def build_optimizer(params):
    return SAM(params, torch.optim.SGD, lr=0.1, momentum=0.9)


def make_batch(n):
    return torch.randn(n, 32), torch.randint(0, 2, (n,))


def train_step(model, batch, optimizer):
    def f():
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    f().backward()
    optimizer.first_step()
    optimizer.zero_grad()
    f().backward()
    optimizer.second_step()
    optimizer.zero_grad()
