"""Quantised weights kept in GGUF's block formats (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K,
MXFP4) and the CPU products over them.

    blocks.py   QuantTensor (block bytes viewing the file's map, type, logical shape), dequantise
    kquants.py  the K-quants' 256-weight super-blocks and their torch dequantisation
    matmul.py   y = x · Wᵀ over the blocks (native kernels, torch fallback), embedding rows
    modules.py  QuantLinear / QuantEmbedding, and the swap of a placed model's layers onto them
    experts.py  the resident CPU expert executor over quantised experts
"""
