"""The KV cache's layout for TPU (the reference einsums, splash and flex): keys
[batch, kv_heads, slots, head_dim] and values [batch, kv_heads, head_dim, slots].

TPU stores an array's last two axes in tiles of (8 or 16, 128), so the model's own order
[batch, slots, kv_heads, head_dim] keeps 12 heads of 64 in 16 x 128 tiles: 2.67 times the
cache's size in HBM, every byte of it read at every decoding step. Here the keys are in the
order the kernels take them (a prefill writes the array it hands the kernel; a decoding step
writes one sublane row per slot), 64 values on 128 lanes (2x); the values have their slots on
the lanes, nothing padded (head_dim a multiple of 16). Both are pinned (`pin_order`): inside a
program XLA picks the physical order of a value, and left free it stored the cache in the
model's order again.

Compiled for `v5e-8` (`benchmarks/recheck_compiled.py`, decode loops; docs/gpu-tpu.md): GPT-2
small's loop with a 65,536-token prompt over `mesh.context=8` 9.88 -> 6.99 GB per chip; with
8 x 4,096-token prompts 1.02 -> 0.88 GB. Keys with their slots on the lanes too took less at
65,536 tokens (5.08 GB) but more at 4,096 (1.09 GB, and 26% more bytes accessed), so only
the values have them.
"""

from tfm.kernels.cache_layouts import CacheLayout

TPU_LAYOUT = CacheLayout("tpu", key_axes="bnsh", value_axes="bnhs", pin_order=True)
