"""Tokens out: the one decode loop (decode.py), sampling options (sampling.py),
constraints (constrain.py), token healing (healing.py), select's options scored in one pass
(options.py), one open decode (open_decode.py) and the types a request hands back
(results.py)."""
