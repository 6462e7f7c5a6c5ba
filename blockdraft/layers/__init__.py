"""Building blocks shared by target models and the DFlash drafter."""
