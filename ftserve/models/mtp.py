"""Multi-token prediction (MTP) layers: the draft model some checkpoints ship
beside the main one (Qwen3-Next's ``mtp.*`` tensors), run by ``--speculative mtp``.

One MTP step predicts the token after next from the main model's final hidden
state at position i (after its final norm) and the token at position i + 1::

    e = pre_fc_norm_embedding(embed(t[i + 1]))     the main model's embedding
    h = pre_fc_norm_hidden(hidden[i])
    x = fc([e | h])                                [2H] -> [H]
    x = layer(x)                                   one decoder layer of the family,
                                                   full attention over its own KV
    g = norm(x)                                    -> lm_head(g): logits of t[i + 2]

The layer's KV lives in the paged pool as one more layer after the main
model's (``kv_layer``): the entry at slot i is the one computed from
(hidden[i], t[i + 1]), at rotary position i. Drafting chains the step: the
next one takes (g, the drafted token) as its (hidden, token) pair.

Tensor names: ``mtp.fc.weight`` [H, 2H], ``mtp.pre_fc_norm_embedding.weight``,
``mtp.pre_fc_norm_hidden.weight``, ``mtp.layers.<j>.*`` (named as a main
layer's ``model.layers.<n>.*``) and ``mtp.norm.weight``; the embedding and the
lm_head are the main model's. A family supplies the layer and its norm
(``MTPHead.normalize`` / ``MTPHead.block``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ftserve.models.config import ModelConfig
from ftserve.models.decoder import DecoderLayer, Target
from ftserve.models.forward_batch import ForwardBatch
from ftserve.models.layers import Linear, RMSNorm

PREFIX = "mtp."


class MTPHead(nn.Module):
    """The MTP layers of one checkpoint (module docstring). Subclasses say how
    the family's norms and decoder layer run."""

    def __init__(self, hidden_size: int, layers: list[nn.Module], make_norm: Callable[[], nn.Module],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.fc = Linear(2 * hidden_size, hidden_size, False, dtype)
        self.pre_fc_norm_embedding = make_norm()
        self.pre_fc_norm_hidden = make_norm()
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm()

    def normalize(self, norm: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def block(self, layer: nn.Module, x: torch.Tensor, batch: ForwardBatch,
              cos_sin: torch.Tensor) -> torch.Tensor:
        """The decoder layer then the final norm: x [T, H] -> g [T, H]."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, batch: ForwardBatch,
                cos_sin: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (the main model's, or the previous step's g), embeds [T, H]
        (of the tokens one position later) -> g [T, H]; the layer writes its K/V at
        batch.attn.out_cache_loc and attends as the batch says."""
        e = self.normalize(self.pre_fc_norm_embedding, embeds, batch)
        h = self.normalize(self.pre_fc_norm_hidden, hidden, batch)
        x = self.fc(torch.cat([e, h], dim=-1), batch.kernels)  # [T, 2H] -> [T, H]
        return self.block(self.layers[0], x, batch, cos_sin)

    def checkpoint_targets(self, layer_targets: Callable[[str, str, nn.Module], dict[str, Target]],
                           ) -> dict[str, Target]:
        """HF name -> destination for the MTP tensors (``layer_targets(hf, me,
        layer)``: the family's per-layer map)."""
        t = {f"{PREFIX}{name}.weight": Target(f"mtp.{name}.weight")
             for name in ("fc", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        for j, layer in enumerate(self.layers):
            t.update(layer_targets(f"{PREFIX}layers.{j}", f"mtp.layers.{j}", layer))
        return t


def count_layers(names: list[str] | set[str]) -> int:
    """How many MTP layers a checkpoint's tensor names hold (``mtp.layers.<j>.*``)."""
    found = {n[len(PREFIX) + 7:].split(".", 1)[0] for n in names if n.startswith(f"{PREFIX}layers.")}
    return len(found)


class DecoderMTP(MTPHead):
    """MTP layers of the generic decoder's families (decoder.py): RMSNorm and a
    DecoderLayer, MoE where the main model is MoE."""

    def __init__(self, cfg: ModelConfig, num_layers: int, dtype: torch.dtype) -> None:
        # The MTP layer j is decoder layer cfg.num_layers + j: its attention
        # writes that pool layer, after the main model's.
        n = cfg.num_layers
        ext = dataclasses.replace(cfg, num_layers=n + num_layers,
                                  sparse_layers=cfg.sparse_layers + (cfg.is_moe,) * num_layers)
        layers = [DecoderLayer(ext, n + j, dtype) for j in range(num_layers)]
        super().__init__(cfg.hidden_size, layers, lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype),
                         dtype)

    def normalize(self, norm: nn.Module, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert isinstance(norm, RMSNorm)
        return norm(x, batch.kernels)

    def block(self, layer: nn.Module, x: torch.Tensor, batch: ForwardBatch,
              cos_sin: torch.Tensor) -> torch.Tensor:
        assert isinstance(layer, DecoderLayer) and isinstance(self.norm, RMSNorm)
        x, residual, normed = layer(x, None, batch, cos_sin)  # no norm after it folded in
        assert normed is False
        out, _ = self.norm.forward_add(x, residual, batch.kernels)
        return out
