"""Training: the train state and pure step pieces, the Trainer, the fit loop and its actions, the Linen adapter."""
