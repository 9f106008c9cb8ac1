"""What each DeepSpeed optimizer wrapper holds of a rank's training state, read and written locally.

A survivor keeps its optimizer state across the in-process rebuild, a donor sends it, a buddy
holds a copy of it: all three need the wrapper's state as plain tensors plus JSON-able scalars,
taken WITHOUT a collective (at teardown the process groups are broken) and put into a freshly
built wrapper of the same geometry. DeepSpeed's own ``state_dict()`` pickles loss-scaler objects
and its ``load_state_dict`` expects checkpoint lists, so this reads the attributes directly.

Per wrapper (:class:`~ds_swift.patches.deepspeed_wrappers.WrapperKind`, DeepSpeed 0.19.8 attribute names):

- ``TORCH``: ZeRO-0 fp32, the engine's optimizer is the torch optimizer (masters = module params);
- ``BF16_OPTIMIZER``: ``fp32_groups_flat_partition`` (this data-parallel rank's slice);
- ``ZERO_STAGE1``: ``single_partition_of_fp32_groups`` + ``loss_scaler``;
- ``FP16_FUSED``: ``fp32_groups_flat`` + ``loss_scale_config``;
- ``FP16_UNFUSED``: ``fp32_groups`` + ``loss_scale_config``.

The inner torch optimizer's ``state_dict()`` (moments, step, hyper-parameters) goes along as is.
After loading, :func:`refresh_lp_params` rebuilds the low-precision parameters from the masters:
for ``BF16_OPTIMIZER``/``ZERO_STAGE1`` that is DeepSpeed's ``update_lp_params`` (an all-gather over the new
generation's data-parallel group, the same call the failure-free step ends with, so bitwise the
same result): every rank must call it.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ds_swift.patches.deepspeed_wrappers import UnsupportedWrapper, WrapperKind, kind_of

# UnsupportedWrapper, WrapperKind and kind_of are ds_swift.patches.deepspeed_wrappers', named here too.
__all__ = [
    "GeometryError",
    "UnsupportedWrapper",
    "WrapperKind",
    "capture_optimizer",
    "flag_bytes_to_come",
    "geometry_of",
    "is_partitioned",
    "kind_of",
    "load_optimizer",
    "load_optimizer_scalars",
    "loss_scalers",
    "optimizer_payload",
    "optimizer_scalars",
    "refresh_lp_params",
    "reshard_optimizer",
]

#: wrapper attributes that are per-step state (the undo record restores the same ones)
_FLAGS = ("overflow", "_global_grad_norm", "clip_grad")


class GeometryError(RuntimeError):
    """The state to load was taken from a wrapper of another shape (partition sizes, ids, params)."""


def _masters(opt: Any, kind: WrapperKind) -> list[torch.Tensor]:
    if kind is WrapperKind.BF16_OPTIMIZER:
        return list(opt.fp32_groups_flat_partition)
    if kind is WrapperKind.ZERO_STAGE1:
        return list(opt.single_partition_of_fp32_groups)
    if kind is WrapperKind.FP16_FUSED:
        return list(opt.fp32_groups_flat)
    if kind is WrapperKind.FP16_UNFUSED:
        return [t for group in opt.fp32_groups for t in group]
    return []  # TORCH: the module's parameters are the masters


def loss_scalers(opt: Any, kind: WrapperKind) -> list[Any]:
    """The wrapper's objects whose ``__dict__`` is loss-scale state (ZeRO-1's ``loss_scaler``, fp16's
    ``loss_scale_config``). Look them up at each use, never keep them: DeepSpeed's ZeRO load replaces
    the loss scaler (``_load_global_state``). ds_swift.undo.engine's step record keeps the same
    objects' state, in the same order."""
    if kind is WrapperKind.ZERO_STAGE1:
        return [opt.loss_scaler]
    if kind.fp16:
        return [opt.loss_scale_config]
    return []


def _partitions(opt: Any, kind: WrapperKind) -> list[list[int]]:
    """[partition id, partition count] per parameter group (local: no collective)."""
    if not kind.partitioned_by_dp:
        return []
    import deepspeed.comm as dscomm

    return [
        [int(dscomm.get_rank(group=g)), int(n)]
        for g, n in zip(opt.real_dp_process_group, opt.partition_count, strict=True)
    ]


def is_partitioned(opt: Any) -> bool:
    """Whether each data-parallel rank holds only its own slice of the optimizer state (ZeRO-1 and
    BF16_Optimizer with more than one data-parallel rank): a replica cannot donate it."""
    if opt is None:
        return False
    try:
        kind = kind_of(opt)
    except UnsupportedWrapper:
        return False
    return kind.partitioned_by_dp and any(int(n) > 1 for n in opt.partition_count)


def geometry_of(opt: Any) -> dict[str, Any]:
    """The shape a loaded state must match: kind, master sizes, partition ids and counts."""
    kind = kind_of(opt)
    inner = opt if kind is WrapperKind.TORCH else opt.optimizer
    return {
        "kind": kind.value,  # plain data: it travels with the state
        "masters": [int(t.numel()) for t in _masters(opt, kind)],
        "partitions": _partitions(opt, kind),
        "params": [[list(p.shape) for p in g["params"]] for g in inner.param_groups],
    }


def _plain(value: Any) -> bool:
    if isinstance(value, bool | int | float | str | torch.dtype | torch.Tensor) or value is None:
        return True
    return isinstance(value, list | tuple) and all(_plain(v) for v in value)


def _copy_plain(value: Any) -> Any:
    """A copy of a :func:`_plain` value: scalars as they are (immutable), tensors cloned, lists and
    tuples element by element. What ``copy.deepcopy`` gives, at a fraction of its cost per step
    (the buddy copier captures the scalars after every step, on the training thread)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [_copy_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_plain(v) for v in value)
    return value


def capture_optimizer(opt: Any) -> dict[str, Any]:
    """This rank's optimizer state by reference (masters and the inner optimizer), plus copies of
    the scalars (loss scaler, flags). No collective: safe on broken process groups.

    Call :func:`optimizer_payload` on the result to read the state (after any undo).
    """
    kind = kind_of(opt)
    return {
        "geometry": geometry_of(opt),
        "masters": _masters(opt, kind),
        "inner": opt if kind is WrapperKind.TORCH else opt.optimizer,
        **optimizer_scalars(opt),
    }


def optimizer_scalars(opt: Any) -> dict[str, Any]:
    """Copies of the wrapper's scalars: its loss scaler's (``scalers``) and its flags (overflow, the
    clipping norm: ``flags``), as plain data."""
    kind = kind_of(opt)
    return {
        "scalers": [{k: _copy_plain(v) for k, v in vars(s).items() if _plain(v)} for s in loss_scalers(opt, kind)],
        "flags": {k: _copy_plain(getattr(opt, k)) for k in _FLAGS if k in vars(opt) and _plain(getattr(opt, k))},
    }


def flag_bytes_to_come(opt: Any) -> int:
    """Bytes the wrapper's flags gain as tensors at its first step (a cost estimate made before it):
    BF16_Optimizer and ZeRO-1 keep the step's gradient norm (``_global_grad_norm``) as a float32
    scalar tensor once a step computed it; 0 where it is one already, or ``opt`` is no such wrapper."""
    if kind_of(opt) not in (WrapperKind.BF16_OPTIMIZER, WrapperKind.ZERO_STAGE1):
        return 0
    return 0 if isinstance(vars(opt).get("_global_grad_norm"), torch.Tensor) else 4


def load_optimizer_scalars(opt: Any, scalars: dict[str, Any]) -> None:
    """Put :func:`optimizer_scalars`' copies back into ``opt``."""
    for scaler, saved in zip(loss_scalers(opt, kind_of(opt)), scalars["scalers"], strict=True):
        vars(scaler).update(copy.deepcopy(saved))
    for name, value in scalars["flags"].items():
        setattr(opt, name, copy.deepcopy(value))


def optimizer_payload(captured: dict[str, Any]) -> dict[str, Any]:
    """The state to send or load: tensors (by reference) and JSON-able scalars."""
    return {
        "geometry": captured["geometry"],
        "masters": list(captured["masters"]),
        "inner": captured["inner"].state_dict(),
        "scalers": captured["scalers"],
        "flags": captured["flags"],
    }


def load_optimizer(opt: Any, payload: dict[str, Any]) -> None:
    """Put ``payload`` (from :func:`optimizer_payload`, possibly of another rank) into ``opt``.

    Raises:
        GeometryError: the payload was taken from a wrapper of another kind or shape (another
            partition, other parameter shapes): loading it would silently train on wrong state.
    """
    want = geometry_of(opt)
    got = payload["geometry"]
    if got != want:
        diff = {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
        raise GeometryError(f"optimizer state of another geometry (got, expected): {diff}")
    kind = WrapperKind(want["kind"])
    with torch.no_grad():
        for dst, src in zip(_masters(opt, kind), payload["masters"], strict=True):
            dst.copy_(src.reshape(dst.shape))
    inner = opt if kind is WrapperKind.TORCH else opt.optimizer
    inner.load_state_dict(payload["inner"])
    load_optimizer_scalars(opt, payload)
    link = getattr(opt, "_link_all_hp_params", None)
    if callable(link):
        link()  # the hp mappings point at the optimizer state dict that load_state_dict replaced


def _unpadded(opt: Any, kind: WrapperKind, group: int) -> int:
    """The elements of flat parameter group ``group`` without the alignment padding at its end."""
    lp = opt.bf16_groups[group] if kind is WrapperKind.BF16_OPTIMIZER else opt.bit16_groups[group]
    return sum(int(p.numel()) for p in lp)


def reshard_optimizer(parts: list[dict[str, Any]], opt: Any) -> dict[str, Any]:
    """The payload :func:`load_optimizer` takes for ``opt``, built from the payloads of EVERY
    partition of another data-parallel size (an elastic shrink or grow), in partition-id order.

    A ``BF16_OPTIMIZER``/``ZERO_STAGE1`` group is one flat buffer, aligned at its end to the partition count and cut
    into equal contiguous partitions: the old partitions joined, less their padding, are the whole
    group; padded for the new count (zeros, as DeepSpeed pads), this rank's partition is its slice.
    The masters and each partition-sized tensor of the inner optimizer's state (Adam's moments) are
    cut so; its scalars (the step count) must agree across the parts. Unpartitioned wrappers hold
    the whole state on every rank: any part is it.

    Raises:
        GeometryError: the parts are not one whole set of partitions of the same model and kind.
    """
    want = geometry_of(opt)
    kind = WrapperKind(want["kind"])
    if not parts:
        raise GeometryError("no partition of the old geometry to reshard from")
    kinds = {p["geometry"]["kind"] for p in parts}
    if kinds != {kind}:
        raise GeometryError(
            f"optimizer state of kind(s) {sorted(kinds)} cannot be loaded into a {kind.value!r} wrapper"
        )
    if not kind.partitioned_by_dp:
        if parts[0]["geometry"] != want:
            raise GeometryError(f"optimizer state of another geometry: {parts[0]['geometry']} vs {want}")
        return parts[0]
    count = len(parts)
    for q, part in enumerate(parts):
        ids = part["geometry"]["partitions"]
        if ids != [[q, count]] * len(want["partitions"]):
            raise GeometryError(f"part {q} of {count} holds partitions {ids}: not one whole set, in order")
    out_masters, out_state = [], {}
    inner_parts = [p["inner"] for p in parts]
    for i, (pid, new_count) in enumerate(want["partitions"]):
        size, full = want["masters"][i], _unpadded(opt, kind, i)

        def cut(
            tensors: list[torch.Tensor],
            i: int = i,
            pid: int = pid,
            size: int = size,
            full: int = full,
            new_count: int = new_count,
        ) -> torch.Tensor:
            joined = torch.cat([t.reshape(-1) for t in tensors])
            if joined.numel() < full:
                raise GeometryError(f"group {i}: the old partitions hold {joined.numel()} elements, the model {full}")
            padded = torch.zeros(size * new_count, dtype=joined.dtype)
            padded[:full] = joined[:full]
            return padded[pid * size : (pid + 1) * size].clone()

        out_masters.append(cut([p["masters"][i] for p in parts]))
        states = [ip["state"].get(i, {}) for ip in inner_parts]
        merged: dict[str, Any] = {}
        for key, value in states[0].items():
            values = [st[key] for st in states]
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == parts[0]["masters"][i].numel():
                merged[key] = cut(values)
            elif all(torch.equal(torch.as_tensor(v), torch.as_tensor(value)) for v in values):
                merged[key] = value
            else:
                raise GeometryError(f"group {i}: optimizer state {key!r} differs between the old partitions")
        out_state[i] = merged
    inner = {"state": out_state, "param_groups": copy.deepcopy(inner_parts[0]["param_groups"])}
    return {
        "geometry": want,
        "masters": out_masters,
        "inner": inner,
        "scalers": parts[0]["scalers"],
        "flags": parts[0]["flags"],
    }


def refresh_lp_params(opt: Any, gather: bool = True) -> None:
    """Rebuild the low-precision model parameters from the fp32 masters.

    Args:
        opt: the engine's optimizer (None: nothing to do).
        gather: for the partitioned kinds, all-gather every rank's partition (a collective over
            the data-parallel group: every rank of the generation calls it); False copies only
            this rank's own partition (for a recovery that re-forms the groups first, then
            gathers).
    """
    if opt is None:
        return
    kind = kind_of(opt)
    if kind.partitioned_by_dp:
        if gather:
            opt.update_lp_params()
        else:
            _copy_own_partition(opt, kind)
        if kind is WrapperKind.ZERO_STAGE1:
            for i in range(len(opt.bit16_groups)):
                opt._update_model_bit16_weights(i)
    elif kind.fp16:
        with torch.no_grad():
            if kind is WrapperKind.FP16_FUSED:
                for lp_group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat, strict=True):
                    offset = 0
                    for lp in lp_group:
                        lp.data.copy_(flat[offset : offset + lp.numel()].view_as(lp))
                        offset += lp.numel()
            else:
                for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
                    for lp, hp in zip(lp_group, hp_group, strict=True):
                        lp.data.copy_(hp.data)


def _copy_own_partition(opt: Any, kind: WrapperKind) -> None:
    """This rank's fp32 master partition into its slice of the flat low-precision groups (no collective)."""
    import deepspeed.comm as dscomm

    if kind is WrapperKind.ZERO_STAGE1:
        pairs = zip(opt.parallel_partitioned_bit16_groups, opt.single_partition_of_fp32_groups, strict=True)
    else:
        pairs = zip(opt.bf16_partitioned_groups, opt.fp32_groups_flat_partition, strict=True)
    for i, (parts, fp32) in enumerate(pairs):
        rank = dscomm.get_rank(group=opt.real_dp_process_group[i])
        parts[rank].data.copy_(fp32.data)
