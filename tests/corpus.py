"""A corpus of real models and real training habits, as tiny programs shared by tests and benchmarks.

Hugging Face models (GPT-2 with its default sdpa attention and with eager attention, Llama with grouped-query
attention, BERT, T5, ViT) from tiny random configs (no download), two causal transformers written by hand the way
tutorials write them (the mask by ``masked_fill(-inf)``, or added as ``log(tril(ones))``), an LSTM language model,
torch.nn recurrent and attention modules, a CNN with BatchNorm, and the habits around them: evaluation
under ``torch.no_grad``, CPU autocast to bfloat16, activation checkpointing, gradient accumulation with clipping
and an LR scheduler, ``torch.compile``. Plain functions (no pytest), so that ``benchmarks/`` can import them too:

>>> program = build("gru")
>>> outputs = run(program)
>>> len(outputs) == program.steps * program.accumulate
True

Sizes are tiny on purpose: a shadowed program runs its two steps in 0.1-2 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from models import MLP

_VOCAB = 64
_CLASSES = 5
_BATCH, _SEQ = 2, 8

Forward = Callable[[nn.Module, tuple], torch.Tensor]  # (the module to call, a batch) -> the loss or the output


@dataclasses.dataclass
class Program:
    """A model, its batches and how it is stepped; ``run(program)`` runs it, the caller compares what it leaves.

    ``forward(module, batch)`` returns the loss (training) or the output (``train=False``: evaluation only, under
    ``torch.no_grad``); ``accumulate`` micro-batches add up their gradients before each optimizer step."""

    model: nn.Module  # owns the parameters and buffers
    batches: list[tuple]
    forward: Forward
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None  # an LR scheduler, stepped after each optimizer step
    steps: int = 2
    accumulate: int = 1
    clip: float | None = None  # clip_grad_norm_ max norm, applied before each optimizer step
    autocast: torch.dtype | None = None  # CPU autocast around each forward
    train: bool = True
    module: nn.Module | None = None  # what forward calls, when not the model itself (a torch.compile wrapper)


def run(program: Program) -> list[torch.Tensor]:
    """Run ``program``; return what each micro-batch's forward returned, detached.

    >>> [tuple(t.shape) for t in run(build("mha"))]
    [(), ()]
    """
    p, outs = program, []
    module = p.module if p.module is not None else p.model
    for step in range(p.steps):
        if p.optimizer is not None:
            p.optimizer.zero_grad(set_to_none=True)
        for batch in p.batches[step * p.accumulate:(step + 1) * p.accumulate]:
            with torch.set_grad_enabled(p.train), \
                    torch.autocast("cpu", dtype=p.autocast or torch.bfloat16, enabled=p.autocast is not None):
                out = p.forward(module, batch)
            if p.train:
                (out / p.accumulate if p.accumulate > 1 else out).backward()
            outs.append(out.detach())
        if p.clip is not None:
            torch.nn.utils.clip_grad_norm_(p.model.parameters(), p.clip)
        if p.optimizer is not None:
            p.optimizer.step()
        if p.scheduler is not None:
            p.scheduler.step()
    return outs


# --- data ----------------------------------------------------------------------------------------------------
def _labels(g: torch.Generator, batch: int = _BATCH) -> torch.Tensor:
    return torch.randint(0, _CLASSES, (batch,), generator=g)


def _token_ids(g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, _VOCAB, (_BATCH, _SEQ), generator=g)


def _attention_mask() -> torch.Tensor:
    """Hugging Face's attention mask (1: token, 0: padding): the first sequence full, the second padded by 3."""
    mask = torch.ones(_BATCH, _SEQ, dtype=torch.long)
    mask[1, _SEQ - 3:] = 0
    return mask


def _sequence(g: torch.Generator) -> tuple:
    """Features (batch, seq, 16) and torch.nn's key padding mask (True: padding, ignored)."""
    return torch.randn(_BATCH, _SEQ, 16, generator=g), _attention_mask() == 0


def _features(width: int, g: torch.Generator) -> tuple:
    return (torch.randn(_BATCH, _SEQ, width, generator=g),)


def _images(size: int, g: torch.Generator) -> tuple:
    return (torch.randn(_BATCH, 3, size, size, generator=g),)


# --- Hugging Face models: (config class, model class, config, one batch of keyword arguments) --------------------
def _causal_lm(g: torch.Generator) -> dict:
    ids = _token_ids(g)
    return {"input_ids": ids, "labels": ids}


_GPT2 = dict(vocab_size=_VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
_HF: dict[str, tuple[str, str, dict, Callable[[torch.Generator], dict]]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _GPT2, _causal_lm),  # attention by sdpa, transformers' default
    # attention written out: the causal and padding masks as finfo(dtype).min added to the scores
    "gpt2_eager": ("GPT2Config", "GPT2LMHeadModel", dict(_GPT2, attn_implementation="eager"), _causal_lm),
    # grouped-query attention: 2 key/value heads shared by 4 query heads
    "llama_gqa": ("LlamaConfig", "LlamaForCausalLM",
                  dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32),
                  _causal_lm),
    "bert": ("BertConfig", "BertForSequenceClassification",
             dict(vocab_size=_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=32, num_labels=_CLASSES),
             lambda g: {"input_ids": _token_ids(g), "attention_mask": _attention_mask(), "labels": _labels(g)}),
    # encoder-decoder with relative position bias (8 buckets over distances up to 16)
    "t5": ("T5Config", "T5ForConditionalGeneration",
           dict(vocab_size=_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                relative_attention_num_buckets=8, relative_attention_max_distance=16, decoder_start_token_id=0,
                pad_token_id=0),
           lambda g: {"input_ids": _token_ids(g), "attention_mask": _attention_mask(), "labels": _token_ids(g)}),
    "vit": ("ViTConfig", "ViTForImageClassification",
            dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=4, intermediate_size=64, num_labels=_CLASSES),
            lambda g: {"pixel_values": _images(16, g)[0], "labels": _labels(g)}),
}


def _hf_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(**batch[0]).loss


def _hf(name: str, g: torch.Generator, n: int) -> tuple[nn.Module, list[tuple], Forward]:
    import transformers

    config_cls, model_cls, config, make_batch = _HF[name]
    config = dict(config)
    attention = config.pop("attn_implementation", None)
    config_object = getattr(transformers, config_cls)(**config)
    if attention is not None:
        config_object._attn_implementation = attention
    model = getattr(transformers, model_cls)(config_object)
    return model, [(make_batch(g),) for _ in range(n)], _hf_loss


# --- torch.nn models ------------------------------------------------------------------------------------------
class Recurrent(nn.Module):
    """Embedding -> 2-layer bidirectional LSTM or GRU (dropout between layers) -> Linear on the last step."""

    def __init__(self, cell: type[nn.RNNBase]):
        super().__init__()
        self.emb = nn.Embedding(_VOCAB, 8)
        self.rnn = cell(8, 12, num_layers=2, dropout=0.2, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(24, _CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(tokens))
        return self.fc(out[:, -1])


class Attention(nn.Module):
    """nn.MultiheadAttention (self-attention, dropout, key padding mask, averaged weights returned), a linear head."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, _CLASSES)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h, weights = self.attn(x, x, x, key_padding_mask=padding, need_weights=True)
        return self.head(h.mean(1)) + weights.mean()


class Encoder(nn.Module):
    """nn.TransformerEncoder (2 post-norm layers) and a linear head on the mean token. In eval with a padding mask
    the fast path packs the sequences into nested tensors, unless ``nested=False``."""

    def __init__(self, nested: bool = True):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=nested)
        self.head = nn.Linear(16, _CLASSES)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x, src_key_padding_mask=padding).mean(1))


class ResNet(nn.Module):
    """A Conv-BN-ReLU stem, one residual block of two Conv-BN, global average pooling, a linear head."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                   nn.ReLU(), nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width))
        self.head = nn.Linear(width, _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = F.relu(h + self.block(h))
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


class Checkpointed(nn.Module):
    """An input projection, then three MLP blocks (Linear, GELU, Dropout, LayerNorm), each recomputed in backward
    by torch.utils.checkpoint (the projection makes the blocks' input require grad, as the reentrant variant needs;
    dropout's RNG state is restored for the recomputation)."""

    def __init__(self, reentrant: bool, width: int = 16):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1), nn.LayerNorm(width)) for _ in range(3))
        self.head = nn.Linear(width, _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x.mean(1))


class Block(nn.Module):
    """A pre-norm residual MLP block (LayerNorm, Linear, GELU, Linear) and a linear head on the mean token."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(x.mean(1))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention as hand-written GPTs have it (minGPT, nanoGPT without flash): the scores
    masked either by ``masked_fill(tril == 0, float('-inf'))`` or by adding ``log(tril(ones))`` (0 on and below
    the diagonal, -inf above), then softmax, dropout and the weighted sum of the values."""

    def __init__(self, width: int, heads: int, mask: str):
        super().__init__()
        self.heads, self.mask = heads, mask
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("tril", torch.tril(torch.ones(_SEQ, _SEQ)).view(1, 1, _SEQ, _SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.mask == "masked_fill":
            att = att.masked_fill(self.tril[:, :, :t, :t] == 0, float("-inf"))
        else:
            att = att + torch.log(torch.tril(torch.ones(t, t, dtype=x.dtype)))
        y = self.drop(F.softmax(att, dim=-1)) @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)) with a GELU MLP of 4x width."""

    def __init__(self, width: int, heads: int, mask: str):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, mask)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A hand-written causal language model (token and position embeddings, two ``GPTBlock``s, a final LayerNorm,
    a head tied to the token embedding, nanoGPT's initialization) whose forward returns the next-token cross
    entropy, as tutorials' do."""

    def __init__(self, mask: str, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(_VOCAB, width), nn.Embedding(_SEQ, width)
        self.h = nn.ModuleList(GPTBlock(width, heads, mask) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, _VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():  # nanoGPT's initialization: N(0, 0.02) weights, zero biases
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class LSTMLanguageModel(nn.Module):
    """Embedding -> 2-layer LSTM -> Linear over the vocabulary, the next-token cross entropy at every position."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.emb = nn.Embedding(_VOCAB, width)
        self.rnn = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, _VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(idx))
        logits = self.head(out)
        return F.cross_entropy(logits.reshape(-1, _VOCAB), targets.reshape(-1))


def language_model(module: nn.Module, batch: tuple) -> torch.Tensor:
    """The loss a language model's forward returns for (tokens, next tokens)."""
    return module(*batch)


def classify(module: nn.Module, batch: tuple) -> torch.Tensor:
    """Cross entropy of ``module(*inputs)`` against the batch's last element, the class targets."""
    *inputs, target = batch
    return F.cross_entropy(module(*inputs), target)


def _nn(make_model: Callable[[], nn.Module], make_inputs: Callable[[torch.Generator], tuple],
        g: torch.Generator, n: int) -> tuple[nn.Module, list[tuple], Forward]:
    batches = []
    for _ in range(n):
        inputs = make_inputs(g)
        batches.append(inputs + (_labels(g, len(inputs[0])),))
    return make_model(), batches, classify


def _tokens(g: torch.Generator) -> tuple:
    return (_token_ids(g),)


def _next_tokens(g: torch.Generator) -> tuple:
    """(tokens, the tokens shifted by one): a language model's inputs and targets."""
    ids = torch.randint(0, _VOCAB, (_BATCH, _SEQ + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _lm(make_model: Callable[[], nn.Module], g: torch.Generator, n: int
        ) -> tuple[nn.Module, list[tuple], Forward]:
    return make_model(), [_next_tokens(g) for _ in range(n)], language_model


def _wide_rows(g: torch.Generator) -> tuple:
    return (torch.randn(32, 256, generator=g),)


# name -> (generator, number of batches) -> (model, batches, forward)
_MODELS: dict[str, Callable[[torch.Generator, int], tuple[nn.Module, list[tuple], Forward]]] = {
    **{name: functools.partial(_hf, name) for name in _HF},
    "lstm": functools.partial(_nn, functools.partial(Recurrent, nn.LSTM), _tokens),
    "gru": functools.partial(_nn, functools.partial(Recurrent, nn.GRU), _tokens),
    "mha": functools.partial(_nn, Attention, _sequence),
    "encoder": functools.partial(_nn, Encoder, _sequence),
    "encoder_dense": functools.partial(_nn, functools.partial(Encoder, False), _sequence),
    "resnet": functools.partial(_nn, ResNet, functools.partial(_images, 8)),
    "checkpoint": functools.partial(_nn, functools.partial(Checkpointed, False), functools.partial(_features, 16)),
    "checkpoint_reentrant": functools.partial(_nn, functools.partial(Checkpointed, True),
                                              functools.partial(_features, 16)),
    "block": functools.partial(_nn, Block, functools.partial(_features, 32)),
    "gpt_masked_fill": functools.partial(_lm, functools.partial(GPT, "masked_fill")),
    "gpt_log_tril": functools.partial(_lm, functools.partial(GPT, "log_tril")),
    "lstm_lm": functools.partial(_lm, LSTMLanguageModel),
    # a 256-wide MLP on (32, 256) rows: the soak's model
    "wide_mlp": functools.partial(_nn, functools.partial(MLP, 256, 256, _CLASSES), _wide_rows),
}
HF_MODELS = tuple(_HF)
MODELS = tuple(_MODELS)


def unavailable(name: str) -> str | None:
    """Why model ``name`` cannot be built on this machine, or None: a Hugging Face model needs transformers, and
    transformers >= 5 imports without its models on a torch older than it supports (2.4.1 among them)."""
    if name not in _HF:
        return None
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    if not transformers.utils.is_torch_available():
        return f"transformers {transformers.__version__} does not run on torch {torch.__version__}"
    return None


# --- the habits ----------------------------------------------------------------------------------------------
def _warmup_cosine(opt: torch.optim.Optimizer, total: int) -> Any:
    """Linear warmup over the first step, then cosine decay: the usual fine-tuning schedule."""
    lr = torch.optim.lr_scheduler
    return lr.SequentialLR(opt, [lr.LinearLR(opt, start_factor=0.1, total_iters=1),
                                 lr.CosineAnnealingLR(opt, T_max=max(total - 1, 1))], milestones=[1])


HABITS = ("train", "eval", "autocast_bf16", "accumulate_clip_schedule", "compile", "compile_inductor")


def build(name: str, *, habit: str = "train", dtype: torch.dtype = torch.float32, seed: int = 0,
          steps: int = 2) -> Program:
    """A fresh program: model ``name`` initialized from ``seed`` (in float32, then converted to ``dtype``), its
    batches (floating inputs cast to ``dtype``) and AdamW (foreach), stepped as ``habit`` says:

    - ``train``: ``steps`` optimizer steps, one batch each;
    - ``eval``: the model in eval mode, ``steps`` forwards under ``torch.no_grad``, no optimizer;
    - ``autocast_bf16``: the forwards under CPU autocast to bfloat16;
    - ``accumulate_clip_schedule``: 2 micro-batches per step, ``clip_grad_norm_`` and a warmup-cosine LR schedule;
    - ``compile``, ``compile_inductor``: the model called through ``torch.compile`` (the ``eager`` backend, which
      runs the captured graph with the eager kernels, or the default, inductor).

    >>> build("lstm", habit="eval").model.training
    False
    """
    if name not in _MODELS:
        raise ValueError(f"build({name!r}): expected one of {', '.join(MODELS)}")
    if habit not in HABITS:
        raise ValueError(f"build(habit={habit!r}): expected one of {', '.join(HABITS)}")
    accumulate = 2 if habit == "accumulate_clip_schedule" else 1
    g = torch.Generator().manual_seed(seed + 1)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model, batches, forward = _MODELS[name](g, steps * accumulate)
    model = model.to(dtype).train(habit != "eval")
    program = Program(model, [_cast(b, dtype) for b in batches], forward, steps=steps)
    if habit == "eval":
        program.train = False
        return program
    program.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=True)
    if habit == "autocast_bf16":
        if any(isinstance(m, nn.LSTM) for m in model.modules()) and (why := no_bf16_lstm()) is not None:
            import pytest  # the corpus is the tests' own: a model this CPU's torch cannot run is skipped
            pytest.skip(why)
        program.autocast = torch.bfloat16
    elif habit == "accumulate_clip_schedule":
        program.accumulate, program.clip = accumulate, 0.1
        program.scheduler = _warmup_cosine(program.optimizer, steps)
    elif habit.startswith("compile"):
        program.module = torch.compile(model, backend="inductor" if habit == "compile_inductor" else "eager")
    return program


@functools.cache
def no_bf16_lstm() -> str | None:
    """Why nn.LSTM cannot run under CPU bfloat16 autocast here (None: it can). Below AVX-512 oneDNN has no bfloat16
    LSTM and torch itself raises ("could not create a primitive descriptor for the LSTM forward"), shadow or not."""
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.LSTM(4, 4)(torch.randn(2, 1, 4))
    except RuntimeError as exc:
        return f"torch {torch.__version__} cannot run nn.LSTM under CPU bfloat16 autocast on this CPU: {exc}"
    return None


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in a batch (tuples and dicts of them) cast to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return tuple(_cast(v, dtype) for v in value)
