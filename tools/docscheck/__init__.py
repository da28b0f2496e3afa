"""The docs check: README.md and docs/*.md held to the code (``python tools/docscheck`` runs it; ``make test`` too)."""
