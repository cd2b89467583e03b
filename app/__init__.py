"""recc.app: the top layer -- the ``recc`` command line (``cli``) and the training harness
(``training``: the one training loop that ``recc train`` and the Python API share). It may import
every layer below it (recc's core, passes, runtime, kernels, models); nothing below imports it."""
