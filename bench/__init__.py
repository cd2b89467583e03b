"""recc's benchmarks: each script compares recc with the alternatives on this machine, side by side.

Run them from the repository root as modules, ``python -m bench.<script> --help``, so that
``bench`` (and ``bench.lib``, what the scripts share) import by name, in this process and in the
ranks ``recc.launch`` spawns. bench/README.md says what each script measures.
"""
