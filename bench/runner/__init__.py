"""The one runner of bench/ (`python -m bench`): the registry of benchmarks, running one, saving its result
under bench/results/<name>/, and the generated INDEX.md and README table."""
