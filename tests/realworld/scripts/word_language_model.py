"""An LSTM language model: the shape of pytorch/examples ``word_language_model/main.py``.

Imitates: https://github.com/pytorch/examples/tree/main/word_language_model (``main.py`` with
``model.RNNModel`` inlined), module-level script code like the original, a synthetic corpus of
token ids instead of ``data.Corpus('./data/wikitext-2')``.

memkit pitfalls it exercises:

* no optimizer at all: manual SGD (``p.data.add_(p.grad, alpha=-lr)``) after
  ``model.zero_grad()``/``loss.backward()``/``clip_grad_norm_``, so steps are not marked by an
  ``optimizer.step()``;
* the hidden state carried across batches and cut with ``repackage_hidden`` (truncated BPTT);
* ``torch.save(model, f)`` pickles the whole module (its class lives in ``__main__``) and
  ``torch.load(f, weights_only=False)`` brings back a *new* model object at the end, followed by
  ``model.rnn.flatten_parameters()`` and a final evaluation with that new object;
* ``evaluate()`` with ``model.eval()`` + ``torch.no_grad()`` after every epoch.

Run: ``python word_language_model.py`` (a second or two), or
``memkit run --device cpu --budget 300MiB word_language_model.py --epochs 3``.
"""

# ruff: noqa: UP032  (kept as upstream writes it)

import argparse
import math
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description="PyTorch Synthetic-corpus RNN/LSTM Language Model")
parser.add_argument("--ntokens", type=int, default=500, help="size of the synthetic vocabulary")
parser.add_argument("--train-tokens", type=int, default=20000, help="tokens in the training split")
parser.add_argument(
    "--model", type=str, default="LSTM", help="type of network (RNN_TANH, RNN_RELU, LSTM, GRU)"
)
parser.add_argument("--emsize", type=int, default=64, help="size of word embeddings")
parser.add_argument("--nhid", type=int, default=64, help="number of hidden units per layer")
parser.add_argument("--nlayers", type=int, default=2, help="number of layers")
parser.add_argument("--lr", type=float, default=20, help="initial learning rate")
parser.add_argument("--clip", type=float, default=0.25, help="gradient clipping")
parser.add_argument("--epochs", type=int, default=2, help="upper epoch limit")
parser.add_argument("--batch_size", type=int, default=20, metavar="N", help="batch size")
parser.add_argument("--bptt", type=int, default=35, help="sequence length")
parser.add_argument(
    "--dropout", type=float, default=0.2, help="dropout applied to layers (0 = no dropout)"
)
parser.add_argument(
    "--tied", action="store_true", help="tie the word embedding and softmax weights"
)
parser.add_argument("--seed", type=int, default=1111, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="report interval")
parser.add_argument(
    "--save",
    type=str,
    default=os.path.join(tempfile.gettempdir(), "wlm_model.pt"),
    help="path to save the final model",
)
args = parser.parse_args()

# Set the random seed manually for reproducibility.
torch.manual_seed(args.seed)

device = torch.device("cpu")

###############################################################################
# Model (model.py)
###############################################################################


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5, tie_weights=False):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ["LSTM", "GRU"]:
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            try:
                nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
            except KeyError as e:
                raise ValueError(
                    """An invalid option for `--model` was supplied,
                                 options are ['LSTM', 'GRU', 'RNN_TANH' or 'RNN_RELU']"""
                ) from e
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)

        # Optionally tie weights as in:
        # "Using the Output Embedding to Improve Language Models" (Press & Wolf 2016)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight

        self.init_weights()

        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (
                weight.new_zeros(self.nlayers, bsz, self.nhid),
                weight.new_zeros(self.nlayers, bsz, self.nhid),
            )
        else:
            return weight.new_zeros(self.nlayers, bsz, self.nhid)


###############################################################################
# Load data
###############################################################################


def synthetic_corpus(ntokens, length, seed):
    """Token ids with some structure: each token is often followed by (token * 7 + 3) % ntokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ntokens, (length,), generator=g)
    follow = torch.rand(length, generator=g) < 0.5
    ids[1:][follow[1:]] = (ids[:-1][follow[1:]] * 7 + 3) % ntokens
    return ids


train_ids = synthetic_corpus(args.ntokens, args.train_tokens, 0)
valid_ids = synthetic_corpus(args.ntokens, args.train_tokens // 10, 1)
test_ids = synthetic_corpus(args.ntokens, args.train_tokens // 10, 2)

# Starting from sequential data, batchify arranges the dataset into columns.
# For instance, with the alphabet as the sequence and batch size 4, we'd get
# ┌ a g m s ┐
# │ b h n t │
# │ c i o u │
# │ d j p v │
# │ e k q w │
# └ f l r x ┘.
# These columns are treated as independent by the model, which means that the
# dependence of e. g. 'g' on 'f' can not be learned, but allows more efficient
# batch processing.


def batchify(data, bsz):
    # Work out how cleanly we can divide the dataset into bsz parts.
    nbatch = data.size(0) // bsz
    # Trim off any extra elements that wouldn't cleanly fit (remainders).
    data = data.narrow(0, 0, nbatch * bsz)
    # Evenly divide the data across the bsz batches.
    data = data.view(bsz, -1).t().contiguous()
    return data.to(device)


eval_batch_size = 10
train_data = batchify(train_ids, args.batch_size)
val_data = batchify(valid_ids, eval_batch_size)
test_data = batchify(test_ids, eval_batch_size)

###############################################################################
# Build the model
###############################################################################

ntokens = args.ntokens
model = RNNModel(
    args.model, ntokens, args.emsize, args.nhid, args.nlayers, args.dropout, args.tied
).to(device)

criterion = nn.NLLLoss()

###############################################################################
# Training code
###############################################################################


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""

    if isinstance(h, torch.Tensor):
        return h.detach()
    else:
        return tuple(repackage_hidden(v) for v in h)


# get_batch subdivides the source data into chunks of length args.bptt.
# If source is equal to the example output of the batchify function, with
# a bptt-limit of 2, we'd get the following two Variables for i = 0:
# ┌ a g m s ┐ ┌ b h n t ┐
# └ b h n t ┘ └ c i o u ┘
# Note that despite the name of the function, the subdivison of data is not
# done along the batch dimension (i.e. dimension 1), since that was handled
# by the batchify function. The chunks are along dimension 0, corresponding
# to the seq_len dimension in the LSTM.


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i : i + seq_len]
    target = source[i + 1 : i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    # Turn on evaluation mode which disables dropout.
    model.eval()
    total_loss = 0.0
    hidden = model.init_hidden(eval_batch_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return total_loss / (len(data_source) - 1)


def train():
    # Turn on training mode which enables dropout.
    model.train()
    total_loss = 0.0
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        # Starting each batch, we detach the hidden state from how it was previously produced.
        # If we didn't, the model would try backpropagating all the way to start of the dataset.
        model.zero_grad()
        hidden = repackage_hidden(hidden)
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()

        # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)

        total_loss += loss.item()

        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            print(
                "| epoch {:3d} | {:5d}/{:5d} batches | lr {:02.2f} | ms/batch {:5.2f} | "
                "loss {:5.2f} | ppl {:8.2f}".format(
                    epoch,
                    batch,
                    len(train_data) // args.bptt,
                    lr,
                    elapsed * 1000 / args.log_interval,
                    cur_loss,
                    math.exp(cur_loss),
                )
            )
            total_loss = 0
            start_time = time.time()


# Loop over epochs.
lr = args.lr
best_val_loss = None

# At any point you can hit Ctrl + C to break out of training early.
try:
    for epoch in range(1, args.epochs + 1):
        epoch_start_time = time.time()
        train()
        val_loss = evaluate(val_data)
        print("-" * 89)
        print(
            "| end of epoch {:3d} | time: {:5.2f}s | valid loss {:5.2f} | valid ppl {:8.2f}".format(
                epoch, (time.time() - epoch_start_time), val_loss, math.exp(val_loss)
            )
        )
        print("-" * 89)
        # Save the model if the validation loss is the best we've seen so far.
        if not best_val_loss or val_loss < best_val_loss:
            with open(args.save, "wb") as f:
                torch.save(model, f)
            best_val_loss = val_loss
        else:
            # Anneal the learning rate if no improvement has been seen in the validation dataset.
            lr /= 4.0
except KeyboardInterrupt:
    print("-" * 89)
    print("Exiting from training early")

# Load the best saved model.
with open(args.save, "rb") as f:
    model = torch.load(f, weights_only=False)
    # after load the rnn params are not a continuous chunk of memory
    # this makes them a continuous chunk, and will speed up forward pass
    # Currently, only rnn model supports flatten_parameters function.
    if args.model in ["RNN_TANH", "RNN_RELU", "LSTM", "GRU"]:
        model.rnn.flatten_parameters()

# Run on test data.
test_loss = evaluate(test_data)
print("=" * 89)
print(f"| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}")
print("=" * 89)
