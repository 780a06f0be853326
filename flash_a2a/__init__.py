"""FlashAttention fused with the Ulysses post-attention All-to-All (work in progress).

Done: the Ulysses output mapping (``mapping``) and the device-initiated post-attention All-to-All
(``scatter``: every output tile's owner stores it straight into the destination rank's symmetric buffer,
completion by per-sender epoch flags). Not done yet: the CuTe DSL attention mainloop that will own those
stores (see the project issues).
"""
