"""The measurement scripts: each measures one figure the docs, docs/bench/*.json or a test's bound quote, and says in
its docstring how to run it (from the repository root, e.g. `python tools/measure/measure_noise.py`). They are not
tests (pytest collects tests/ and the package only) and not in the wheel; those that build tiny models import the tests'
helpers (tests/ on `sys.path`). `trl-padfree bench` is the product's own benchmark; tools/gpu_report.py the GPU run."""
