"""Text and character ids, before any table: what a token is and how the biLM spells it.

chars       token → bilm-tf character ids; the special tokens and their ids (the only home of both)
manylangs_chars  ELMoForManyLangs' character and word dictionaries: Unicode characters, ``<oov>``, their framing
tokenize    whitespace / unicode / chinese tokenizers and a sentence splitter
wordnet     WordNet 3.0's sense-annotated examples (the word-sense probe's default data)
vocab_file  bilm-tf's vocab.txt, read and written without DuckDB
corpus      the default corpus (Python's pydoc topics), written as text files
"""
