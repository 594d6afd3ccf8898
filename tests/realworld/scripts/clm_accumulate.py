"""Causal language modelling with gradient accumulation, the ``run_clm_no_trainer`` way.

Imitates: transformers' ``examples/pytorch/language-modeling/run_clm_no_trainer.py``: a GPT-2
built from a config, the dataset already grouped into blocks (rows of token lists, as
``group_texts`` leaves them), ``default_data_collator``, AdamW over two parameter groups
(no weight decay for biases and LayerNorm weights), a linear schedule, and Accelerate's
``accelerator.accumulate(model)`` with ``--gradient_accumulation_steps``. Synthetic tokens, a
tiny config, CPU.

memkit pitfall it exercises: gradient accumulation keeps the gradients of the first
micro-batch alive through the forwards of micro-batches 2..k (with the previous micro-batch's
outputs). A probe that frees gradients before every forward answers a size that fits the
script only without accumulation.

Run: ``python clm_accumulate.py --per_device_train_batch_size 8
--gradient_accumulation_steps 4``; the probe reads it as a model file:
``memkit probe tests/realworld/scripts/clm_accumulate.py --device cpu --budget 128MiB
--target-batch 64``.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

BLOCK_SIZE = 64
CONFIG = GPT2Config(
    vocab_size=8192, n_positions=BLOCK_SIZE, n_embd=128, n_layer=2, n_head=2,
    bos_token_id=0, eos_token_id=0,
)  # fmt: skip


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT2LMHeadModel(CONFIG)


def build_optimizer(params) -> torch.optim.Optimizer:
    """AdamW: the same state (two moments per parameter) as the script's two groups."""
    return torch.optim.AdamW(params, lr=5e-5)


def grouped(model: torch.nn.Module, weight_decay: float = 0.0) -> list[dict]:
    """The script's parameter groups: no weight decay for biases and LayerNorm weights."""
    no_decay = ["bias", "layer_norm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]  # fmt: skip


def make_batch(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab_size, (batch_size, BLOCK_SIZE))
    return {"input_ids": ids, "labels": ids}


def lm_dataset(rows: int) -> list[dict[str, list[int]]]:
    """Rows of token lists, as ``group_texts`` leaves the tokenized dataset."""
    draw = torch.Generator().manual_seed(42)
    ids = torch.randint(0, CONFIG.vocab_size, (rows, BLOCK_SIZE), generator=draw).tolist()
    return [{"input_ids": row, "labels": list(row)} for row in ids]


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    dataset: list[dict[str, list[int]]],
    batch_size: int,
    accumulation: int,
    max_train_steps: int,
) -> None:
    """The script's training loop, through Accelerate."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=True)
    train_dataloader = DataLoader(
        dataset, shuffle=True, collate_fn=default_data_collator, batch_size=batch_size
    )
    lr_scheduler = get_scheduler(
        name="linear", optimizer=optimizer, num_warmup_steps=0,
        num_training_steps=max_train_steps * accumulation,
    )  # fmt: skip
    model, optimizer, train_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, lr_scheduler
    )
    model.train()
    completed_steps = 0
    for batch in train_dataloader:
        with accelerator.accumulate(model):
            outputs = model(**batch)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        if completed_steps >= max_train_steps:
            break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--max_train_steps", type=int, default=2)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    args = parser.parse_args()
    model = build_model()
    optimizer = torch.optim.AdamW(grouped(model, args.weight_decay), lr=5e-5)
    rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
    dataset = lm_dataset(rows * args.max_train_steps)
    train(model, optimizer, dataset, args.per_device_train_batch_size,
          args.gradient_accumulation_steps, args.max_train_steps)  # fmt: skip


if __name__ == "__main__":
    main()
