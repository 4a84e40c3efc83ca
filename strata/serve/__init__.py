"""The HTTP side: the OpenAI-compatible server and the engine it drives."""
