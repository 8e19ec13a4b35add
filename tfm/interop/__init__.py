"""Checkpoint interop with other libraries (Hugging Face: tfm.interop.hf)."""
