"""A small Llama-style byte-level decoder for gradient studies (PyTorch, CPU).

Pre-norm blocks (RMSNorm), rotary positions (or a learned table of absolute
positions), multi-head causal attention, SwiGLU MLP, tied or untied
embeddings, vocabulary of the 256 byte values.
The training text is the English of ``pydoc_data.topics`` (the help topics
that ship with CPython, ~0.46 MB), so nothing is downloaded.

Reusable pieces for data-parallel studies:

* :class:`LlamaConfig` (model and batch shape) and :data:`CONFIGS` (``small``
  trains on two CPU cores; ``medium`` and ``7b`` exist for byte accounting);
* ``build_model(cfg, seed)``: identical weights on every rank for one seed;
* :class:`TextData`: ``batches(split, rank, world, step)`` is a pure
  function of (seed, split, step, rank, world): the global batch of a step
  is the same for every world size, rank r takes its slice;
* ``average_gradients(model, codec)``: every parameter's gradient averaged
  over the ranks through ``geocomm.allreduce(..., op="avg", key=name)``.

    python perf/studies/llama.py --steps 50    # a quick single-process run
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 256


@dataclass(frozen=True)
class LlamaConfig:
    """Model and batch shape. ``batch`` counts sequences per rank and step."""

    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    ff: int = 688
    seq_len: int = 128
    batch: int = 8
    tied: bool = False
    positions: str = "rotary"  # or "learned": a table added to the token embeddings
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "ff", "seq_len", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.positions not in ("rotary", "learned"):
            raise ValueError(f"positions must be rotary or learned, got {self.positions!r}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"d_model {self.d_model} must split into {self.n_heads} heads "
                "of even size (rotary pairs)"
            )

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, as ``build_model`` names them."""
        d, f = self.d_model, self.ff
        shapes: dict[str, tuple[int, ...]] = {"embed.weight": (VOCAB, d)}
        if self.positions == "learned":
            shapes["pos.weight"] = (self.seq_len, d)
        for i in range(self.n_layers):
            p = f"blocks.{i}."
            shapes[p + "attn_norm.weight"] = (d,)
            for w in ("wq", "wk", "wv", "wo"):
                shapes[p + f"attn.{w}.weight"] = (d, d)
            shapes[p + "mlp_norm.weight"] = (d,)
            shapes[p + "mlp.gate.weight"] = (f, d)
            shapes[p + "mlp.up.weight"] = (f, d)
            shapes[p + "mlp.down.weight"] = (d, f)
        shapes["norm.weight"] = (d,)
        if not self.tied:
            shapes["head.weight"] = (VOCAB, d)
        return shapes

    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())


CONFIGS: dict[str, LlamaConfig] = {
    # trains at ~1 s/step per rank on one CPU core; matrices 256x256 and 688x256
    "small": LlamaConfig(),
    # shapes of a ~100M-parameter model (bytes accounting, or a GPU)
    "medium": LlamaConfig(d_model=1024, n_layers=8, n_heads=16, ff=2752),
    # the layer shapes of Llama-2 7B (4096x4096 attention, 11008x4096 MLP): bytes only
    "7b": LlamaConfig(d_model=4096, n_layers=32, n_heads=32, ff=11008),
}


# ---------------------------------------------------------------------------
# model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (seq_len, head_dim / 2)."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[..., 2i], x[..., 2i+1]) of x (batch, heads, seq, head_dim)."""
    t = x.shape[-2]
    c, s = cos[:t], sin[:t]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        d = cfg.d_model
        self.heads = cfg.n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)

        q = apply_rotary(heads(self.wq), cos, sin)
        k = apply_rotary(heads(self.wk), cos, sin)
        y = F.scaled_dot_product_attention(q, k, heads(self.wv), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.ff, bias=False)
        self.down = nn.Linear(cfg.ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Byte-level decoder; ``forward(tokens, targets)`` returns the mean cross-entropy."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB, cfg.d_model)
        learned = cfg.positions == "learned"
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model) if learned else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = None if cfg.tied else nn.Linear(cfg.d_model, VOCAB, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_base)
        if learned:  # no rotation: cos 1 and sin 0 leave every pair as it is, exactly
            cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        x = self.norm(x)
        return x @ self.embed.weight.T if self.head is None else self.head(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out = self.logits(tokens)
        return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1))


def build_model(cfg: LlamaConfig, seed: int) -> Llama:
    """The model with weights drawn from ``seed`` alone (same on every rank).

    Matrices ~ N(0, init_std^2), residual outputs (wo, down) scaled by
    1/sqrt(2 n_layers) as in GPT-2; norms start at 1. The global torch RNG
    is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Llama(cfg)
        for name, p in model.named_parameters():
            if p.ndim < 2:
                continue
            std = cfg.init_std
            if name.endswith(("attn.wo.weight", "mlp.down.weight")):
                std /= math.sqrt(2 * cfg.n_layers)
            nn.init.normal_(p, 0.0, std)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == cfg.weight_shapes()
    return model


# ---------------------------------------------------------------------------
# data


def corpus_bytes() -> np.ndarray:
    """The help-topic texts of ``pydoc_data.topics`` in key order, UTF-8, as uint8."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), np.uint8)


class TextData:
    """Train/held-out byte windows with a seed-determined order.

    The first ``1 - holdout`` of the corpus is the training split, the rest
    held out. Step ``step`` of a split draws ``world * batch`` window starts
    from a generator seeded by (seed, split, step); rank r gets windows
    [r * batch, (r + 1) * batch). Each window is seq_len + 1 bytes: inputs
    and next-byte targets.
    """

    SPLITS = ("train", "heldout")

    def __init__(self, cfg: LlamaConfig, seed: int = 0, holdout: float = 0.1):
        data = corpus_bytes()
        cut = int(len(data) * (1 - holdout))
        self.cfg, self.seed = cfg, seed
        self.parts = {"train": data[:cut], "heldout": data[cut:]}
        for name, part in self.parts.items():
            if len(part) <= cfg.seq_len + 1:
                raise ValueError(f"{name} split of {len(part)} bytes is shorter than a window")

    def batches(
        self, split: str, rank: int, world: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch, seq_len) int64, of ``rank`` at ``step``."""
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in a world of {world}")
        part, b, t = self.parts[split], self.cfg.batch, self.cfg.seq_len
        rng = np.random.default_rng([self.seed, self.SPLITS.index(split), step])
        starts = rng.integers(0, len(part) - t - 1, size=world * b)[rank * b : (rank + 1) * b]
        windows = np.stack([part[s : s + t + 1] for s in starts]).astype(np.int64)
        w = torch.from_numpy(windows)
        return w[:, :-1], w[:, 1:]


@torch.no_grad()
def heldout_loss(
    model: Llama, data: TextData, batches: int = 4, rank: int = 0, world: int = 1
) -> float:
    """Mean loss over ``batches`` fixed held-out batches of this rank."""
    model.eval()
    losses = [float(model(*data.batches("heldout", rank, world, i))) for i in range(batches)]
    model.train()
    return float(np.mean(losses))


# ---------------------------------------------------------------------------
# optimizer and data-parallel gradient averaging


@dataclass(frozen=True)
class TrainConfig:
    lr: float = 2e-3
    warmup: int = 20
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip: float = 1.0


def make_optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only."""
    mats = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [
        {"params": mats, "weight_decay": tc.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=tc.betas, eps=tc.eps)


def lr_at(tc: TrainConfig, step: int) -> float:
    """Linear warm-up, then constant."""
    return tc.lr * min(1.0, (step + 1) / max(tc.warmup, 1))


def named_grads(model: nn.Module) -> Iterator[tuple[str, np.ndarray]]:
    """(name, gradient as a writable float32 numpy view) of every parameter with one."""
    for name, p in model.named_parameters():
        if p.grad is not None:
            yield name, p.grad.detach().numpy()


def average_gradients(model: nn.Module, codec: Any = None, comm: Any = None) -> None:
    """Average every gradient over the ranks in place, one ``geocomm.allreduce`` per
    parameter with ``key=name`` (so stateful codecs keep per-parameter geometry).

    ``codec``: an id, config or Codec instance (None: the exact average). Every
    rank must call this with the same parameters in the same order.
    """
    import geocomm

    for name, g in named_grads(model):
        geocomm.allreduce(g, codec=codec, op="avg", out=g, key=name, comm=comm)


def train_step(
    model: Llama, opt: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> float:
    """Forward and backward on this rank's batch; returns the local loss (no update)."""
    opt.zero_grad(set_to_none=False)
    loss = model(tokens, targets)
    loss.backward()
    return float(loss.detach())


def apply_update(model: nn.Module, opt: torch.optim.Optimizer, tc: TrainConfig, step: int) -> None:
    """Clip the (averaged) gradient, set the learning rate, take the AdamW step."""
    if tc.clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), tc.clip)
    for group in opt.param_groups:
        group["lr"] = lr_at(tc, step)
    opt.step()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = CONFIGS[args.config]
    if args.batch:
        cfg = replace(cfg, batch=args.batch)
    tc = TrainConfig()
    model = build_model(cfg, args.seed)
    opt = make_optimizer(model, tc)
    data = TextData(cfg, args.seed)
    print(f"# {args.config}: {cfg.n_params() / 1e6:.2f}M parameters, {cfg}")
    t0 = time.perf_counter()
    for step in range(args.steps):
        loss = train_step(model, opt, *data.batches("train", 0, 1, step))
        apply_update(model, opt, tc, step)
        if step % 10 == 0 or step == args.steps - 1:
            print(
                f"step {step:4d} loss {loss:.4f} heldout {heldout_loss(model, data):.4f} "
                f"{(time.perf_counter() - t0) / (step + 1):.2f} s/step",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
