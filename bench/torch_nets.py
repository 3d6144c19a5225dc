"""Tiny pure-PyTorch versions of architectures that `transformers` does not ship, written the way their
reference code writes them (so exported the way users export them): a YOLOv8-style detector, MobileNetV3,
ShuffleNetV2, DenseNet, a diffusion UNet's blocks and a nanoGPT-style decoder. Random weights; used by
`ortfuse.bench.coverage`."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn
from torch.nn import functional as F


def _cbn(c1: int, c2: int, k: int = 1, s: int = 1, act: Any = nn.SiLU, groups: int = 1) -> nn.Sequential:
    """Conv (no bias) + BatchNorm + activation, padded to keep the size at stride 1."""
    return nn.Sequential(nn.Conv2d(c1, c2, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(c2),
                         act() if act else nn.Identity())


# ---- YOLOv8-style: C2f blocks (Split, Bottlenecks, Concat), SPPF (three 5x5 MaxPools), an FPN Upsample +
# Concat, and a head decoding box distributions (DFL: a Softmax over 16 bins, then their expectation)

class _Bottleneck(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.cv1, self.cv2 = _cbn(c, c, 3), _cbn(c, c, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.cv2(self.cv1(x))


class _C2f(nn.Module):
    def __init__(self, c1: int, c2: int, n: int = 1) -> None:
        super().__init__()
        self.c = c2 // 2
        self.cv1, self.cv2 = _cbn(c1, 2 * self.c), _cbn((2 + n) * self.c, c2)
        self.m = nn.ModuleList(_Bottleneck(self.c) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).chunk(2, 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class _SPPF(nn.Module):
    def __init__(self, c1: int, c2: int) -> None:
        super().__init__()
        self.cv1, self.cv2, self.m = _cbn(c1, c1 // 2), _cbn(c1 // 2 * 4, c2), nn.MaxPool2d(5, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        y.extend(self.m(y[-1]) for _ in range(3))
        return self.cv2(torch.cat(y, 1))


class Yolo(nn.Module):
    def __init__(self, classes: int = 4, bins: int = 16) -> None:
        super().__init__()
        self.bins = bins
        self.stem = nn.Sequential(_cbn(3, 16, 3, 2), _cbn(16, 32, 3, 2), _C2f(32, 32))
        self.down = nn.Sequential(_cbn(32, 64, 3, 2), _C2f(64, 64), _SPPF(64, 64))
        self.fuse = _C2f(96, 32)
        self.box = nn.Sequential(_cbn(32, 32, 3), nn.Conv2d(32, 4 * bins, 1))
        self.cls = nn.Sequential(_cbn(32, 32, 3), nn.Conv2d(32, classes, 1))
        self.register_buffer("proj", torch.arange(bins, dtype=torch.float32).view(1, bins, 1, 1))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values
        p3 = self.stem(x)
        p4 = self.down(p3)
        f = self.fuse(torch.cat([F.interpolate(p4, scale_factor=2.0, mode="nearest"), p3], 1))
        n, _, h, w = f.shape
        box = self.box(f).view(n, 4, self.bins, h * w).transpose(1, 2).softmax(1)  # [n, bins, 4, anchors]
        dist = (box * self.proj).sum(1)  # DFL: each side's expected bin
        return torch.cat([dist, self.cls(f).view(n, -1, h * w).sigmoid()], 1)


# ---- MobileNetV3: Hardswish, squeeze-excite with Hardsigmoid, inverted residuals

class _SE(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.fc2(F.relu(self.fc1(s))))


class _InvertedResidual(nn.Module):
    def __init__(self, c1: int, mid: int, c2: int, k: int, s: int, se: bool, act: Any) -> None:
        super().__init__()
        self.res = s == 1 and c1 == c2
        self.block = nn.Sequential(_cbn(c1, mid, 1, act=act), _cbn(mid, mid, k, s, act=act, groups=mid),
                                   _SE(mid) if se else nn.Identity(), _cbn(mid, c2, 1, act=None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.res else y


class MobileNetV3(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        hs, re = nn.Hardswish, nn.ReLU
        self.features = nn.Sequential(
            _cbn(3, 16, 3, 2, act=hs), _InvertedResidual(16, 16, 16, 3, 2, True, re),
            _InvertedResidual(16, 72, 24, 3, 2, False, re), _InvertedResidual(24, 88, 24, 3, 1, False, re),
            _InvertedResidual(24, 96, 40, 5, 2, True, hs), _InvertedResidual(40, 240, 40, 5, 1, True, hs),
            _cbn(40, 240, 1, act=hs))
        self.head = nn.Sequential(nn.Linear(240, 128), nn.Hardswish(), nn.Linear(128, classes))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values
        return self.head(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


# ---- ShuffleNetV2: channel split, branches, Concat and the channel shuffle (Reshape, Transpose, Reshape)

def _shuffle(x: torch.Tensor, groups: int = 2) -> torch.Tensor:
    n, c, h, w = x.shape
    return x.view(n, groups, c // groups, h, w).transpose(1, 2).contiguous().view(n, c, h, w)


class _ShuffleUnit(nn.Module):
    def __init__(self, c1: int, c2: int, s: int) -> None:
        super().__init__()
        self.s, half = s, c2 // 2
        inp = c1 if s > 1 else half
        self.branch2 = nn.Sequential(_cbn(inp, half, 1, act=nn.ReLU), _cbn(half, half, 3, s, act=None, groups=half),
                                     _cbn(half, half, 1, act=nn.ReLU))
        self.branch1 = nn.Sequential(_cbn(c1, c1, 3, s, act=None, groups=c1), _cbn(c1, half, 1, act=nn.ReLU)) \
            if s > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.branch1 is None:
            x1, x2 = x.chunk(2, dim=1)
            return _shuffle(torch.cat((x1, self.branch2(x2)), 1))
        return _shuffle(torch.cat((self.branch1(x), self.branch2(x)), 1))


class ShuffleNetV2(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(_cbn(3, 24, 3, 2, act=nn.ReLU), nn.MaxPool2d(3, 2, 1))
        self.stages = nn.Sequential(_ShuffleUnit(24, 48, 2), _ShuffleUnit(48, 48, 1), _ShuffleUnit(48, 96, 2),
                                    _ShuffleUnit(96, 96, 1))
        self.fc = nn.Linear(96, classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values
        return self.fc(self.stages(self.stem(x)).mean([2, 3]))


# ---- DenseNet: BN-ReLU-Conv layers whose outputs are concatenated onto their inputs, AvgPool transitions

class _DenseLayer(nn.Module):
    def __init__(self, c: int, growth: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, 4 * growth, 1, bias=False),
                                  nn.BatchNorm2d(4 * growth), nn.ReLU(),
                                  nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], 1)


class DenseNet(nn.Module):
    def __init__(self, classes: int = 10, growth: int = 8) -> None:
        super().__init__()
        c = 16
        layers: list[nn.Module] = [nn.Conv2d(3, c, 3, 1, 1, bias=False)]
        for block in range(2):
            for _ in range(3):
                layers.append(_DenseLayer(c, growth))
                c += growth
            if block == 0:
                layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2)]
                c //= 2
        self.features = nn.Sequential(*layers, nn.BatchNorm2d(c), nn.ReLU())
        self.fc = nn.Linear(c, classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = pixel_values
        return self.fc(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))


# ---- a diffusion UNet's blocks: GroupNorm + SiLU + Conv residual blocks with a time embedding, a spatial
# self-attention block, a strided-Conv downsample, a nearest Upsample and a skip Concat

class _ResBlock(nn.Module):
    def __init__(self, c1: int, c2: int, temb: int) -> None:
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(8, c1), nn.Conv2d(c1, c2, 3, 1, 1)
        self.t = nn.Linear(temb, c2)
        self.n2, self.c2 = nn.GroupNorm(8, c2), nn.Conv2d(c2, c2, 3, 1, 1)
        self.skip = nn.Conv2d(c1, c2, 1) if c1 != c2 else nn.Identity()

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.c1(F.silu(self.n1(x))) + self.t(F.silu(t))[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class _AttnBlock(nn.Module):
    def __init__(self, c: int, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.norm = heads, nn.GroupNorm(8, c)
        self.qkv, self.out = nn.Linear(c, 3 * c), nn.Linear(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, c, h, w = x.shape
        t = self.norm(x).view(n, c, h * w).transpose(1, 2)
        q, k, v = self.qkv(t).view(n, h * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, h * w, c)
        return x + self.out(a).transpose(1, 2).view(n, c, h, w)


class UNet(nn.Module):
    def __init__(self, c: int = 32, temb: int = 32) -> None:
        super().__init__()
        self.temb = temb
        self.t = nn.Sequential(nn.Linear(temb, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(4, c, 3, 1, 1)
        self.d1, self.down = _ResBlock(c, c, temb), nn.Conv2d(c, c, 3, 2, 1)
        self.mid, self.attn = _ResBlock(c, 2 * c, temb), _AttnBlock(2 * c)
        self.u1 = _ResBlock(3 * c, c, temb)
        self.out = nn.Sequential(nn.GroupNorm(8, c), nn.SiLU(), nn.Conv2d(c, 4, 3, 1, 1))

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        x = sample
        half = self.temb // 2
        freqs = torch.exp(-torch.arange(half, dtype=torch.float32) * (9.21 / half))
        args = timestep[:, None].float() * freqs[None]
        t = self.t(torch.cat([torch.cos(args), torch.sin(args)], -1))
        h1 = self.d1(self.inp(x), t)
        m = self.attn(self.mid(self.down(h1), t))
        up = F.interpolate(m, scale_factor=2.0, mode="nearest")
        return self.out(self.u1(torch.cat([up, h1], 1), t))


# ---- a GPT in nanoGPT's style: learned positions (an arange), pre-LayerNorm blocks, one packed QKV Linear
# split three ways, scaled_dot_product_attention(is_causal=True) (no mask tensor: torch writes the causal rule
# itself, ONNX's Attention with is_causal at opset 23), a GELU MLP, the LM head tied to the embedding

class _CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in self.c_attn(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class _GptBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), _CausalSelfAttention(d, heads), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGpt(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 64, heads: int = 4, layers: int = 2, positions: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.h = nn.ModuleList(_GptBlock(d, heads) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---- GPT-2 as transformers wrote it before its masking utilities (4.2x-4.3x, the form of many GPT-2 ONNX files
# in use): a KV cache, each layer's `bias` buffer (a lower triangle over every position) sliced at run time to
# rows Sk - Sq .. Sk - 1, Where(causal, scores, lowest), an additive padding mask (1 - m) * lowest

class _LegacyGpt2Attention(nn.Module):
    def __init__(self, d: int, heads: int, positions: int) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        tril = torch.tril(torch.ones(positions, positions, dtype=torch.bool))
        self.register_buffer("bias", tril.view(1, 1, positions, positions), persistent=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for y in self.c_attn(x).split(d, dim=2))
        k, v = torch.cat((past_k, k), dim=-2), torch.cat((past_v, v), dim=-2)
        w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5, dtype=q.dtype)
        ql, kl = q.size(-2), k.size(-2)
        causal = self.bias[:, :, kl - ql:kl, :kl]
        w = torch.where(causal, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype)) + mask
        y = torch.matmul(w.softmax(dim=-1), v).transpose(1, 2).reshape(b, t, d)
        return self.c_proj(y), k, v


class _LegacyGpt2Block(nn.Module):
    def __init__(self, d: int, heads: int, positions: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), _LegacyGpt2Attention(d, heads, positions)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a, k, v = self.attn(self.ln_1(x), mask, past_k, past_v)
        x = x + a
        return x + self.mlp(self.ln_2(x)), k, v


class LegacyGpt2(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 64, heads: int = 4, layers: int = 2, positions: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.h = nn.ModuleList(_LegacyGpt2Block(d, heads, positions) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **past: torch.Tensor) -> dict:
        first = past["past_key_values.0.key"]
        pos = torch.arange(first.size(-2), first.size(-2) + input_ids.size(-1), device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        low = torch.finfo(x.dtype).min
        mask = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * low
        out = {}
        for i, block in enumerate(self.h):
            x, out[f"present.{i}.key"], out[f"present.{i}.value"] = block(
                x, mask, past[f"past_key_values.{i}.key"], past[f"past_key_values.{i}.value"])
        return {"logits": self.lm_head(self.ln_f(x)), **out}


@contextlib.contextmanager
def _mha_slow_path() -> Iterator[None]:
    """nn.MultiheadAttention as exported with gradients on: the coverage sweep traces under no_grad, where it
    takes its fused fast path, which the TorchScript exporter refuses."""
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


class _MhaBlock(nn.Module):
    """torchvision's ViT encoder block: LayerNorm, nn.MultiheadAttention (batch first, packed in-projection),
    residual, LayerNorm, GELU MLP, residual."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attention = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class TorchvisionVit(nn.Module):
    """torchvision.models.vit_b_16's structure at 32x32 pixels: an 8x8 patch Conv, a class token, learned
    positions, two nn.MultiheadAttention blocks, a final LayerNorm (the class token's row out)."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.conv_proj = nn.Conv2d(3, d, 8, 8)
        self.class_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embedding = nn.Parameter(torch.randn(1, 17, d) * 0.02)
        self.layers = nn.Sequential(_MhaBlock(d), _MhaBlock(d))
        self.ln = nn.LayerNorm(d)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        with _mha_slow_path():
            x = self.conv_proj(pixel_values).flatten(2).transpose(1, 2)
            x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embedding
            return self.ln(self.layers(x))[:, 0]


class _QuickGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class _SeqFirstBlock(nn.Module):
    """OpenAI CLIP's residual attention block: sequence-first [seq, batch, d] activations, nn.MultiheadAttention
    (not batch first: its output flattened to [seq * batch, d] for the out-projection) under a causal float
    mask, a QuickGELU MLP."""

    def __init__(self, d: int, heads: int, mask: torch.Tensor) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads)
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), _QuickGelu(), nn.Linear(4 * d, d))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=self.mask)[0]
        return x + self.mlp(self.ln_2(x))


class ClipTextOpenai(nn.Module):
    """The text tower of OpenAI's CLIP release (its own model code, not transformers'): token and learned
    position embeddings, the stream permuted to sequence first through two causal blocks and back, a final
    LayerNorm, the end-of-text token's row (the largest id) projected. Its fixed context (16 here) is the
    sequence length."""

    def __init__(self, d: int = 64, heads: int = 4, context: int = 16, vocab: int = 100) -> None:
        super().__init__()
        mask = torch.full((context, context), float("-inf")).triu(1)
        self.token_embedding = nn.Embedding(vocab, d)
        self.positional_embedding = nn.Parameter(torch.randn(context, d) * 0.01)
        self.blocks = nn.Sequential(*(_SeqFirstBlock(d, heads, mask) for _ in range(2)))
        self.ln_final = nn.LayerNorm(d)
        self.text_projection = nn.Parameter(torch.randn(d, d) * d ** -0.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        with _mha_slow_path():
            x = self.token_embedding(input_ids) + self.positional_embedding
            x = self.blocks(x.permute(1, 0, 2)).permute(1, 0, 2)
            x = self.ln_final(x)
            return x[torch.arange(x.shape[0]), input_ids.argmax(dim=-1)] @ self.text_projection


def _randomized(net: nn.Module) -> nn.Module:
    """Normalization statistics and affines drawn at random (fresh ones are the identity, which folds away)."""
    g = torch.Generator().manual_seed(0)
    for m in net.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)):
            m.weight.data = 1.0 + 0.2 * torch.randn(m.weight.shape, generator=g)
            m.bias.data = 0.1 * torch.randn(m.bias.shape, generator=g)
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean = 0.1 * torch.randn(m.running_mean.shape, generator=g)
            m.running_var = 0.5 + torch.rand(m.running_var.shape, generator=g)
    return net.eval()


def make(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The module (random weights and statistics) and its example inputs (2 images, or 2 rows of tokens)."""
    if name == "unet":
        return _randomized(UNet()), {"sample": torch.randn(2, 4, 16, 16), "timestep": torch.tensor([10, 500])}
    if name == "nanogpt":
        return _randomized(NanoGpt()), {"input_ids": torch.randint(0, 100, (2, 16))}
    if name == "clip_text_openai":
        return _randomized(ClipTextOpenai()), {"input_ids": torch.randint(0, 100, (2, 16))}
    if name == "gpt2_legacy_past":  # traced after a past of 5 with 3 new tokens, the second row left-padded
        mask = torch.ones(2, 8, dtype=torch.int64)
        mask[1, :2] = 0
        past = {f"past_key_values.{i}.{kv}": torch.randn(2, 4, 5, 16) for i in range(2) for kv in ("key", "value")}
        return _randomized(LegacyGpt2()), {"input_ids": torch.randint(0, 100, (2, 3)), "attention_mask": mask, **past}
    cls = {"yolo": Yolo, "mobilenet_v3": MobileNetV3, "shufflenet_v2": ShuffleNetV2, "densenet": DenseNet,
           "torchvision_vit": TorchvisionVit}[name]
    size = 64 if name == "yolo" else 32
    return _randomized(cls()), {"pixel_values": torch.rand(2, 3, size, size)}
