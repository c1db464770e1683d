"""Models: loading (tokenizers, causal LMs, safetensors only), the ONE forward, the reward model, export, tiny and
default models."""
