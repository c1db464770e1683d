"""Rollout engines (--rollout_engine): the registry, hybrid generation on the gathered actor, the vLLM client and its
worker."""
