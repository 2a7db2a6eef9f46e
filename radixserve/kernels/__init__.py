"""Native CPU kernels (csrc/*.cpp), compiled on first use with the machine's C++ compiler.

`--cpu-kernels auto` (the default) uses them on a CPU when they build, and the pure-torch path
otherwise; `native` insists on them, `torch` never loads them.
"""
