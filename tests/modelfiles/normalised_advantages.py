"""A PPO-like train_step that normalises its advantages over the minibatch: at batch size 1
their std is NaN, the step makes the parameters NaN, and the next step's Categorical raises a
ValueError on its NaN logits."""

import torch
from no_forward_agent import Agent


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Agent()


def make_batch(batch_size: int):
    return torch.randn(batch_size, 16), torch.randn(batch_size)


def train_step(agent, batch, optimizer):
    obs, advantages = batch
    _, logprob, _, _ = agent.get_action_and_value(obs)
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    loss = -(advantages * logprob).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
