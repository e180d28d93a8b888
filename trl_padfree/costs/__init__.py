"""The cost model: what a layout of pairs costs in arithmetic (`flops`). Pure integers, at the bottom of the package:
it imports nothing of trl-padfree, so packing/, modeling/, plan/ and the bench all build on it."""
