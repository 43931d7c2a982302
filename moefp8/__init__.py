"""moefp8: MoE pretraining with the DeepSeek-V3 FP8 recipe.

Shape legend, used in names (``topk_idx_TK``) and comments across the package:

    T  tokens on this rank            H  hidden size
    I  expert intermediate size       E  experts (global), E_l local experts
    K  top-k experts per token        M  permuted rows (tokens x their local experts, padded)
    N  output features of a GEMM      G  128-wide tiles along the quantized dimension

The numerics, the data flow and the layout are specified in docs/design.md;
`moefp8.fp8` holds the FP8 tensor format, `moefp8.kernels` the Triton kernels with
their pure-PyTorch reference twins, `moefp8.dispatch` the expert-parallel dispatch backends.
"""

__version__ = "0.1.0"
