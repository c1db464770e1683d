"""Pure tensor math shared by every step: masked reductions, log-probs, KL estimators, losses, rows of real tokens.
Imports torch only."""
