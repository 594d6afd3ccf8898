"""An RL agent as cleanRL writes one: no forward, only get_value and get_action_and_value."""

import torch
from torch import nn


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.actor = nn.Linear(32, 4)
        self.critic = nn.Linear(32, 1)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(self.body(x))

    def get_action_and_value(self, x: torch.Tensor):
        hidden = self.body(x)
        # (validate_args: checked whatever another test left as the default)
        probs = torch.distributions.Categorical(logits=self.actor(hidden), validate_args=True)
        action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(hidden)


def build_model() -> nn.Module:
    return Agent()


def make_batch(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 16)
