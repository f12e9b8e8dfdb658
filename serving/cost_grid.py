"""The grid a cost table is measured on by default (serving/cost_table.py, ``specray profile``),
importable without torch: batch sizes, rows per request, committed tokens per request."""

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_CONTEXT_TOKENS = 256
