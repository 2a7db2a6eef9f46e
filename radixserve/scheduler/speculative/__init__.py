"""Speculative decoding: draft tokens cheaply, verify them in one forward of the target model.

ngram.py drafts from a shared n-gram index, verify.py turns a verify step's logits into emitted
tokens, worker.py (NgramSpeculator) plans verify steps and commits their results. docs/
speculative.md has the flags and when they help.
"""
