"""Forward passes over the model: a unit's encode (encoder.py), a request's prefill of its
uncached tokens and the visibility rule (prefill.py), and query:K's probe pass (probe.py)."""
