"""The model: attention maths, position schemes, layers, models and the KV cache (pure functions
and thin Flax modules; the reference maths is the specification)."""
