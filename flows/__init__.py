"""Prefect flows over elmo_core. Thin: each task is one call into the library."""
