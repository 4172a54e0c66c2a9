"""pdserve: a disaggregated prefill/decode LLM serving cluster.

One import package mapped over the repository's top-level folders (``pdserve.cluster`` is
``cluster/``, ``pdserve.kernels`` is ``kernels/``, ...), so that no folder name of ours shadows an
installed distribution of the same name (Hugging Face's ``kernels`` above all) when the
repository root is on ``sys.path``. The folders are namespace packages for that reason: they
have no ``__init__.py`` and the import system lets any regular package of the same name win.
"""
