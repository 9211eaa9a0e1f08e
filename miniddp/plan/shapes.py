"""A transformer's shape, the presets, and how many parameters and FLOPs it has.

FLOPs, two ways, because the sources we check against count them two ways (Narayanan et al.
2021, appendix; Megatron-LM's `num_floating_point_operations`). With B sequences of s tokens,
l layers of width h, a heads of which g share keys and values, an MLP of width F (gated: three
matmuls, not two) and a vocabulary V, one step's *model* FLOPs are

    12·B·s·l·h² · [ (1 + g/a + s/h) + (F/h)·(3/2 if gated) + V/(2lh) ]

each matmul 2mnk, three times (forward, and backward's two). For a GPT (g = a, F = 4h) that is
72·B·s·l·h²·(1 + s/6h + V/12lh). The *hardware* FLOPs add what recomputation runs again: full
recomputation the layers' forward once more, 96·B·s·l·h²·(1 + s/6h + V/16lh) for a GPT, the
count Megatron-LM's 2021 tables report; selective recomputation the attention scores' forward.

The s/h term counts all s² scores. A causal flash kernel computes only the lower half, so the
FLOPs a GPU *executes* (`executed_flops`, what the plan's time is made of) count half of them;
Llama 3's published TFLOP/s do the same (the source says so in published.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer, as Megatron-LM and Llama shape one."""

    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None  # grouped-query attention: fewer key/value heads
    ffn: int | None = None  # the MLP's width; 4·hidden when None
    gated: bool = False  # SwiGLU: three matmuls in the MLP
    biases: bool = True  # GPT's Linear biases and LayerNorm; Llama has neither (RMSNorm)
    dropout: bool = True

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "vocab"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden {self.hidden} is not a multiple of heads {self.heads}: each head gets "
                "hidden/heads dimensions. Change --hidden or --heads."
            )
        if self.heads % self.key_value_heads:
            raise ValueError(
                f"heads {self.heads} is not a multiple of kv heads {self.key_value_heads}: "
                "each key/value head serves a whole group of query heads. Change --kv-heads."
            )

    @property
    def key_value_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def mlp_width(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_parameters(self) -> int:
        """One layer: q and the output projection h² each, k and v h·(g·d) each, the MLP's
        2hF (3hF gated), the norms' 2h each (LayerNorm) or h (RMSNorm), and GPT's biases."""
        h, f, kv = self.hidden, self.mlp_width, self.key_value_heads * self.head_dim
        weights = 2 * h * h + 2 * h * kv + (3 if self.gated else 2) * h * f
        if not self.biases:
            return weights + 2 * h
        return weights + (h + 2 * kv + h) + (f + h) + 4 * h

    @property
    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    @property
    def parameters(self) -> int:
        """All of them, with the output layer tied to the embedding (GPT) or not (Llama)."""
        head = 0 if self.biases else self.embedding_parameters
        return self.layers * self.layer_parameters + self.embedding_parameters + head

    def model_flops(self, sequences: int, seq: int) -> float:
        """The model FLOPs of a step of `sequences` sequences of `seq` tokens (docstring)."""
        h, a = self.hidden, self.heads
        attention = 1 + self.key_value_heads / a + seq / h
        mlp = self.mlp_width / h * (1.5 if self.gated else 1.0)
        logits = self.vocab / (2 * self.layers * h)
        return 12 * sequences * seq * self.layers * h * h * (attention + mlp + logits)

    def layer_forward_flops(self, seq: int, causal_half: bool = False) -> float:
        """One layer's forward for one sequence: a third of its share of model_flops."""
        h, a = self.hidden, self.heads
        scores = seq / h / (2 if causal_half else 1)
        attention = 1 + self.key_value_heads / a + scores
        mlp = self.mlp_width / h * (1.5 if self.gated else 1.0)
        return 4 * seq * h * h * (attention + mlp)

    def recompute_flops(self, sequences: int, seq: int, recompute: str, causal_half: bool) -> float:
        """What recomputation runs again: the whole forward of every layer (full), or the
        scores' two batched matmuls, 4·s²·h a sequence (selective)."""
        if recompute == "full":
            return sequences * self.layers * self.layer_forward_flops(seq, causal_half)
        if recompute == "selective":
            return sequences * self.layers * 4 * seq * seq * self.hidden / (2 if causal_half else 1)
        return 0.0

    def hardware_flops(self, sequences: int, seq: int, recompute: str) -> float:
        """Model FLOPs plus the recomputed forward, counted as the model counts (all scores)."""
        return self.model_flops(sequences, seq) + self.recompute_flops(
            sequences, seq, recompute, causal_half=False
        )

    def executed_flops(self, sequences: int, seq: int, recompute: str, causal_half: bool) -> float:
        """What a GPU computes: hardware FLOPs, with a causal kernel's half of the scores."""
        saved = 12 * sequences * seq * self.layers * seq * self.hidden / 2 if causal_half else 0
        extra = self.recompute_flops(sequences, seq, recompute, causal_half)
        return self.model_flops(sequences, seq) - saved + extra


def gpt(name: str, layers: int, hidden: int, heads: int, vocab: int) -> Transformer:
    return Transformer(name, layers, hidden, heads, vocab)


def llama(name: str, layers: int, hidden: int, heads: int, ffn: int) -> Transformer:
    """Llama 3: 8 key/value heads, SwiGLU, no biases, no dropout, 128,256 tokens."""
    return Transformer(name, layers, hidden, heads, 128_256, 8, ffn, True, False, False)


# GPT-3 (Brown et al. 2020, Table 2.1) with Megatron's padded vocabulary; Llama 3 (Grattafiori
# et al. 2024, Table 3); chapter 12's GPT at its defaults (tutorials/gpt_settings.py), its
# vocabulary the characters of its text, about 100, taken as 128.
PRESETS = {
    "gpt3-175b": gpt("gpt3-175b", 96, 12288, 96, 51_200),
    "llama3-8b": llama("llama3-8b", 32, 4096, 32, 14_336),
    "llama3-70b": llama("llama3-70b", 80, 8192, 64, 28_672),
    "llama3-405b": llama("llama3-405b", 126, 16384, 128, 53_248),
    "chapter12": gpt("chapter12", 4, 128, 4, 128),
}
