"""Tokens out: the one decode loop (decode.py), sampling options (sampling.py), constraints
(constrain.py), token healing (healing.py), one open decode (open_decode.py) and the types
a request hands back (results.py)."""
