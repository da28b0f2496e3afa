"""Lightning's ``DDPStrategy`` with fanfold's ``DistributedDataParallel`` in place of torch's, on the ``fanfold``
backend by default: ``Trainer(strategy=FanfoldDDPStrategy())``, or ``strategy="fanfold_ddp"`` once this module is
imported. Needs ``lightning`` (``lightning.pytorch``); importing this module imports it. docs/integrations.md."""
from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from torch import nn

from ..distributed.ddp import DistributedDataParallel

__all__ = ["FanfoldDDPStrategy"]


class FanfoldDDPStrategy(DDPStrategy):
    """``DDPStrategy``'s arguments, each meaning what it means there (``**kwargs`` are torch's DDP keywords, which
    fanfold's DDP takes); ``process_group_backend`` defaults to ``"fanfold"``, so Lightning's own collectives
    (``sync_dist`` logging, ``all_gather``, ``barrier``, ``broadcast``) run on fanfold's shared memory too."""

    strategy_name = "fanfold_ddp"

    def __init__(self, *args: Any, process_group_backend: str | None = "fanfold", **kwargs: Any) -> None:
        super().__init__(*args, process_group_backend=process_group_backend, **kwargs)

    def _setup_model(self, model: nn.Module) -> DistributedDataParallel:
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), **self._ddp_kwargs)

    def _register_ddp_hooks(self) -> None:
        # Lightning registers its comm hook keywords on CUDA only, on torch's DDP; fanfold's takes the same call
        if self._ddp_comm_wrapper is not None:
            raise ValueError("FanfoldDDPStrategy: ddp_comm_wrapper wraps torch's DDP hooks; pass a hook that "
                             "compresses itself (fanfold.distributed.fp16_compress_hook, bf16_compress_hook)")
        if self._ddp_comm_hook is not None and isinstance(self.model, DistributedDataParallel):
            self.model.register_comm_hook(self._ddp_comm_state, self._ddp_comm_hook)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        # accumulate_grad_batches: Lightning's own check is for torch's DDP class
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module  # unwrapped, as Lightning does with torch's
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls, description="fanfold's DDP on the fanfold backend")


FanfoldDDPStrategy.register_strategies(StrategyRegistry)
