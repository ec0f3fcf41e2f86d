"""hetproc benchmarks.

Every benchmark reports the product's figure next to a raw baseline measured
in the same run (see ``bench/_raw.py``), because on a shared, noisy 2-core
machine absolute numbers drift between runs while ratios stay meaningful.

Run ``python -m bench`` (or ``python -m bench --quick``) from the repo root.
"""
