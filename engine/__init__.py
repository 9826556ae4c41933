"""Async speculative-decoding serving engine on llama.cpp."""
