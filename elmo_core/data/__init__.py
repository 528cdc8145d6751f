"""The training data after ingest: the vocabulary in DuckDB, token ids per split, and bilm-tf's batches.

vocab     vocab, char ids and corpus stats in DuckDB (``vocab.txt`` beside it); token ids per split as Parquet
batches   bilm-tf's stateful training batches, streamed from those ids, resumable, sharded by rank
prefetch  the batches made ahead of the step by a background thread, the position kept exact
"""
