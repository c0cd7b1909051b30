"""Storage, shared by the operators and the ranks (no Airflow, no torch at import).

``uri`` (locations and the fsspec filesystem for them), ``aws`` (an Airflow connection or the
environment -> s3fs options and the ranks' env), ``errors`` (S3 failures worded for users),
``checkpoints`` (the store: steps, commit marker, verification, retention) and ``lineage`` (who owns
a root, the final checkpoint, where a try resumes).
"""
