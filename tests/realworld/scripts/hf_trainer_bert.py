"""Fine-tune a tiny BERT classifier with the Hugging Face ``Trainer``, on synthetic data.

Imitates: the transformers text-classification recipe (``run_glue.py`` / the "Fine-tune a
pretrained model" tutorial): ``BertForSequenceClassification`` + ``TrainingArguments`` +
``Trainer.train()`` + ``Trainer.evaluate()``. The model is built from a small ``BertConfig``
(no download) and the dataset is a plain torch ``Dataset`` of dicts (no ``datasets``).

memkit pitfalls it exercises:

* the training loop is not the user's: accelerate wraps the optimizer
  (``AcceleratedOptimizer``) and the Trainer calls ``accelerator.backward(loss)``, evaluation
  runs inside ``trainer.evaluate()`` every ``--eval-steps`` steps, under ``torch.no_grad``;
* ``--gradient-checkpointing`` recomputes every layer's forward inside backward
  (``torch.utils.checkpoint``): module forwards that happen during the backward phase;
* ``--grad-accum`` gives several forward/backward pairs per optimizer step;
* the model returns a ``ModelOutput`` (a dict subclass), not a tensor.

Run: ``python hf_trainer_bert.py`` (a few seconds, mostly importing transformers), or
``memkit run --device cpu --budget 300MiB hf_trainer_bert.py --gradient-checkpointing``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainingArguments,
)


class SyntheticPairs(Dataset):
    """Token sequences whose label is whether token 5 appears more often than token 6."""

    def __init__(self, n: int, seq_len: int, vocab_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(7, vocab_size, (n, seq_len), generator=g)
        self.input_ids[:, 0] = 2  # [CLS]
        marks = torch.randint(5, 7, (n, seq_len // 4), generator=g)
        self.input_ids[:, 1 : 1 + seq_len // 4] = marks
        self.labels = ((marks == 5).sum(1) > (marks == 6).sum(1)).long()
        lengths = torch.randint(seq_len // 2, seq_len + 1, (n,), generator=g)
        self.attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
        self.input_ids[self.attention_mask == 0] = 0  # [PAD]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[i],
            "attention_mask": self.attention_mask[i],
            "labels": self.labels[i],
        }


def compute_metrics(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--eval-steps", type=int, default=20)
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=512)
    parser.add_argument("--eval-size", type=int, default=128)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--lr", type=float, default=5e-4)
    args = parser.parse_args()

    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    vocab_size = 128
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=2,
        pad_token_id=0,
    )
    model = BertForSequenceClassification(config)

    train_dataset = SyntheticPairs(args.train_size, args.seq_len, vocab_size, seed=0)
    eval_dataset = SyntheticPairs(args.eval_size, args.seq_len, vocab_size, seed=1)

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=args.batch_size,
            per_device_eval_batch_size=args.eval_batch_size,
            gradient_accumulation_steps=args.grad_accum,
            learning_rate=args.lr,
            max_steps=args.max_steps,
            eval_strategy="steps",
            eval_steps=args.eval_steps,
            logging_steps=args.logging_steps,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            gradient_checkpointing=args.gradient_checkpointing,
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(
            model=model,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            compute_metrics=compute_metrics,
        )
        train_result = trainer.train()
        print(f"train: {train_result.metrics}")
        metrics = trainer.evaluate()
        print(f"eval: {metrics}")


if __name__ == "__main__":
    main()
