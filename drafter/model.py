"""A small DFlash-style block drafter, readable in one sitting.

Given an anchor position ``a`` (token ``x_a`` known, the target's tapped states known up to ``a``), the
drafter predicts the next ``block_size`` tokens ``x_{a+1} … x_{a+B}`` in one parallel forward:

1. **Fuse the taps.** Every context position ``p`` has ``L`` tapped target states ``[L, H]``; each is
   RMS-normalized on its own (SmolLM2 states carry channels of magnitude ~10^4), the ``L`` are
   concatenated and projected ``L*H → d`` (EAGLE-3 / DFlash style). The target's (frozen) embedding of
   ``x_p``, projected ``H → d``, is added, and a learned offset embedding.
2. **Context window.** Block tokens see the fused states of the ``context`` positions
   ``a-context+1 … a`` of the same conversation (positions before its start are masked out). The
   context is injected as keys/values into every drafter layer and is not itself updated (DFlash's
   "target context as KV" idea, on a short window instead of the whole prefix).
3. **Block tokens.** ``B`` inputs, each the anchor's fused state plus a learned mask embedding and a
   block-position embedding, pass
   through ``n_layers`` pre-norm transformer layers: attention over [context ; block] (bidirectional
   within the block, as in DFlash), then an MLP.
4. **Head.** Project ``d → H``, add ``lens[j]`` times the anchor's normalized deepest tap (a trainable
   per-position shortcut, 1 for position 0 and 0 elsewhere at init: the deepest tap through the LM head
   already predicts the target's next token often, 53% for SmolLM2 tap 27), RMS-normalize, multiply by the target's frozen LM head (SmolLM2 ties it
   to ``embed_tokens``). Logits are computed over ``vocab`` only (a subset of token ids, see
   :class:`ModelConfig`), which keeps training on a 2-core CPU affordable.

Block position ``j`` (0-based) is trained to output the target's greedy token ``argmax[a+j]`` (the
target's choice for ``x_{a+j+1}``); see :mod:`drafter.blocks`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from capture.errors import CaptureError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a drafter. ``num_taps`` (L) and ``hidden_size`` (H) come from the run header;
    ``vocab_size`` from the target. Defaults keep it tiny (~2.3M trainable parameters at SmolLM2 scale)."""

    num_taps: int
    hidden_size: int
    vocab_size: int
    d_model: int = 256
    n_layers: int = 2
    n_heads: int = 4
    block_size: int = 8  # B: tokens drafted per anchor
    context: int = 8  # context positions a-context+1 … a the block attends to
    mlp_ratio: int = 4


class Layer(nn.Module):
    """Pre-norm transformer layer: block queries attend to [fixed context ; block], then an MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.norm_x, self.norm_ctx, self.norm_mlp = nn.RMSNorm(d), nn.RMSNorm(d), nn.RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(), nn.Linear(cfg.mlp_ratio * d, d))

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """x [A, B, d] block states; ctx [A, C, d] fused context; keep [A, C+B] bool (key allowed)."""
        A, B, d = x.shape
        h = self.norm_x(x)
        k, v = self.kv(torch.cat([self.norm_ctx(ctx), h], dim=1)).chunk(2, dim=-1)

        def heads(t):
            return t.view(A, -1, self.n_heads, d // self.n_heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(heads(self.q(h)), heads(k), heads(v), attn_mask=keep[:, None, None, :])
        x = x + self.o(att.transpose(1, 2).reshape(A, B, d))
        return x + self.mlp(self.norm_mlp(x))


class Drafter(nn.Module):
    """The block drafter. Trainable: tap norms, fusion, token projection, embeddings, layers, output
    projection. Frozen (buffers, not saved in checkpoints): ``embed`` [V, H] (the target's
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
        self.tap_norm = nn.RMSNorm(H)  # applied to each tap separately: [.., L, H]
        self.fuse = nn.Linear(cfg.num_taps * H, d, bias=False)
        self.tok = nn.Linear(H, d, bias=False)
        self.ctx_pos = nn.Embedding(cfg.context, d)
        self.block_pos = nn.Embedding(cfg.block_size, d)
        self.mask = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.norm_out = nn.RMSNorm(d)
        self.out = nn.Linear(d, H, bias=False)
        self.norm_head = nn.RMSNorm(H)
        # Per block position, how much of the anchor's last (deepest) normalized tap goes straight to the
        # head: a "logit lens" shortcut, 1 for position 0 (whose label the target state nearly holds) and
        # 0 elsewhere at init; trainable.
        self.lens = nn.Parameter(torch.zeros(cfg.block_size))
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name == "mask":
                nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            self.lens[0] = 1.0

    def forward(self, taps: torch.Tensor, input_ids: torch.Tensor, ctx_index: torch.Tensor,
                ctx_keep: torch.Tensor) -> torch.Tensor:
        """Head inputs for every block position.

        taps [N, L, H] (bf16 or float) and input_ids [N] of a packed batch; ctx_index [A, C] int64 rows of
        the batch each anchor's block sees (the anchor last), ctx_keep [A, C] bool (False: before the
        conversation starts). Returns float32 [A, B, H]; :meth:`logits` maps it to scores.
        """
        A, C = ctx_index.shape
        t = self.tap_norm(taps[ctx_index].float())  # [A, C, L, H]
        ctx = self.fuse(t.flatten(-2)) + self.tok(self.embed[input_ids[ctx_index]]) + self.ctx_pos.weight
        x = self.mask + self.block_pos.weight + ctx[:, -1:]  # [A, B, d]: the anchor's fused state in every input
        keep = torch.cat([ctx_keep, ctx_keep.new_ones(A, self.cfg.block_size)], dim=1)
        for layer in self.layers:
            x = layer(x, ctx, keep)
        lens = self.lens[:, None] * t[:, -1, -1, None, :]  # [A, B, H]: anchor row, last tap
        return self.norm_head(self.out(self.norm_out(x)) + lens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] → float32 [..., V'] scores over ``vocab`` (column i is token ``vocab[i]``)."""
        return hidden @ self.lm_head[self.vocab].T


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
