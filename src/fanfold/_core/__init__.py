"""fanfold._core: the bottom layer. Device normalisation (``devices``), one walk over nested data (``tree``) and the
wrapper prefixes (``prefixes``), bytes to a tensor and back without numpy (``buffers``), each written once. Imports
torch only."""
