"""Question data: the parquet schema (``schema``), reading and writing with a column mapping and
row-level errors (``loader``, ``rows``), and which questions each RL step samples (``sampler``).

Pure Python + pyarrow; nothing here knows the runtime, the engines or torch."""
