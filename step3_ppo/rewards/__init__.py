"""Where sequence rewards come from: the reward model and reward functions behind one interface, the built-ins, their
worker."""
