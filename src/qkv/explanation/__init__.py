"""The learner side: a step-by-step trace of attention, its exact form, exercises and practice.

- :mod:`~qkv.explanation.trace` — :func:`explain` and the :class:`Trace` it returns (plain
  data: every intermediate number, and its dict).
- :mod:`~qkv.explanation.scale` — the scale rule: a number or an expression in ``d``.
- :mod:`~qkv.explanation.exact` — the same steps in exact arithmetic (SymPy).
- :mod:`~qkv.explanation.exercise`, :mod:`~qkv.explanation.practice` — problems to work by
  hand, and feedback on a learner's answers.

Nothing here imports the render package: the renderers register themselves in
:mod:`~qkv.explanation.formats`, and :meth:`Trace.render` looks them up there.
"""
