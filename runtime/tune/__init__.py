"""Learned seam repair: a small adapter, trained by self-distillation, that lets the tokens
after a request's cached modules read modules encoded apart as a full prefill would.

samples.py  one combination's teacher (the full prefill) and student (the runtime's own
            served request, plus the adapter on the tokens after the modules)
corpus.py   the training text: the user's documents and the model's own writing
train.py    the loop: `tune(llm, folder, TuneOptions(...))`, checkpoints, the evaluation

The adapter itself (runtime/model/lora.py) and its serving under policy `tuned`
(runtime/model/seam.py) live with the model: the engine, below this room, serves it.
"""
