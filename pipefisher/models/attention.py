"""The attention core, apart from its projections: a parameter-free module, so a model can name it
as what `model.recompute: selective` recomputes (scores, softmax, dropout and context: the part
whose memory grows with the square of the sequence length)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F


class AttentionCore(nn.Module):
    """softmax(q kᵀ / √d + mask) v with dropout `dropout` on the weights while training.
    q, k, v: (B, heads, T, head size); mask broadcasts to (B, heads, T, T), True = attend."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None) -> Tensor:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )
