"""attnx benchmark harness: every available backend beside torch's own attention.

Run ``python -m benchmarks.run --help`` (or ``python benchmarks/run.py``).
"""
