"""The tiny model sizes shared by the model-level tests (fast to compile on a 2-core CPU)."""

TINY = dict(
    vocab_size=13,
    d_model=16,
    num_heads=4,
    num_kv_heads=2,
    d_ff=32,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dropout_rate=0.0,
    max_len=32,
    relative_max_distance=3,
    t5_num_buckets=8,
    t5_max_distance=16,
)
# The same sizes for a decoder-only LM (DecoderLM refuses encoder layers it would ignore).
TINY_LM = {**TINY, "num_encoder_layers": 0}
