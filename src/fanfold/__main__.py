"""``python -m fanfold``: the same as the ``fanfold`` command (see ``fanfold.cli``)."""
import sys

from .cli import main

sys.exit(main())
