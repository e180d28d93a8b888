"""Every private name of the libraries under trl-padfree, one module each (trl.py, transformers.py, accelerate.py,
deepspeed.py, torch.py), matching tests/integrations/test_seams.py: the rest of the package reaches them only through these
functions. And the one way this package swaps a library's attribute or registry entry for a while (swap.py):
`swapped` / `swapped_item`, which check that the swap took effect, and, where asked, that the library really went
through it.
"""

from .swap import Use, swapped, swapped_item

__all__ = ["Use", "swapped", "swapped_item"]
