"""Speculative decoding: proposers that guess a request's next tokens, and the rule that keeps the ones the model agrees with.

The engine asks a proposer for draft tokens after each step; the scheduler puts them in the request's
next chunk; the model runner scores them in the same forward pass as everything else and keeps, per
request, the drafts equal to what it samples at their positions plus the token after them (verify.py).
"""
