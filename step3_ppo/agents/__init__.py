"""Multi-turn rollouts: the loop, environments, tools, the python tool's sandbox, their flags and held-out
evaluation."""
