"""lcsm: Hyena long-convolution language models and Flash Inference, exact online convolution in O(L log^2 L).

Modules: model (Hyena LM), hyena (the titan ModelSpec), engines (lazy / eager / recompute / flash), tiles (the
schedules), tau (tile implementations), relaxed (data-dependent filters), generate and bench (entry points).
"""
