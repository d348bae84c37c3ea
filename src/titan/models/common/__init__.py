"""The decoder toolkit the LLM families are built from: RoPE variants, GQA attention with optional QK-norm,
SwiGLU, RMSNorm, tied embeddings, the decoder stack and its parallelize plan."""

from titan.models.common.decoder import Attention, Decoder, DecoderArgs, FeedForward, TransformerBlock

__all__ = ["Attention", "Decoder", "DecoderArgs", "FeedForward", "TransformerBlock"]
