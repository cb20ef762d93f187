"""The models of the gradient zoo (perf/studies/zoo.py): one next-byte loss for all.

Every model maps (tokens, targets), each (batch, seq_len) int64 bytes, to the
mean cross-entropy of the next byte, so one training loop and one text
(:class:`llama.TextData`) serve them all:

* ``llama``: the project's byte-level Llama (perf/studies/llama.py);
  ``llama-pos`` the same with a learned table of absolute positions instead
  of rotary ones;
* ``gpt2``, ``hf-llama``, ``opt``, ``neox``: Hugging Face GPT-2, Llama, OPT
  and GPT-NeoX built from their configs (``transformers``; nothing
  downloaded, weights from the seed);
* ``mlp``: a next-byte MLP over the embeddings of the 8 previous bytes;
* ``conv``: a causal, dilated 1-D convolutional net over byte embeddings;
* ``lstm``: a two-layer LSTM over byte embeddings.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from llama import VOCAB, LlamaConfig, build_model
from torch import nn

#: context of the MLP (bytes before the predicted one)
MLP_CONTEXT = 8


class NextByteMLP(nn.Module):
    """Embed the previous MLP_CONTEXT bytes, concatenate, three linear layers."""

    def __init__(self, width: int, embed: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, embed)
        self.fc1 = nn.Linear(MLP_CONTEXT * embed, width)
        self.fc2 = nn.Linear(width, width)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        e = self.embed(tokens)  # (b, t, embed)
        pad = torch.zeros_like(e[:, : MLP_CONTEXT - 1])
        ctx = torch.cat([pad, e], 1).unfold(1, MLP_CONTEXT, 1)  # (b, t, embed, ctx)
        h = F.gelu(self.fc1(ctx.transpose(-1, -2).flatten(-2)))
        logits = self.out(F.gelu(self.fc2(h)))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class CausalConvNet(nn.Module):
    """Residual blocks of a causal Conv1d (kernel 5, dilation 1, 2, 4) and GELU."""

    def __init__(self, width: int, layers: int = 3, kernel: int = 5):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.convs = nn.ModuleList(
            nn.Conv1d(width, width, kernel, dilation=2**i) for i in range(layers)
        )
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(1, 2)  # (b, width, t)
        for conv in self.convs:
            left = (conv.kernel_size[0] - 1) * conv.dilation[0]
            x = x + F.gelu(conv(F.pad(x, (left, 0))))
        logits = self.head(x.transpose(1, 2))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class ByteLSTM(nn.Module):
    """Embed, two LSTM layers of ``width``, a linear head."""

    def __init__(self, width: int, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.lstm = nn.LSTM(width, width, layers, batch_first=True)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        logits = self.head(hidden)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class HFNextByte(nn.Module):
    """A Hugging Face causal LM (from a config) behind the next-byte loss."""

    def __init__(self, lm: Any):
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=tokens).logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _hf(kind: str, width: int, seq_len: int) -> nn.Module:
    import transformers

    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=seq_len, n_embd=width, n_layer=4, n_head=4
        )
        return HFNextByte(transformers.GPT2LMHeadModel(cfg))
    if kind == "opt":  # learned positions (two rows of offset), ReLU MLP, tied head
        cfg = transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            word_embed_proj_dim=width,
            ffn_dim=4 * width,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=seq_len,
        )
        return HFNextByte(transformers.OPTForCausalLM(cfg))
    if kind == "neox":  # fused query-key-value, partial rotary, parallel residual
        cfg = transformers.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=4 * width,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=seq_len,
        )
        return HFNextByte(transformers.GPTNeoXForCausalLM(cfg))
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=width * 43 // 16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq_len,
        tie_word_embeddings=False,
    )
    return HFNextByte(transformers.LlamaForCausalLM(cfg))


def build(kind: str, width: int, seq_len: int, seed: int) -> nn.Module:
    """The model ``kind`` at ``width``, weights from ``seed`` alone (torch RNG left as it was)."""
    if kind in ("llama", "llama-pos"):
        positions = "learned" if kind == "llama-pos" else "rotary"
        cfg = LlamaConfig(d_model=width, ff=width * 43 // 16, seq_len=seq_len, positions=positions)
        return build_model(cfg, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if kind in ("gpt2", "hf-llama", "opt", "neox"):
            return _hf(kind, width, seq_len)
        if kind == "mlp":
            return NextByteMLP(width)
        if kind == "conv":
            return CausalConvNet(width)
        if kind == "lstm":
            return ByteLSTM(width)
    raise ValueError(f"unknown zoo model {kind!r}")
