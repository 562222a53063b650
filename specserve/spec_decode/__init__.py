"""Speculative decoding: one file per drafter, verification and draft-side sampling beside them.

draft_tree.py      DraftTree: the drafted tokens one verification checks (a chain is a tree)
draft_state.py     DraftState / DraftForward: what a drafter's level loop needs from its worker
chain.py           chains of SL tokens, greedy or sampled
eagle2.py          EAGLE-2 dynamic trees with DDD's dynamic depth
eagle_head.py      the EAGLE-1/2 and EAGLE-3 draft heads (one layer over the target's features)
head_checkpoint.py the heads' published checkpoint layouts, read and written with every check a head must pass
draft_sampling.py  the top-K distribution a sampled chain draws from
verify.py          lossless acceptance for chains and trees
synthetic.py       SYNTHETIC acceptance (system benchmarks only)
"""
