"""Device mesh, logical-axis sharding rules, and the checks that run before anything compiles.

Sharding is configuration, not code (as in Levanter / MaxText): layers name the axes of their
parameters with logical names (`nn.with_logical_partitioning(init, ("embed", "mlp"))`), and a
list of rules maps each logical name to mesh axes. The mesh always has four axes:

  data     pure data parallelism (replicated parameters; across hosts in multi-host runs)
  fsdp     data parallelism with parameters and optimizer state sharded over "embed" (ZeRO-3)
  context  context parallelism: every row's sequence ("length") split over devices, attention
           by tfm.kernels.context_parallel (all-gather or ring); parameters unaffected
  tensor   tensor (model) parallelism over heads, mlp and vocab (Megatron-style)

Typical use in a training loop:

    mesh = make_mesh(config.mesh)
    rules = resolve_rules(config.get("logical_axis_rules"))
    check_divisibility(model_config, mesh, config.batch_size, rules)
    abstract = jax.eval_shape(model.init, rng, dummy_batch)       # boxed params
    state_sharding = param_shardings(abstract, mesh, rules)      # raises on bad shapes
    with sharding_context(mesh, rules):                           # before the first trace
        params = jax.jit(model.init, out_shardings=state_sharding)(rng, dummy_batch)
        step = jax.jit(train_step, in_shardings=(state_sharding, batch_sharding(mesh, rules)),
                       out_shardings=(state_sharding, replicated(mesh)))
        for host_batch in data:
            state, metrics = step(state, shard_batch(host_batch, mesh, rules=rules))

Inside modules, `constrain(x, ("batch", "length", "embed"))` pins an activation's sharding.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax.core import meta
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tfm.checks import ConfigError, section_dict

MESH_AXES = ("data", "fsdp", "context", "tensor")
DEFAULT_MESH = {"data": -1, "fsdp": 1, "context": 1, "tensor": 1}

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]

# Logical axis name -> mesh axes. Order is priority: flax assigns each mesh axis at most once
# per array, first rule first, so "batch" must come before "embed" for activations
# [batch, length, embed] to shard the batch over data x fsdp (embed then stays unsharded).
DEFAULT_LOGICAL_RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("length", "context"),
    ("relpos", None),
    ("buckets", None),
)


def _axis_sizes(mesh_or_sizes: Mesh | Mapping[str, int]) -> dict[str, int]:
    return dict(mesh_or_sizes.shape) if isinstance(mesh_or_sizes, Mesh) else dict(mesh_or_sizes)


def _as_axes(axes: MeshAxes | Sequence[str]) -> tuple[str, ...]:
    """Mesh axes of one rule as a tuple: None -> (), "tensor" -> ("tensor",)."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _describe(axes: tuple[str, ...], sizes: Mapping[str, int]) -> str:
    return " x ".join(f"mesh.{axis}={sizes[axis]}" for axis in axes)


# ----------------------------------------------------------------------------- mesh


def validate_mesh_config(mesh_config: Any, num_devices: int) -> dict[str, int]:
    """Resolves {data, fsdp, context, tensor} sizes (at most one -1 = the remaining devices).

    Missing axes default to DEFAULT_MESH (data=-1, fsdp=1, context=1, tensor=1). Returns the
    sizes in mesh axis order; raises ConfigError naming `mesh.<axis>`, the sizes and the device
    count.
    """
    given = section_dict(mesh_config, "mesh", MESH_AXES)
    sizes = {axis: given.get(axis, DEFAULT_MESH[axis]) for axis in MESH_AXES}
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int | np.integer):
            raise ConfigError(f"mesh.{axis}={size!r} must be an integer >= 1, or -1")
        if size < 1 and size != -1:
            raise ConfigError(f"mesh.{axis}={size} must be >= 1, or -1 for the remaining devices")
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(
            f"mesh.{fill[0]} and mesh.{fill[1]} are both -1; at most one mesh axis may take "
            "the remaining devices"
        )
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % fixed:
            others = " x ".join(f"{a}={s}" for a, s in sizes.items() if s != -1)
            raise ConfigError(
                f"mesh.{fill[0]}=-1 cannot fill the {num_devices} available devices: "
                f"{others} = {fixed} does not divide {num_devices}"
            )
        sizes[fill[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total != num_devices:
        product = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
        raise ConfigError(
            f"mesh sizes {product} = {total} do not match the {num_devices} available devices; "
            "set one of mesh.data, mesh.fsdp, mesh.context, mesh.tensor to -1 to take the "
            "remaining devices"
        )
    return {axis: int(size) for axis, size in sizes.items()}


def _split_over_granules(sizes: dict[str, int], num_granules: int) -> tuple[list[int], list[int]]:
    """Splits each mesh axis into (across granules (DCN), inside a granule (ICI/NVLink)).

    Hosts go to "data" first (only gradients cross the slow links), then "fsdp", "context",
    "tensor".
    """
    dcn, ici, remaining = [], [], num_granules
    for axis in MESH_AXES:
        factor = math.gcd(sizes[axis], remaining)
        remaining //= factor
        dcn.append(factor)
        ici.append(sizes[axis] // factor)
    if remaining != 1:
        raise ConfigError(
            f"mesh sizes {' x '.join(f'{axis}={sizes[axis]}' for axis in MESH_AXES)} "
            f"cannot be laid out over {num_granules} hosts/slices: the product of the axes split "
            f"across hosts must be {num_granules}; make mesh.data a multiple of {num_granules}"
        )
    return dcn, ici


def make_mesh(mesh_config: Any = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with axes MESH_AXES (data, fsdp, context, tensor), all AxisType.Auto (GSPMD).

    `mesh_config`: {data, fsdp, context, tensor} sizes (see validate_mesh_config; None = all data).
    `devices`: defaults to jax.devices(). When the devices span several hosts (processes; TPU
    slices on TPU), the mesh is built with create_hybrid_device_mesh so that "data" crosses hosts
    and "fsdp"/"context"/"tensor" stay on the fast links inside one host.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = validate_mesh_config(DEFAULT_MESH if mesh_config is None else mesh_config,
                                 len(devices))
    shape = [sizes[axis] for axis in MESH_AXES]
    on_tpu = devices[0].platform == "tpu"
    # A TPU slice is one ICI domain even when several hosts drive it; elsewhere a process is.
    if on_tpu:
        granules = {getattr(device, "slice_index", 0) for device in devices}
    else:
        granules = {device.process_index for device in devices}
    if len(granules) > 1:
        dcn, ici = _split_over_granules(sizes, len(granules))
        device_array = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=not on_tpu, allow_split_physical_axes=True
        )
    else:
        device_array = mesh_utils.create_device_mesh(
            shape, devices, allow_split_physical_axes=True
        )
    return Mesh(device_array, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


# ----------------------------------------------------------------------------- rules


def resolve_rules(overrides: Sequence[Sequence[Any]] | None = None) -> Rules:
    """DEFAULT_LOGICAL_RULES with `overrides`, a list of (logical_name, mesh_axes) pairs.

    An override replaces every default rule for its logical name, in the default's place (so
    priorities are kept); several pairs for one name are fallbacks tried in order. mesh_axes is
    None, one of MESH_AXES, or a list of them. Raises ConfigError naming
    `logical_axis_rules[i]` for unknown logical names or mesh axes.
    """
    known = [name for name, _ in DEFAULT_LOGICAL_RULES]
    parsed: dict[str, list[tuple[str, MeshAxes]]] = {}
    for index, pair in enumerate(overrides or ()):
        field = f"logical_axis_rules[{index}]"
        if isinstance(pair, str) or len(pair) != 2:
            raise ConfigError(f"{field}={pair!r} must be a (logical_name, mesh_axes) pair")
        name, axes = pair
        if name not in known:
            raise ConfigError(
                f"{field} names logical axis {name!r}, which is unknown; known logical axes: "
                f"{', '.join(known)}"
            )
        axes_tuple = _as_axes(axes)
        bad = [axis for axis in axes_tuple if axis not in MESH_AXES]
        if bad:
            raise ConfigError(
                f"{field} maps {name!r} to mesh axis {bad[0]!r}; choose None or from "
                f"{', '.join(MESH_AXES)}"
            )
        value: MeshAxes = (
            None if not axes_tuple else axes_tuple[0] if len(axes_tuple) == 1 else axes_tuple
        )
        parsed.setdefault(name, []).append((name, value))
    rules: list[tuple[str, MeshAxes]] = []
    for name, axes in DEFAULT_LOGICAL_RULES:
        if name not in parsed:
            rules.append((name, axes))
        elif not any(rule_name == name for rule_name, _ in rules):
            rules.extend(parsed[name])
    return tuple(rules)


def _check_names(names: Sequence[Any], rules: Rules, where: str) -> None:
    """Every logical name must have a rule: a typo ("emebd") would silently replicate."""
    known = {name for name, _ in rules}
    for name in names:
        if isinstance(name, str) and name not in known:
            raise ValueError(
                f"{where} uses logical axis name {name!r}, which has no sharding rule; "
                f"known logical axes: {', '.join(sorted(known))}"
            )


def _mesh_axes_for(name: str, rules: Rules) -> tuple[str, ...]:
    """Mesh axes of the first rule for `name` (what a 1-d array named (name,) gets)."""
    for rule_name, axes in rules:
        if rule_name == name:
            return _as_axes(axes)
    return ()


# ----------------------------------------------------------------------------- shardings


def replicated(mesh: Mesh) -> NamedSharding:
    """A sharding that puts a full copy on every device (scalars, metrics, rng keys)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, rules: Rules | None = None) -> NamedSharding:
    """Sharding for batch arrays of any rank >= 1 ([B], [B, T], ...): axis 0 over the "batch"
    rule's mesh axes (data x fsdp by default), other axes replicated."""
    axes = _mesh_axes_for("batch", DEFAULT_LOGICAL_RULES if rules is None else rules)
    return NamedSharding(mesh, P(axes if axes else None))


def logical_to_sharding(logical_spec_tree: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """Tree of PartitionSpecs of logical names (nn.get_partition_spec output) -> NamedShardings."""
    rules = DEFAULT_LOGICAL_RULES if rules is None else rules
    for spec in jax.tree.leaves(logical_spec_tree, is_leaf=lambda x: isinstance(x, P)):
        if isinstance(spec, P):
            _check_names(spec, rules, f"partition spec {spec}")
    return nn.logical_to_mesh_sharding(logical_spec_tree, mesh, rules)


def _path(key_path: Any) -> str:
    return jax.tree_util.keystr(key_path, simple=True, separator="/")


def check_param_divisibility(abstract_variables: Any, mesh: Mesh, rules: Rules | None = None
                             ) -> None:
    """Checks every sharded dimension of every boxed parameter divides by its mesh axes.

    `abstract_variables`: a tree with nn.LogicallyPartitioned leaves (from jax.eval_shape of
    model.init, or of an optimizer init on boxed params). Raises ConfigError naming the path.
    """
    rules = DEFAULT_LOGICAL_RULES if rules is None else rules
    sizes = _axis_sizes(mesh)
    leaves = jax.tree_util.tree_flatten_with_path(
        abstract_variables, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)
    )[0]
    for key_path, leaf in leaves:
        if not isinstance(leaf, meta.AxisMetadata):
            continue
        path = _path(key_path)
        if not isinstance(leaf, nn.LogicallyPartitioned):
            raise ValueError(
                f"parameter {path} is boxed with {type(leaf).__name__}; tfm layers name "
                "parameter axes with nn.with_logical_partitioning(init, logical_names)"
            )
        shape = leaf.value.shape
        if len(leaf.names) != len(shape):
            raise ValueError(
                f"parameter {path} has shape {shape} but {len(leaf.names)} logical axis names "
                f"{tuple(leaf.names)}"
            )
        _check_names(leaf.names, rules, f"parameter {path}")
        spec = nn.logical_to_mesh_axes(leaf.names, rules)
        for dim, (name, axes) in enumerate(zip(leaf.names, spec, strict=True)):
            axes = _as_axes(axes)
            shards = math.prod(sizes[axis] for axis in axes)
            if shape[dim] % shards:
                raise ConfigError(
                    f"parameter {path} has shape {shape}: dimension {dim} ({name!r}, size "
                    f"{shape[dim]}) is sharded over {_describe(axes, sizes)} = {shards} "
                    f"and must be divisible by it; change the model size, the mesh, or map "
                    f"{name!r} to None in logical_axis_rules"
                )


def param_shardings(abstract_variables: Any, mesh: Mesh, rules: Rules | None = None) -> Any:
    """NamedShardings for a tree with nn.LogicallyPartitioned leaves (params, optimizer state).

    `abstract_variables`: e.g. jax.eval_shape(model.init, rng, batch), or the abstract train
    state when the optimizer was initialised on boxed params (optax keeps the boxes, so mu/nu
    get the params' shardings). Unboxed leaves (step counters) are replicated. The result has
    the boxes replaced by NamedShardings: it is a valid `out_shardings` for the boxed init and
    the exact sharding tree of the unboxed (nn.unbox / meta.unbox) variables. Checks names and
    divisibility first (check_param_divisibility), so bad sizes fail before compilation.
    """
    rules = DEFAULT_LOGICAL_RULES if rules is None else rules
    check_param_divisibility(abstract_variables, mesh, rules)
    return logical_to_sharding(nn.get_partition_spec(abstract_variables), mesh, rules)


# ----------------------------------------------------------------------------- checks


def cpu_devices_hint(batch_size: int, microbatches: int, backend: str, num_devices: int,
                     cores: int | None = None) -> str | None:
    """A hint for a run on one CPU device of a host with several cores, else None: split into
    N devices (launch.sh --devices_per_process N), each device runs its share of the batch on
    its own thread, so the many small ops of a small model overlap instead of leaving cores idle
    (benchmarks/README.md has the figures). N is
    the most devices, at most `cores` (default: this process's) and 8, whose share of the batch
    `microbatches` divides."""
    if backend != "cpu" or num_devices != 1:
        return None
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cores = cores or 1
    fits = [n for n in range(2, min(cores, 8) + 1) if batch_size % (n * microbatches) == 0]
    if not fits:
        return None
    return (f"training on 1 CPU device of a {cores}-core host: ./launch.sh train ... "
            f"--devices_per_process {fits[-1]} splits each batch over {fits[-1]} devices, one "
            "thread each (data parallel; faster for small models)")


def log_cpu_devices_hint(mesh: Mesh, batch_size: int, microbatches: int) -> None:
    """Logs cpu_devices_hint for a training run on `mesh` (one process only: the hint is about
    launch.sh's single-process flag). Training only: eval and generate take no such flag."""
    hint = cpu_devices_hint(batch_size, microbatches, mesh.devices.flat[0].platform,
                            mesh.devices.size)
    if hint and jax.process_count() == 1:
        logging.getLogger(__name__).warning(hint)


def check_divisibility(model_config: Any, mesh: Mesh | Mapping[str, int], batch_size: int,
                       rules: Rules | None = None, microbatches: int = 1) -> None:
    """Model- and batch-level divisibility checks, before anything is built or compiled.

    `model_config`: a tfm ModelConfig; `mesh`: a Mesh or {axis: size}; `batch_size`: the global
    batch; `microbatches`: train.microbatches, which must divide each device's share of it.
    Raises ConfigError naming `batch_size` or the model field and the mesh axes.
    """
    rules = DEFAULT_LOGICAL_RULES if rules is None else rules
    sizes = _axis_sizes(mesh)
    axes = _mesh_axes_for("batch", rules)
    shards = math.prod(sizes[axis] for axis in axes)
    if batch_size % shards:
        raise ConfigError(
            f"batch_size={batch_size} is not divisible by {_describe(axes, sizes)} = {shards}, "
            "the mesh axes the batch is split over; pick a multiple of it"
        )
    if (batch_size // shards) % microbatches:
        raise ConfigError(
            f"train.microbatches={microbatches} must divide each device's share of the batch, "
            f"batch_size={batch_size} / {shards} = {batch_size // shards} (the batch is split "
            f"over {_describe(axes, sizes)})"
        )
    fields = [
        ("d_model", "embed", model_config.d_model),
        ("num_heads", "heads", model_config.num_heads),
        ("num_kv_heads", "kv_heads", model_config.resolved_num_kv_heads),
        ("head_dim", "head_dim", model_config.resolved_head_dim),
        ("d_ff", "mlp", model_config.d_ff),
        ("vocab_size", "vocab", model_config.vocab_size),
        ("source_vocab_size", "vocab", model_config.resolved_source_vocab_size),
    ]
    for field, name, value in fields:
        axes = _mesh_axes_for(name, rules)
        shards = math.prod(sizes[axis] for axis in axes)
        if value % shards:
            raise ConfigError(
                f"model.{field}={value} is not divisible by {_describe(axes, sizes)} = {shards}, "
                f"which shards logical axis {name!r}; pick a multiple of {shards}, a smaller "
                f"mesh, or map {name!r} to None in logical_axis_rules"
            )


def context_size(mesh: Mesh | Mapping[str, int]) -> int:
    """How many devices every row's sequence is split over (mesh.context)."""
    return _axis_sizes(mesh).get("context", 1)


def context_refusal(model_config: Any, context: int, seq_len: int,
                    source_seq_len: int | None = None) -> str | None:
    """Why context parallelism over `context` devices cannot run this model yet (one line
    naming the fields), or None. `model_config`: a tfm ModelConfig, its attention backend
    resolved (tfm.training.experiment.context_attention_backend). Each chunk runs the
    reference maths or the flex kernel, under either strategy. source_seq_len: an
    encoder-decoder's source row length (None: seq_len)."""
    given = f"with mesh.context={context}"
    if model_config.num_encoder_layers and not model_config.num_decoder_layers:
        return (f"model.num_decoder_layers=0 {given}: context parallelism runs decoder-only "
                "and encoder-decoder models so far; use mesh.context=1")
    source_len = seq_len if source_seq_len is None else source_seq_len
    if model_config.num_encoder_layers and source_len % context:
        return (f"data.source_seq_len={source_len} {given}: the encoder's rows split into "
                f"mesh.context equal contiguous chunks; use a multiple of {context}")
    backend, strategy = model_config.attention_backend, model_config.context_parallel
    if model_config.scheme.logit_bias_kind == "query" and strategy != "all_gather":
        return (f"model.position_scheme={model_config.position_scheme!r} with "
                f"model.context_parallel={strategy!r} {given}: the ring's blocks take no bias "
                "from the queries, and Shaw's value term needs each key block's attention "
                "weights, which its online softmax never holds; use context_parallel='all_gather'")
    if backend not in ("reference", "flex"):
        return (f"model.attention_backend={backend!r} {given}: each chunk's attention is the "
                "reference maths or the flex kernel so far; use 'auto', 'reference' or 'flex'")
    if model_config.attention_dropout_rate > 0:
        return (f"model.attention_dropout_rate={model_config.attention_dropout_rate} {given}: "
                "context-parallel attention has no attention dropout; set it to 0")
    if seq_len % (2 * context):
        return (f"data.seq_len={seq_len} {given}: causal load balancing cuts every row into "
                f"2 x mesh.context = {2 * context} equal chunks; use a multiple of {2 * context}")
    return None


def check_context(model_config: Any, mesh: Mesh | Mapping[str, int], seq_len: int,
                  source_seq_len: int | None = None) -> None:
    """ConfigError (`context_refusal`) when mesh.context > 1 cannot run this model."""
    context = context_size(mesh)
    reason = None if context == 1 else context_refusal(model_config, context, seq_len,
                                                       source_seq_len)
    if reason is not None:
        raise ConfigError(reason)


def chunked_prefill_warning(field: str, chunk: int, mesh: Mesh | Mapping[str, int]
                            ) -> str | None:
    """What a prefill in chunks of `chunk` tokens (the config `field`) costs under
    mesh.context > 1, or None: a whole-prompt prefill splits over the context axis as a
    training row does, but a chunk reads the KV cache, so it runs whole on every device."""
    context = context_size(mesh)
    if context == 1 or not chunk:
        return None
    return (f"{field}={chunk} with mesh.context={context}: each prefill chunk reads the KV "
            "cache, so it runs whole on every device, [chunk, cache] scores included; "
            f"{field}=0 prefills the whole prompt split over the context axis")


# ----------------------------------------------------------------------------- data


def shard_batch(host_batch: Mapping[str, np.ndarray], mesh: Mesh,
                sharding: NamedSharding | None = None, rules: Rules | None = None
                ) -> dict[str, jax.Array]:
    """Global jax.Arrays from this process's rows of the batch (1 or N processes).

    `host_batch`: {name: [local_batch, ...] numpy}; every process passes its own rows, in
    process order, and the global batch is their concatenation (local_batch x process_count
    rows when the batch axes span all processes). `sharding`: default batch_sharding(mesh,
    rules). Raises ValueError naming the key when a leaf cannot be split.
    """
    sharding = batch_sharding(mesh, rules) if sharding is None else sharding
    if jax.process_count() == 1 and all(np.ndim(value) > 0 for value in host_batch.values()):
        try:  # one process: the local batch is the global one; one transfer for every leaf
            return jax.device_put(dict(host_batch), sharding)
        except ValueError:
            pass  # the loop below names the leaf that cannot be split
    out = {}
    for key, value in host_batch.items():
        value = np.asarray(value)
        if value.ndim == 0:
            raise ValueError(f"batch[{key!r}] is a scalar; batch leaves need a leading batch axis")
        try:
            out[key] = jax.make_array_from_process_local_data(sharding, value)
        except ValueError as error:
            raise ValueError(
                f"batch[{key!r}] with local shape {value.shape} cannot be sharded as "
                f"{sharding.spec} over mesh {dict(mesh.shape)}: {error}"
            ) from error
    return out


# ----------------------------------------------------------------------------- activations


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: Rules | None = None) -> Iterator[None]:
    """Sets the mesh (jax.set_mesh) and the logical rules (nn.logical_axis_rules) together.

    Enter it around jit *tracing* (the first call of a jitted step): `constrain` and boxed
    params read both at trace time. jit's cache does not key on the flax rules, so always trace
    a given function inside the same context.
    """
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_LOGICAL_RULES if rules is None
                                                   else rules):
        yield


def constrain(x: jax.Array, logical_names: Sequence[str | None],
              rules: Rules | None = None) -> jax.Array:
    """Pins the sharding of activation `x` by logical axis names, e.g. ("batch", "length",
    "embed") for x: [batch, length, embed].

    Inside modules call it without `rules`: it then uses the rules of the enclosing
    sharding_context (nn.logical_axis_rules). It is a no-op when no mesh is set (jax.set_mesh)
    or no rules are given, so single-device code and unit tests need no setup.
    """
    names = tuple(logical_names)
    if len(names) != x.ndim:
        raise ValueError(f"constrain got {len(names)} logical names {names} for x of shape "
                         f"{x.shape}")
    active = rules if rules is not None else nn.get_logical_axis_rules()
    if active:
        _check_names(names, tuple(active), "constrain")
    return nn.with_logical_constraint(x, names, rules=rules)
