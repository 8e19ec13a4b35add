"""Decoding inside jit: greedy, sampling and beam search against a tokens_to_logits callback
(search.py), and the user-facing generation of LMs and encoder-decoders (generate.py)."""
