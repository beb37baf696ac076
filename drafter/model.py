"""A small DFlash block drafter, readable in one sitting.

At an anchor ``a`` (see :mod:`drafter.blocks`: token ``x_a`` known, the target's tapped states known at
every ``p < a``) the drafter fills the block ``x_{a+1} … x_{a+B-1}`` in one parallel forward, as DFlash
does:

1. **Target context features.** Every context position has ``L`` tapped target states; each is
   RMS-normalized on its own (done once, in :func:`drafter.data.prepare`: SmolLM2 states carry
   channels of magnitude ~10^4), the ``L`` are concatenated and projected ``L*H → d`` and normalized
   (DFlash's ``fc`` + ``hidden_norm``). These features are never updated by the drafter: in every layer
   they are keys and values only ("target context as KV").
2. **Block tokens.** Every slot gets the anchor token through the target's frozen embedding (projected
   ``H → d``), the context feature at ``a-1`` (projected ``d → d``; EAGLE gives its draft the same pair)
   and a learned slot embedding. With ``lookup`` n > 0, drafted slot ``j`` also gets the embedding of
   the token prompt lookup would draft there (:func:`drafter.metrics.lookup_draft`: what followed the
   latest earlier occurrence of the n tokens ending at ``a``; only tokens up to ``x_a`` are read), or a
   learned "no match" vector: the drafter learns when copying pays.
3. **Layers.** ``n_layers`` pre-norm transformer layers: block queries attend to the context features
   of ``a-window … a-1`` and to the whole block (bidirectional inside it), with rotary position
   embeddings on the true positions (context ``p``, slot ``j`` at ``a+j``); then an MLP.
4. **Head.** Slots ``1 … B-1`` are normalized, projected ``d → H``, normalized again and multiplied by
   the target's frozen LM head (SmolLM2 ties it to ``embed_tokens``). Logits are computed over
   ``vocab`` only (a subset of token ids, see :class:`Drafter`), which keeps training on a 2-core CPU
   affordable.

Slot ``j`` is trained toward the target's greedy token ``argmax[a+j-1]``; see :mod:`drafter.train`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import CaptureError
from drafter.blocks import Batch


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a drafter. ``num_taps`` (L) and ``hidden_size`` (H) come from the run header;
    ``vocab_size`` from the target. ``window``: context positions a block sees (DFlash 2: 2,048)."""

    num_taps: int
    hidden_size: int
    vocab_size: int
    d_model: int = 256
    n_layers: int = 2
    n_heads: int = 4
    block_size: int = 8  # B: slot 0 = the anchor token, B-1 drafted tokens
    window: int = 2048
    mlp_ratio: int = 4
    rope_theta: float = 10000.0
    dropout: float = 0.0  # on the context features and each residual branch, while training
    lookup: int = 2  # n: drafted slots also get the prompt-lookup draft of an n-gram match (0: off)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` computed in float32 whatever the input dtype (under bf16 autocast too), returned in
    the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), self.normalized_shape, self.weight, self.eps).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form, as in Llama): x [S, heads, N, dh], pos int64 [S, N]."""
    dh = x.shape[-1]
    freq = theta ** (-torch.arange(0, dh, 2, dtype=torch.float32) / dh)  # [dh/2]
    angle = pos[:, None, :, None].float() * freq  # [S, 1, N, dh/2]
    cos, sin = torch.cos(angle).repeat(1, 1, 1, 2).to(x.dtype), torch.sin(angle).repeat(1, 1, 1, 2).to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Layer(nn.Module):
    """Pre-norm layer: block queries attend to [context features ; block], then an MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.theta, self.dropout = cfg.n_heads, cfg.rope_theta, cfg.dropout
        self.norm_x, self.norm_mlp = RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(), nn.Linear(cfg.mlp_ratio * d, d))

    def forward(self, x, ctx, x_pos, ctx_pos, keep_ctx, block_size):
        """x [S, Q, d] block tokens (Q = M*B, anchor-major) at positions x_pos [S, Q]; ctx [S, T, d]
        context features at ctx_pos [S, T]; keep_ctx bool [S, Q, T] (context key allowed). A block token
        also sees the B tokens of its own block; the softmax runs over both key sets at once."""
        S, Q, d = x.shape
        B, M, nh = block_size, Q // block_size, self.n_heads
        h = self.norm_x(x)

        def heads(t):
            return t.view(S, -1, nh, d // nh).transpose(1, 2)  # [S, nh, N, dh]

        k_ctx, v_ctx = self.kv(ctx).chunk(2, dim=-1)
        k_x, v_x = self.kv(h).chunk(2, dim=-1)
        q = rope(heads(self.q(h)), x_pos, self.theta) * (d // nh) ** -0.5
        k_ctx, v_ctx = rope(heads(k_ctx), ctx_pos, self.theta), heads(v_ctx)
        k_x, v_x = rope(heads(k_x), x_pos, self.theta).unflatten(2, (M, B)), heads(v_x).unflatten(2, (M, B))
        s_ctx = (q @ k_ctx.transpose(-1, -2)).masked_fill(~keep_ctx[:, None], -float("inf"))  # [S, nh, Q, T]
        s_blk = q.unflatten(2, (M, B)) @ k_x.transpose(-1, -2)  # [S, nh, M, B, B]
        w = torch.softmax(torch.cat([s_ctx, s_blk.flatten(2, 3)], dim=-1), dim=-1)
        T = ctx.shape[1]
        att = w[..., :T] @ v_ctx + (w[..., T:].unflatten(2, (M, B)) @ v_x).flatten(2, 3)  # [S, nh, Q, dh]
        x = x + F.dropout(self.o(att.transpose(1, 2).reshape(S, Q, d)), self.dropout, self.training)
        return x + F.dropout(self.mlp(self.norm_mlp(x)), self.dropout, self.training)


class Drafter(nn.Module):
    """The block drafter. Trainable: fusion, token projection, mask embedding, layers, output projection
    and norms. Frozen (buffers, not saved in checkpoints): ``embed`` [V, H] (the target's
    ``embed_tokens``) and ``lm_head`` [V, H]. ``vocab`` [V'] (int64, saved) lists the token ids the head
    scores; by default all ``V``.
    """

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 vocab: torch.Tensor | None = None):
        super().__init__()
        V, H, d = cfg.vocab_size, cfg.hidden_size, cfg.d_model
        if embed.shape != (V, H) or lm_head.shape != (V, H):
            raise CaptureError(f"target embeddings {tuple(embed.shape)} / LM head {tuple(lm_head.shape)} "
                               f"do not match vocab {V} x hidden {H}")
        self.cfg = cfg
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer("lm_head", lm_head.float(), persistent=False)
        self.register_buffer("vocab", torch.arange(V) if vocab is None else vocab.long().clone())
        self.fuse = nn.Linear(cfg.num_taps * H, d, bias=False)
        self.norm_ctx = RMSNorm(d)
        self.tok = nn.Linear(H, d, bias=False)
        self.last = nn.Linear(d, d, bias=False)  # the context feature at a-1, given to every block token
        self.slot = nn.Parameter(torch.zeros(cfg.block_size, d))  # slot 0: the anchor token; 1 …: mask tokens
        if cfg.lookup:  # the copied token of each drafted slot, a vector for "no match", a copy logit
            self.look = nn.Linear(H, d, bias=False)
            self.no_match = nn.Parameter(torch.zeros(d))
            self.copy = nn.Linear(d, 1)
        column = torch.full((V,), -1, dtype=torch.long)
        column[self.vocab] = torch.arange(len(self.vocab))
        self.register_buffer("column", column, persistent=False)  # token id → its logit column, -1: not scored
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm_out = RMSNorm(d)
        self.out = nn.Linear(d, H, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Head inputs of slots 1 … B-1 for every anchor of ``batch``: float [S, M, B-1, d] (pad anchors
        give values that the caller masks out); :meth:`logits` maps them to scores."""
        B, W = self.cfg.block_size, self.cfg.window
        S, T, _ = batch.feats.shape
        M = batch.anchors.shape[1]
        feats = batch.feats if torch.is_autocast_enabled("cpu") else batch.feats.to(self.fuse.weight.dtype)
        ctx = F.dropout(self.norm_ctx(self.fuse(feats)), self.cfg.dropout, self.training)  # [S, T, d]
        a = batch.anchors.clamp(min=1)  # pads: any position
        anchor = self.tok(self.embed[batch.ids.gather(1, a)]) + self.last(ctx.gather(1, (a - 1)[..., None].expand(-1, -1, ctx.shape[-1])))
        x = anchor[:, :, None] + self.slot  # [S, M, B, d]
        if self.cfg.lookup:
            found = batch.lookup >= 0
            look = torch.where(found[..., None], self.look(self.embed[batch.lookup.clamp(min=0)]), self.no_match)
            x = torch.cat([x[:, :, :1], x[:, :, 1:] + look], dim=2)
        x = x.flatten(1, 2)  # [S, M*B, d]
        x_pos = (a[:, :, None] + torch.arange(B)).flatten(1)  # [S, M*B]
        ctx_pos = torch.arange(T).expand(S, T)
        # context keys a-W <= p < a (none for pad anchors: they see their own block only)
        anchor_q = batch.anchors.repeat_interleave(B, dim=1)[..., None]  # [S, M*B, 1]
        p = torch.arange(T)
        keep_ctx = (p < anchor_q) & (p >= anchor_q - W)
        for layer in self.layers:
            x = layer(x, ctx, x_pos, ctx_pos, keep_ctx, B)
        return self.norm_out(x.view(S, M, B, -1)[:, :, 1:])

    def head(self) -> torch.Tensor:
        """[V', d]: the target's frozen LM head rows of ``vocab`` composed with the output projection
        ``d → H`` (one product per forward instead of an ``H``-wide hidden per slot)."""
        return self.lm_head[self.vocab].to(self.out.weight.dtype) @ self.out.weight

    def logits(self, hidden: torch.Tensor, lookup: torch.Tensor | None = None) -> torch.Tensor:
        """[..., d] (from :meth:`forward`) → [..., V'] scores over ``vocab`` (column i is token ``vocab[i]``).
        With ``lookup`` (int64 [...], the batch's prompt-lookup drafts of the same slots, -1: none) the
        copied token's score gets a learned bonus ``copy(hidden)`` (a pointer to the copy)."""
        out = hidden @ self.head().T.to(hidden.dtype)
        if lookup is None or not self.cfg.lookup:
            return out
        col = self.column[lookup.clamp(min=0)].masked_fill(lookup < 0, -1)
        bonus = self.copy(hidden).to(out.dtype) * (col >= 0)[..., None]
        return out.scatter_add(-1, col.clamp(min=0)[..., None], bonus)


def load_target_head(model_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's ``embed_tokens`` and LM head, each [V, H] in the stored dtype (bf16 for SmolLM2),
    read with safetensors from ``model_dir``'s ``*.safetensors`` files (only those two tensors are
    loaded). A model with ``tie_word_embeddings`` (or no ``lm_head.weight``) uses ``embed_tokens`` for
    both. Raises CaptureError when the folder has no safetensors or no ``embed_tokens``."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CaptureError(f"{model_dir}: no *.safetensors files (the target's embeddings are read from them)")
    found = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") and "embed" not in found:
                    found["embed"] = f.get_tensor(key)
                elif key == "lm_head.weight":
                    found["lm_head"] = f.get_tensor(key)
    if "embed" not in found:
        raise CaptureError(f"{model_dir}: no embed_tokens.weight in its safetensors")
    cfg_path = model_dir / "config.json"
    tied = json.loads(cfg_path.read_text()).get("tie_word_embeddings", False) if cfg_path.is_file() else False
    lm_head = found["embed"] if tied or "lm_head" not in found else found["lm_head"]
    return found["embed"], lm_head
