"""Quantised weights kept in GGUF's block formats (Q8_0, Q4_0, Q4_1) and the CPU products over them.

    blocks.py   QuantTensor (block bytes viewing the file's map, type, logical shape), dequantise
    matmul.py   y = x · Wᵀ over the blocks (native kernels, torch fallback), embedding rows
    modules.py  QuantLinear / QuantEmbedding, and the swap of a placed model's layers onto them
    experts.py  the resident CPU expert executor over quantised experts
"""
