"""Checkpoints of other frameworks: Hugging Face ``config.json`` + safetensors (``hf_checkpoint``)."""
