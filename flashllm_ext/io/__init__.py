"""Bytes in and out: safetensors files, checkpoints (Hugging Face, GGUF), aligned and pinned buffers, the disk
profile, and paths written without losing a user's file."""
