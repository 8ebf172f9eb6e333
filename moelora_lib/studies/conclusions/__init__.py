"""Written conclusions of the stage notebooks, computed from the CSVs a run just wrote.

One module per notebook (``nb01`` ... ``nb08``), each with a ``conclusion(...)`` function that reads that
notebook's CSV rows (pandas DataFrames), asserts the claims it makes, and returns Markdown (rendered in the
notebook's last cell with :func:`moelora_lib.studies.notebook.conclude`). Keeping them here, not in the
notebooks, lets the tests render them from the committed GPU CSVs in ``data/``.
"""
