"""Live learning: ``qkv learn`` serves a page where every step of attention is recomputed by
the library as the learner edits q, K, V and d, with a practice pane whose answers the library
checks.

- :mod:`~qkv.learn.api` — the form's fields -> :func:`qkv.explain`'s steps, as JSON data;
- :mod:`~qkv.learn.exercises` — practice problems and answers checked;
- :mod:`~qkv.learn.page` — the page (HTML, CSS and a script that only draws);
- :mod:`~qkv.learn.server` — the local HTTP server (standard library, 127.0.0.1 only).
"""
