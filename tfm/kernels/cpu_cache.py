"""The KV cache's layout on CPU, the one `cpu_attention.attention(..., cache_layout=True)` reads.

- Keys [batch, kv_heads, head_dim, slots] and values [batch, kv_heads, slots, head_dim]: the
  layouts the decode step's two attention matmuls (q . K and weights . V) read as they are, so
  no step copies or transposes the cache; one buffer per layer, so a layer reads its slots
  without a copy and writes its new tokens in place.
- A batch-1 cache stacks its layers on axis 1: there XLA dropped the unit batch axis before the
  attention matmul and then duplicated each per-layer write into that reader and the loop
  carry (four whole-layer copies per layer and step, against one slice copy when stacked).
- bfloat16/float16 slots are written as uint16: per-row starts make the write a scatter, and
  XLA's CPU backend computed a 16-bit scatter in float32 over the whole cache every step.
"""

from tfm.kernels.cache_layouts import CacheLayout

CPU_LAYOUT = CacheLayout(
    "cpu", key_axes="bnhs", value_axes="bnsh", stack_single_row=True, write_16bit_as_uint16=True
)
