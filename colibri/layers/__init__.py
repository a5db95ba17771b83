"""The pieces family files build from: placeholders, RoPE, KV caches, attention, routers and experts, norms,
and the mixers that stand in for attention (latent, linear, delta, Mamba)."""
