"""What a trained biLM gives: contextual vectors in Parquet tables, their index, queries, and the probes.

embed   embedding jobs → a Parquet dataset of token/sentence vectors, one job per folder
probe   what each layer is worth: word-sense 1-NN and a linear tagging probe
ann     the nearest-neighbour index beside an embedding table (faiss shards, exact re-ranking, a key map)
query   nearest-neighbour queries over embedding tables: through the index, else a DuckDB scan
"""
