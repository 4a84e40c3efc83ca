"""The model: arguments and presets, the decoder layer and its parts, families and their names."""
