"""fanfold._core: the bottom layer. Device normalisation (``devices``), one walk over nested data (``tree``) and the
wrapper prefixes (``prefixes``), each written once. Imports torch only."""
