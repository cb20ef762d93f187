"""The gradient zoo: per-rank gradients of several models and regimes, made once and cached.

Two halves: :data:`TUNING`, the sources GeoFP8's defaults are chosen on, and
:data:`HELDOUT`, sources no default was chosen on, added afterwards with
what the tuning half lacks (learned position tables, 4 and 8 ranks, 512
tokens per rank, OPT, GPT-NeoX and an LSTM, later steps); the studies
report them side by side (perf/studies/geo_heldout.py).

A source is a model (perf/studies/zoo_models.py) at a width, a per-rank
micro-batch of ``tokens`` bytes and a phase: ``early`` records the first
``window`` steps from the initial weights, ``late`` trains ``late`` steps
first. Training is data-parallel on ``world`` ranks simulated in one
process, as perf/studies/geo_real_gradients.py does: every step each rank
takes its own slice of the step's global batch (:class:`llama.TextData`),
computes its gradient, and AdamW steps on the exact average. The recorded
steps keep every rank's gradient of every parameter (float32, exact), so a
codec sees the same per-rank inputs in the same order as in training.

Cache: ``$GEOCOMM_ZOO_CACHE`` (default ``$TMPDIR/geocomm_zoo``, outside the
repository), one ``.npz`` per source named by its config's hash.

    python perf/studies/zoo.py            # make (or find) every source, list them
    python perf/studies/zoo.py --only gpt2-256-2k-late32
    python perf/studies/zoo.py --only heldout
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

SEQ_LEN = 128
#: bump when the way gradients are made changes (invalidates the cache)
ZOO_VERSION = 1


@dataclass(frozen=True)
class Source:
    """One zoo entry: model, width, per-rank tokens per step, phase."""

    model: str
    width: int
    tokens: int
    late: int = 0  # AdamW steps before the recorded window (0: early)
    window: int = 8  # recorded steps
    world: int = 2
    seed: int = 0
    lr: float = 2e-3

    @property
    def name(self) -> str:
        phase = f"late{self.late}" if self.late else "early"
        ranks = f"-x{self.world}" if self.world != 2 else ""
        return f"{self.model}-{self.width}-{self.tokens / 1024:g}k-{phase}{ranks}"

    def key(self) -> str:
        text = json.dumps({**asdict(self), "version": ZOO_VERSION}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


#: The tuning half: the byte-level Llama at three widths, GPT-2 and Llama from
#: Hugging Face configs, an MLP and a conv net; 2K and 16K tokens per rank on 2
#: ranks; early and late (the zoo the defaults were first chosen on).
TUNING: tuple[Source, ...] = (
    Source("llama", 256, 2048),
    Source("llama", 256, 2048, late=32),
    Source("llama", 128, 16384),
    Source("llama", 512, 2048, late=16),
    Source("gpt2", 256, 2048, late=32),
    Source("hf-llama", 256, 2048),
    Source("mlp", 512, 2048, late=32),
    Source("conv", 128, 16384, late=16),
)
#: The held-out half (chosen before any of it was measured): the Llama with learned
#: positions (the model of issue 40: 2 ranks of 2K tokens late in training, and 8
#: ranks of 512 tokens early), GPT-2 on 8 ranks of 512 tokens, OPT and GPT-NeoX, the
#: Hugging Face Llama at width 384 on 4 ranks, an LSTM on 16K tokens, an MLP with a
#: 1024 x 1024 layer; 12 recorded steps each.
HELDOUT: tuple[Source, ...] = (
    Source("llama-pos", 256, 2048, late=96, window=12),
    Source("llama-pos", 256, 512, window=12, world=8),
    Source("gpt2", 192, 512, late=64, window=12, world=8),
    Source("opt", 256, 4096, late=48, window=12),
    Source("neox", 320, 4096, window=12, world=4),
    Source("hf-llama", 384, 1024, late=64, window=12, world=4),
    Source("lstm", 256, 16384, late=24, window=12),
    Source("mlp", 1024, 2048, late=48, window=12, world=4),
)
SOURCES: tuple[Source, ...] = TUNING + HELDOUT
HALVES = {"tuning": TUNING, "heldout": HELDOUT}


def cache_dir() -> Path:
    default = Path(tempfile.gettempdir()) / "geocomm_zoo"
    return Path(os.environ.get("GEOCOMM_ZOO_CACHE", default))


def make(src: Source) -> dict[str, Any]:
    """Train ``src`` and record its window: {"names", "steps": [[{name: grad}] per rank]}."""
    import torch
    from llama import LlamaConfig, TextData, TrainConfig, apply_update, make_optimizer, train_step
    from zoo_models import build

    torch.set_num_threads(1)
    model = build(src.model, src.width, SEQ_LEN, src.seed)
    tc = TrainConfig(lr=src.lr)
    opt = make_optimizer(model, tc)
    data = TextData(LlamaConfig(seq_len=SEQ_LEN, batch=src.tokens // SEQ_LEN), src.seed)
    params = dict(model.named_parameters())
    steps, losses = [], []
    for step in range(src.late + src.window):
        local, loss = [], 0.0
        for rank in range(src.world):
            loss += train_step(model, opt, *data.batches("train", rank, src.world, step))
            local.append({n: p.grad.detach().numpy().copy() for n, p in params.items()})
        for n, p in params.items():
            p.grad.copy_(torch.from_numpy(sum(g[n] for g in local) / src.world))
        apply_update(model, opt, tc, step)
        losses.append(loss / src.world)
        if step >= src.late:
            steps.append(local)
    return {"names": list(params), "steps": steps, "loss": losses}


def _save(path: Path, made: dict[str, Any], src: Source) -> None:
    arrays = {
        f"{s}/{r}/{n}": g[n]
        for s, ranks in enumerate(made["steps"])
        for r, g in enumerate(ranks)
        for n in made["names"]
    }
    meta = {"source": asdict(src), "names": made["names"], "loss": made["loss"]}
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def load(src: Source, verbose: bool = True) -> dict[str, Any]:
    """The source's recorded window, made and cached on first use."""
    path = cache_dir() / f"{src.name}-{src.key()}.npz"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        made = make(src)
        _save(path, made, src)
        if verbose:
            print(f"# made {src.name} in {time.perf_counter() - start:.0f} s -> {path}", flush=True)
    with np.load(path) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        names = meta["names"]
        steps = [
            [{n: z[f"{s}/{r}/{n}"] for n in names} for r in range(src.world)]
            for s in range(src.window)
        ]
    return {"source": src, "names": names, "steps": steps, "loss": meta["loss"]}


def select(only: str | None) -> list[Source]:
    """The sources named in the comma-separated ``only`` (all when None); a name may
    be a half, ``tuning`` or ``heldout``."""
    if not only:
        return list(SOURCES)
    wanted = only.split(",")
    chosen = [s for s in SOURCES if s.name in wanted or any(s in HALVES.get(w, ()) for w in wanted)]
    missing = set(wanted) - {s.name for s in chosen} - set(HALVES)
    if missing:
        raise SystemExit(
            f"unknown zoo sources {sorted(missing)}; known {[s.name for s in SOURCES]}"
        )
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help="comma-separated source names")
    args = p.parse_args(argv)
    for src in select(args.only):
        z = load(src)
        mats = [n for n in z["names"] if z["steps"][0][0][n].ndim >= 2]
        params = sum(z["steps"][0][0][n].size for n in z["names"])
        print(
            f"{src.name:28s} {params / 1e6:6.2f}M params, {len(mats):3d} matrices, "
            f"loss {z['loss'][0]:.3f} -> {z['loss'][-1]:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
