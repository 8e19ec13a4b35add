"""The KV cache's layout for TPU (the reference einsums, splash and flex): keys and values
[batch, kv_heads, head_dim, slots].

TPU stores an array's last two axes in tiles of (8 or 16, 128), so the model's own order
[batch, slots, kv_heads, head_dim] keeps 12 heads of 64 in 16 x 128 tiles: 2.67 times the
cache's size in HBM, every byte of it read at every decoding step. Here the slots are on the
lanes, nothing padded (head_dim a multiple of 16), and it is the order splash and flex read
narrow heads in (`tpu_attention.operand_layout`, `flex_operands.sequence_minor`): a prefill
that fills the cache hands the kernel its keys and values read back from it
(`prefill_reads_back`), so XLA keeps one array for the write and the kernel. Every cache array
is pinned (`pin_order`): inside a program XLA picks the physical order of a value, and left
free it stored the cache in the model's order again.

The keys were first heads-major [batch, kv_heads, slots, head_dim] (1e7dca5): 64 values on 128
lanes, twice their size. Tried with the slots on the lanes then, they did worse at 8 x 4,096
tokens because the prefill copied them into the kernels' order; with the prefill reading them
back (and flex reading narrow heads sequence-minor without a gradient too), every TPU decode
loop of docs/gpu-tpu.md moved fewer bytes and all but two took less memory (`benchmarks/
recheck_compiled.py --decode_only`, v5e-8 and v5p-8): GPT-2 medium's 65,536-token loop 10.80 ->
6.03 GB per chip, the paper's beam loops about half (base v5e-8 3.88 -> 1.84 GB), the 131,072-
token context-parallel ones 6.99 -> 4.82 GB. The two 32,768-token flex loops rose, 1.81 -> 1.90
and 1.94 GB, with 23-27% fewer bytes. Heads of 128 or 256 fill their lanes either way; the
kernels read those head-minor, so their prefill copies the keys and values once per layer.
"""

from tfm.kernels.cache_layouts import CacheLayout

TPU_LAYOUT = CacheLayout("tpu", key_axes="bnhs", value_axes="bnhs", pin_order=True,
                         prefill_reads_back=True)
