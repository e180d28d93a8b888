"""Maintainer tools, run from a checkout (`python -m tools.<name>`): not part of the `trl_padfree` wheel."""
