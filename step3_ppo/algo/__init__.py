"""Step 3's pure math: advantage estimators and the per-token reward with its KL penalty (torch and utils.math only)."""
