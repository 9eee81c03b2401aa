"""The Python rules PyTorch ops are traced through where Core ATen's decompositions do not
reach the IR, by domain; :mod:`salus.decompositions` assembles them into the table a step
records with and installs the ones that must run above autograd.

- :mod:`.common`: helpers every rule uses (zeros, result types, a dtype's extremes).
- :mod:`.sampling`: random draws from the session's generator (dropout, ``rand``,
  ``randn``, ``normal_``, ``uniform_``, ``exponential_``, ``randint``, ``randperm``,
  ``RReLU``'s slopes).
- :mod:`.arithmetic`: elementwise arithmetic and functions (division and remainders,
  comparisons and logic, trigonometric and hyperbolic functions, ``fmax``, ``hypot``,
  ``addbmm``, ``addmv``, norms).
- :mod:`.order`: ordering and reductions by position (sorts, ``topk``, medians,
  ``max``/``min`` along a dim, products, scans: ``cummax``, ``cummin``,
  ``logcumsumexp``).
- :mod:`.indexing`: gathers and scatters (``EmbeddingBag``, ``scatter_reduce``,
  ``index_reduce``, ``masked_scatter``, ``put``, insertion points, slices, diagonals).
- :mod:`.pooling`: pooling and padding (adaptive, 3-d, windows, replication and circular
  padding, ``unfold``).
- :mod:`.sequences`: sequence and pair models (the CTC loss, the LSTM, bilinear layers,
  pairwise distances).
"""
