"""fanfold inside training frameworks. Each module imports its framework and so is importable only where that
framework is installed; ``import fanfold`` imports none of them. ``fanfold.integrations.lightning``:
:class:`~fanfold.integrations.lightning.FanfoldDDPStrategy`, fanfold's DDP as a Lightning strategy.
docs/integrations.md."""
