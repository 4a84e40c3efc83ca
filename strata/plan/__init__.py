"""Planning a rig: the layer split, its memory and speed model, the chunk schedule."""
