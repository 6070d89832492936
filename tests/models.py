"""Small models, their data, optimizers and a training-step loop, shared by tests, benchmarks and the demo.

Plain functions (no pytest) so that ``benchmarks/`` and ``python -m shadow demo`` can import them too:

>>> model = build("mlp")
>>> opt = make_optimizer("adam", model.parameters(), "foreach")
>>> losses = train_steps(model, opt, make_batches("mlp", 3), loss_fn("mlp"))
>>> len(losses)
3

Sizes are small on purpose: every model runs a shadowed training step in well under a second on 2 cores.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("mlp", "cnn", "transformer", "lstm")
OPTIMIZERS = ("sgd", "adam", "adamw")
IMPLS = ("forloop", "foreach", "fused")  # the optimizer kernels: for-loop, _foreach_*, _fused_*

_VOCAB = 50
_CLASSES = 5


class MLP(nn.Module):
    def __init__(self, d_in: int = 12, d_hidden: int = 32, d_out: int = _CLASSES):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.fc3 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(self.act(self.fc1(x)))))


class CNN(nn.Module):
    """Conv -> BatchNorm2d -> ReLU -> MaxPool2d -> Dropout -> Linear."""

    def __init__(self, channels: int = 3, width: int = 8, classes: int = _CLASSES):
        super().__init__()
        self.conv = nn.Conv2d(channels, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)
        self.pool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(width * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.pool(F.relu(self.bn(self.conv(x)))))
        return self.fc(h.flatten(1))


class Transformer(nn.Module):
    """One nn.TransformerEncoderLayer (dropout > 0, batch_first) and a linear head on the mean token."""

    def __init__(self, d_model: int = 16, heads: int = 4, d_ff: int = 32, classes: int = _CLASSES):
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).mean(1))


class LSTMClassifier(nn.Module):
    """Embedding -> 2-layer LSTM (dropout between layers) -> Linear on the last step."""

    def __init__(self, vocab: int = _VOCAB, d_emb: int = 8, d_hidden: int = 12, classes: int = _CLASSES):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_emb)
        self.lstm = nn.LSTM(d_emb, d_hidden, num_layers=2, dropout=0.2, batch_first=True)
        self.fc = nn.Linear(d_hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.emb(tokens))
        return self.fc(out[:, -1])


_BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "transformer": Transformer,
    "lstm": LSTMClassifier,
}


def build(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A fresh model in training mode, initialized from ``seed`` (in float32, then converted to ``dtype``).

    >>> build("cnn").bn.training
    True
    """
    if name not in _BUILDERS:
        raise ValueError(f"build({name!r}): expected one of {', '.join(MODELS)}")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _BUILDERS[name]()
    return model.to(dtype).train()


def make_batches(name: str, n: int, *, batch: int = 4, seed: int = 1,
                 dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input, class target) batches for model ``name``; floating inputs drawn in float32, then cast.

    >>> x, y = make_batches("lstm", 1)[0]; x.dtype, y.dtype
    (torch.int64, torch.int64)
    """
    g = torch.Generator().manual_seed(seed)
    shapes = {"mlp": (batch, 12), "cnn": (batch, 3, 8, 8), "transformer": (batch, 6, 16)}
    out = []
    for _ in range(n):
        if name == "lstm":
            x = torch.randint(0, _VOCAB, (batch, 7), generator=g)
        elif name in shapes:
            x = torch.randn(shapes[name], generator=g).to(dtype)
        else:
            raise ValueError(f"make_batches({name!r}): expected one of {', '.join(MODELS)}")
        out.append((x, torch.randint(0, _CLASSES, (batch,), generator=g)))
    return out


def to_dtype(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> list:
    """The same batches with floating tensors cast to ``dtype`` (exact when upcasting)."""
    return [tuple(t.to(dtype) if t.is_floating_point() else t for t in b) for b in batches]


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss for model ``name``: cross entropy over the class logits."""
    return F.cross_entropy


_OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.05}),
}


def make_optimizer(name: str, params: Iterable[torch.Tensor], impl: str, **overrides) -> torch.optim.Optimizer:
    """SGD (momentum), Adam or AdamW with the for-loop, foreach or fused kernels.

    >>> make_optimizer("sgd", build("mlp").parameters(), "fused").defaults["fused"]
    True
    """
    if name not in _OPTIMIZERS:
        raise ValueError(f"make_optimizer({name!r}): expected one of {', '.join(OPTIMIZERS)}")
    if impl not in IMPLS:
        raise ValueError(f"make_optimizer(impl={impl!r}): expected one of {', '.join(IMPLS)}")
    cls, kw = _OPTIMIZERS[name]
    kw = {**kw, **overrides}
    if impl == "fused":
        return cls(params, fused=True, **kw)
    return cls(params, foreach=impl == "foreach", **kw)


def fused_unsupported(name: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> str | None:
    """Why this torch cannot run optimizer ``name`` fused on ``device`` for ``dtype`` (None: it can).

    Computed by trying one step on a 3-element parameter, so a skip states torch's own reason."""
    p = nn.Parameter(torch.ones(3, dtype=dtype, device=device))
    try:
        opt = make_optimizer(name, [p], "fused")
        p.grad = torch.ones_like(p)
        opt.step()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        return f"torch {torch.__version__}: fused {name} on {device} {dtype}: {exc}"
    return None


def impl_unsupported(name: str, impl: str, *dtypes: torch.dtype) -> str | None:
    """Why optimizer ``name`` cannot run as ``impl`` here for every dtype given (None: it can)."""
    if impl != "fused":
        return None
    return next((r for r in (fused_unsupported(name, dt) for dt in dtypes or (torch.float32,)) if r), None)


def dtype_unsupported(name: str, dtype: torch.dtype) -> str | None:
    """Why this torch cannot train model ``name`` in ``dtype`` on the CPU (None: it can), e.g. torch 2.4.1's
    oneDNN has no bfloat16 LSTM on CPUs without AVX512-BF16. Computed by one plain step, so a skip states
    torch's own reason."""
    model = build(name, dtype=dtype)
    x, y = make_batches(name, 1, dtype=dtype)[0]
    try:
        loss_fn(name)(model(x), y).backward()
    except (RuntimeError, NotImplementedError) as exc:
        return f"torch {torch.__version__}: {name} in {dtype} on this CPU: {' '.join(str(exc).split())[:200]}"
    return None


def one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A zero-argument training step returning its loss, as shadow.attribute and shadow.audit take it.

    >>> step = one_step(m, o, x, y, F.mse_loss); loss = step()     # doctest: +SKIP
    """

    def step() -> torch.Tensor:
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        return value

    return step


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, accumulate: int = 1,
                clip: float | None = None, clip_foreach: bool | None = None,
                norms: list | None = None) -> list[torch.Tensor]:
    """Run ``len(batches) // accumulate`` optimizer steps; return every micro-batch's loss (detached).

    ``accumulate``: micro-batches whose gradients add up before each step (the loss is divided by it);
    ``clip``: ``clip_grad_norm_`` max norm applied before each step (``norms``, if given, receives the
    total norms it returned, before clipping).

    >>> m = build("mlp"); o = make_optimizer("sgd", m.parameters(), "forloop")
    >>> len(train_steps(m, o, make_batches("mlp", 4), loss_fn("mlp"), accumulate=2))
    4
    """
    if accumulate < 1 or len(batches) % accumulate:
        raise ValueError(f"train_steps: {len(batches)} batches do not split into groups of accumulate={accumulate}")
    losses = []
    for start in range(0, len(batches), accumulate):
        opt.zero_grad(set_to_none=True)
        for x, y in batches[start:start + accumulate]:
            value = loss(model(x), y)
            (value / accumulate if accumulate > 1 else value).backward()
            losses.append(value.detach())
        if clip is not None:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=clip_foreach)
            if norms is not None:
                norms.append(total.detach())
        opt.step()
    return losses
