"""``python -m fanfold``: the same as the ``fanfold`` command (see ``fanfold.cli``)."""
from .cli import main

raise SystemExit(main())
