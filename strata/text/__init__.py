"""Tokens and text: tokenizers, chat templates, sampling and structured output."""
