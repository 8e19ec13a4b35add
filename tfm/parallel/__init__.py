"""Many devices and hosts: the (data, fsdp, tensor) mesh and logical-axis rules (sharding.py),
jax.distributed start-up (distributed.py)."""
