"""specserve: LLM serving with speculative decoding."""

import os

__version__ = "0.1.0"

# Transparent huge pages for torch's large CPU allocations (weights, KV caches): fewer TLB misses on the weights every
# decode step reads (docs/benchmarks.md, "Huge pages for the weights and caches"). torch reads the variable at its
# first CPU allocation, so it is set here, before any; THP_MEM_ALLOC_ENABLE=0 in the environment turns it off.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
