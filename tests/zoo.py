"""Small real-model architectures, built from configs with random weights (no downloads).

Written here rather than imported from timm / torchvision (test_hf_models runs transformers'
own models): the same layers those libraries use (rotary embeddings, RMSNorm, SwiGLU, grouped-query attention, causal
masks, batch norm, depthwise convolutions, patch embeddings, token mixing, a recurrent
cell run in a Python loop), without their import cost or version pins, and torchvision's
wheel on the registry here is a CUDA build that does not import beside the CPU torch.
Sizes are small so the interpreter runs a training step in seconds, but every matmul and
norm still spans several Triton programs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- transformers --------------------------------------------------------------------------------

@dataclass(frozen=True)
class TransformerConfig:
    vocab: int = 97
    dim: int = 48
    heads: int = 4
    kv_heads: int = 4  # < heads: grouped-query attention
    layers: int = 2
    seq: int = 16
    hidden: int = 96


class GPT2Block(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.fc, self.out = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)
        self.heads = c.heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, c: TransformerConfig = TransformerConfig()):
        super().__init__()
        self.tok, self.pos = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(GPT2Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2's

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.dim // c.heads
        self.norm1, self.norm2 = RMSNorm(c.dim), RMSNorm(c.dim)
        self.q = nn.Linear(c.dim, c.dim, bias=False)
        self.kv = nn.Linear(c.dim, 2 * c.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(c.dim, c.dim, bias=False)
        self.gate, self.up = nn.Linear(c.dim, c.hidden, bias=False), nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).view(b, t, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask, dim=-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, c: TransformerConfig = TransformerConfig(kv_heads=2)):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        half = c.dim // c.heads // 2
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(half).float() / half), persistent=False)

    def forward(self, idx):
        t = idx.shape[1]
        freqs = torch.outer(torch.arange(t, device=idx.device).float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


class BertLayer(nn.Module):
    def __init__(self, c: TransformerConfig):
        super().__init__()
        self.attn = nn.MultiheadAttention(c.dim, c.heads, batch_first=True)
        self.ln1, self.ln2 = nn.LayerNorm(c.dim, eps=1e-12), nn.LayerNorm(c.dim, eps=1e-12)
        self.ff = nn.Sequential(nn.Linear(c.dim, c.hidden), nn.GELU(), nn.Linear(c.hidden, c.dim))

    def forward(self, x, pad):
        x = self.ln1(x + self.attn(x, x, x, key_padding_mask=pad, need_weights=False)[0])
        return self.ln2(x + self.ff(x))


class Bert(nn.Module):
    """A BERT-style encoder: token + position + segment embeddings, post-norm layers with a
    padding mask, and a pooled classifier."""

    def __init__(self, c: TransformerConfig = TransformerConfig(), classes: int = 3):
        super().__init__()
        self.tok, self.pos, self.seg = nn.Embedding(c.vocab, c.dim), nn.Embedding(c.seq, c.dim), nn.Embedding(2, c.dim)
        self.ln = nn.LayerNorm(c.dim, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.layers))
        self.pool, self.cls = nn.Linear(c.dim, c.dim), nn.Linear(c.dim, classes)

    def forward(self, idx):
        t = idx.shape[1]
        segments = (torch.arange(t, device=idx.device) >= t // 2).long()
        x = self.ln(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)) + self.seg(segments))
        pad = idx == 0
        for layer in self.layers:
            x = layer(x, pad)
        return self.cls(torch.tanh(self.pool(x[:, 0])))


class ViT(nn.Module):
    def __init__(self, image: int = 16, patch: int = 4, dim: int = 48, heads: int = 4, layers: int = 2,
                 classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image // patch) ** 2 + 1
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, tokens, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.token_mlp = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channel_mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MLPMixer(nn.Module):
    def __init__(self, image: int = 16, patch: int = 4, dim: int = 32, layers: int = 2, classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (image // patch) ** 2
        self.blocks = nn.Sequential(*(MixerBlock(tokens, dim) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, images):
        x = self.blocks(self.patch(images).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(1))


# -- convolutional networks ----------------------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18's layout (stem, max pool, basic blocks with batch norm, average pool) at a
    small width and depth."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layers = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, images):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(images)), 1), 1))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4):
        super().__init__()
        hidden = cin * expand
        self.block = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class MobileNet(nn.Module):
    """MobileNet-v3's building blocks: inverted residuals with depthwise convolutions,
    hardswish, and a squeeze-style global pool before the classifier."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 2, 1, bias=False), nn.BatchNorm2d(width), nn.Hardswish())
        self.blocks = nn.Sequential(InvertedResidual(width, width, 1), InvertedResidual(width, 2 * width, 2))
        self.head = nn.Sequential(nn.Linear(2 * width, 32), nn.Hardswish(), nn.Dropout(0.0), nn.Linear(32, classes))

    def forward(self, images):
        return self.head(self.blocks(self.stem(images)).mean((2, 3)))


# -- recurrent -----------------------------------------------------------------------------------

class GRULanguageModel(nn.Module):
    """A GRU cell unrolled in a Python loop over time steps (what Dynamo traces into one graph)."""

    def __init__(self, vocab: int = 50, dim: int = 32):
        super().__init__()
        self.embed, self.cell, self.head = nn.Embedding(vocab, dim), nn.GRUCell(dim, dim), nn.Linear(dim, vocab)

    def forward(self, idx):
        x = self.embed(idx)
        h = x.new_zeros(x.shape[0], x.shape[2])
        outputs = []
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
            outputs.append(h)
        return self.head(torch.stack(outputs, dim=1))


# -- the zoo -------------------------------------------------------------------------------------

class WithLoss(nn.Module):
    """A zoo model and its cross-entropy loss, compiled together: a training step's whole forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, target):
        out = self.model(x)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: type
    kind: str  # "tokens" (int64 ids -> logits over the vocabulary or classes) or "images"
    classes: int

    def inputs(self, generator: torch.Generator, batch: int = 2) -> torch.Tensor:
        if self.kind == "images":
            return torch.randn(batch, 3, 16, 16, generator=generator)
        vocab = TransformerConfig.vocab if self.name != "gru" else 50
        return torch.randint(1, vocab, (batch, TransformerConfig.seq), generator=generator)

    def loss(self, out: torch.Tensor, generator_seed: int = 0) -> torch.Tensor:
        g = torch.Generator().manual_seed(generator_seed)
        target = torch.randint(0, out.shape[-1], out.shape[:-1], generator=g)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


ZOO = {m.name: m for m in (
    ZooModel("gpt2", GPT2, "tokens", TransformerConfig.vocab),
    ZooModel("llama", Llama, "tokens", TransformerConfig.vocab),
    ZooModel("bert", Bert, "tokens", 3),
    ZooModel("resnet", ResNet, "images", 10),
    ZooModel("mobilenet", MobileNet, "images", 10),
    ZooModel("vit", ViT, "images", 10),
    ZooModel("mixer", MLPMixer, "images", 10),
    ZooModel("gru", GRULanguageModel, "tokens", 50),
)}


def without_dropout(config):
    """A transformers config with every dropout probability set to 0, for a comparison with
    eager, whose draws differ (the models copy them into their layers when built); used by
    tests/test_hf_models.py and bench/sweep.py."""
    for key, value in vars(config).items():
        if isinstance(value, float) and ("dropout" in key or key.endswith(("_pdrop", "_prob")) or "drop_path" in key):
            setattr(config, key, 0.0)
    return config
