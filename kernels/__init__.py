"""Triton kernels, each beside a plain-torch reference with the same signature.

Every module here holds, for one operation: the Triton kernel, a thin wrapper that checks
shapes, dtypes and strides, and ``<name>_ref``, the torch reference that CPU runs use and that
tests compare the kernel against. Nothing heavy is imported at package level: importing
``kernels`` must stay cheap and must not look like the Hugging Face ``kernels`` hub package
(no ``__version__`` here), which transformers probes for by name.
"""
