"""The machine: accelerator, process groups, DeepSpeed's JIT-built op, free ports, the project's cache folder."""
