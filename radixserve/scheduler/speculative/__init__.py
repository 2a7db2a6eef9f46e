"""Speculative decoding: draft tokens cheaply, verify them in one forward of the target model.

worker.py holds the Speculator base (verify, commit, acceptance) and NgramSpeculator, which drafts
from ngram.py's shared n-gram index; draft_model.py's DraftModelSpeculator drafts with a smaller
model (STANDALONE). verify.py turns a verify step's logits into emitted tokens; cost.py gates
drafting by what it costs here. docs/speculative.md has the flags and when they help.
"""
