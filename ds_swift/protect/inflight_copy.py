"""PipeChurn's copy of the iteration in flight as a protection (``inflight``): its sends and a copy of
its gradients before their reduction, kept until the next iteration, so that after a decode only the
lost ranks' passes run again (the keeper itself: ds_swift.recovery.state.inflight, which the
runtime's hooks install on every engine)."""

from __future__ import annotations

from typing import Any

from ds_swift.protect.base import CostInputs, Protection, Site
from ds_swift.recovery.holdings import InflightHeld
from ds_swift.recovery.kept import KeptState
from ds_swift.recovery.state.inflight import InflightKeeper

__all__ = ["InflightCopy"]


class InflightCopy(Protection):
    """The worker's :class:`InflightKeeper` (the runtime's hooks hold it: ``EngineHooks.inflight``)."""

    name = "inflight"
    label = "partial recomputation"

    def __init__(self, keeper: InflightKeeper, site: Site) -> None:
        self.keeper, self._site = keeper, site

    @classmethod
    def build(cls, site: Site) -> InflightCopy | str | None:
        if not site.services.inflight_copy:
            if site.services.erasure_chunks:  # pipechurn, with partial recomputation switched off
                return "pipechurn.partial_recompute false: every rank retrains the iteration in flight"
            return None
        keeper = site.hooks.inflight
        return cls(keeper, site) if keeper is not None else "no keeper installed"

    def quiesce(self, timeout_s: float) -> None:
        engine = self._site.engine()
        if engine is not None:  # the gradients of the passes that ran, before they go with the engine
            self.keeper.on_teardown(engine)

    def held(self, kept: KeptState | None) -> InflightHeld | None:
        return self.keeper.held() if kept is not None else None  # a replacement holds no copy

    def lent(self, kept: KeptState | None) -> InflightKeeper:
        return self.keeper

    def cost_line(self, engine: Any, costs: CostInputs) -> str:
        from ds_swift.patches.deepspeed_grad_accum import accumulator
        from ds_swift.protect.costs import HOST_COPY_BYTES_PER_S, PCIE_BYTES_PER_S, mb

        try:
            hp = accumulator(engine.optimizer).where == "hp"
        except Exception:  # noqa: BLE001 - an unsupported wrapper: the keeper says so at its first copy
            hp = False
        grads = sum(p.numel() * (4 if hp else p.element_size()) for p in engine.module.parameters() if p.requires_grad)
        rate = PCIE_BYTES_PER_S * 4 if costs.device != "cpu" else HOST_COPY_BYTES_PER_S  # a device-to-device copy
        return (
            f"  partial recomputation: a copy of the gradients before their reduction, {mb(grads)} per iteration "
            f"(~{grads / rate * 1e3:.2f} ms, estimated at {rate / 1e9:.0f} GB/s), and references to the iteration's "
            f"sent activations/gradients, both in {costs.device} memory until the next iteration (one iteration's worth)"
        )
